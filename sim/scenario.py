"""Scenario files: YAML in, validated `Scenario` out (format: docs/scenario.md).

Validation is pydantic (`extra="forbid"`, so an unknown key is an error); the
YAML is composed node by node first so that every error can name the file
line of the key it is about.  Cross-references (member ids in workloads,
links and faults) are checked after pydantic, with the same line mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kdsync.core.types import ProtocolName
from sim.quantiles import check_quantiles


class ScenarioError(Exception):
    """A scenario file a user must fix: `str(err)` is one line `file:line: key: what`."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MemberSpec(_Strict):
    id: str = Field(min_length=1)
    role: Literal["member", "witness"] = "member"
    # extension: kdsync run's protocol.clock_lead_ms (unset: chosen from measured delays, kdsync.core.leads)
    clock_lead_ms: float | None = Field(default=None, ge=0, le=60_000)


class LinkSpec(_Strict):
    """Properties of one direction of a link; in overrides every field is optional."""

    latency_ms: float | None = Field(default=None, ge=0)
    jitter_ms: float | None = Field(default=None, ge=0)
    loss: float | None = Field(default=None, ge=0, le=1)
    duplicate: float | None = Field(default=None, ge=0, le=1)
    reorder: float | None = Field(default=None, ge=0, le=1)
    bandwidth_mbps: float | None = Field(default=None, gt=0)
    # extension: a one-sided extra delay per message, drawn from these evenly spaced quantiles
    # (0 .. 100 %, ms; e.g. a delaying proxy's own lateness, bench/simreal.py)
    extra_quantiles_ms: list[float] | None = Field(default=None, min_length=2, max_length=1001)

    @model_validator(mode="after")
    def _extra(self) -> "LinkSpec":
        check_quantiles(self.extra_quantiles_ms, "extra_quantiles_ms")
        return self


class LinkOverride(LinkSpec):
    from_: str = Field(alias="from")
    to: str


class NetworkSpec(_Strict):
    default: LinkSpec = LinkSpec()
    links: list[LinkOverride] = []


class KafkaSpec(_Strict):
    produce_ms: float = Field(default=2.0, ge=0)
    consume_ms: float = Field(default=1.0, ge=0)
    # extension: the member's consume loop hands what has been fetched to the
    # node every poll_ms (one batch); 0 = each fetch as soon as it arrives
    poll_ms: float = Field(default=0.0, ge=0, le=10_000)
    # extension: input offsets are committed this long after the member's own
    # events became durable (the member commits asynchronously from its
    # consume loop); a crash in between means they are consumed again
    commit_ms: float = Field(default=50.0, ge=0, le=60_000)
    # extension: producers send one batch per partition every linger_ms with
    # the records written meanwhile (Kafka's linger.ms; librdkafka's default
    # is 5); 0 = every record its own batch at its own Poisson arrival time
    linger_ms: float = Field(default=5.0, ge=0, le=10_000)
    # extension: with linger_ms 0 (exact arrivals), batch them as librdkafka does:
    # the first record of a partition opens a batch sent writer_linger_ms later
    writer_linger_ms: float = Field(default=0.0, ge=0, le=10_000)
    # extension: the consumer pauses while this many consumed records are not
    # yet durable in the member's global topic (the real member's back-pressure)
    max_inflight: int = Field(default=50_000, ge=1, le=100_000_000)
    # extension (testbed fidelity): the member's source consumer as librdkafka's
    # fetch loop.  0 = off (a batch reaches the member consume_ms after it was
    # acknowledged).  > 0: one fetch outstanding per member; a fetch that finds
    # nothing new is held by the broker for fetch_wait_ms (fetch.wait.max.ms),
    # then the next one goes out; each response takes fetch_overhead_ms more
    fetch_wait_ms: float = Field(default=0.0, ge=0, le=60_000)
    fetch_overhead_ms: float = Field(default=0.0, ge=0, le=60_000)
    # extension: while it holds an idle fetch the broker looks for new data every
    # fetch_check_ms and answers at the first look that finds some (0: at once;
    # not given: never before fetch_wait_ms, a broker without early wake-up)
    fetch_check_ms: float | None = Field(default=None, ge=0, le=60_000)
    # extension: the member's global-topic producer: a batch opens with the
    # first delivery and leaves sink_linger_ms later (linger.ms); it is durable
    # produce_ms + ack_ms after it left (broker append, then acks=all replication)
    sink_linger_ms: float = Field(default=0.0, ge=0, le=10_000)
    ack_ms: float = Field(default=0.0, ge=0, le=60_000)


    @model_validator(mode="after")
    def _writer_linger(self) -> "KafkaSpec":
        if self.writer_linger_ms > 0 and self.linger_ms > 0:
            raise ValueError("writer_linger_ms batches exact arrivals: it needs linger_ms: 0")
        return self


