"""Stall detection: a member that cannot make progress says so.

A record goes through four stages in a member (docs/metrics.md,
`kdsync_stalled`):

| stage | holds | moves when |
|---|---|---|
| `fetch` | source records above the consumed position (the source is not held back) | records are consumed |
| `ordering` | own batches submitted to the ordering node, not delivered yet | the node delivers |
| `produce` | delivered records not handed to the producer (a producer being recovered) | records are produced |
| `delivery report` | records produced whose delivery report has not come | positions become durable |

A stage that holds something and has not moved for `stall_after_s` is
stalled: one WARNING line (topic, stage, what it holds, for how long), the
gauge `kdsync_stalled{topic,stage}` at 1, and the alert `KdsyncStalled`; when
it moves again, one INFO line and the gauge back at 0.

`StallDetector` is pure (samples in, transitions out), so it is tested with
a fake clock; `sample_pipelines` is the member's sampling, once a second.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kdsync.observability.logs import kv

__all__ = ["STAGES", "StallDetector", "Transition", "sample_pipelines"]

log = logging.getLogger("kdsync.member")

STAGES = ("fetch", "ordering", "produce", "delivery report")


@dataclass
class _Watch:
    progress: int
    since: float  # when progress last moved, or the stage last held nothing
    stalled: bool = False


@dataclass(frozen=True)
class Transition:
    topic: str
    stage: str
    stalled: bool  # True: it just stalled; False: it just moved again
    held: int
    for_s: float  # how long it has not moved (stalled) / had not moved (resumed)


class StallDetector:
    """Watches each (topic, stage) while it holds something: a stage that
    holds nothing has no watch (a thousand idle topics cost a lookup each),
    and its clock starts at the first sample that finds it holding."""

    def __init__(self, stall_after_s: float):
        if stall_after_s <= 0:
            raise ValueError("stall_after_s must be > 0")
        self.stall_after_s = stall_after_s
        self._w: dict[str, dict[str, _Watch]] = {}  # topic -> stage -> its watch, while it holds something

    def sample(self, now: float, topic: str, stage: str, held: int, progress: int) -> Transition | None:
        """One observation of `stage` of `topic`: `held` items wait in it,
        `progress` is a counter that grows when it moves.  Returns the
        transition it causes, if any."""
        ws = self._w.get(topic)
        w = ws.get(stage) if ws is not None else None
        if held <= 0:
            if w is None:
                return None
            del ws[stage]
            if not ws:
                del self._w[topic]
            return Transition(topic, stage, False, held, now - w.since) if w.stalled else None
        if w is None:
            self._w.setdefault(topic, {})[stage] = _Watch(progress, now)
            return None
        if progress != w.progress:
            was, since = w.stalled, w.since
            w.progress, w.since, w.stalled = progress, now, False
            return Transition(topic, stage, False, held, now - since) if was else None
        if not w.stalled and now - w.since >= self.stall_after_s:
            w.stalled = True
            return Transition(topic, stage, True, held, now - w.since)
        return None

    def watching(self, topic: str) -> bool:
        """Some stage of `topic` held something at its last sample."""
        return topic in self._w

    def stalled(self) -> list[tuple[str, str]]:
        """(topic, stage) of every stage stalled now."""
        return [(t, s) for t, ws in self._w.items() for s, w in ws.items() if w.stalled]

    def forget(self, topic: str) -> None:
        self._w.pop(topic, None)


def sample_pipelines(detector: StallDetector, metrics, pipelines, source, now: float) -> None:
    """Sample every stage of every pipeline of a member (kdsync.pipeline):
    log and set `kdsync_stalled` on each transition."""
    held_back = source is None or source.held_back
    for p in list(pipelines):
        w = p.writer
        own = p.own_waiting()
        fetch = 0 if held_back else source.unfetched(p.topic)
        if not (own or fetch or (w is not None and (w.unproduced or w.outstanding))) \
                and not detector.watching(p.topic):
            continue  # holds nothing in any stage and did not at the last sample: an idle topic
        samples = [("ordering", own, p.delivered_end)]
        if source is not None:
            samples.append(("fetch", fetch, p.consumed))
        if w is not None:
            samples += [("produce", w.unproduced, w.produced_end), ("delivery report", w.outstanding, w.durable_end)]
        for stage, held, progress in samples:
            t = detector.sample(now, p.topic, stage, held, progress)
            if t is None:
                continue
            metrics.stalled.labels(t.topic, t.stage).set(1 if t.stalled else 0)
            if t.stalled:
                log.warning("stalled: records wait in a stage that does not move", **kv(
                    topic=t.topic, stage=t.stage, held=t.held, for_s=round(t.for_s, 1)))
            else:
                log.info("stall over", **kv(topic=t.topic, stage=t.stage, stalled_s=round(t.for_s, 1)))


def loop_delay(metrics, delay: float, suspect_ms: float, groups: int, asleep: int, gc_pause: float = 0.0,
               liveness=None) -> None:
    """The longest tick delay since the last health sample: a metric, and a
    warning when it reached half of suspect_ms (peers may then judge the
    member silent), with the longest garbage collection in that time.  With
    the member's `liveness` (kdsync.core.liveness.PeerLiveness): how long
    each peer may now be silent before it is suspected (suspect_ms plus the
    tolerance learned from late loops and late pings; with adaptive
    suspicion, sooner for a peer whose pings came regularly)."""
    metrics.loop_delay.set(delay)
    metrics.groups_asleep.set(asleep)
    metrics.gc_pause.set(gc_pause)
    if liveness is not None:
        per_tick = suspect_ms / 1000.0 / liveness.suspect_ticks
        for peer in liveness.peers:
            metrics.suspect_after.labels(peer).set(per_tick * liveness.limit(peer))
    if delay * 2000 >= suspect_ms:
        log.warning("loop late", **kv(delay_ms=round(delay * 1000), groups=groups, asleep=asleep,
                                      gc_ms=round(gc_pause * 1000)))
