"""Configuration of one member (`kdsync run --config FILE`), validated with pydantic.

The TOML file (reference: docs/config.md) with every optional section::

    state_dir = "/var/lib/kdsync/dc1"   # HardState; default: .kdsync-state/<id> next to the file

    [member]
    id = "dc1"
    listen = "127.0.0.1:7401"
    role = "member"                     # or "witness" (orders and votes, no Kafka)

    [peers]                             # every member, this one included
    dc1 = "127.0.0.1:7401"
    dc2 = "127.0.0.1:7402"
    arb = { address = "127.0.0.1:7409", role = "witness" }

    [kafka]                             # any librdkafka property, as is
    "bootstrap.servers" = "127.0.0.1:9092"
    [kafka.consumer]                    # overrides for the source consumer
    "fetch.wait.max.ms" = 10
    [kafka.producer]                    # overrides for the global-topic producer
    "linger.ms" = 2

    [topics]
    source = "test"                     # or ["a", "b"] or { allow = "^app-.*", deny = "-global$" }
    global_suffix = "-global"
    global_partitions = 1               # >1: partitioned by key hash, same in every cluster
    replication_factor = 3              # of the global topics; absent: the broker's default
    min_insync_replicas = 2             # absent: the broker's default
    shards = 1                          # K > 1: K ordering groups, source partition p -> shard p mod K,
                                        # shard s writes partition s of the global topic (docs/shards.md)
    serve_shards = [0, 1]               # the shards this host runs (absent: all of them)
    [topics.config]                     # any topic config of the global topics, as is
    "retention.ms" = 604800000

    [transport]
    kind = "auto"                       # auto | tcp | rdma
    secret = "..."                      # or secret_file = "/etc/kdsync/secret"
    tls = { certfile = "m.pem", keyfile = "m.key", cafile = "ca.pem" }

    [protocol]
    name = "derecho"                    # derecho | sequencer | mirror
    tick_ms = 50
    heartbeat_ms = 100
    suspect_ms = 500
    retransmit_ms = 50
    quiesce = true                      # idle topics' groups sleep (one ping per peer keeps liveness)

    [checkpoint]                        # the restart state next to each global topic (T-global.kdsync)
    interval_ms = 10000                 # written at most this often while positions advance
    positions = 100000                  # ...or as soon as this many positions are durable since the last

    [metrics]
    listen = "127.0.0.1:9464"           # Prometheus endpoint; absent: none

    [log]
    level = "info"
    format = "kv"                       # kv | json
    kafka_interval_ms = 5000            # librdkafka's own lines: at most one per kind per interval

`load_config(path)` returns a `Config` or raises `ConfigError` whose message is
one line naming the key: ``config error: peers.dc9: ...``.

The original positional form ``kdsync run [N [BROKERS [TOPIC]]]`` (or just
``kdsync N BROKERS TOPIC``) is mapped by `legacy_config(n, brokers, topic,
derecho_cfg)`, with the file `find_derecho_cfg()` finds: members are ``m0 .. m{N-1}``;
``m<local_id>`` is this member at ``local_ip:gms_port``; ``m0`` is the leader at
``leader_ip:leader_gms_port`` and every other ``m<i>`` at ``leader_ip:leader_gms_port + i``
(Derecho's single-host layout).  For members on several hosts, add to the
``[DERECHO]`` section ``members = "ip:port, ip:port, ..."`` (in id order).
``[RDMA] provider`` picks the transport: ``verbs`` -> rdma, ``sockets``/``tcp``
(or no provider) -> tcp.
"""

from __future__ import annotations

import configparser
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from kdsync.core.types import ProtocolName

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kdsync.kafka.checkpoint import CHECKPOINT_SUFFIX

__all__ = ["DERECHO_SYSTEM_CFG", "Config", "ConfigError", "find_derecho_cfg", "load_config", "legacy_config",
           "parse_address"]

KafkaValue = Union[str, int, float, bool]


_KEY = "\x00"  # ValueError("\0sub.key\0message") names a key below the failing location


class ConfigError(Exception):
    """A user error in the configuration; str() is one line naming the key."""