class WorkloadSpec(_Strict):
    member: str
    rate_eps: float | None = Field(default=None, gt=0)
    start_s: float | None = Field(default=None, ge=0)
    stop_s: float | None = Field(default=None, ge=0)
    burst: int | None = Field(default=None, ge=1)
    at_s: float | None = Field(default=None, ge=0)
    partitions: int = Field(default=1, ge=1, le=1024)
    payload_bytes: int = Field(default=100, ge=0, le=1 << 20)
    # how a steady rate's records arrive: Poisson, or evenly spaced (a paced writer, as bench.load's)
    arrivals: Literal["poisson", "paced"] = "poisson"

    @model_validator(mode="after")
    def _one_kind(self) -> "WorkloadSpec":
        if (self.rate_eps is None) == (self.burst is None):
            raise ValueError("give exactly one of rate_eps (with start_s/stop_s) or burst (with at_s)")
        if self.burst is not None and (self.start_s is not None or self.stop_s is not None):
            raise ValueError("a burst takes at_s, not start_s/stop_s")
        if self.burst is not None and self.at_s is None:
            raise ValueError("a burst needs at_s")
        if self.rate_eps is not None and self.at_s is not None:
            raise ValueError("a rate takes start_s/stop_s, not at_s")
        if self.burst is not None and self.arrivals != "poisson":
            raise ValueError("arrivals is for a rate, not a burst")
        return self


class LinkFault(LinkSpec):
    from_: str = Field(alias="from")
    to: str


_FAULT_ACTIONS = ("crash", "stop", "restart", "partition", "heal", "link", "clock_pause")


class FaultSpec(_Strict):
    at_s: float = Field(ge=0)
    crash: str | None = None
    stop: str | None = None  # a clean stop: the member leaves (announced), then its process ends
    restart: str | None = None
    partition: list[list[str]] | None = None
    heal: Literal[True] | None = None
    link: LinkFault | None = None
    until_s: float | None = Field(default=None, ge=0)  # link faults (and partitions): when they end
    clock_pause: str | None = None
    for_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_action(self) -> "FaultSpec":
        given = [a for a in _FAULT_ACTIONS if getattr(self, a) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(_FAULT_ACTIONS)} (got {', '.join(given) or 'none'})")
        if self.for_s is not None and self.clock_pause is None:
            raise ValueError("for_s belongs to clock_pause")
        if self.clock_pause is not None and self.for_s is None:
            raise ValueError("clock_pause needs for_s")
        if self.until_s is not None and self.link is None and self.partition is None:
            raise ValueError("until_s belongs to link or partition")
        if self.until_s is not None and self.until_s <= self.at_s:
            raise ValueError("until_s must be after at_s")
        return self

    @property
    def action(self) -> str:
        return next(a for a in _FAULT_ACTIONS if getattr(self, a) is not None)


