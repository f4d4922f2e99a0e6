"""One CLI style for every command (kdsync/cli_style.py): help with defaults,
exit 0; bad usage as ONE line ``PROG: what to fix`` and exit 2; the
command lines argparse accepted keep working (greedy options, abbreviated
long options, the legacy `kdsync run N BROKERS TOPIC`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kdsync.cli import main as kdsync
from kdsync.demo import main as demo
from kdsync.spark.archive import main_archive, main_compact, main_restore
from kdsync.spark.audit import main as audit
from sim.cli import main as sim


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _commands():
    import typer

    from kdsync import cli, demo as demo_mod
    from kdsync.cli_style import command
    from kdsync.spark import archive, audit as audit_mod
    from sim import cli as sim_cli

    for mod, name in [(cli, "run"), (demo_mod, "demo"), (audit_mod, "audit"), (archive, "archive"),
                      (archive, "compact"), (archive, "restore")]:
        yield f"kdsync {name}", command(mod.app, name)
    for name, cmd in typer.main.get_group(sim_cli.app).commands.items():
        yield f"kdsync-sim {name}", cmd


@pytest.mark.parametrize("prog, cmd", list(_commands()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_command_and_option_has_help_and_shows_its_default(prog, cmd):
    assert cmd.help, prog
    for p in cmd.params:
        assert p.help, (prog, p.name)
        shown = p.show_default if isinstance(p.show_default, str) else (p.show_default and p.default is not None)
        assert p.required or shown, (prog, p.name, p.default, p.show_default)


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["help"], ["run", "--help"], ["demo", "-h"]])
def test_help_exits_0(argv, capsys):
    assert kdsync(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage: kdsync")
    if argv[0] in ("--help", "-h", "help"):
        for name in ("run", "demo", "audit", "archive", "compact", "restore"):
            assert f"\n  {name} " in out, out
    else:
        assert "[default: " in out


def test_kdsync_sim_help(capsys):
    assert sim(["--help"]) == 0 and "swarm" in capsys.readouterr().out
    assert sim(["swarm", "--help"]) == 0
    assert "[default: derecho]" in capsys.readouterr().out


@pytest.mark.parametrize("main, argv, line", [
    (kdsync, [], "kdsync: give a command: run, demo, audit, archive, compact, restore, offsets, check, status (see kdsync --help)"),
    (kdsync, ["bogus"], "kdsync: unknown command 'bogus' (expected one of: run, demo, audit, archive, compact, "
                        "restore, offsets, check, status)"),
    (kdsync, ["--bogus"], "kdsync: unrecognized option --bogus (see kdsync --help)"),
    (kdsync, ["run", "--bogus"], "kdsync run: unrecognized option --bogus (see kdsync run --help)"),
    (kdsync, ["run", "--config"], "kdsync run: option '--config' requires an argument (see kdsync run --help)"),
    (kdsync, ["run", "x"], "kdsync run: N must be a number of members, got 'x'"),
    (kdsync, ["run", "--config", "c.toml", "3"], "kdsync run: give either --config FILE or N BROKERS TOPIC, not both"),
    (kdsync, ["run", "1", "b", "t", "extra"],
     "kdsync run: got unexpected extra argument(s) (extra) (see kdsync run --help)"),
    (kdsync, ["run", "--log-level", "loud"], "kdsync run: --log-level must be debug, info, warning or error, not 'loud'"),
    (kdsync, ["demo", "--events", "x"], "kdsync demo: invalid value for '--events': not an integer "
                                        "(see kdsync demo --help)"),
    (demo, ["--protocol", "paxos"], "kdsync demo: invalid value for '--protocol': 'paxos' is not one of 'derecho', "
                                    "'clock', 'sequencer', 'mirror' (see kdsync demo --help)"),
    (kdsync, ["audit", "--trace"], "kdsync audit: option '--trace' requires an argument (see kdsync audit --help)"),
    (main_archive, ["--topic", "t", "--path", "p"], "kdsync archive: missing option '--cluster' "
                                                    "(see kdsync archive --help)"),
    (main_compact, ["--path", "p", "--target-bytes", "0"], "kdsync compact: --target-bytes must be > 0"),
    (main_restore, ["--path", "p", "--topic", "t", "--cluster", "a=h:1", "--cluster", "b=h:2"],
     "kdsync restore: give exactly one --cluster NAME=BROKERS"),
    (sim, ["swarm", "--seeds", "0"], "kdsync-sim swarm: --seeds must be at least 1"),
    (sim, ["swarm", "--protocol", "x", "--seeds", "1"], "kdsync-sim swarm: invalid value for '--protocol': 'x' is "
                                                        "not one of 'derecho', 'clock', 'sequencer', 'mirror' "
                                                        "(see kdsync-sim swarm --help)"),
    (sim, ["bogus"], "kdsync-sim: no such command 'bogus' (see kdsync-sim --help)"),
])
def test_bad_usage_is_one_line_and_exit_2(main, argv, line, capsys):
    assert main(argv) == 2
    assert one_line(capsys) == line


def test_version(capsys):
    from kdsync import __version__

    assert kdsync(["--version"]) == 0 and capsys.readouterr().out == f"kdsync {__version__}\n"


def test_argparse_command_lines_still_parse(capsys):
    # several values after one --cluster / --trace, and abbreviated long options, as argparse took them:
    # the audit gets as far as checking them (no Spark is started for these errors)
    assert audit(["--cluster", "a=h:1", "b=h:2", "--topic", "t-global"]) == 2
    assert one_line(capsys) == "kdsync audit: --topic names the source topic T, not T-global"
    assert audit(["--cluster", "a=h:1", "a=h:2", "--topic", "t"]) == 2
    assert one_line(capsys) == "kdsync audit: --cluster 'a' given twice"
    assert audit(["--clus", "a=h:1", "--top", "t", "--window", "0"]) == 2
    assert one_line(capsys) == "kdsync audit: --window-s must be > 0"
    assert audit(["--trace", "/nonexistent/a", "/nonexistent/b", "--window-s=2"]) == 2
    assert one_line(capsys) == "kdsync audit: --trace /nonexistent/a: no such file or directory"


def test_legacy_run_form_reaches_the_config(tmp_path):
    # `kdsync run N BROKERS TOPIC`: the peers come from derecho.cfg; a missing one is a config error, exit 2
    r = subprocess.run([sys.executable, "-m", "kdsync.cli", "run", "3", "127.0.0.1:1", "t"], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("config error:") and "derecho.cfg" in r.stderr, r.stderr


def test_original_command_line_without_run(tmp_path, monkeypatch, capsys):
    """`kdsync N BROKERS TOPIC` is `kdsync run N BROKERS TOPIC`: derecho.cfg is
    searched in $DERECHO_CONF_FILE, ./derecho.cfg, then /etc/derecho/derecho.cfg
    (a stand-in path here: tests never write to /etc)."""
    from kdsync import config as kconfig

    etc = tmp_path / "etc" / "derecho.cfg"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DERECHO_CONF_FILE", raising=False)
    monkeypatch.setattr(kconfig, "DERECHO_SYSTEM_CFG", str(etc))
    assert kdsync(["3", "127.0.0.1:1", "t"]) == 2
    assert one_line(capsys) == (f"config error: no derecho.cfg in the working directory nor '{etc}', and "
                                f"DERECHO_CONF_FILE is not set (put derecho.cfg in one of them or use --config FILE)")
    etc.parent.mkdir()
    etc.write_text("[DERECHO]\nlocal_ip = 127.0.0.1\n")  # found, read, and its error named
    assert kdsync(["3", "127.0.0.1:1", "t"]) == 2
    assert one_line(capsys) == f"config error: DERECHO.local_id: required key is missing in {etc}"
    assert kdsync(["run", "3", "127.0.0.1:1", "t"]) == 2  # the same with `run`
    assert one_line(capsys) == f"config error: DERECHO.local_id: required key is missing in {etc}"
