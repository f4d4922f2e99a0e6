"""The ordering stream of one view of the `clock` protocol (work in progress,
docs/design/wan-ordering.md): Clock-RSM's order inside a view.

Theory of operation
-------------------
*Slots and timestamps.*  Each sender of the view cuts its pending batches
into slots, numbered 0, 1, ... per sender, and stamps each with a timestamp
from its hybrid logical clock: ``ts = max(now, clock + 1)``, so one sender's
timestamps strictly increase whatever its physical clock does.  The agreed
order is (ts, sender rank).  There are no nulls and no rounds: a sender cuts
a slot when it has data and its window has room.

*Received vectors.*  As in derecho's stream, every member keeps
`received[k]`, the number of contiguous slots it holds from sender k, and
multicasts that vector (cumulative acknowledgements).

*Clock reports.*  Every message a member sends carries `(cut, clock)`: it had
cut `cut` slots, and every later slot of it will have a timestamp above
`clock`.  Receiving a slot bumps the receiver's clock past its timestamp, so
the receiver's next report promises past it even when its physical clock is
behind.  At a receiver, a report is usable once it holds the sender's first
`cut` slots (links lose and reorder); the sender's *promise* there is the
larger of its last usable report and the timestamp of its last contiguous
slot: every slot of it not held yet has a larger timestamp.

*Delivery.*  The held, undelivered slot with the smallest (ts, rank) is
delivered once

  C1  a commit quorum of the view's members hold it (a majority unless
      configured smaller; received vectors: this member's own, the peers'
      acknowledgements), and
  C2  every other sender either has a held undelivered slot (its key is
      larger: this one is the smallest) or promises at least its ts here.

Then nothing with a smaller key can still arrive, and a quorum holds it, so
the next view's ragged trim (the maximum received prefix per sender over
reports from enough members to meet every quorum) contains it.  Clock skew, drift and jumps change when
C2 holds, never what is delivered.
"""

from __future__ import annotations

from collections import deque
from operator import itemgetter, lt
from typing import Iterable, Sequence

from kdsync.core.batch import Batch
from kdsync.core.stream import NULL, Slot, _take, hold, merge_ack, pop_own
from kdsync.core.types import View

__all__ = ["FENCED", "ClockStream", "Stamped"]

Stamped = tuple[int, Slot]  # (timestamp, batches)
FENCED = 1 << 62  # a fenced sender's promise: every slot of it not held is stamped above this (none is)


