"""A crashed member fenced by all the others, for the `clock` protocol
(`NodeConfig.crash_fence`, `[protocol] crash_fence`; docs/design/wan-ordering.md,
"The crash fence").  Mixed into ClockNode before kdsync.core.fence's Fencing.

Theory of operation
-------------------
C2 delivers a slot once every sender's promise passed its timestamp, so a
sender that crashed holds every member's order until a view change removes
it: `suspect_ms` (or adaptive suspicion's few heartbeats), then the view
change's Paxos rounds, during which every member is wedged.  The crash fence
removes both terms for the common case: one member silent, every other one
answering.

*Capping.*  A member whose order waits for promises (`ClockStream.blocked`)
looks at the senders it waits for and takes the one silent longest, k.  If
k is unusually silent (kdsync.core.silence: no setting) and every other
member is heard as usual, it *caps* k: it takes
none of k's slots past the `count` it holds (`ClockStream.cap`; slots held
out of order past it are dropped) and sends CAP (k, attempt, count) to every
member but k.  A member that gets a CAP follows (caps k in the same attempt)
once k is unusually silent here too; once k reports a clock newer than it
had when the CAP came, it answers NOCAP (k, attempt) to every member instead
and never caps that attempt.  A member holds one cap at a time.

*Attempts.*  A NOCAP kills its attempt: no fence can come of it, so every
member that capped it lifts its cap (and asks again for what it dropped),
and caps k again only in a later attempt, once k reported since.  A member
starts attempt a + 1 only once it knows attempt a dead, so a CAP of a + 1
tells its receiver that every earlier attempt is dead.  Any member that
knows an attempt dead says so again to whoever sends a CAP of it (a NOCAP
may be lost); a wedged member, which caps nothing more in its view, answers
NOCAP to a CAP it does not share; a member that fenced a sender answers
NOCAP to a CAP of any other one (every other member holds its cap of the
fenced sender for good, and caps one sender at a time) — also when that CAP
is of itself, which a wedged capper sends it too.  A false alarm (a lossy
link, a member slow to speak) so costs the capper a round trip of waiting,
not a view change.  After MAX_ATTEMPTS dead attempts on one sender in one
view only suspicion is left.

*The fence.*  A member that holds the caps of one attempt from *every*
member of the view but k fences k at c = the largest: it raises its cap to
c, fetches the slots it lacks from a member whose cap was c, and from then
on k's promise is the end of time once k's first c slots are held, and k's
acknowledgements count no more (`ClockStream.fence`, as for a leaver:
kdsync.core.fence's `fenced`).  Every member that fences k uses the same
caps (each member sends one count per attempt, the same each time), so the
same c.  Nothing changes the view: the others never stop delivering.  k
stays fenced in the view until it returns (its new incarnation's JOIN), or,
cut off rather than crashed, is told it was fenced and comes back as a new
incarnation (kdsync.core.fenced_return).

Safety.  The commit quorum q is at least 2 (with one holder, k alone may
have held and delivered its slots: no cap is made).  (1) *Every slot of k
delivered anywhere is below c.*  A delivered slot was held by q members
(C1); k aside, at least one of them is another member, and every other
member capped at a count it held then and took nothing past it, so one cap
is above the slot's index.  (2) *No member delivers a slot of k at or past
c:* no other member holds one, so C1 never holds for it, at k either.
(3) *A view change ends k's stream at exactly c when anyone delivered past
it.*  A member whose cap of k is in force when it wedges neither lets k lead
(`ClockViewChange.may_lead`; a COLLECT or ACCEPT from k is not answered) nor
takes k's own count of k's slots: the trim of k is the largest count over
the reporters other than k that remember the view, n - q + 1 of them or
derecho's base path (`ClockViewChange.trim_holders`, `trim`); the other
senders' trims take k's report as any.  A wedged member never caps, and
caps are lifted only in dead attempts.  So if a fence was reached, the
leader and every reporter but k capped before they wedged: every count of
k in the trim is at most c, and a member that delivered past k's slot c - 1
held all of them, each held by q - 1 others (C1, k aside), which n - q + 1
reporters meet: the trim is c.  If no fence was reached nobody delivered by
it, and the trim is today's.  Slots only k lacks may have been forgotten by
the others: the trim's extras start at the smallest count over the holders
other than k, and k catches up instead.

*Who leads* (the swarm seeds behind each rule: docs/design/wan-ordering.md).
The refusal would wedge a group for good where k's report is needed and no
fence can be settled (the third of three members crashed after one or two
caps: its restart cannot say whether its old incarnation fenced anyone). So
a wedged capper sends its CAP to k too (and to k when it refuses k's
COLLECT, a member that fenced k as well); k, told a member capped it, trusts
its own count of its slots no more in that view — leading, it takes their
trim from the other reporters exactly as the capper does
(`distrusted_senders`: the base path, every durable prefix known, when too
few of them remember the view) — and answers with a CAP naming itself; the
capper then answers k's COLLECT and ACCEPT. Leading, k may then have to
catch up to its own trim instead of delivering it, so it names another
holder the catch-up source, one whose count nobody distrusts where there is
one. Safe: k's proposals from before it knew came from reporters that did
not refuse it, so none of them had capped it (a member that reported is
wedged and caps nothing more), and no fence of k, which needs every other
member's cap, was reached; any later one is computed as the capper would. An
older release ignores the CAP naming it (and its capper the answer): the
refusal stands, as before. The refusal is of the incarnation capped: a new
one (k's restart, or k back in place after a FENCE) remembers nothing of the
view, so no trim takes its count, and it may lead as any restart may
(refused, its ballots could keep for good those of the one member that
remembers the view from a majority).

Liveness.  A fence needs every other member's cap: with two members silent,
or one without the fence (an older release drops CAP and NOCAP and never
caps), none is reached and the view changes: at once where several are
silent (kdsync.core.several_silent), else after the silence as before.
Caps end with the view.

*When*: one crash fence per view, in a group that keeps its fault
tolerance with the member fenced (kdsync.core.fence's `may_fence`), while no
other member is suspected or fenced.
"""

