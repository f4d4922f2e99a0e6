"""A member's producer that failed is re-created in place.

A fatal producer error or a delivery error does not stop `kdsync run` at
once (kdsync.kafka.sink's module doc): every writer is suspended, the failed
producer's queue is purged and its requests in flight are waited for (at most
`DRAIN_S`), a new producer is made, each global partition's tail is read from
the writer's durable floor, and only the positions missing there are written
again, in order (`kdsync_producer_recoveries_total`).  More than
`MAX_RECOVERIES` within `RECOVERY_WINDOW_S` is fatal with one line: the
restart resumes from the global topic.

What the recovery uses of the member is `RecoveryHost`: nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from confluent_kafka import KafkaException

from kdsync.kafka.sink import make_producer, read_present
from kdsync.observability.logs import kv

from kdsync.pipeline import TopicPipeline

__all__ = ["ProducerRecovery", "RecoveryHost"]

log = logging.getLogger("kdsync.member")

MAX_RECOVERIES, RECOVERY_WINDOW_S = 5, 60.0  # more producer recoveries than this within the window: fatal
DRAIN_S = 30.0  # a failed producer's in-flight requests are waited for this long before its tail is read


class RecoveryHost(Protocol):
    """What the producer recovery uses of the member: its producer (read, and
    replaced), the pipelines whose writers it suspends and resumes, the Kafka
    settings to make a producer and read a tail, and the member's callbacks."""

    stopping: bool
    producer: Any
    pipelines: dict[str, TopicPipeline]
    kafka_conf: dict
    metrics: Any  # kdsync.observability.metrics.MemberMetrics: producer_recoveries

    def producer_conf(self) -> dict: ...

    async def retry(self, what: str, fn: Callable[..., Any], *args: Any) -> Any: ...

    def fatal(self, msg: str) -> None: ...

    def stop_requested(self) -> bool: ...

    def poll_reports_soon(self) -> None: ...


class ProducerRecovery:
    """The producer recovery of member `m` (module doc)."""

    def __init__(self, m: RecoveryHost):
        self.m = m
        self.active = False  # the producer is being re-created
        self._again: str | None = None  # it failed again while being recovered: recover once more after
        self._starts: list[float] = []  # when recent recoveries began

    def failed(self, why: str) -> None:
        """The producer failed (a fatal error, or a delivery error): recover
        it in place unless recoveries repeat."""
        m = self.m
        if m.stopping:
            return
        if self.active:
            self._again = why
            return
        now = time.monotonic()
        self._starts = [t for t in self._starts if now - t < RECOVERY_WINDOW_S] + [now]
        if len(self._starts) > MAX_RECOVERIES:
            m.fatal(f"{why} ({len(self._starts)} producer recoveries within {RECOVERY_WINDOW_S:.0f} s; "
                    f"restart the member once the cluster accepts writes; it resumes from the global topic)")
            return
        self.active = True
        for p in m.pipelines.values():
            if p.writer is not None:
                p.writer.suspend()
        asyncio.ensure_future(self._recover(why))

    async def _recover(self, why: str) -> None:
        m = self.m
        log.warning("producer failed; re-creating it and resuming from the global topics' tails", **kv(error=why))
        m.metrics.producer_recoveries.inc()
        old = m.producer
        try:
            with contextlib.suppress(Exception):
                old.purge(in_queue=True, in_flight=False)  # what was sent may still land: wait for it below
            deadline = time.monotonic() + DRAIN_S
            while len(old) > 0 and time.monotonic() < deadline and not m.stop_requested():
                # its reports are ignored (suspended writers); they tell the requests are over.  poll()
                # may raise the fatal error that started this (when it first surfaced in produce(), not
                # through poll: seen in CI, where it stopped the member): expected of the producer replaced
                with contextlib.suppress(KafkaException):
                    old.poll(0)
                await asyncio.sleep(0.05)
            if len(old):
                log.warning("the failed producer still has requests in flight; going on", **kv(messages=len(old)))
            m.producer = make_producer(m.producer_conf())
            for p in list(m.pipelines.values()):
                if p.writer is None:
                    continue
                w = p.writer
                present = await m.retry(f"reading the tail of {p.global_topic}", read_present, m.kafka_conf,
                                        p.global_topic, dict(w.floors), w.durable_end)
                w.resume(m.producer, present)
                if p.checkpoint is not None:
                    p.checkpoint.producer = m.producer
                log.info("writer resumed", **kv(topic=p.topic, durable_end=w.durable_end, present=len(present),
                                                produced_end=w.produced_end))
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - recovery failed: stop with one line, the restart recovers
            m.fatal(f"{why}; recovering the producer failed: {e}")
            return
        finally:
            self.active = False
        if self._again is not None:  # the new producer failed while the writers resumed
            why, self._again = self._again, None
            self.failed(why)
            return
        m.poll_reports_soon()
