"""The group contract: the settings every member of a group must share.

Theory of operation.  Members are configured one file each, so two of them
can disagree: another protocol, another peer list, another source topic.
Such a member used to be let in, and one disagreement could stop the whole
group (a `clock` member in a `derecho` view: every peer dropped its messages
as malformed and nothing was ordered).  Kafka refuses a broker with another
cluster id, etcd a member with another cluster id; kdsync refuses a member
with another contract, at the door, before any ordering message.

`group_contract(cfg)` is the contract of one member's configuration: a flat
{setting: canonical value} of the group-wide settings (`GROUP_WIDE`, listed
in docs/config.md).  Every connection's handshake carries it (framing.py:
in the AUTH frames, after both sides proved the group secret, so a stranger
learns nothing of it), and `differences(mine, theirs)` names the settings
that differ with both values: the refusal's one line at both ends.  Settings
that are a member's own (its id, listen address, lead, Kafka client
settings, timeouts, state directory) are not in it.  A setting only one side
has (a witness has no source topics; an older release sends no contract at
all) is not compared.

The wire version range (`WIRE`) is the core message format a release speaks;
two members connect when their ranges overlap.  This release speaks 1..1
(the format of every earlier release).  `KDSYNC_TEST_WIRE=LO-HI` in the
environment makes a process claim another range: how the tests show that an
unknown version is refused with one line naming both.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kdsync.config import Config

__all__ = ["GROUP_WIDE", "WIRE", "Difference", "differences", "group_contract", "wire_overlap", "wire_range"]

WIRE = (1, 1)  # the core message formats this release reads and writes

# every setting of the contract, in the order a refusal names them
GROUP_WIDE = ("protocol.name", "protocol.commit_quorum", "protocol.quiesce", "members", "topics.source",
              "topics.global_suffix", "topics.shards", "topics.global_partitions", "shard")


class Difference(NamedTuple):
    setting: str
    mine: str
    theirs: str

    def __str__(self) -> str:
        return f"{self.setting} = {self.mine} here, {self.theirs} at the peer"


def wire_range() -> tuple[int, int]:
    """The wire version range this process speaks (`KDSYNC_TEST_WIRE` overrides it)."""
    forced = os.environ.get("KDSYNC_TEST_WIRE")
    if forced:
        lo, _, hi = forced.partition("-")
        return int(lo), int(hi or lo)
    return WIRE


def wire_overlap(mine: tuple[int, int], theirs: object) -> bool:
    """Whether a peer's announced range (a [lo, hi] list) overlaps `mine`;
    a malformed announcement does not."""
    if not (isinstance(theirs, (list, tuple)) and len(theirs) == 2 and all(type(x) is int for x in theirs)):
        return False
    return theirs[0] <= mine[1] and mine[0] <= theirs[1]


def show_wire(r: object) -> str:
    if isinstance(r, (list, tuple)) and len(r) == 2:
        return f"{r[0]}" if r[0] == r[1] else f"{r[0]}-{r[1]}"
    return repr(r)


def _source(src) -> str:
    if isinstance(src, str):
        return src
    if isinstance(src, list):
        return ",".join(sorted(src))
    return f"allow {src.allow!r}" + (f" deny {src.deny!r}" if src.deny else "")


def group_contract(cfg: Config, shard: int | None = None) -> dict[str, str]:
    """The group-wide settings of `cfg` as {setting: canonical value}
    (module doc).  `shard`: the shard this member orders (K > 1)."""
    p = cfg.protocol
    out = {
        "protocol.name": p.name,
        "protocol.commit_quorum": str(p.commit_quorum),
        "protocol.quiesce": str(p.quiesce).lower(),
        "members": ",".join(f"{m}" + ("(witness)" if cfg.roles().get(m) == "witness" else "")
                            for m in cfg.member_ids()),
    }
    t = cfg.topics
    if t is not None:
        out["topics.source"] = _source(t.source)
        out["topics.global_suffix"] = t.global_suffix
        out["topics.shards"] = str(t.shards)
        out["topics.global_partitions"] = str(t.partition_count())
    if shard is not None:
        out["shard"] = str(shard)
    return out


def differences(mine: dict[str, str], theirs: object) -> list[Difference]:
    """The settings on which a peer's contract differs from `mine`, in
    `GROUP_WIDE` order; settings only one side has are not compared.  A
    contract that is not a {str: str} table differs as a whole."""
    if not isinstance(theirs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in theirs.items()):
        return [Difference("contract", "a table of settings", "malformed")]
    order = {k: i for i, k in enumerate(GROUP_WIDE)}
    keys = sorted(set(mine) & set(theirs), key=lambda k: (order.get(k, len(order)), k))
    return [Difference(k, mine[k], theirs[k]) for k in keys if mine[k] != theirs[k]]


def describe(diffs: list[Difference]) -> str:
    """One line naming every differing setting and both values."""
    return "; ".join(str(d) for d in diffs)