from __future__ import annotations

from kdsync.core.fence import may_fence
from kdsync.core.fenced_return import FencedReturn
from kdsync.core.messages import Cap, NoCap, SlotData, SlotReq
from kdsync.core.several_silent import SeveralSilent
from kdsync.core.types import RemoteProtocolError

__all__ = ["CrashFencing"]

BEYOND_MAX = 64  # slots of a capped sender sent ahead to, or kept aside by, one member
MAX_ATTEMPTS = 8  # attempts to fence one sender in one view that a NOCAP ended: then only suspicion


class CrashFencing(FencedReturn, SeveralSilent):
    """The crash fence of a ClockNode (module docstring)."""

    def _reset_view_state(self) -> None:
        self._caps: dict[tuple[int, int], dict[str, int]] = {}  # (sender index, attempt) -> member -> its cap
        self._dead: dict[int, int] = {}  # sender index -> its highest attempt known dead (a NOCAP exists)
        # sender index -> (attempt, its newest clock then, when): a CAP to answer
        self._pending: dict[int, tuple[int, int, int]] = {}
        self._cap_k = self._cap_a = -1  # our cap in force: the sender and the attempt
        self._cap_clock = -1  # the sender's newest clock report heard when we capped it
        self._recap_clock: dict[int, int] = {}  # sender index -> we cap it again only once it reports past this
        self._cap_sent = -10**9
        self._crash_fenced = False  # we fenced it (every other member's cap of that attempt is here)
        self._fence_holder: str | None = None  # a member holding its slots up to the fence
        self._beyond: dict[int, tuple] = {}  # the capped sender's slots past our cap, sent by a higher capper
        self._pushed: set[tuple[str, int, int]] = set()  # (capper, sender index, attempt) we sent our slots past its cap
        self._wait_since: int | None = None  # since when our order waits for a promise (None: it does not)
        self._busy_since: int | None = None  # since when some held slot is undelivered here (None: none is)
        self._told_since: int | None = None  # the member we fenced spoke again: since when we tell it so
        self._told_sent = -10**9  # our last FENCE naming it, to it
        self._knows_capped = False  # a CAP naming us came: we do not trust our own count of our slots either
        self._acked: set[int] = set()  # sender indices that said they know we capped them: they may lead us
        super()._reset_view_state()

    # ------------------------------------------------------------ when to cap
    def _clock_of(self, s: str) -> int:
        heard = self._clocks.get(s)
        return heard[2] if heard is not None else -1

    def _note_wait(self) -> None:
        """After a delivery attempt: since when our order waits for some
        sender's promise, and since when it holds slots it has not delivered."""
        st = self.stream
        if st.blocked < 0:
            self._wait_since = None
        elif self._wait_since is None:
            self._wait_since = self.now_us
        if self._wait_since is not None or st.waiting():
            if self._busy_since is None:
                self._busy_since = self.now_us
        else:
            self._busy_since = None

    def _owed_since(self, s: str) -> int | None:
        """Since when a live s owes us messages, as far as we can tell: when
        our order began to wait for it, or — when we have held undelivered
        slots for longer than a round trip to s — our busy period's start
        plus that round trip.  Every slot we hold went to s too, and s reports
        every tick while anything waits there, so its reports about the
        first of them reached us within a round trip to s (one way from its
        origin to s, then s to us: triangle inequality).  Under steady load
        s's silence then counts from its last message rather than from when
        our order first needed it; s's lead (its promises run ahead) used to
        add most of that wait (Region failure's crash: Oregon capped Tokyo
        85 ms after Tokyo's last message).  Only how soon we cap changes: a
        cap of a live sender costs a NOCAP round trip, never safety."""
        w, b = self._wait_since, self._busy_since
        if w is None or b is None:
            return w
        one_way = self.leads.one_way(s)
        return w if one_way is None else min(w, b + 2 * one_way)

    def _may_cap(self, k: int, since: int | None) -> bool:
        """We may cap sender k: the crash fence is on, C1 needs two holders
        or more (with one, k alone may have held and delivered its slots),
        nothing else is capped or fenced in this view, nobody suspected, and
        every other member is heard as usual (counted as k's silence is,
        from `since`) — k alone is silent.  A member
        cut off from several (a minority, a partition) caps nobody: no fence
        could be reached."""
        v = self.view
        s = v.senders[k]
        return (self.cfg.crash_fence and self._cap_k < 0 and not self.fenced and not self._lifted_inc
                and not self.suspected and not self.wedged and not self.leaving and self._is_member()
                and self.state in (self.State.ACTIVE, self.State.CATCHING_UP)
                and self._quorum(v) >= 2 and may_fence(len(v.members), self.cfg.commit_quorum)
                and all(m in self._heard_here and not self._unusually_silent(m, since)
                        for m in v.members if m != s and m != self.me))

    # ------------------------------------------------------------ capping
    def _crash_fence_tick(self) -> None:
        """Before the view's tick: keep a capped member suspected once wedged;
        answer the caps heard (follow, or NOCAP once the sender spoke); resend
        our cap where it is missing; or cap the sender our order waits for."""
        if not self.cfg.crash_fence:
            return
        if self._cap_k >= 0 and not self._crash_fenced and self.now - self._cap_sent >= self.cfg.retransmit_ticks:
            self._send_cap(missing_only=True)  # also once wedged: the others' NOCAPs lift it
        self._keep_silent_suspected()
        if self.wedged:
            return
        for k, (a, clock, since) in list(self._pending.items()):
            self._answer(k, a, clock, since)
        if self._suspect_the_silent():
            return
        if self._cap_k >= 0:
            return
        if self.stream.blocked < 0 or not self._tick_us or self.state is not self.State.ACTIVE:
            return
        # of the senders our order waits for, the one silent longest (a live one on a lossy link may be behind too)
        heard, senders = self._heard_us, self.view.senders
        k = min(self.stream.waits_for(), key=lambda j: heard.get(senders[j], 1 << 62), default=-1)
        if k < 0 or self._dead.get(k, -1) >= MAX_ATTEMPTS - 1:
            return
        s = senders[k]
        if self._clock_of(s) > self._recap_clock.get(k, -1) and self._unusually_silent(s, self._owed_since(s)) \
                and self._may_cap(k, self._wait_since):
            self._cap(k, self._dead.get(k, -1) + 1)

    def _answer(self, k: int, a: int, clock: int, since: int) -> None:
        """A CAP of sender k's attempt a is here (since `since`) and we have
        not capped it: follow while k is unusually silent here too (counted
        from when our order began to wait, or else from the CAP's arrival);
        NOCAP once k reported past `clock` (its newest report when the CAP
        came): it is alive."""
        s = self.view.senders[k]
        if a <= self._dead.get(k, -1) or (self._cap_k, self._cap_a) == (k, a):
            self._pending.pop(k, None)
        elif self._clock_of(s) > clock:
            self._pending.pop(k, None)
            self._nocap(k, a)
        else:
            since = since if self._wait_since is None else self._wait_since
            if self._unusually_silent(s, self._owed_since(s) if self._wait_since is not None else since) \
                    and self._may_cap(k, since):
                self._pending.pop(k, None)
                self._cap(k, a)

    def _cap(self, k: int, a: int) -> None:
        st = self.stream
        s = self.view.senders[k]
        count = st.received[k]
        st.cap(k, count)
        self._cap_k, self._cap_a = k, a
        self._cap_clock = self._clock_of(s)
        self._caps.setdefault((k, a), {})[self.me] = count
        self.stats["caps"] = self.stats.get("caps", 0) + 1
        self._send_cap(missing_only=False)
        self._check_caps()

    def _send_cap(self, missing_only: bool, to: str | None = None) -> None:
        k, a = self._cap_k, self._cap_a
        s = self.view.senders[k]
        got = self._caps[(k, a)]
        data = Cap(self.me, self.incarnation, self.view.view_id, k, a, got[self.me], to is not None).encode()
        self._cap_sent = self.now
        for p in ([to] if to is not None else self.view.members):
            # once wedged, k too: if it fenced another member, it says that no fence of it can come
            if p != self.me and (p != s or self.wedged) and not (missing_only and p in got):
                self._send(p, data)

    def _nocap(self, k: int, a: int) -> None:
        """k spoke after a CAP of attempt a came: we never cap that attempt, so no fence comes of it."""
        self._dead[k] = max(self._dead.get(k, -1), a)
        s = self.view.senders[k]
        data = NoCap(self.me, self.incarnation, self.view.view_id, k, a).encode()
        for p in self.view.members:
            if p != self.me and p != s:
                self._send(p, data)

    def _attempt_dead(self, k: int, a: int) -> None:
        """Attempts of sender k up to a can reach no fence: a cap of ours among them is lifted."""
        if a <= self._dead.get(k, -1):
            return
        self._dead[k] = a
        for key in [key for key in self._caps if key[0] == k and key[1] <= a]:
            del self._caps[key]
        if self._cap_k == k and self._cap_a <= a and not self._crash_fenced:
            self._cap_k = self._cap_a = -1
            self._recap_clock[k] = self._clock_of(self.view.senders[k])
            self.stream.cap(k, None)  # (none once wedged: caps end with the view's order)
            self._beyond.clear()
            self.stats["caps_lifted"] = self.stats.get("caps_lifted", 0) + 1
            self._try_deliver()

    def _on_cap(self, msg: Cap) -> None:
        k, a = self._cap_message(msg)
        if k < 0:
            return
        if a > 0:
            self._attempt_dead(k, a - 1)  # its sender knew attempt a - 1 dead (attempts start in turn)
        if a <= self._dead.get(k, -1):  # dead: say so again (its NOCAP may have been lost)
            self._send(msg.sender, NoCap(self.me, self.incarnation, self.view.view_id, k, a).encode())
            return
        caps = self._caps.setdefault((k, a), {})
        prev = caps.get(msg.sender)
        if prev is not None and prev != msg.count:
            raise RemoteProtocolError("two caps of one sender from one member in one attempt")
        caps[msg.sender] = msg.count
        self._push_beyond(msg.sender, k, a, msg.count)
        if (self._cap_k, self._cap_a) == (k, a):
            if not msg.echo:  # it may lack ours (a cap goes again only to those whose cap is missing)
                self._send_cap(missing_only=False, to=msg.sender)
            self._check_caps()
        elif k not in self._pending or self._pending[k][0] < a:
            self._pending[k] = p = (a, self._clock_of(self.view.senders[k]), self.now_us)
            self._answer(k, *p)

    def _on_nocap(self, msg: NoCap) -> None:
        k, a = self._cap_message(msg)
        if k >= 0:
            self._attempt_dead(k, a)

    def _cap_message(self, msg) -> tuple[int, int]:
        """(sender index, attempt) of a CAP or NOCAP we take, or (-1, -1)."""
        if not self._in_current_view(msg):
            return -1, -1
        v = self.view
        if msg.k < 0 or msg.k >= len(v.senders) or msg.attempt < 0 or getattr(msg, "count", 0) < 0:
            raise RemoteProtocolError("cap names no sender of the view, or a negative attempt or count")
        s = v.senders[msg.k]
        if not self.cfg.crash_fence:
            return -1, -1
        if s == msg.sender and type(msg) is Cap:
            # it does not cap itself: a CAP naming its sender says it knows a cap of it (`_capped_here`),
            # so it may lead us (its NOCAP, though, says what it knows: below)
            self._acked.add(msg.k)
            return -1, -1
        if self._crash_fenced and msg.k != self._cap_k:
            # every member but the one we fenced holds its cap on it for good, and caps one sender at a
            # time: no fence of another sender can be reached in this view.  Said also to a member that
            # capped us (a cap of us otherwise says nothing: we are alive, and our next report tells them)
            if type(msg) is Cap:
                self._send(msg.sender, NoCap(self.me, self.incarnation, v.view_id, msg.k, msg.attempt).encode())
            return -1, -1
        if s == self.me:
            if type(msg) is Cap:
                self._capped_here(msg)
            return -1, -1
        if self.wedged:
            # we cap nothing more in this view: an attempt we did not cap is dead, and its cappers may lift
            if type(msg) is Cap and (self._cap_k, self._cap_a) != (msg.k, msg.attempt):
                self._send(msg.sender, NoCap(self.me, self.incarnation, v.view_id, msg.k, msg.attempt).encode())
            elif type(msg) is NoCap:
                self._attempt_dead(msg.k, msg.attempt)
            return -1, -1
        return msg.k, msg.attempt

    def _check_caps(self) -> None:
        """Every other member's cap of our attempt is here: fence k at the largest (module docstring)."""
        k, a = self._cap_k, self._cap_a
        v = self.view
        s = v.senders[k]
        caps = self._caps[(k, a)]
        if self._crash_fenced or self.wedged or any(m not in caps for m in v.members if m != s):
            return
        c = max(caps.values())
        st = self.stream
        self._crash_fenced = True
        self._pending.clear()
        st.cap(k, c)
        self.fenced[s] = c
        self.fence_recv = ()  # its final received vector is not known: the trim needs n - q + 1 reporters
        st.fence(k, c)
        self.stats["crash_fences"] = self.stats.get("crash_fences", 0) + 1
        for i in sorted(i for i in self._beyond if i < c):  # sent ahead by a higher capper (`_push_beyond`)
            st.add(k, i, (self._beyond[i],))
            self.stats["fence_slots_ahead"] = self.stats.get("fence_slots_ahead", 0) + 1
        self._beyond.clear()
        if st.received[k] < c:
            # the nearest member whose cap was the fence (measured one-way delays; rank without one):
            # Oregon, one slot short of the fence, asked Frankfurt 80 ms away, not Virginia at 44
            near = self.leads.one_way
            self._fence_holder = min((m for m, x in caps.items() if x == c and m != self.me),
                                     key=lambda m: (near(m) is None, near(m) or 0, self.rank_of[m]))
            self._note_hole(k, c)
            self._send(self._fence_holder, SlotReq(self.me, self.incarnation, v.view_id, k, st.received[k],
                                                   min(c, st.received[k] + 64)).encode())
        self._try_deliver()

    def _push_beyond(self, capper: str, k: int, a: int, count: int) -> None:
        """A CAP of sender k below our count: the fence, the largest cap, will be
        at least ours, and the capper would then fetch the slots it lacks, a
        round trip after it fences (a 391-ms crash window on Region failure's
        seed 30: Oregon one slot short, Frankfurt asked).  Send them now,
        once per capper and attempt; it keeps them aside, uncounted, until it
        fences (`_keep_beyond`)."""
        st = self.stream
        if self.wedged or capper == self.view.senders[k] or count >= st.received[k] \
                or (capper, k, a) in self._pushed:
            return
        run = st.held_run(k, count, min(st.received[k], count + BEYOND_MAX))
        if run:
            self._pushed.add((capper, k, a))
            self._send(capper, SlotData(self.me, self.incarnation, self.view.view_id, k, count, tuple(run)).encode())

    def _keep_beyond(self, msg: SlotData) -> None:
        """Slot data of the current view from one of its members, while a cap
        is in force (ClockNode._on_slot_data): slots of the sender we capped
        past our cap, sent ahead by a member that capped higher, are kept
        aside — not held, so neither counted nor acknowledged, and our cap's
        promise stands — and taken once the fence is known and covers them
        (`_check_caps`)."""
        k = msg.k
        if k == self._cap_k and not self._crash_fenced:
            top = self.stream.caps[k]
            for i, slot in enumerate(msg.slots, msg.first):
                if i >= top and len(self._beyond) < BEYOND_MAX:
                    self._beyond[i] = slot

    # ------------------------------------------------------------ who leads
    def refused_leader(self, s: str) -> None:
        """A COLLECT or ACCEPT of `s` was not answered (`refuses_leader`): if we
        fenced it, it is alive and is told so — once we are wedged, of our cap
        only: it may lead us once it says it knows (`_capped_here`)."""
        if self._crash_fenced and not self.wedged and self.view.senders[self._cap_k] == s:
            self._fenced_spoke(s)
        elif self.now - self._cap_sent >= self.cfg.retransmit_ticks:
            self._send_cap(missing_only=False, to=s)

    # ------------------------------------------------------------ around it
    def _note_hole(self, k: int, top: int) -> None:
        caps = self.stream.caps
        super()._note_hole(k, min(top, caps[k]) if caps is not None else top)

    def _hole_source(self, k: int) -> str:
        """The sender we fenced is not asked: a member whose cap was the fence is."""
        if self._fence_holder is not None and k == self._cap_k:
            return self._fence_holder
        return super()._hole_source(k)

    def _become_wedged(self) -> None:
        was = self.wedged
        super()._become_wedged()
        if self.wedged and not was and self._cap_k >= 0:
            # silent: not waited for, suspected until it speaks (the tick's silence); if it reports, its
            # report counts, but not its own slots (ClockViewChange.trim: module docstring, safety (3)).
            # The trim's fetches are below the reported counts: caps are over.
            s = self.view.senders[self._cap_k]
            if self._unusually_silent(s):
                self.last_heard[s] = -10**9
                self.suspected.add(s)
            # else it spoke again (what ends a fenced member's view): waited for, so the view change
            # keeps it rather than leaving it out for a second one to take it back
            self.stream.caps = None

    _wedge = _become_wedged

    def _capped_here(self, msg: Cap) -> None:
        """A (wedged) member capped us: a fence of us may have been reached
        somewhere, at a count we do not know.  From now on in this view we
        do not trust our own count of our slots either — leading, we take
        our trim from the others' counts as the capper would
        (`distrusted_senders`) — and we say so with a CAP naming ourselves,
        so that the capper may answer our COLLECT (module docstring, "Who
        leads")."""
        self._knows_capped = True
        k = self.stream.my_k
        self._send(msg.sender, Cap(self.me, self.incarnation, self.view.view_id, k, msg.attempt,
                                   self.stream.received[k], True).encode())

    def distrusted_senders(self) -> list[int]:
        """The sender indices whose own count of their slots the trim does
        not take: the one our cap is in force on, and we ourselves once we
        know a member capped us.  The trim counts their slots from the other
        reporters (the base path when too few)."""
        out = [self._cap_k] if self._cap_k >= 0 else []
        if self._knows_capped and self.stream.my_k >= 0 and self.stream.my_k not in out:
            out.append(self.stream.my_k)
        return out

    def refuses_leader(self, s: str, inc: int | None = None) -> bool:
        """A COLLECT or ACCEPT from `s` (of incarnation `inc`, where known) is
        not answered: our cap of it is in force, it has not said it knows, and
        it is the incarnation we capped.  A new incarnation of it (a restart,
        or the fenced member back in place) remembers nothing of the view: no
        trim takes its count, so it may lead us as any restart may (swarm clock
        seed 8771237: refused, its ballots kept ours from the other restart for
        good, and the view never changed)."""
        if self._cap_k < 0 or self.view.senders[self._cap_k] != s or self._cap_k in self._acked:
            return False
        known = self.view.incarnations[self.view.members.index(s)]
        return inc is None or known == 0 or known == inc
