"""The `kdsync` command.

`kdsync run` is defined here (its runtime is kdsync.member), and
`kdsync N BROKERS TOPIC` (the original command line) is `kdsync run N BROKERS
TOPIC`; every other
subcommand lives in its own module as a typer command and is imported only
when it is used, so `kdsync run` does not pay for PySpark.  Every command
follows kdsync.cli_style: help text with defaults, and bad usage as one line,
exit 2.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys

import typer
from typer.core import TyperGroup

from kdsync.cli_style import UsageError, command, new_app
from kdsync.cli_style import run as run_cli

# subcommand -> module defining it (as `app`, a typer app with a command of that name)
SUBCOMMANDS = {
    "run": __name__,
    "demo": "kdsync.demo",
    "audit": "kdsync.spark.audit",
    "archive": "kdsync.spark.archive",
    "compact": "kdsync.spark.archive",
    "restore": "kdsync.spark.archive",
    "offsets": "kdsync.offsets_cli",
    "check": "kdsync.group_cli",
    "status": "kdsync.group_cli",
}


class _LazyCommands(TyperGroup):
    """The subcommands of SUBCOMMANDS, each imported when it is used (or listed by --help)."""

    def list_commands(self, ctx) -> list[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx, name: str):
        if name not in SUBCOMMANDS:
            return None
        return command(importlib.import_module(SUBCOMMANDS[name]).app, name)

    def resolve_command(self, ctx, args):
        if args[0] not in SUBCOMMANDS:
            raise UsageError(f"unknown command {args[0]!r} (expected one of: {', '.join(SUBCOMMANDS)})")
        return super().resolve_command(ctx, args)


top = new_app("Keep several Kafka clusters in the same order: Derecho-style atomic multicast of topic events. "
              "The original command line `kdsync N BROKERS TOPIC` is `kdsync run N BROKERS TOPIC`.",
              cls=_LazyCommands)


@top.callback(invoke_without_command=True)
def _top(ctx: typer.Context,
         version: bool = typer.Option(False, "--version", "-V", help="print the version and exit")) -> None:
    if version:
        from kdsync import __version__

        print(f"kdsync {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        raise UsageError(f"give a command: {', '.join(SUBCOMMANDS)} (see kdsync --help)")


# ---------------------------------------------------------------- kdsync run
app = new_app()


@app.command("run", help="Run one kdsync member: source topic(s) in, the agreed order out to the global topic(s). "
                         "Give --config FILE, or the original form N BROKERS TOPIC.")
def _run(
    config: str | None = typer.Option(None, "--config", "-c", metavar="FILE", show_default="none",
                                      help="TOML configuration file"),
    log_level: str | None = typer.Option(None, "--log-level", metavar="LEVEL", show_default="[log] level",
                                         help="debug, info, warning or error; overrides [log] level"),
    trace_latency: str | None = typer.Option(None, "--trace-latency", metavar="FILE", show_default="none",
                                             help="append one JSON line per batch of records once durable: the time "
                                                  "it reached each stage (docs/outputs.md); with shards, shard S "
                                                  "appends to FILE.shard-S"),
    workers: int | None = typer.Option(None, "--workers", "-w", metavar="W", show_default="none: in this process",
                                       help="run the shards ([topics] shards) in W worker processes, restarted "
                                            "when they die (docs/shards.md)"),
    n: str | None = typer.Argument(None, metavar="N", show_default="2",
                                   help="original form: number of members; peers come from $DERECHO_CONF_FILE, "
                                        "./derecho.cfg or /etc/derecho/derecho.cfg"),
    brokers: str | None = typer.Argument(None, metavar="BROKERS", show_default="127.0.0.1:9092",
                                         help="original form: bootstrap servers of this member's cluster"),
    topic: str | None = typer.Argument(None, metavar="TOPIC", show_default="test",
                                       help="original form: the source topic"),
) -> int:
    from kdsync.config import ConfigError, find_derecho_cfg, legacy_config, load_config
    from kdsync.fatal import FatalError
    from kdsync.observability.logs import setup_logging

    if log_level is not None and log_level not in ("debug", "info", "warning", "error"):
        raise UsageError(f"--log-level must be debug, info, warning or error, not {log_level!r}")
    if workers is not None and (workers < 1 or not config):
        raise UsageError("--workers must be at least 1" if workers < 1 else "--workers needs --config FILE")
    notes: list[tuple[str, dict]] = []  # what the original form's mapping has to say, logged below
    try:
        if config:
            if n is not None:
                raise UsageError("give either --config FILE or N BROKERS TOPIC, not both")
            cfg = load_config(config)
        else:
            try:
                members = int(n) if n is not None else 2
            except ValueError:
                raise UsageError(f"N must be a number of members, got {n!r}") from None
            cfg = legacy_config(members, brokers or "127.0.0.1:9092", topic or "test", find_derecho_cfg(), notes)
    except ConfigError as e:
        raise UsageError(str(e), prefix=False) from None
    setup_logging(cfg.member.id, cfg.log.format, log_level or cfg.log.level)
    from kdsync.observability.logs import kv

    for msg, fields in notes:
        logging.getLogger("kdsync.config").info(msg, **kv(**fields))
    from kdsync.observability import gcpauses

    gcpauses.tune()  # a process that runs members: fewer, shorter collections (the module's doc)
    if workers is not None or cfg.shards() > 1:
        from kdsync.config import parse_address
        from kdsync.workers import Supervisor, run_shards

        try:
            if workers is not None:
                return Supervisor(cfg, config, workers, log_level, trace_latency).run()
            return run_shards(cfg, cfg.served_shards(),
                              parse_address(cfg.metrics.listen) if cfg.metrics.listen else None, trace_latency)
        except FatalError as e:
            print(f"kdsync run: {e}", file=sys.stderr)
            return 1
    from kdsync.eventloop import run as run_loop
    from kdsync.member import Member

    try:
        return run_loop(Member(cfg, trace_latency=trace_latency).run(), cfg.member.coalesce_us)
    except FatalError as e:
        print(f"kdsync run: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    """`kdsync ARGS`; returns the exit code of the subcommand (2 on bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["help"]:  # `kdsync help` = `kdsync --help`
        argv = ["--help"]
    elif argv and re.fullmatch(r"\d+", argv[0]):  # the original `kdsync N BROKERS TOPIC`
        argv = ["run", *argv]
    return run_cli(typer.main.get_group(top), argv, "kdsync")


if __name__ == "__main__":
    sys.exit(main())
