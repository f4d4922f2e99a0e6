"""The ordering stream of one view: slots, acknowledgements, stability, delivery.

Theory of operation
-------------------
*Slots.*  Each sender of the view cuts its pending batches into slots; slot r
of the sender of rank k sits at round-robin place (r, k).  A slot holds whole
batches (at most `max_batch` records) or nothing (a null).  Every member
keeps `received[k]`, the number of contiguous slots it holds from sender k,
and multicasts that vector: piggybacked on its own slots, or in an ACK.

*Stability and delivery.*  Slots are delivered strictly in round-robin order.
A data slot is delivered once every member of the view has acknowledged it
(stable).  A null slot that this member holds is passed at once: it holds no
records, so it takes no position, and the ragged trim of a later view change
includes every data slot delivered anywhere (stable means every member holds
it) whether or not the nulls around it are in the trim.  Positions are the
records' count, so every member assigns the same positions.

*Message economy.*  A sender fills the rounds other senders opened with
nulls at once (the proactive nulls of Derecho's SST), and the last slot of
such a fill carries its pending data: data rides in a message that goes out
anyway.  A new round is opened only while fewer than `window` of the
sender's own data slots are unacknowledged by some peer, and while no
sender is `window` rounds behind the highest round (with many senders, a
round every sender fills is worth more than a round each: every round costs
every sender a message); meanwhile new records accumulate and leave as one
slot when the window opens — an idle sender sends at once, a busy one
coalesces.  Acknowledgements are
cumulative vectors, piggybacked on every APPEND.  A data slot needs every
member's acknowledgement (stability); a member sends its vector alone once
the round of the data it has not acknowledged yet is complete here (every
sender's slot of that round arrived: with many senders, one message per
round instead of one per slot), or at the next tick if the round stays
incomplete.  Nulls need no stability: their acknowledgement rides on the
next heartbeat, and retransmission waits that long.

*Retransmission.*  A peer whose acknowledgement of our slots lags for
`retransmit_ticks` + `heartbeat_ticks` gets them again.  An own slot missing from our store at
or above that peer's acknowledgement can only be a null we passed: data is
removed only when stable, i.e. acknowledged by every peer.
"""

from __future__ import annotations

from collections import deque
from operator import itemgetter

from kdsync.core.batch import Batch, coalesce
from kdsync.core.types import View

Slot = tuple[Batch, ...]
NULL: Slot = ()


def ragged_trim(received_vectors) -> list[int]:
    """Per sender, the number of slots every reporter holds (element-wise min)."""
    vecs = list(received_vectors)
    if not vecs:
        raise ValueError("ragged trim of no reports")
    return [min(col) for col in zip(*vecs)]


def stable_counts(received_vectors) -> list[int]:
    """Per sender, how many slots every member of the view holds (the same
    element-wise min, over the acknowledgements of the whole view)."""
    return ragged_trim(received_vectors)


def round_robin(limits, start_round: int = 0, start_k: int = 0):
    """Places (round, sender index) with round < limits[k], in delivery order,
    starting at (start_round, start_k)."""
    n = len(limits)
    r, k = start_round, start_k
    top = max(limits, default=0)
    while n and r < top:
        if r < limits[k]:
            yield r, k
        k += 1
        if k == n:
            k, r = 0, r + 1


