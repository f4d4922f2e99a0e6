"""The `kdsync` command.  Each subcommand lives in its own module and is
imported lazily, so `kdsync run` does not pay for PySpark and `kdsync audit`
does not need confluent-kafka's producer path.

Every subcommand module exposes `main(argv: list[str]) -> int` and owns its
own argument parsing (a user error prints one line and returns 2).
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "run": ("kdsync.member", "one member: source topic(s) in, agreed order out to the global topic(s)"),
    "demo": ("kdsync.demo", "embedded brokers + one member per cluster, concurrent writes, agreement check"),
    "audit": ("kdsync.spark.audit", "PySpark job: agreement, loss, duplicates, order, latency"),
    "archive": ("kdsync.spark.archive", "write a cluster's global topic to Parquet segments"),
    "compact": ("kdsync.spark.archive", "merge level-0 archive segments into level-1 segments"),
    "restore": ("kdsync.spark.archive", "replay an archive into a cluster's global topic"),
    "offsets": ("kdsync.offsets_cli", "move a consumer group between clusters by offset; translate source offsets"),
}


def _usage() -> str:
    lines = ["usage: kdsync COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        from kdsync import __version__

        print(f"kdsync {__version__}")
        return 0
    name = argv[0]
    if name not in SUBCOMMANDS:
        print(f"kdsync: unknown command {name!r} (expected one of: {', '.join(SUBCOMMANDS)})", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    entry = getattr(module, f"main_{name}", None) or module.main
    return int(entry(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
