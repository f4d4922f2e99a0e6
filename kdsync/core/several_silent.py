"""Several members silent at once, for the `clock` protocol's crash fence
(kdsync.core.crash_fence; `NodeConfig.crash_fence`).  Mixed into
CrashFencing, over kdsync.core.silence's SilenceMeter.

Where no fence can be reached — two or more members unusually silent, or
one after this view fenced another — a member whose order waits for one of
them suspects them all once each is silent for SUSPECT_MARGIN x its usual
gap (`_suspect_the_silent`), not after `suspect_ms`, when the members still
heard can form the next view without them: a majority of the view, and
n - q + 1 reporters for the trim (else that view change could not end
before a return, and nothing changes).  Its acknowledgements tell the
others; each keeps a member named there suspected until it speaks, once it
finds it unusually silent too (`_keep_silent_suspected`: once wedged, the
tick's suspicion is only a timeout).  Suspicion is safe under any pattern;
a false alarm costs a view change.
"""

from __future__ import annotations

from kdsync.core.silence import SUSPECT_MARGIN, SilenceMeter

__all__ = ["SeveralSilent"]

GONE = -10**9  # a `last_heard` that the tick's silence always suspects


class SeveralSilent(SilenceMeter):
    """Suspicion of several unusually silent members (module docstring)."""

    def _reset_view_state(self) -> None:
        self._told_silent: dict[str, int] = {}  # member a peer suspects (its acknowledgement said) -> when we heard it
        self._gone_at: dict[str, int] = {}  # member suspected until it speaks -> since when (tick)
        super()._reset_view_state()

    def _suspect_the_silent(self) -> bool:
        """Our order waits for a sender that is unusually silent, and no fence
        can be reached: two or more members are (a fence needs every other
        member's cap), or one once this view fenced a member already (one
        fence per view).  Silent for twice what a cap needs
        (kdsync.core.silence's SUSPECT_MARGIN: a lossy link's gaps do not
        make its sender look gone).  Suspect them now, not after
        `suspect_ms` — where the members still heard can form the next view
        without them: a majority of the view, and n - q + 1 reporters for
        the trim.  Else
        (a minority, or commit quorum 2 with two of five gone) nothing
        changes: that view change could not end before a return anyway.
        They stay suspected until they speak (a false alarm costs a view
        change, which is safe under any suspicion)."""
        st = self.stream
        if st.blocked < 0 or not self._tick_us or self.state is not self.State.ACTIVE or self.leaving \
                or not self._is_member():
            return False
        if self._last_tick_us is not None and self.now_us - self._last_tick_us > 4 * self._tick_us:
            return False  # our own loop ran late: the silence may be ours (a late loop is not a silent peer)
        v, fenced, since = self.view, self.fenced, self._wait_since
        quiet = self._unusually_silent
        # the senders our order waits for first (every tick while it waits): mostly none is silent
        if not any(quiet(v.senders[j], since, SUSPECT_MARGIN) for j in st.waits_for()):
            return False
        silent = {m for m in v.members if m != self.me and m not in fenced and quiet(m, since, SUSPECT_MARGIN)}
        if len(silent) + (1 if fenced or self._lifted_inc else 0) < 2:
            return False
        live = len(v.members) - len(silent) - len(fenced)
        if live <= len(v.members) // 2 or live < len(v.members) - self._quorum(v) + 1:
            return False
        for s in silent:
            self._until_it_speaks(s)
        self.stats["silent_suspected"] = self.stats.get("silent_suspected", 0) + len(silent)
        self._suspect(silent)
        return True

    def _take_ack(self, msg) -> None:
        if msg.suspected and self.cfg.crash_fence and not self.wedged and msg.sender not in self.fenced:
            v, now = self.view, self.now_us
            for m in msg.suspected:
                if m != self.me and m in v.members:
                    self._told_silent.setdefault(m, now)
        super()._take_ack(msg)

    def _keep_silent_suspected(self) -> None:
        """A member a peer suspected while we were in the view with it, silent
        since, and unusually silent here too (SUSPECT_MARGIN), stays suspected
        until it speaks: once wedged, the tick's suspicion is a timeout, and
        the view change would otherwise wait `suspect_ms` for its report
        (`_suspect_the_silent`: the member that found two silent tells us of
        both, and we may not have found the second yet).  Names heard once
        wedged are not taken: a view change's own pauses (heartbeats only)
        are longer than a member's usual gap while ordering."""
        told = self._told_silent
        if not told:
            return
        last, heard = self.last_heard, self._heard_us
        for m, at in list(told.items()):
            if m in self.fenced or last.get(m, 0) <= GONE or heard.get(m, at) > at:
                del told[m]  # gone already, or it spoke since
            elif self._unusually_silent(m, None, SUSPECT_MARGIN):
                del told[m]
                self._until_it_speaks(m)
                self.stats["silent_suspected"] = self.stats.get("silent_suspected", 0) + 1
                if not self.wedged:
                    self._suspect({m})

    def _until_it_speaks(self, m: str) -> None:
        """m is suspected until it speaks (the tick's silence keeps it so once wedged)."""
        self.last_heard[m] = GONE
        self._gone_at[m] = self.now

    def heard(self, heard_ago) -> None:
        """The member's liveness says when it last heard each peer (adaptive
        suspicion, many topics): a member suspected until it speaks stays so
        unless heard since."""
        super().heard(heard_ago)
        last = self.last_heard
        for m, at in list(self._gone_at.items()):
            if last.get(m, GONE) > at:
                del self._gone_at[m]  # it spoke
            else:
                last[m] = GONE