def parse_address(value: str) -> tuple[str, int]:
    """"host:port" -> (host, port); raises ValueError with a short reason."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"expected \"host:port\", got {value!r}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"missing host in {value!r}")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"port {port!r} is not a number") from None
    if not 0 < p < 65536:
        raise ValueError(f"port {p} out of range 1..65535")
    return host, p


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _address(v: Any) -> str:
    parse_address(v)
    return v


class MemberSection(_Model):
    id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    listen: str
    role: Literal["member", "witness"] = "member"
    state_dir: str | None = None
    coalesce_us: Annotated[int, Field(ge=0, le=100_000)] = 0  # kdsync.eventloop: loop wake-ups this far apart
    stop_timeout_ms: Annotated[int, Field(ge=1_000, le=3_600_000)] = 45_000  # kdsync.stopping: a stop's bound

    _check_listen = field_validator("listen")(lambda cls, v: _address(v))


class PeerEntry(_Model):
    address: str
    role: Literal["member", "witness"] = "member"

    _check_address = field_validator("address")(lambda cls, v: _address(v))


class TopicFilter(_Model):
    allow: str
    deny: str | None = None

    @field_validator("allow", "deny")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"bad regular expression: {e}") from None
        return v


class TopicsSection(_Model):
    source: Any  # a name, a list of names, or TopicFilter (normalised by _source)
    global_suffix: str = "-global"
    global_partitions: Annotated[int, Field(ge=1, le=10_000)] = 1
    replication_factor: Annotated[int, Field(ge=1, le=32_767)] | None = None  # None: the broker's default
    min_insync_replicas: Annotated[int, Field(ge=1, le=32_767)] | None = None
    config: dict[str, KafkaValue] = Field(default_factory=dict)  # topic configs of the global topics, as is
    shards: Annotated[int, Field(ge=1, le=1024)] = 1  # K ordering groups (docs/shards.md); 1: one total order
    serve_shards: list[int] | None = None  # the shards this host runs; None: all of them
    # idle source partitions paused and watched with ListOffsets (kdsync.kafka.idle_watch); 0: never
    idle_after_ms: Annotated[int, Field(ge=0, le=86_400_000)] = 10_000
    idle_watch_ms: Annotated[int, Field(ge=20, le=60_000)] = 500
    idle_watch_long_ms: Annotated[int, Field(ge=20, le=600_000)] = 2_000  # partitions paused for a minute
    hot_partitions: Annotated[int, Field(ge=1)] = 100

    def idle(self) -> tuple[float, float, int, float]:
        """SourceConsumer's `idle` argument."""
        return self.idle_after_ms / 1000, self.idle_watch_ms / 1000, self.hot_partitions, self.idle_watch_long_ms / 1000

    @field_validator("config", mode="before")
    @classmethod
    def _topic_config(cls, v):
        if not isinstance(v, dict):
            raise ValueError("must be a table of topic configs, e.g. \"retention.ms\" = 604800000")
        for k, x in v.items():
            if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", k):
                raise ValueError(f"{_KEY}\"{k}\"{_KEY}not a topic config name (lower-case letters, digits, . _ -)")
            if not isinstance(x, (str, int, float, bool)):
                raise ValueError(f"{_KEY}\"{k}\"{_KEY}a topic config value must be a string, number or boolean")
        return v

    @model_validator(mode="after")
    def _settings(self):
        if self.idle_watch_long_ms < self.idle_watch_ms:
            raise ValueError(f"{_KEY}idle_watch_long_ms{_KEY}{self.idle_watch_long_ms} is less than idle_watch_ms = "
                             f"{self.idle_watch_ms}: long-idle partitions are watched at most as often as the others")
        if self.min_insync_replicas is not None and "min.insync.replicas" in self.config:
            raise ValueError(f"{_KEY}config.\"min.insync.replicas\"{_KEY}set min_insync_replicas or "
                             f"config.\"min.insync.replicas\", not both")
        if (self.min_insync_replicas is not None and self.replication_factor is not None
                and self.min_insync_replicas > self.replication_factor):
            raise ValueError(f"{_KEY}min_insync_replicas{_KEY}{self.min_insync_replicas} is more than "
                             f"replication_factor = {self.replication_factor}: no write could ever succeed")
        if self.shards > 1 and self.global_partitions not in (1, self.shards):
            raise ValueError(f"{_KEY}global_partitions{_KEY}with shards = {self.shards} the global topic has one "
                             f"partition per shard; leave global_partitions out")
        if self.serve_shards is not None:
            if not self.serve_shards:
                raise ValueError(f"{_KEY}serve_shards{_KEY}empty list: name at least one shard (or leave it out)")
            for s in self.serve_shards:
                if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.shards:
                    raise ValueError(f"{_KEY}serve_shards{_KEY}{s!r} is not a shard in 0..{self.shards - 1} "
                                     f"(shards = {self.shards})")
            if len(set(self.serve_shards)) != len(self.serve_shards):
                raise ValueError(f"{_KEY}serve_shards{_KEY}names a shard twice")
        return self

    def served_shards(self) -> list[int]:
        """The shards this host runs, in order (all of 0..shards-1 unless serve_shards names some)."""
        return sorted(self.serve_shards) if self.serve_shards is not None else list(range(self.shards))

    def partition_count(self) -> int:
        """Partitions of each global topic: one per shard, or global_partitions with one shard."""
        return self.shards if self.shards > 1 else self.global_partitions

    def global_topic_config(self) -> dict[str, str]:
        """Topic configs the global topics are created with (strings, as Kafka takes them)."""
        out = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in self.config.items()}
        if self.min_insync_replicas is not None:
            out["min.insync.replicas"] = str(self.min_insync_replicas)
        return out

    @field_validator("source", mode="before")
    @classmethod
    def _source(cls, v):
        if isinstance(v, dict):
            try:
                return TopicFilter.model_validate(v)
            except ValidationError as e:
                raise ValueError(_format(e, prefix=False)) from None
        names = [v] if isinstance(v, str) else v if isinstance(v, list) else None
        if names is None:
            raise ValueError("expected a topic name, a list of names, or { allow = REGEX, deny = REGEX }")
        if not names:
            raise ValueError("empty list of source topics")
        for n in names:
            if not isinstance(n, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", n):
                raise ValueError(f"{n!r} is not a valid Kafka topic name")
        return v

    @field_validator("global_suffix")
    @classmethod
    def _suffix(cls, v: str) -> str:
        if not v or not re.fullmatch(r"[A-Za-z0-9._-]+", v):
            raise ValueError("must be a non-empty topic-name suffix (letters, digits, . _ -)")
        return v

    def global_topic(self, source: str) -> str:
        return source + self.global_suffix

    def matches(self, topic: str) -> bool:
        """Whether a topic that exists in the cluster is a source topic (never a
        global topic, its checkpoint topic or an internal `__` topic)."""
        if (topic.endswith(self.global_suffix) or topic.endswith(self.global_suffix + CHECKPOINT_SUFFIX)
                or topic.startswith("__")):
            return False
        s = self.source
        if isinstance(s, str):
            return topic == s
        if isinstance(s, list):
            return topic in s
        return re.search(s.allow, topic) is not None and not (s.deny and re.search(s.deny, topic))

    def fixed_names(self) -> list[str] | None:
        """The source topics when they are named, None for a regex filter."""
        s = self.source
        return [s] if isinstance(s, str) else list(s) if isinstance(s, list) else None


class TLSSection(_Model):
    certfile: str
    keyfile: str
    cafile: str | None = None


class TransportSection(_Model):
    kind: Literal["auto", "tcp", "rdma"] = "auto"
    secret: str | None = None
    secret_file: str | None = None
    tls: TLSSection | None = None
    max_frame_bytes: Annotated[int, Field(ge=4096)] = 64 * 1024 * 1024

    @model_validator(mode="after")
    def _one_secret(self):
        if self.secret is not None and self.secret_file is not None:
            raise ValueError("set either secret or secret_file, not both")
        return self


TICK_MS = 50  # protocol.tick_ms when not set
# ... for `clock`, which reports its clock every tick while a slot waits for
# C2 and counts a slot older than four ticks as far (acknowledged with the
# next message to its sender, kdsync/core/far_links.py): with 50 ms ticks
# nothing across regions is far; five regions at 1 000 events/s in the
# simulator send 2.9 peer messages per event with 5 ms ticks against 12.3
# with 50 ms, at the same p50 and p99 within 1 % (docs/wan.md)
CLOCK_TICK_MS = 5


class ProtocolSection(_Model):
    name: ProtocolName = "derecho"
    tick_ms: Annotated[float, Field(gt=0, le=10_000)] = TICK_MS
    heartbeat_ms: Annotated[float, Field(gt=0)] = 100
    suspect_ms: Annotated[float, Field(gt=0)] = 500
    retransmit_ms: Annotated[float, Field(gt=0)] = 50
    max_batch: Annotated[int, Field(ge=1)] = 10_000
    log_retention: Annotated[int, Field(ge=1)] = 1_000_000
    catchup_chunk: Annotated[int, Field(ge=1)] = 5_000
    clock_lead_ms: Annotated[float, Field(ge=0, le=60_000)] | None = None  # unset: chosen from measured delays
    commit_quorum: Annotated[int, Field(ge=0, le=1000)] = 0
    quiesce: bool = True  # an idle topic's group sleeps: no ticks, no heartbeats (kdsync.core.liveness)
    # suspect_ms becomes a ceiling: a peer whose pings came regularly is
    # suspected after a few of its longest ping gaps (kdsync.core.liveness)
    adaptive_suspect: bool = False
    # clock: a member silent while the order waits for it is fenced by every
    # other member instead of stopping the order until a view change
    # (kdsync.core.crash_fence; the default since stop 61: docs/wan.md)
    crash_fence: bool = True
    # clock: a fenced member's restart is taken back in place, without a
    # view change (kdsync.core.lift; off by default until the swarm has run it)
    lift_fence: bool = False

    @model_validator(mode="before")
    @classmethod
    def _protocol_tick(cls, data):
        """`tick_ms` left out: the protocol's own default (CLOCK_TICK_MS for clock)."""
        if isinstance(data, dict) and data.get("name") == "clock" and "tick_ms" not in data:
            data = {**data, "tick_ms": CLOCK_TICK_MS}
        return data

    def ticks(self, ms: float) -> int:
        return max(1, round(ms / self.tick_ms))


class CheckpointSection(_Model):
    interval_ms: Annotated[int, Field(ge=100, le=86_400_000)] = 10_000
    positions: Annotated[int, Field(ge=1)] = 100_000


class HealthSection(_Model):
    stall_after_ms: Annotated[int, Field(ge=100, le=86_400_000)] = 30_000  # kdsync.observability.stalls


class MetricsSection(_Model):
    listen: str | None = None
    # histograms (e2e latency, stage times) per topic while a member orders at most
    # this many source topics; the topics it opens beyond share topic="_all"
    # (docs/metrics.md: a thousand topics' histograms made a scrape cost seconds)
    topic_histograms: Annotated[int, Field(ge=0)] = 100
    # librdkafka statistics of every Kafka client, for kdsync_kafka_requests_total (0: off)
    kafka_stats_ms: Annotated[int, Field(ge=0)] = 10_000

    @field_validator("listen")
    @classmethod
    def _addr(cls, v):
        return None if v is None else _address(v)


class LogSection(_Model):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["kv", "json"] = "kv"
    kafka_interval_ms: Annotated[int, Field(ge=0)] = 5_000  # librdkafka's lines: one per kind per interval


class KafkaSection(BaseModel):
    """librdkafka properties, as is; `consumer` / `producer` override them."""

    model_config = ConfigDict(extra="allow", frozen=True)
    consumer: dict[str, Any] = Field(default_factory=dict)
    producer: dict[str, Any] = Field(default_factory=dict)
    # kdsync's own, not librdkafka's: true orders whatever read_committed hands over, without the
    # start-up probe and the check of transactional records (kdsync.kafka.transactions, docs/config.md)
    trust_read_committed: bool = False

    @model_validator(mode="before")
    @classmethod
    def _values(cls, data):
        if not isinstance(data, dict):
            return data
        for k, v in data.items():
            sub = v.items() if k in ("consumer", "producer") and isinstance(v, dict) else [(None, v)]
            if k in ("consumer", "producer") and not isinstance(v, dict):
                raise ValueError(f"{_KEY}{k}{_KEY}must be a table of librdkafka properties")
            for k2, v2 in sub:
                name = f"{k}.{k2}" if k2 is not None else k
                if not isinstance(v2, (str, int, float, bool)):
                    raise ValueError(f"{_KEY}{name}{_KEY}librdkafka property must be a string, number or boolean")
                if (k2 or k) == "isolation.level" and k != "producer" and v2 != "read_committed":
                    key = f'{k}."{k2}"' if k2 is not None else f'"{k}"'
                    raise ValueError(f"{_KEY}{key}{_KEY}{v2!r}: kdsync reads its source read_committed (aborted "
                                     f"records never enter the order); leave it out")
        if "trust_read_committed" in data and not isinstance(data["trust_read_committed"], bool):
            raise ValueError(f"{_KEY}trust_read_committed{_KEY}must be true or false, got "
                             f"{data['trust_read_committed']!r}")
        return data

    def common(self) -> dict[str, KafkaValue]:
        return dict(self.model_extra or {})

    def consumer_conf(self) -> dict[str, KafkaValue]:
        return {**self.common(), **self.consumer}

    def producer_conf(self) -> dict[str, KafkaValue]:
        return {**self.common(), **self.producer}


class Config(_Model):
    member: MemberSection
    peers: dict[str, PeerEntry]
    kafka: KafkaSection = Field(default_factory=KafkaSection)
    topics: TopicsSection | None = None
    transport: TransportSection = Field(default_factory=TransportSection)
    protocol: ProtocolSection = Field(default_factory=ProtocolSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    health: HealthSection = Field(default_factory=HealthSection)
    log: LogSection = Field(default_factory=LogSection)
    state_dir: str | None = None
    base_dir: str = Field(default=".", exclude=True)  # directory of the config file

    @field_validator("peers", mode="before")
    @classmethod
    def _peers(cls, v):
        if not isinstance(v, dict) or not v:
            raise ValueError("a table of member id = \"host:port\" with at least this member")
        for pid in v:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", pid):
                raise ValueError(f"{pid!r} is not a valid member id (letters, digits, . _ -)")
        return {pid: {"address": e} if isinstance(e, str) else e for pid, e in v.items()}

    @model_validator(mode="after")
    def _consistent(self):
        me = self.member.id
        if me not in self.peers:
            raise ValueError(f"{_KEY}member.id{_KEY}{me!r} must be listed in [peers]")
        mine = self.peers[me]
        if mine.role != self.member.role and "role" in mine.model_fields_set:
            raise ValueError(f"{_KEY}peers.{me}.role{_KEY}disagrees with member.role")
        if self.member.role == "member":
            if self.topics is None:
                raise ValueError(f"{_KEY}topics.source{_KEY}required for a member (only a witness runs without Kafka)")
            if "bootstrap.servers" not in self.kafka.common() and "bootstrap.servers" not in self.kafka.consumer:
                raise ValueError(f"{_KEY}kafka.\"bootstrap.servers\"{_KEY}required for a member")
        if self.transport.tls is not None:
            for f in ("certfile", "keyfile", "cafile"):
                p = getattr(self.transport.tls, f)
                if p is not None and not self._path(p).is_file():
                    raise ValueError(f"{_KEY}transport.tls.{f}{_KEY}no such file {p!r}")
        if self.transport.secret_file is not None and not self._path(self.transport.secret_file).is_file():
            raise ValueError(f"{_KEY}transport.secret_file{_KEY}no such file {self.transport.secret_file!r}")
        self._distinct_addresses()
        k = self.shards()
        if k > 1:  # shard s listens on listen's port + s, and reaches every peer on its port + s
            for key, addr in [("member.listen", self.member.listen),
                              *((f"peers.{pid}", e.address) for pid, e in self.peers.items()),
                              *([("metrics.listen", self.metrics.listen)] if self.metrics.listen else [])]:
                if parse_address(addr)[1] + k - 1 > 65535:
                    raise ValueError(f"{_KEY}{key}{_KEY}port + shards - 1 is beyond 65535 (shard s uses port + s)")
        return self

    def _distinct_addresses(self) -> None:
        """Every member at its own address: two peers at one address, or a
        peer at this member's listen address, would dial the wrong member
        (with K shards, member ports p..p+K-1 must not overlap on one host)."""
        k = self.shards()

        def norm(addr: str) -> tuple[str, int]:
            host, port = parse_address(addr)
            return ("127.0.0.1" if host in ("localhost", "::1") else host.lower()), port

        taken: dict[tuple[str, int], tuple[str, int]] = {}  # (host, port) -> (member, shard using it)
        me = self.member.id
        entries = [(pid, e.address) for pid, e in sorted(self.peers.items())]
        for pid, addr in entries:
            host, port = norm(addr)
            for s in range(k):
                other = taken.get((host, port + s))
                if other is not None:
                    clash = ("the same address" if s == 0 == other[1] else
                             f"overlapping ports (shard s uses port + s, shards = {k})")
                    raise ValueError(f"{_KEY}peers.{pid}{_KEY}{addr!r}: {other[0]} and {pid} are at {clash}; "
                                     f"each member needs its own address")
                taken[(host, port + s)] = (pid, s)
        lhost, lport = norm(self.member.listen)
        # listening on every interface: this host is also loopback and the address the peers list for it
        mine = {lhost} if lhost not in ("0.0.0.0", "::") else {"127.0.0.1", norm(self.peers[me].address)[0]}
        for pid, addr in entries:
            host, port = norm(addr)
            if pid != me and abs(port - lport) < k and host in mine:
                raise ValueError(f"{_KEY}peers.{pid}{_KEY}{addr!r} is this member's own listen address "
                                 f"(member.listen = {self.member.listen!r}); each member needs its own address")

    # ------------------------------------------------------------ derived
    def shards(self) -> int:
        """K, the number of ordering groups of each topic ([topics] shards; 1 without [topics])."""
        return self.topics.shards if self.topics is not None else 1

    def served_shards(self) -> list[int]:
        """The shards this host runs ([topics] serve_shards, default all)."""
        return self.topics.served_shards() if self.topics is not None else [0]

    def for_shard(self, s: int) -> Config:
        """The config of shard s's member (K > 1): its listen port and every
        peer's port + s, its hard state in state_dir/shard-s, no metrics
        endpoint of its own (its worker serves one for all its shards)."""
        def shifted(addr: str) -> str:
            host, port = parse_address(addr)
            return f"{host}:{port + s}" if ":" not in host else f"[{host}]:{port + s}"

        return self.model_copy(update={
            "member": self.member.model_copy(update={"listen": shifted(self.member.listen), "state_dir": None}),
            "peers": {pid: e.model_copy(update={"address": shifted(e.address)}) for pid, e in self.peers.items()},
            "state_dir": str(self.state_path() / f"shard-{s}"),
            "metrics": MetricsSection(),
        })

    def _path(self, p: str) -> Path:
        q = Path(p).expanduser()
        return q if q.is_absolute() else Path(self.base_dir) / q

    def peer_addresses(self) -> dict[str, tuple[str, int]]:
        return {pid: parse_address(e.address) for pid, e in self.peers.items()}

    def roles(self) -> dict[str, str]:
        """Member ids with role "witness" (others are members)."""
        out = {pid: e.role for pid, e in self.peers.items() if e.role == "witness"}
        if self.member.role == "witness":
            out[self.member.id] = "witness"
        return out

    def member_ids(self) -> tuple[str, ...]:
        """All members in rank order (sorted ids, the same at every member)."""
        return tuple(sorted(self.peers))

    def secret_bytes(self) -> bytes | None:
        t = self.transport
        if t.secret is not None:
            return t.secret.encode()
        if t.secret_file is not None:
            return self._path(t.secret_file).read_bytes().strip()
        return None

    def state_path(self) -> Path:
        d = self.state_dir or self.member.state_dir or f".kdsync-state/{self.member.id}"
        return self._path(d)

    def resolved_tls(self):
        """TLS paths made absolute relative to the config file, or None."""
        t = self.transport.tls
        if t is None:
            return None
        return TLSSection(certfile=str(self._path(t.certfile)), keyfile=str(self._path(t.keyfile)),
                          cafile=str(self._path(t.cafile)) if t.cafile else None)


def _format(err: ValidationError, prefix: bool = True) -> str:
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"])
    msg = e["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if msg.startswith(_KEY):
        sub, _, msg = msg[1:].partition(_KEY)
        loc = f"{loc}.{sub}" if loc else sub
    if e["type"] == "extra_forbidden":
        msg = "unknown key"
    elif e["type"] == "missing":
        msg = "required key is missing"
    text = f"{loc}: {msg}" if loc else msg
    return f"config error: {text}" if prefix else text


def config_from_dict(data: dict, base_dir: str = ".") -> Config:
    """Validate a parsed config; raises ConfigError (one line)."""
    try:
        return Config.model_validate({**data, "base_dir": base_dir})
    except ValidationError as e:
        raise ConfigError(_format(e)) from None


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML config file; raises ConfigError (one line)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"config error: cannot read {str(path)!r}: {e.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config error: {path}: {e}") from None
    if "base_dir" in data:
        raise ConfigError("config error: base_dir: unknown key")
    return config_from_dict(data, base_dir=str(p.resolve().parent))


DERECHO_SYSTEM_CFG = "/etc/derecho/derecho.cfg"

# derecho.cfg [RDMA] provider -> transport.kind
_PROVIDERS = {"verbs": "rdma", "sockets": "tcp", "tcp": "tcp"}


def find_derecho_cfg(environ: dict[str, str] | None = None, cwd: str | os.PathLike[str] = ".",
                     system: str | os.PathLike[str] | None = None) -> Path:
    """The derecho.cfg of the original form: the file named by
    $DERECHO_CONF_FILE when it is set, else ``derecho.cfg`` in `cwd`, else
    `system` (default /etc/derecho/derecho.cfg).  Returns its path; raises
    ConfigError (one line naming every place searched) when there is none,
    or when $DERECHO_CONF_FILE names a file that does not exist."""
    env = os.environ if environ is None else environ
    named = env.get("DERECHO_CONF_FILE")
    if named:
        if not Path(named).is_file():
            raise ConfigError(f"config error: cannot read {named!r} (named by DERECHO_CONF_FILE): no such file")
        return Path(named).absolute()
    system = Path(DERECHO_SYSTEM_CFG if system is None else system)
    for candidate in (Path(cwd) / "derecho.cfg", system):
        if candidate.is_file():
            return candidate.absolute()
    raise ConfigError(f"config error: no derecho.cfg in the working directory nor {str(system)!r}, and "
                      f"DERECHO_CONF_FILE is not set (put derecho.cfg in one of them or use --config FILE)")


def legacy_config(n: int, brokers: str, topic: str, derecho_cfg: str | os.PathLike[str],
                  notes: list[tuple[str, dict]] | None = None) -> Config:
    """The original `kdsync run N BROKERS TOPIC` + derecho.cfg form (see
    module doc); returns the Config, raises ConfigError (one line).  What the
    member should log about the mapping (the transport chosen from
    ``[RDMA] provider``) is appended to `notes` as (message, fields)."""
    cp = configparser.ConfigParser(inline_comment_prefixes=("#", ";"))
    try:
        with open(derecho_cfg, encoding="utf-8") as f:
            cp.read_file(f)
    except OSError as e:
        raise ConfigError(f"config error: cannot read {str(derecho_cfg)!r}: {e.strerror} "
                          "(put derecho.cfg in the working directory or set DERECHO_CONF_FILE)") from None
    except configparser.Error as e:
        raise ConfigError(f"config error: {derecho_cfg}: {str(e).splitlines()[0]}") from None
    if not cp.has_section("DERECHO"):
        raise ConfigError(f"config error: {derecho_cfg}: missing [DERECHO] section")
    sec = cp["DERECHO"]

    def get(key: str, conv=str):
        if key not in sec:
            raise ConfigError(f"config error: DERECHO.{key}: required key is missing in {derecho_cfg}")
        try:
            return conv(sec[key].strip())
        except ValueError:
            raise ConfigError(f"config error: DERECHO.{key}: {sec[key]!r} is not a valid value") from None

    if n < 1:
        raise ConfigError("config error: N: the number of members must be at least 1")
    local_id = get("local_id", int)
    if not 0 <= local_id < n:
        raise ConfigError(f"config error: DERECHO.local_id: {local_id} is not in 0..{n - 1} (N = {n})")
    local_ip, gms_port = get("local_ip"), get("gms_port", int)
    leader_ip, leader_port = get("leader_ip"), get("leader_gms_port", int)
    if "members" in sec:
        addrs = [a.strip() for a in sec["members"].split(",") if a.strip()]
        if len(addrs) != n:
            raise ConfigError(f"config error: DERECHO.members: lists {len(addrs)} addresses but N = {n}")
    else:
        addrs = [f"{leader_ip}:{leader_port + i}" for i in range(n)]
    addrs[local_id] = f"{local_ip}:{gms_port}"
    provider = cp.get("RDMA", "provider", fallback="").strip()
    kind = _PROVIDERS.get(provider.lower(), None) if provider else "tcp"
    if kind is None:
        raise ConfigError(f"config error: RDMA.provider: {provider!r} in {derecho_cfg} is not supported "
                          f"(verbs -> rdma; sockets or tcp -> tcp)")
    if notes is not None:
        notes.append(("transport from derecho.cfg", {"file": str(derecho_cfg), "provider": provider or "-",
                                                     "transport": kind}))
    me = f"m{local_id}"
    data = {
        "member": {"id": me, "listen": f"{local_ip}:{gms_port}"},
        "peers": {f"m{i}": a for i, a in enumerate(addrs)},
        "kafka": {"bootstrap.servers": brokers},
        "topics": {"source": topic},
        "transport": {"kind": kind},
    }
    return config_from_dict(data, base_dir=str(Path(derecho_cfg).resolve().parent))
