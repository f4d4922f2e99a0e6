"""One style for every kdsync command (`kdsync ...`, `kdsync-sim ...`).

Arguments and help come from typer: every command and option has help text
and shows its default.  Errors follow one policy: bad usage or bad input
prints ONE line on stderr naming what to fix — ``PROG: message`` — and exits
2; click's multi-line usage dump is never shown.  `--help`/`-h` exits 0.

A command is a typer command whose function returns its exit code; each
module that defines one keeps a ``main(argv) -> int`` that runs it through
`run`, so it works alone and under the `kdsync` group alike.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

import typer
from typer.core import TyperCommand

# typer 0.29 vendors click; of its exceptions only BadParameter is re-exported
from typer._click.exceptions import ClickException, NoSuchOption
from typer._click.exceptions import UsageError as _ClickUsageError
from typer._click.globals import get_current_context

__all__ = ["CONTEXT", "App", "KdsyncCommand", "UsageError", "command", "error_line", "new_app", "run", "run_job"]

# -h as well as --help (argparse accepted both); help at most 100 columns wide
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# typer reports bad values in pydantic's words
_PLAIN = {"Input should be a valid integer, unable to parse string as an integer": "not an integer",
          "Input should be a valid number, unable to parse string as a number": "not a number",
          "Value error, ": ""}


class UsageError(_ClickUsageError):
    """Bad arguments or input: one line naming what to fix, exit 2.

    Printed as ``PROG: message`` (PROG = the command being run), or as the
    bare message when `prefix` is False (for errors that already name their
    file and line)."""

    def __init__(self, message: str, *, prefix: bool = True):
        super().__init__(message, ctx=get_current_context(silent=True))
        self.prefix = prefix


class KdsyncCommand(TyperCommand):
    """A command that parses the way kdsync's argparse commands did: a long
    option may be abbreviated to a unique prefix, and an option named in
    `greedy` takes every word that follows it up to the next option
    (``--cluster a=h:1 b=h:2``)."""

    greedy: tuple[str, ...] = ()

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self._argparse_style(ctx, args))

    def _argparse_style(self, ctx, args: list[str]) -> list[str]:
        longs = sorted({o for p in self.get_params(ctx) for o in (*p.opts, *p.secondary_opts) if o.startswith("--")})
        out: list[str] = []
        greedy = None
        for i, a in enumerate(args):
            if a == "--":
                return out + args[i:]
            if a.startswith("--"):
                name, eq, value = a.partition("=")
                hits = [o for o in longs if o.startswith(name)]
                if name not in longs and len(hits) == 1:
                    name = hits[0]
                out.append(name + eq + value)
                greedy = name if name in self.greedy and not eq else None
            elif greedy is not None and not a.startswith("-"):
                if out[-1] != greedy:
                    out.append(greedy)
                out.append(a)
            else:
                greedy = None
                out.append(a)
        return out


class App(typer.Typer):
    """A typer app whose commands are KdsyncCommands with kdsync's context
    settings; `command(..., greedy=("--opt",))` names greedy options."""

    def command(self, name: str | None = None, *, greedy: tuple[str, ...] = (), **kw):
        kw.setdefault("cls", type("Command", (KdsyncCommand,), {"greedy": tuple(greedy)}))
        kw.setdefault("context_settings", CONTEXT)
        return super().command(name, **kw)


def new_app(help_: str | None = None, **kw) -> App:
    """An App in kdsync's style (plain help text, no completion commands); returns it."""
    return App(help=help_, add_completion=False, rich_markup_mode=None, context_settings=CONTEXT, **kw)


def command(app: typer.Typer, name: str):
    """The click command `name` registered on `app`; raises KeyError if there is none."""
    return typer.main.get_group(app).commands[name]


def usage_line(e: ClickException, path: str) -> str:
    """Click/typer error `e` of command `path` as one line (the command's own
    UsageErrors verbatim, click's with a pointer to --help)."""
    if isinstance(e, UsageError):
        return e.format_message()
    if isinstance(e, NoSuchOption):
        msg = f"unrecognized option {e.option_name}"
        if e.possibilities:
            msg += f" (did you mean {' or '.join(sorted(e.possibilities))}?)"
    else:
        msg = " ".join(e.format_message().split()).rstrip(".")
        for wordy, plain in _PLAIN.items():
            msg = msg.replace(wordy, plain)
        msg = msg[:1].lower() + msg[1:]
    return f"{msg} (see {path} --help)"


def error_line(e: BaseException) -> str:
    """The first meaningful line of an exception (Py4J/Spark errors are long)."""
    text = str(e).strip() or type(e).__name__
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "at ", "JVM stacktrace")):
            return f"{type(e).__name__}: {line[:300]}"
    return type(e).__name__


def run_job(prog: str, fn: Callable[..., Any], *args, what: str = "failed") -> tuple[bool, Any]:
    """Run a job `fn(*args)` (a Spark job, a broker's): (True, its result);
    a UsageError passes; another exception prints ``PROG: WHAT: <one line>``
    and gives (False, None), or is raised with KDSYNC_DEBUG=1."""
    try:
        return True, fn(*args)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - one line (KDSYNC_DEBUG=1 for the traceback)
        if os.environ.get("KDSYNC_DEBUG"):
            raise
        print(f"{prog}: {what}: {error_line(e)}", file=sys.stderr)
        return False, None


def _path(cmd, argv: list[str], prog: str) -> str:
    """The command path `argv` reaches (for errors click raises without a context)."""
    path = prog
    while hasattr(cmd, "get_command"):  # a group: follow the first word that names a subcommand
        word = next((a for a in argv if not a.startswith("-")), None)
        sub = cmd.get_command(None, word) if word is not None else None
        if sub is None:
            break
        path, cmd, argv = f"{path} {word}", sub, argv[argv.index(word) + 1:]
    return path


def run(cmd, argv: Sequence[str] | None, prog: str) -> int:
    """Run click command `cmd` (a typer command or group) on `argv` as `prog`;
    return its exit code.  Usage errors print one line and return 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rv = cmd.main(args=argv, prog_name=prog, standalone_mode=False)
    except ClickException as e:
        ctx = getattr(e, "ctx", None)
        path = ctx.command_path if ctx is not None else _path(cmd, argv, prog)
        text = usage_line(e, path)
        print(text if isinstance(e, UsageError) and not e.prefix else f"{path}: {text}", file=sys.stderr)
        return e.exit_code
    except typer.Abort:
        return 1
    return int(rv or 0)
