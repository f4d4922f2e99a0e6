"""`kdsync audit` bad input: one clear line on stderr, exit 2, no Spark needed."""

from __future__ import annotations

import pytest

from kdsync.spark.audit import main


@pytest.mark.parametrize("argv, needle", [
    ([], "nothing to audit"),
    (["--cluster", "dc1"], "NAME=HOST:PORT"),
    (["--cluster", "dc1=h:1"], "--topic"),
    (["--cluster", "dc1=h:1", "--cluster", "dc1=h:2", "--topic", "t"], "given twice"),
    (["--cluster", "dc1=h:1", "--topic", "t-global"], "source topic"),
    (["--trace", "/nonexistent/trace.parquet"], "no such file"),
    (["--trace", "x", "--cluster", "a=b:1"], "either"),
    (["--bogus"], "unrecognized"),
    (["--trace", "x", "--window-s", "0"], "--window-s"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_cli_dispatch_reaches_audit(capsys):
    from kdsync.cli import main as kdsync

    assert kdsync(["audit"]) == 2
    assert "nothing to audit" in capsys.readouterr().err
