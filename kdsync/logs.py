"""The member's log lines: one line per event, ``key=value`` or JSON.

    ts=1712.345 level=info member=dc1 logger=kdsync.member msg="view installed" topic=t view=3

Structured fields are passed as ``log.info("msg", **kv(topic=t, view=3))``.
"""

from __future__ import annotations

import json
import logging
import sys

__all__ = ["KVFormatter", "kv", "setup_logging"]


class KVFormatter(logging.Formatter):
    """One line per event: ``ts=... level=info logger=... msg="..." key=value``."""

    def __init__(self, member: str, as_json: bool = False):
        super().__init__()
        self.member = member
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = {"ts": f"{record.created:.3f}", "level": record.levelname.lower(), "member": self.member,
                  "logger": record.name, "msg": record.getMessage()}
        fields.update(getattr(record, "kv", {}))
        if record.exc_info and record.levelno >= logging.ERROR:
            fields["exc"] = self.formatException(record.exc_info).splitlines()[-1]
        if self.as_json:
            return json.dumps(fields, default=str)
        out = []
        for k, v in fields.items():
            s = str(v)
            out.append(f"{k}={json.dumps(s)}" if (not s or any(c in s for c in ' "=\n')) else f"{k}={s}")
        return " ".join(out)


def kv(**fields) -> dict:
    """Keyword arguments for a logging call that attach `fields` to the line."""
    return {"extra": {"kv": fields}}


def setup_logging(member: str, fmt: str, level: str) -> None:
    """Send every logger's lines to stderr, one line each, in format `fmt`
    ("kv" or "json"), at `level` ("debug", "info", ...)."""
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(KVFormatter(member, as_json=fmt == "json"))
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level.upper())
