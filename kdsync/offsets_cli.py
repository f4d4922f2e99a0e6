"""`kdsync offsets`: move a consumer group from one cluster to another by offset.

A typer sub-application (`offsets_app`); the logic is kdsync.kafka.offsets.
Exit codes: 0 done / found, 1 refused, failed or not (yet) there, 2 bad input.
Reference: docs/commands.md, fail-over walk-through: docs/operations.md.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from kdsync.cli_style import new_app
from kdsync.cli_style import run as run_cli
from kdsync.kafka.offsets import BadInput, ClusterRef, OffsetsError, parse_cluster, sync_offsets, translate
from kdsync.stopping import StopSignal

offsets_app = new_app(
    "Fail a consumer group over between clusters: kdsync puts every event at the same offset of T-global "
    "in every cluster, so committed offsets are exact everywhere.", no_args_is_help=True)
# for the `kdsync` group (kdsync.cli loads `app` and takes its command "offsets")
app = new_app()
app.add_typer(offsets_app, name="offsets")


def _cluster(text: str) -> ClusterRef:
    try:
        return parse_cluster(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


_Suffix = Annotated[str, typer.Option("--global-suffix", help="suffix of the global topic (global_suffix in the [topics] section of the member config)")]
_Timeout = Annotated[float, typer.Option("--timeout", min=0.1, help="seconds to wait for a broker's answer")]


@offsets_app.command("sync")
def sync_cmd(
    group: Annotated[str, typer.Option("--group", help="consumer group whose offsets move")],
    topic: Annotated[str, typer.Option("--topic", help="source topic T; the offsets are those on T-global")],
    source: Annotated[ClusterRef, typer.Option("--from", parser=_cluster, metavar="NAME=BROKERS",
                                               help="cluster the group committed in")],
    target: Annotated[ClusterRef, typer.Option("--to", parser=_cluster, metavar="NAME=BROKERS",
                                               help="cluster the group moves to")],
    follow: Annotated[bool, typer.Option("--follow", help="keep syncing every --interval seconds until "
                                                          "SIGINT/SIGTERM (refusals are reported and retried)")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="seconds between syncs with --follow")] = 10.0,
    global_suffix: _Suffix = "-global",
    timeout: _Timeout = 30.0,
) -> None:
    """Copy GROUP's committed offsets on T-global (every partition) from one cluster to the other, exactly.

    Refused (exit 1) while GROUP has consumers in the target cluster, or when the target's T-global does not yet hold the record just below a committed offset (kdsync there is behind). Prints one JSON line per sync that changed something.
    """
    if source.bootstrap == target.bootstrap or source.name == target.name:
        raise typer.BadParameter("--from and --to name the same cluster", param_hint="'--to'")
    if not follow:
        try:
            res = sync_offsets(source, target, group, topic, global_suffix, timeout)
        except BadInput as e:
            _fail(e, 2)
        except OffsetsError as e:
            _fail(e, 1)
        print(json.dumps(res.as_json()), flush=True)
        return
    stop = StopSignal()
    stop.install()
    last_error, first = None, True
    while not stop.is_set():
        try:
            res = sync_offsets(source, target, group, topic, global_suffix, timeout)
            if res.changed or first or last_error is not None:
                print(json.dumps(res.as_json()), flush=True)
            last_error, first = None, False
        except BadInput as e:
            _fail(e, 2)
        except OffsetsError as e:  # a checkpoint connector waits for the target to be ready: report once, retry
            if str(e) != last_error:
                print(f"kdsync offsets sync: {e} (retrying every {interval:g}s)", file=sys.stderr, flush=True)
            last_error = str(e)
        stop.wait(interval)


@offsets_app.command("translate")
def translate_cmd(
    topic: Annotated[str, typer.Option("--topic", help="source topic T; the answer is a place in T-global")],
    cluster: Annotated[ClusterRef, typer.Option("--cluster", parser=_cluster, metavar="NAME=BROKERS",
                                                help="cluster whose T-global is searched")],
    source_partition: Annotated[int, typer.Option("--source-partition", min=0, help="partition of T")],
    source_offset: Annotated[int, typer.Option("--source-offset", min=0, help="offset in that partition of T")],
    origin: Annotated[str | None, typer.Option("--origin", help="member id of the cluster whose T holds the event "
                                                               "(kdsync.origin)  [default: NAME of --cluster]")] = None,
    global_suffix: _Suffix = "-global",
    timeout: _Timeout = 30.0,
    shards: Annotated[int, typer.Option("--shards", min=1, help="[topics] shards of the members: with K > 1 the event "
                                                               "is in partition P mod K of T-global")] = 1,
) -> None:
    """Print where a source event sits in T-global, as one JSON line: partition, offset and kdsync.seq.

    Exit 0 found, 1 not (yet) there, 2 bad input.
    """
    try:
        loc = translate(cluster, topic, source_partition, source_offset, origin, global_suffix, timeout, shards)
    except BadInput as e:
        _fail(e, 2)
    except OffsetsError as e:
        _fail(e, 1)
    print(json.dumps(loc.as_json(cluster.name, topic + global_suffix, origin or cluster.name, source_partition,
                                 source_offset)), flush=True)
    if not loc.found:
        raise typer.Exit(1)


def _fail(e: Exception, code: int):
    print(f"kdsync offsets: {e}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run `kdsync offsets ARGV`; returns the exit code (usage errors: one line, 2)."""
    return run_cli(typer.main.get_group(offsets_app), argv, "kdsync offsets")


if __name__ == "__main__":
    sys.exit(main())
