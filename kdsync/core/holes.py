"""Holes: slots a sender announced that have not arrived here, asked of it.

Shared by derecho and clock (DerechoNode keeps a `Holes`, resets it with the
view, asks at its tick).  A receiver learns that sender k has cut `top`
slots — a later message's slots arrived first (links lose and reorder), or
the sender's own acknowledgement vector or clock report counts them — while
it holds fewer.  If the hole is still open two ticks later (a reordered
message has arrived by then) it asks the sender for the missing slots
(SlotReq), and again every retransmit period while the hole stays open: one
round trip repairs a lost slot message, where the sender's own
retransmission waits retransmit + heartbeat ticks without acknowledgement
progress.  The answer is the sender's own slots again (derecho: an APPEND,
clock: SLOT_DATA), taken like any other arrival — asking changes when slots
arrive, never which slots exist, so it costs no safety.  A sender that
ignores the request (an older release drops the unknown message) still
retransmits on its own.

Measured (simulator, three sites 50 ms apart, 200 events/s each, 2 % loss):
clock p50 57-90 -> 53 ms over seven seeds (51.7 without loss).
"""

from __future__ import annotations

from dataclasses import dataclass

from kdsync.core.messages import SlotReq
from kdsync.core.types import RemoteProtocolError

__all__ = ["ASK_CHUNK", "HoleRepair", "Holes"]

ASK_CHUNK = 64  # slots asked for at once (the sender's retransmission sends as many)
SETTLE_TICKS = 2  # a hole younger than this may be a reordered message still on its way


@dataclass(slots=True)
class _Hole:
    have: int  # received count when seen (or when it last filled in part)
    top: int  # the sender's announced count
    seen: int  # tick seen, or when it last filled in part
    asked: int = -(10**9)  # tick last asked


class Holes:
    """The open holes of one view, by sender index."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open: dict[int, _Hole] = {}

    def note(self, k: int, have: int, top: int, now: int) -> None:
        """Sender k has cut `top` slots; `have` of them are here."""
        if top <= have:
            return
        h = self.open.get(k)
        if h is None:
            self.open[k] = _Hole(have, top, now)
        elif top > h.top:
            h.top = top

    def due(self, received: list[int], now: int, every: int) -> list[tuple[int, int, int]]:
        """(sender index, first, stop) of the holes to ask for now; closed ones are forgotten."""
        out = []
        for k, h in list(self.open.items()):
            have = received[k]
            if have >= h.top:
                del self.open[k]
            elif have > h.have:  # filling: the rest may be on its way too
                h.have, h.seen = have, now
            elif now - h.seen >= SETTLE_TICKS and now - h.asked >= every:
                h.asked = now
                out.append((k, have, min(h.top, have + ASK_CHUNK)))
        return out


class HoleRepair:
    """The hole duties of a DerechoNode (module docstring), mixed in like
    kdsync.core.departure's.  Needs the node's view, stream, suspicions,
    cfg, `now`, `_send`, `_send_slots`, `_in_current_view`; the node resets
    `holes` with every view and calls `_ask_holes` at its tick."""

    holes: Holes

    def _note_hole(self, k: int, top: int) -> None:
        """Sender index k has cut `top` slots (a later message's, or its own count)."""
        self.holes.note(k, self.stream.received[k], top, self.now)

    def _ask_holes(self) -> None:
        for k, first, stop in self.holes.due(self.stream.received, self.now, self.cfg.retransmit_ticks):
            to = self._hole_source(k)
            if to not in self.suspected:
                self.stats["holes_asked"] += 1
                self._send(to, SlotReq(self.me, self.incarnation, self.view.view_id, k, first, stop).encode())

    def _hole_source(self, k: int) -> str:
        """Whom to ask for sender index k's missing slots: the sender."""
        return self.view.senders[k]

    def _on_slot_req(self, msg: SlotReq) -> None:
        """A receiver lacks some of our slots: send them again (an APPEND, as a retransmission)."""
        if not self._in_current_view(msg) or self.wedged or msg.k != self.stream.my_k:
            return
        if msg.stop <= msg.first or msg.first < 0:
            raise RemoteProtocolError("bad slot request")
        self._send_slots(msg.sender, msg.first, min(msg.stop, msg.first + ASK_CHUNK))