class MemberCostSpec(_Strict):
    """CPU service time of a member (extension): one server per member."""

    message_us: float = Field(default=0.0, ge=0, le=1e6)  # per peer message received or sent
    event_us: float = Field(default=0.0, ge=0, le=1e6)  # per record submitted or delivered
    ready_us: float = Field(default=0.0, ge=0, le=1e6)  # per Ready handshake (one loop iteration)
    cores: int = Field(default=1, ge=1, le=1024)  # of each site, shared by its shards' nodes
    tick_us: float = Field(default=0.0, ge=0, le=1e6)  # per tick (timers, idle loop work), extension
    # extension, the box: an idle member's next service starts after a wake-up
    # delay (exponential, this mean: the scheduler of a busy box), and every
    # service takes `slowdown` times its CPU time in wall time (cores shared)
    wakeup_us: float = Field(default=0.0, ge=0, le=1e6)
    slowdown: float = Field(default=1.0, ge=1.0, le=100.0)
    # extension: the wake-up delay's distribution instead of an exponential: its
    # quantiles at 0, 1/n, ..., 1 (µs, non-decreasing), sampled by inverse CDF
    wakeup_quantiles_us: list[float] | None = Field(default=None, min_length=2, max_length=1001)

    @model_validator(mode="after")
    def _quantiles(self) -> "MemberCostSpec":
        check_quantiles(self.wakeup_quantiles_us, "wakeup_quantiles_us")
        return self

    def costs_anything(self) -> bool:
        return bool(self.message_us or self.event_us or self.ready_us or self.tick_us or self.wakeup_us
                    or self.wakeup_quantiles_us)


class TimingSpec(_Strict):
    """The member's timers as in kdsync run's [protocol] (extension).  With this
    key the simulated node ticks every tick_ms and counts its timeouts in ticks
    exactly like the real member (round(ms / tick_ms), at least 1); a key left
    out takes kdsync's default (kdsync/config.py)."""

    tick_ms: float | None = Field(default=None, gt=0, le=10_000)
    heartbeat_ms: float | None = Field(default=None, gt=0, le=600_000)
    suspect_ms: float | None = Field(default=None, gt=0, le=600_000)
    retransmit_ms: float | None = Field(default=None, gt=0, le=600_000)

    def resolved(self, protocol: str = "derecho") -> dict[str, float]:
        """Every timer in ms, kdsync's defaults for `protocol` for those not given."""
        from kdsync.config import ProtocolSection

        d = ProtocolSection(name=protocol)
        return {k: (getattr(self, k) if getattr(self, k) is not None else getattr(d, k))
                for k in ("tick_ms", "heartbeat_ms", "suspect_ms", "retransmit_ms")}


class ClockJumpSpec(_Strict):
    at_s: float = Field(ge=0)
    by_ms: float = Field(ge=-3_600_000, le=3_600_000)


class ClockSpec(_Strict):
    """One member's faulty wall clock (extension): the `clock` protocol stamps
    with it; skew, drift and jumps may cost latency, never safety.  Other
    protocols ignore clocks."""

    member: str
    offset_ms: float = Field(default=0.0, ge=-3_600_000, le=3_600_000)
    drift_ppm: float = Field(default=0.0, ge=-100_000, le=100_000)
    jumps: list[ClockJumpSpec] = []

    def fault(self):
        from kdsync.testing.clocks import ClockFault

        return ClockFault(int(self.offset_ms * 1000), self.drift_ppm,
                          tuple((int(j.at_s * 1e6), int(j.by_ms * 1000)) for j in self.jumps))


class ExpectSpec(_Strict):
    max_p99_ms: float | None = Field(default=None, gt=0)
    min_delivered_fraction: float | None = Field(default=None, ge=0, le=1)


