"""The member's log lines: one line per event, ``key=value`` or JSON.

    ts=1712.345 level=info member=dc1 logger=kdsync.member msg="view installed" topic=t view=3

Structured fields are passed as ``log.info("msg", **kv(topic=t, view=3))``.

librdkafka's own lines (broker connection failures and the like) go through
`KafkaClientLog`, the `logger` of every Kafka client of the member, so they
come out in the same format instead of raw ``%3|...`` lines:

    ts=1712.345 level=error member=dc1 logger=kdsync.kafka.client msg="Connect to ipv4#127.0.0.1:9092 failed: \
      Connection refused (after 0ms in state CONNECT)" facility=FAIL client=rdkafka#producer-1 \
      thread=127.0.0.1:9092/bootstrap suppressed=12

The tools (`kdsync offsets`, `audit`, `archive`, `restore`, `demo` and the
readers they share) give their clients `client_log()`: the same rate-limited
lines, as ``kdsync: kafka: <what happened>`` on stderr when nothing else
configured logging (`kdsync run` did: then they take its format).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["KVFormatter", "KafkaClientLog", "client_callback", "client_log", "kv", "setup_logging", "where"]


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


def where(e: BaseException) -> str:
    """file:line where `e` was raised (the last frame of its traceback)."""
    import traceback

    tb = traceback.extract_tb(e.__traceback__)
    return f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"


def client_callback(fn: Callable, what: str) -> Callable:
    """`fn` as a confluent-kafka callback (error_cb, logger, on_delivery):
    an exception escaping into the client leaves its error state set and
    surfaces later as an unrelated SystemError, so it is logged here (with
    where it was raised) and not raised."""
    log = logging.getLogger("kdsync.kafka.client")

    def guarded(*args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - see above
            log.error(f"internal error in a kafka client callback ({what})", exc_info=True,
                      **kv(where=where(e), error=repr(e)))
    return guarded


class KafkaErrors:
    """The `error_cb` of a member's Kafka clients (call it with the client's
    KafkaError, from any thread): `last` is the latest error and when
    (time.monotonic(), for `kdsync status`); a fatal error goes to `fatal`
    with one line; any other is logged as a WARNING at most once per error
    code every `interval_s` (a broker that is down: the client retries)."""

    def __init__(self, fatal: Callable[[str], None], logger: logging.Logger, interval_s: float = 5.0):
        self.last: tuple[str, float] | None = None
        self._fatal, self._log, self._interval_s = fatal, logger, interval_s
        self._logged: dict = {}  # error code -> time of its last line

    def __call__(self, err) -> None:
        now = time.monotonic()
        self.last = (err.str(), now)
        if err.fatal():
            self._fatal(f"kafka: {err.str()}")
        elif now - self._logged.get(err.code(), -1e9) > self._interval_s:
            self._logged[err.code()] = now
            self._log.warning("kafka client error (retrying)", **kv(error=err.str()))


    def routed(self, fatal: Callable[[str], None]) -> Callable:
        """This error_cb, but a fatal error goes to `fatal(error text)` (a
        producer's: re-created in place, kdsync.producer_recovery)."""

        def error_cb(err) -> None:
            if err.fatal():
                self.last = (err.str(), time.monotonic())
                fatal(err.str())
            else:
                self(err)

        return error_cb


class KafkaClientLog:
    """The `logger` of a confluent-kafka client: librdkafka's log lines as
    lines of logger `kdsync.kafka.client`, at most one per kind (librdkafka
    facility and level) every `interval_s` seconds; the next line of a kind
    says how many were suppressed meanwhile (field ``suppressed``).
    `interval_s` 0: every line.  Thread-safe (clients log from whichever
    thread polls them)."""

    def __init__(self, interval_s: float = 5.0, logger: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.logger = logger or logging.getLogger("kdsync.kafka.client")
        self.clock = clock
        self._kinds: dict[tuple[str, int], tuple[float, int]] = {}  # kind -> (time of its last line, suppressed)
        self._lock = threading.Lock()

    def log(self, level: int, fmt: str, *args) -> None:
        """Called by confluent-kafka as ``log(level, "%s [%s] %s", facility, client, text)``."""
        try:
            self._log(level, fmt, *args)
        except Exception as e:  # noqa: BLE001 - never into the client (client_callback)
            sys.stderr.write(f"kdsync: internal error logging a kafka client line: {e!r} at {where(e)}\n")

    def _log(self, level: int, fmt: str, *args) -> None:
        if len(args) == 3:
            facility, client, text = (str(a) for a in args)
        else:
            facility, client, text = "-", "-", (fmt % args if args else fmt)
        kind = (facility, level)
        with self._lock:
            now = self.clock()
            last, suppressed = self._kinds.get(kind, (None, 0))
            if last is not None and now - last < self.interval_s:
                self._kinds[kind] = (last, suppressed + 1)
                return
            self._kinds[kind] = (now, 0)
        fields = {"facility": facility, "client": client}
        if text.startswith("[thrd:") and "]: " in text:  # "[thrd:HOST:PORT/ID]: HOST:PORT/ID: what happened"
            thread, _, text = text[6:].partition("]: ")
            fields["thread"] = thread
            if text.startswith(thread + ": "):
                text = text[len(thread) + 2:]
        if suppressed:
            fields["suppressed"] = suppressed
        self.logger.log(level, text, extra={"kv": fields})


_TOOL_LOG: KafkaClientLog | None = None
_TOOL_LOCK = threading.Lock()


def client_log() -> KafkaClientLog:
    """The `logger` for Kafka clients outside the member (module doc): one per
    process, rate-limited like the member's.  Without logging configured (a
    tool, not `kdsync run`), its lines go to stderr as ``kdsync: kafka: ...``
    at warning and above, never as raw ``%3|...`` lines."""
    global _TOOL_LOG
    with _TOOL_LOCK:
        if _TOOL_LOG is None:
            lg = logging.getLogger("kdsync.kafka.client")
            if not logging.getLogger().handlers and not lg.handlers:
                h = logging.StreamHandler(sys.stderr)
                h.setFormatter(logging.Formatter("kdsync: kafka: %(message)s"))
                h.setLevel(logging.WARNING)
                h.addFilter(lambda r: not logging.getLogger().handlers)  # kdsync run's setup_logging takes over
                lg.addHandler(h)
            _TOOL_LOG = KafkaClientLog(5.0, lg)
        return _TOOL_LOG