class Stream:
    """The ordering state of one view at one member (see module docstring)."""

    __slots__ = ("n", "my_k", "received", "slots", "acks", "deliver_round", "deliver_k", "inflight", "cut_upto")

    def __init__(self, view: View, me: str) -> None:
        n = self.n = len(view.senders)
        self.my_k = view.senders.index(me) if me in view.senders else -1
        self.received = [0] * n  # contiguous slots held, per sender
        self.slots: list[dict[int, Slot]] = [{} for _ in range(n)]  # held, not yet delivered
        self.acks: dict[str, list[int]] = {m: [0] * n for m in view.members if m != me}  # peers' received vectors
        self.deliver_round = 0
        self.deliver_k = 0
        self.inflight: deque[int] = deque()  # own data slot indices some peer has not acknowledged
        self.cut_upto = 0  # own slots cut (and multicast)

    # ------------------------------------------------------------- receiving
    def add(self, k: int, first: int, slots: tuple[Slot, ...]) -> tuple[bool, int]:
        """Sender k's slots first.. arrived.  Returns (received[k] grew, round of
        the first data slot that became contiguous, or -1)."""
        have = self.received[k]
        store = self.slots[k]
        hold(store, have, first, slots)
        data = -1
        start = have
        while have in store:
            if data < 0 and store[have]:
                data = have
            have += 1
        if have == start:
            return False, -1
        self.received[k] = have
        return True, data

    def ack(self, peer: str, recv) -> bool:
        """A peer's received vector.  Returns True when any count grew."""
        return merge_ack(self.acks, peer, recv, self.inflight, self.my_k)

    # -------------------------------------------------------------- cutting
    def must_fill(self) -> bool:
        """Another sender opened a round this member has no slot in yet."""
        k = self.my_k
        return k >= 0 and self.received[k] < max(self.received)

    def may_open(self, window: int) -> bool:
        """A new round may be opened: fewer than `window` own data slots are
        unacknowledged and no sender is `window` rounds behind the top."""
        return len(self.inflight) < window and max(self.received) - min(self.received) < window

    def cut(self, pending: list[Batch], window: int, max_batch: int) -> tuple[int, list[Slot]]:
        """Cut own slots: nulls up to the highest round any sender opened (the
        last of them carrying pending data), then new rounds of data while the
        window has room.  Consumes `pending`; returns (first index, slots)."""
        k = self.my_k
        count = first = self.received[k]
        target = max(self.received)
        store = self.slots[k]
        out: list[Slot] = []
        while count < target - 1:
            store[count] = NULL
            out.append(NULL)
            count += 1
        if count < target:  # the last slot of the fill
            s = _take(pending, max_batch)
            store[count] = s
            out.append(s)
            if s:
                self.inflight.append(count)
            count += 1
        low = min(self.received)
        while pending and len(self.inflight) < window and count - low < window:
            s = _take(pending, max_batch)
            store[count] = s
            out.append(s)
            self.inflight.append(count)
            count += 1
        self.received[k] = count
        self.cut_upto = count
        return first, out

    def own_slots(self, start: int, stop: int) -> list[Slot]:
        """Own slots start..stop-1 for a retransmission (passed nulls are gone
        from the store: see module docstring)."""
        store = self.slots[self.my_k]
        return [store.get(i, NULL) for i in range(start, min(stop, self.cut_upto))]

    # ------------------------------------------------------------- delivery
    def deliverable(self) -> list[Slot]:
        """Pop the slots that can be delivered now, in order (nulls passed,
        data slots only when stable)."""
        out: list[Slot] = []
        n = self.n
        if n == 0:
            return out
        r, k = self.deliver_round, self.deliver_k
        received, slots = self.received, self.slots
        acks = tuple(self.acks.values())
        while received[k] > r:
            s = slots[k][r]
            if s:
                for a in acks:
                    if a[k] <= r:
                        self.deliver_round, self.deliver_k = r, k
                        return out
                out.append(s)
            del slots[k][r]
            k += 1
            if k == n:
                k, r = 0, r + 1
        self.deliver_round, self.deliver_k = r, k
        return out

    def take_trim(self, trim) -> list[Slot] | None:
        """Pop every slot of the ragged trim not delivered yet, in order; None
        when this member lacks one (it cannot deliver the trim itself)."""
        if len(trim) != self.n or any(have < t for have, t in zip(self.received, trim)):
            return None
        out: list[Slot] = []
        for r, k in round_robin(trim, self.deliver_round, self.deliver_k):
            s = self.slots[k].pop(r, None)
            if s is None:
                return None  # pragma: no cover - received[k] > r means it is held
            if s:
                out.append(s)
        self.deliver_round, self.deliver_k = max(trim, default=0), 0
        return out

    def undelivered_own(self) -> list[Batch]:
        """Own batches in slots not delivered here (to resubmit), in order."""
        return pop_own(self.slots[self.my_k], lambda s: s) if self.my_k >= 0 else []


def hold(store: dict, have: int, first: int, slots) -> None:
    """Keep slots first, first+1, ... in `store`: those at or above `have`
    (the contiguous count held) and not held yet."""
    for idx, s in enumerate(slots, first):
        if idx >= have and idx not in store:
            store[idx] = s


def merge_ack(acks: dict[str, list[int]], peer: str, recv, inflight: deque[int], my_k: int) -> bool:
    """Merge `peer`'s received vector into `acks` (element-wise max) and drop
    the own slots every peer now holds from `inflight`.  True when a count grew."""
    cur = acks[peer]
    if tuple(cur) == tuple(recv):
        return False
    grew = False
    for k, v in enumerate(recv):
        if v > cur[k]:
            cur[k] = v
            grew = True
    if grew and inflight:
        low = min(map(itemgetter(my_k), acks.values()))
        while inflight and inflight[0] < low:
            inflight.popleft()
    return grew


def pop_own(store: dict, batches_of) -> list[Batch]:
    """Empty an own slot store; its batches in slot order (to resubmit)."""
    out: list[Batch] = []
    for idx in sorted(store):
        out.extend(batches_of(store[idx]))
    store.clear()
    return out


def _take(pending: list[Batch], max_batch: int) -> Slot:
    """Pop whole batches off the front of `pending`, up to max_batch records
    (at least one batch), runs of one origin partition joined (a busy sender's
    slot then carries a few large batches, not many small ones: every receiver
    decodes, delivers and writes per batch)."""
    if not pending:
        return NULL
    n = 0
    i = 0
    for b in pending:
        if i and n + b.count > max_batch:
            break
        n += b.count
        i += 1
    s = tuple(coalesce(pending[:i])) if i > 1 else (pending[0],)
    del pending[:i]
    return s