class Scenario(_Strict):
    name: str = Field(min_length=1)
    seed: int = 0
    protocol: ProtocolName = "derecho"
    duration_s: float = Field(gt=0, le=86_400)
    settle_s: float = Field(default=10.0, ge=0, le=86_400)
    members: list[MemberSpec] = Field(min_length=1)
    network: NetworkSpec = NetworkSpec()
    kafka: KafkaSpec = KafkaSpec()
    workload: list[WorkloadSpec] = []
    faults: list[FaultSpec] = []
    expect: ExpectSpec = ExpectSpec()
    member_cost: MemberCostSpec | None = None
    timing: TimingSpec | None = None  # extension: the real member's timers (default: the simulator's own)
    profile: str | None = None  # extension: the calibration profile merged in (parse_scenario)
    shards: int = Field(default=1, ge=1, le=1024)  # independent ordering groups; partition p -> shard p % shards
    clocks: list[ClockSpec] = []  # extension: members' faulty wall clocks (default: every clock exact)
    commit_quorum: int = Field(default=0, ge=0, le=1000)  # extension: kdsync run's protocol.commit_quorum
    quiesce: bool = False  # extension: kdsync run's protocol.quiesce (idle nodes sleep; members ping each other)
    # extension: kdsync run's protocol.adaptive_suspect (members ping each other; a peer whose
    # pings came regularly is suspected after a few ping gaps, suspect_ms is the ceiling)
    adaptive_suspect: bool = False
    # extension: kdsync run's protocol.crash_fence (clock: a member silent while the order waits for it
    # is fenced by every other member, without a view change: kdsync.core.crash_fence)
    crash_fence: bool = True
    # extension: kdsync run's protocol.lift_fence (clock: a fenced member's restart is taken back in
    # place, without a view change: kdsync.core.lift)
    lift_fence: bool = False

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.members)

    @property
    def clusters(self) -> tuple[str, ...]:
        """Members that have a Kafka cluster (everyone but witnesses), in rank order."""
        return tuple(m.id for m in self.members if m.role == "member")

    @property
    def witnesses(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.members if m.role == "witness")


# ---------------------------------------------------------------- loading


def _plain(node: yaml.Node, path: tuple, lines: dict[tuple, int]) -> Any:
    """Python value of a composed YAML node; records the line of every path."""
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = yaml.constructor.SafeConstructor().construct_object(key_node)
            if not isinstance(key, (str, int, float, bool)):
                raise _LoadError(key_node.start_mark.line + 1, "a mapping key must be a plain scalar")
            if key in out:
                raise _LoadError(key_node.start_mark.line + 1, f"{key}: duplicate key")
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _plain(value_node, path + (key,), lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_plain(item, path + (i,), lines) for i, item in enumerate(node.value)]
    return yaml.constructor.SafeConstructor().construct_object(node)


class _LoadError(Exception):
    def __init__(self, line: int, msg: str):
        super().__init__(msg)
        self.line = line


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _line_of(path: tuple, lines: dict[tuple, int]) -> int:
    path = tuple(path)
    while path and path not in lines:
        path = path[:-1]
    return lines.get(path, 1)


def _field_path(loc: tuple) -> tuple:
    """pydantic loc -> path in the YAML (aliases are already YAML names)."""
    return tuple("from" if p == "from_" else p for p in loc if p not in ("function-after",))


