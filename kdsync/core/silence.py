"""How long each peer is usually silent, measured by this node, for the
crash fence (kdsync.core.crash_fence; `NodeConfig.crash_fence`).  Mixed
into ClockNode through CrashFencing.

A member caps a sender only once it has been silent for longer than is
usual for it, and "usual" is measured here rather than configured: the
longest gap between two of its messages over the last 4-8 heartbeats
(GAP_WINDOW_HEARTBEATS, kept in two halves so that an old maximum ages
out), on this node's clock.  A sender is *unusually silent* when nothing
came from it for MARGIN x that gap plus two ticks, counted from its last
message or from a given instant (when our order began to wait for it: an
idle peer owes nothing before), whichever is later; until MIN_SAMPLES gaps
were measured over half a window (GAP_WINDOW_HEARTBEATS / 2 heartbeats) the
gap is at least two heartbeats: a restarted member catching up speaks in a
burst at first, and its first gaps say nothing of its usual one (a cap of
it then was a false alarm whose dropped slots came back a round trip later).

A gap longer than two heartbeats is not measured: it was a sleep (a
quiescent group sends nothing while idle), not a measure of how long the
sender may be silent.  A new incarnation of a sender is measured afresh,
and a member not heard in the current view is never unusually silent (it
may not have installed the view yet).  Nothing is measured with the crash
fence off.
"""

from __future__ import annotations

__all__ = ["GAP_WINDOW_HEARTBEATS", "MARGIN", "MIN_SAMPLES", "SUSPECT_MARGIN", "SilenceMeter"]

GAP_WINDOW_HEARTBEATS = 8  # a sender's usual gap: the longest between its messages in the last 4-8 heartbeats
MIN_SAMPLES = 16  # gaps between a sender's messages measured before its usual gap may be below two heartbeats
MARGIN = 1.5  # a silence beyond this x the recent maximum gap (plus two ticks) is not usual
SUSPECT_MARGIN = 3.0  # ... and beyond this x, enough to suspect (a view change) where no fence can be reached


class SilenceMeter:
    """Each peer's usual gap between messages, and whether it is unusually
    silent now (module docstring)."""

    def __init__(self, config, **kw) -> None:
        # measured across views, per sender id (microseconds on this node's clock)
        self._heard_us: dict[str, int] = {}  # when we last heard from it
        # the longest gap between its messages: [this half-window's start, its longest, the previous half's]
        self._gap_win: dict[str, list[int]] = {}
        self._gaps: dict[str, int] = {}  # gaps measured
        self._incs: dict[str, int] = {}  # the incarnation they were measured of
        self._first_us: dict[str, int] = {}  # when its first gap of that incarnation was measured
        super().__init__(config, **kw)

    def _reset_view_state(self) -> None:
        self._heard_here: set[str] = set()  # members heard in this view (one not heard yet may not have installed it)
        super()._reset_view_state()

    def _from_view_member(self, msg) -> bool:
        ok = super()._from_view_member(msg)
        if ok and self.cfg.crash_fence:
            s, t = msg.sender, self.now_us
            if self._incs.get(s) != msg.inc:  # a restarted process: its gaps are measured afresh
                self._incs[s] = msg.inc
                self._gap_win.pop(s, None)
                self._gaps.pop(s, None)
                self._heard_us.pop(s, None)
                self._first_us.pop(s, None)
            last = self._heard_us.get(s)
            # a gap longer than two heartbeats was a sleep (a quiescent group sends nothing while idle,
            # where an awake member heartbeats), not a measure of how long it may be silent
            if last is not None and last < t <= last + 2 * self._heartbeat_us:
                self._note_gap(s, t, t - last)
            self._heard_us[s] = t
            self._heard_here.add(s)
        return ok

    def _note_gap(self, s: str, t: int, gap: int) -> None:
        """A gap between two messages of s, kept as the longest of a window of
        GAP_WINDOW_HEARTBEATS heartbeats (two halves): a sender that is idle now
        and then sends only heartbeats, and its usual gap says so."""
        half = GAP_WINDOW_HEARTBEATS * self._heartbeat_us // 2
        w = self._gap_win.get(s)
        if w is None:
            w = self._gap_win[s] = [t, 0, 0]
        elif t - w[0] >= half:
            w[2] = w[1] if t - w[0] < 2 * half else 0
            w[0], w[1] = t, 0
        if gap > w[1]:
            w[1] = gap
        self._gaps[s] = self._gaps.get(s, 0) + 1
        self._first_us.setdefault(s, t)

    @property
    def _heartbeat_us(self) -> int:
        """The heartbeat period on this node's clock (the tick as measured; 1 ms until it is)."""
        return self.cfg.heartbeat_ticks * (self._tick_us or 1000)

    def _usual_gap(self, s: str) -> int | None:
        w = self._gap_win.get(s)
        return None if w is None else max(w[1], w[2])

    def _unusually_silent(self, s: str, since: int | None = None, margin: float = MARGIN) -> bool:
        """s said nothing for longer than `margin` x its usual gap (plus two
        ticks), counted from its last message, or from `since` (when our order
        began to wait: an idle peer need not have spoken before), whichever is
        later."""
        if s not in self._heard_here:
            return False
        g = self._usual_gap(s) or 0
        if self._gaps.get(s, 0) < MIN_SAMPLES or self.now_us - self._first_us[s] < GAP_WINDOW_HEARTBEATS * \
                self._heartbeat_us // 2:  # too few gaps measured, or for too short a time: two heartbeats at least
            g = max(g, 2 * self._heartbeat_us)
        start = self._heard_us[s] if since is None else max(self._heard_us[s], since)
        return self.now_us - start > margin * g + 2 * self._tick_us