class ClockStream:
    """The ordering state of one view at one member (see module docstring)."""

    __slots__ = ("n", "my_k", "senders", "quorum", "received", "slots", "acks", "next", "reports", "promised", "last_ts",
                 "clock", "inflight", "cut_upto", "low", "changed", "caps", "blocked", "blocked_ts")

    def __init__(self, view: View, me: str, clock: int = 0, quorum: int = 0) -> None:
        n = self.n = len(view.senders)
        self.my_k = view.senders.index(me) if me in view.senders else -1
        self.senders = view.senders
        self.quorum = quorum or len(view.members) // 2 + 1  # C1: holders needed (default a majority)
        self.received = [0] * n  # contiguous slots held, per sender
        self.slots: list[dict[int, Stamped]] = [{} for _ in range(n)]  # held, not delivered
        self.acks: dict[str, list[int]] = {m: [0] * n for m in view.members if m != me}  # peers' received vectors
        self.next = [0] * n  # per sender: the next slot index to deliver
        self.reports: list[deque[tuple[int, int]]] = [deque() for _ in range(n)]  # (cut, clock) not usable yet
        self.promised = [-1] * n  # per sender: the last usable report's clock
        self.last_ts = [-1] * n  # per sender: the timestamp of its last contiguous slot
        self.clock = clock  # own hybrid logical clock: every later own slot has ts > clock
        self.inflight: deque[int] = deque()  # own slot indices some peer has not acknowledged
        self.cut_upto = 0
        self.low = [0] * n  # per sender: slots below it are forgotten (delivered and held by every member)
        # something `deliverable` reads may have changed since it last ran (slots, received counts,
        # acknowledgements, reports, positions): it is a function of these alone, so unchanged, it
        # would find nothing again (a message that only repeats what is known costs no scan)
        self.changed = True
        self.caps: list[int] | None = None  # per sender: slots at or past it are not taken (kdsync.core.crash_fence)
        self.blocked = -1  # the sender whose promise C2 waited for when `deliverable` last stopped (-1: none)
        self.blocked_ts = 0  # ...at the head slot of this timestamp

    # ------------------------------------------------------------- the clock
    def report(self, now: int) -> tuple[int, int]:
        """The clock report to send now: (own slots cut, promise)."""
        if now > self.clock:
            self.clock = now
        return self.cut_upto, self.clock

    def promise(self, k: int) -> int:
        """Sender k's promise here: every slot of k not held has ts above it."""
        q = self.reports[k]
        while q and q[0][0] <= self.received[k]:  # usable: the slots it counts are all held
            self.promised[k] = q.popleft()[1]
        return max(self.promised[k], self.last_ts[k])

    def seed_promise(self, k: int, clock: int) -> None:
        """Sender k promised `clock` before this view began: every slot of it
        in this view is stamped above it (ClockNode's promises outlive views)."""
        if clock > self.promised[k]:
            self.promised[k] = clock
            self.changed = True

    def on_report(self, k: int, cut: int, clock: int) -> None:
        """Sender k's clock report arrived."""
        self.changed = True
        q = self.reports[k]
        if clock <= (q[-1][1] if q else self.promised[k]):
            return  # an older report (links reorder)
        while q and q[-1][0] >= cut:  # one with the same slots and a later clock replaces it
            q.pop()
        q.append((cut, clock))
        if clock > self.clock:
            self.clock = clock

    def fence(self, k: int, cut: int) -> None:
        """Sender k stopped for good after cutting `cut` slots (kdsync.core.fence):
        once its first `cut` are held its promise is the end of time, and its
        acknowledgements count no more (C1, the window and forgetting go by
        the others').  Its clock is not taken: nothing else will be stamped."""
        self.changed = True
        q = self.reports[k]
        while q and q[-1][0] >= cut:
            q.pop()
        q.append((cut, FENCED))
        self.acks.pop(self.senders[k], None)
        acks, inflight = self.acks.values(), self.inflight
        low = min((a[self.my_k] for a in acks), default=self.cut_upto) if self.my_k >= 0 else 0
        while inflight and inflight[0] < low:
            inflight.popleft()

    def lift(self, k: int, floor: int) -> None:
        """Sender k, fenced (every slot of it below the fence held), returns
        as a new incarnation (kdsync.core.lift): its slots continue from the
        fence, each stamped above `floor`, and its promise is `floor` until it
        reports past it.  Its acknowledgements still count for nothing here."""
        self.cap(k, None)
        self.reports[k].clear()
        self.promised[k] = floor
        self.changed = True

    def cap(self, k: int, upto: int | None) -> None:
        """Take no slot of sender k at index `upto` or past it (its received
        count stays at most `upto`): a crash fence's promise
        (kdsync.core.crash_fence); None lifts it.  Slots held out of order
        past it are dropped (asked for again once it is lifted)."""
        if upto is None:
            if self.caps is not None:
                self.caps[k] = 1 << 62
            return
        if self.caps is None:
            self.caps = [1 << 62] * self.n
        self.caps[k] = upto
        store = self.slots[k]
        for i in [i for i in store if i >= upto]:
            del store[i]
        self.changed = True

    # ------------------------------------------------------------- receiving
    def add(self, k: int, first: int, slots: Sequence[Stamped], limit: int | None = None) -> bool:
        """Sender k's slots first.. arrived.  Returns True when received[k] grew.
        `limit`: received[k] grows to it at most (a view change's leader filling
        the trim must not count slots it held beyond it: ClockViewChange.on_slot_data)."""
        self.changed = True
        caps = self.caps
        if caps is not None and first + len(slots) > caps[k]:  # capped (kdsync.core.crash_fence): none past it
            slots = slots[:max(0, caps[k] - first)]
            limit = caps[k] if limit is None else min(limit, caps[k])
        own = self.acks.get(self.senders[k])  # the sender holds what it sent
        if own is not None and first + len(slots) > own[k]:
            own[k] = first + len(slots)
        have = self.received[k]
        store = self.slots[k]
        hold(store, have, first, slots)
        if slots and slots[-1][0] > self.clock:  # one sender's timestamps increase
            self.clock = slots[-1][0]  # the next report promises past it
        start = have
        while have in store and (limit is None or have < limit):
            have += 1
        if have == start:
            return False
        self.received[k] = have
        self.last_ts[k] = store[have - 1][0]
        return True

    def ack(self, peer: str, recv: Iterable[int]) -> bool:
        """A peer's received vector.  Returns True when any count grew."""
        if merge_ack(self.acks, peer, recv, self.inflight, self.my_k):
            self.changed = True
            return True
        return False

    # -------------------------------------------------------------- cutting
    def may_cut(self, window: int) -> bool:
        """Fewer than `window` own slots are unacknowledged by some peer."""
        return self.my_k >= 0 and len(self.inflight) < window

    def cut(self, pending: list[Batch], now: int, window: int, max_batch: int) -> tuple[int, list[Stamped]]:
        """Cut own slots from `pending` while the window has room, each
        stamped above the clock.  Consumes what it cuts; returns (first index,
        slots)."""
        self.changed = True
        k = self.my_k
        first = count = self.received[k]
        store = self.slots[k]
        out: list[Stamped] = []
        while pending and len(self.inflight) < window:
            ts = max(now, self.clock + 1)
            self.clock = ts
            s = (ts, _take(pending, max_batch))
            store[count] = s
            out.append(s)
            self.inflight.append(count)
            count += 1
        self.received[k] = self.cut_upto = count
        if out:
            self.last_ts[k] = out[-1][0]
        return first, out

    def own_slots(self, start: int, stop: int) -> list[Stamped]:
        """Own slots start..stop-1 still held (a retransmission)."""
        return self.held_run(self.my_k, start, stop)

    def held_run(self, k: int, start: int, stop: int, kept: dict | None = None) -> list[Stamped]:
        """Sender k's slots start.. held here, contiguous, below `stop`
        (delivered slots are held until every member holds them); `kept`:
        more of sender k's slots by index, not received (a view change's
        leader: ClockViewChange.keep_late)."""
        store = self.slots[k]
        out: list[Stamped] = []
        for i in range(start, stop):
            s = store.get(i)
            if s is None and kept:
                s = kept.get(i)
            if s is None:
                break
            out.append(s)
        return out

    # ------------------------------------------------------------- delivery
    def deliverable(self) -> list[Slot]:
        """Pop the slots that can be delivered now, in (ts, rank) order.
        (Hot: `promise` and the holders' count are written out in the loop.)"""
        out: list[Slot] = []
        if not self.changed:
            return out  # nothing it reads changed since it last ran to the end
        self.changed = False
        n, me, slots, nxt, rcv = self.n, self.my_k, self.slots, self.next, self.received
        reports, promised, last_ts, acks, quorum = self.reports, self.promised, self.last_ts, self.acks, self.quorum
        senders = range(n)
        while True:
            head, hk = None, -1
            for k in senders:
                s = slots[k].get(nxt[k])
                if s is not None and (head is None or s[0] < head[0]):
                    head, hk = s, k
            if head is None:
                self.blocked = -1
                return out
            ts = head[0]
            for j in senders:
                if j != hk and j != me and nxt[j] >= rcv[j]:
                    q = reports[j]  # promise(j), inline
                    while q and q[0][0] <= rcv[j]:
                        promised[j] = q.popleft()[1]
                    if promised[j] < ts and last_ts[j] < ts:
                        self.blocked, self.blocked_ts = j, ts
                        return out  # C2: j may still send something before it
            idx = nxt[hk]
            held = rcv[hk] > idx  # C1: the holders of the head, this member and the acknowledgements
            for a in acks.values():
                if a[hk] > idx:
                    held += 1
            if held < quorum:
                self.blocked = -1
                return out  # C1
            nxt[hk] = idx + 1
            if head[1] is not NULL:
                out.append(head[1])

    def waits_for(self) -> list[int]:
        """The senders C2 waits for at the head slot `deliverable` last stopped at."""
        if self.blocked < 0:
            return []
        nxt, rcv, me, ts = self.next, self.received, self.my_k, self.blocked_ts
        return [j for j in range(self.n) if j != me and nxt[j] >= rcv[j] and self.promise(j) < ts]

    def waiting(self) -> bool:
        """Some held slot is not delivered here yet (clock reports are due)."""
        return any(map(lt, self.next, self.received))  # (hot: once per tick and Ready)

    def forget_stable(self) -> None:
        """Drop delivered slots every member holds: no view change can need
        them (its trim extras start at the holders' smallest received count)."""
        acks = tuple(self.acks.values())
        for k in range(self.n):
            upto = min(self.next[k], self.received[k], *map(itemgetter(k), acks)) if acks else self.next[k]
            lo = self.low[k]
            if upto > lo:
                store = self.slots[k]
                for i in range(lo, upto):
                    store.pop(i, None)
                self.low[k] = upto

    def take_trim(self, trim: Sequence[int]) -> list[Slot] | None:
        """Pop every slot below the trim not delivered yet, in (ts, rank)
        order; None when this member lacks one (it must catch up instead)."""
        if len(trim) != self.n or any(have < t for have, t in zip(self.received, trim)):
            return None
        if any(nx > t for nx, t in zip(self.next, trim)):
            return None  # delivered past the trim: cannot happen (C1); never deliver twice
        self.changed = True
        keyed: list[tuple[int, int, Slot]] = []
        for k in range(self.n):
            store = self.slots[k]
            for i in range(self.next[k], trim[k]):
                s = store.get(i)
                if s is None:
                    return None  # pragma: no cover - received[k] > i means it is held
                keyed.append((s[0], k, s[1]))
            self.next[k] = trim[k]
        keyed.sort(key=lambda x: (x[0], x[1]))
        return [s for _, _, s in keyed if s is not NULL]

    def undelivered_own(self) -> list[Batch]:
        """Own batches in slots not delivered here (to resubmit), in order."""
        k = self.my_k
        if k < 0:
            return []
        self.changed = True
        store = self.slots[k]
        done = [i for i in store if i < self.next[k]]
        for i in done:
            del store[i]
        return pop_own(store, lambda s: s[1])