def parse_scenario(text: str, source: str = "<scenario>") -> Scenario:
    """Validate scenario YAML text.  Raises ScenarioError (one line: source:line: key: what)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark else 1
        raise ScenarioError(f"{source}:{line}: not valid YAML: {err.problem or err}") from None
    if root is None:
        raise ScenarioError(f"{source}:1: the file is empty (expected a mapping with name, duration_s, members, ...)")
    lines: dict[tuple, int] = {}
    try:
        data = _plain(root, (), lines)
    except _LoadError as err:
        raise ScenarioError(f"{source}:{err.line}: {err}") from None
    except yaml.YAMLError as err:
        raise ScenarioError(f"{source}:1: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}:1: a scenario is a mapping (name, duration_s, members, ...)")
    if "profile" in data:
        try:
            data = _with_profile(data, source)
        except _LoadError as err:
            raise ScenarioError(f"{source}:{_line_of(('profile',), lines)}: profile: {err}") from None
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        path = _field_path(first["loc"])
        if first["type"] == "extra_forbidden":
            what = "unknown key"
        elif first["type"] == "missing":
            what = "missing required key"
        else:
            what = first["msg"].removeprefix("Value error, ")
            if "input" in first and not isinstance(first["input"], (dict, list)):
                what += f" (got {first['input']!r})"
        raise ScenarioError(f"{source}:{_line_of(path, lines)}: {_dotted(path)}: {what}") from None
    problem = _cross_check(scenario)
    if problem:
        path, what = problem
        raise ScenarioError(f"{source}:{_line_of(path, lines)}: {_dotted(path)}: {what}")
    return scenario


PROFILE_SECTIONS = ("kafka", "member_cost", "timing")


def _with_profile(data: dict, source: str) -> dict:
    """`data` with the calibration profile it names merged under its own keys."""
    name = data["profile"]
    if not isinstance(name, str) or not name:
        raise _LoadError(1, "give the path of a calibration profile (kdsync-sim calibrate writes one)")
    path = Path(name)
    if not path.is_absolute():
        near = Path(source).parent / path
        path = near if near.exists() else path
    try:
        prof = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _LoadError(1, f"no such calibration profile {name!r} (kdsync-sim calibrate writes one)") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise _LoadError(1, f"cannot read calibration profile {name!r} ({err.__class__.__name__})") from None
    if not isinstance(prof, dict) or not any(k in prof for k in PROFILE_SECTIONS):
        raise _LoadError(1, f"{name!r} is not a calibration profile (no {', '.join(PROFILE_SECTIONS)} section)")
    out = dict(data)
    for sec in PROFILE_SECTIONS:
        given = prof.get(sec)
        if isinstance(given, dict):
            own = data.get(sec)
            out[sec] = {**given, **(own if isinstance(own, dict) else {})}
    return out


def _cross_check(s: Scenario) -> tuple[tuple, str] | None:
    ids = s.member_ids
    seen: set[str] = set()
    for i, m in enumerate(s.members):
        if m.id in seen:
            return ("members", i, "id"), f"duplicate member id {m.id!r}"
        if m.id == "all":
            return ("members", i, "id"), "'all' is reserved (workload member: all)"
        seen.add(m.id)
    if not s.clusters:
        return ("members",), "at least one member must have role member (a Kafka cluster)"

    def unknown(name: str) -> str:
        return f"unknown member {name!r} (members: {', '.join(ids)})"

    for i, link in enumerate(s.network.links):
        for key, name in (("from", link.from_), ("to", link.to)):
            if name not in seen:
                return ("network", "links", i, key), unknown(name)
    for i, w in enumerate(s.workload):
        if w.member != "all" and w.member not in seen:
            return ("workload", i, "member"), unknown(w.member)
        if w.member in s.witnesses:
            return ("workload", i, "member"), f"{w.member!r} is a witness and has no Kafka cluster"
        if w.rate_eps is not None:
            start, stop = w.start_s or 0.0, s.duration_s if w.stop_s is None else w.stop_s
            if stop > s.duration_s:
                return ("workload", i, "stop_s"), f"must be at most duration_s ({s.duration_s})"
            if start >= stop:
                return ("workload", i, "start_s"), "must be before stop_s"
        elif w.at_s is not None and w.at_s >= s.duration_s:
            return ("workload", i, "at_s"), f"must be before duration_s ({s.duration_s})"
    clocked: set[str] = set()
    for i, c in enumerate(s.clocks):
        if c.member not in seen:
            return ("clocks", i, "member"), unknown(c.member)
        if c.member in clocked:
            return ("clocks", i, "member"), f"{c.member!r} has two clocks"
        clocked.add(c.member)
    for i, f in enumerate(s.faults):
        if f.at_s >= s.duration_s:
            return ("faults", i, "at_s"), f"must be before duration_s ({s.duration_s}); everything heals then"
        for key in ("crash", "stop", "restart", "clock_pause"):
            name = getattr(f, key)
            if name is not None and name not in seen:
                return ("faults", i, key), unknown(name)
        if f.link is not None:
            for key, name in (("from", f.link.from_), ("to", f.link.to)):
                if name not in seen:
                    return ("faults", i, "link", key), unknown(name)
        if f.partition is not None:
            placed: set[str] = set()
            for g, group in enumerate(f.partition):
                for j, name in enumerate(group):
                    if name not in seen:
                        return ("faults", i, "partition", g, j), unknown(name)
                    if name in placed:
                        return ("faults", i, "partition", g, j), f"{name!r} is in two groups"
                    placed.add(name)
    return None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file.  Raises ScenarioError for anything a user must fix."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenario file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ScenarioError(f"{path}: cannot read scenario file ({err.__class__.__name__}: {err})") from None
    return parse_scenario(text, str(path))


def dump_scenario(s: Scenario) -> str:
    """YAML text that `parse_scenario` turns back into an equal Scenario."""
    data = s.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=False)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)
