"""`kdsync check` and `kdsync status`: the operator's view of a group.

`kdsync check --config FILE` answers "would this member's group form?"
before (or while) it runs: the file is validated (exit 2 when it is not),
the member's brokers are reached (topics present, the ACLs the member needs
where the broker reports them), and every peer is probed — dialed at its
address, the group secret proved under this member's id and the group
contract compared (kdsync.contract; the peer answers and closes: a probe is
never taken for the member's link).  One line per finding; exit 0 only when
the group would form: no contract differs, the brokers answer, and a
majority of the members (this one included) are reachable and agree.

`kdsync status --config FILE` asks the running member itself, at its own
listen address with the same kind of probe, where it stands (kdsync.status):
per topic the view, each member's link path and refusals, the last durable
position, what each stage holds, stalls and the last Kafka client error.
`--json` prints the snapshot for scripts.  Exit 0 when every topic is
active and every peer linked, 1 otherwise (also when the member does not
answer), 2 on a bad config.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Annotated

import typer

from kdsync.cli_style import UsageError, new_app

__all__ = ["app", "check", "status"]

app = new_app()

_Config = Annotated[str, typer.Option("--config", "-c", metavar="FILE", help="the member's TOML configuration file")]
_Timeout = Annotated[float, typer.Option("--timeout", min=0.1, help="seconds to wait for each broker or peer")]


@dataclass(frozen=True)
class Finding:
    level: str  # ok | note | warning | error
    text: str

    def __str__(self) -> str:
        return f"{self.level}: {self.text}"


def _load(path: str):
    from kdsync.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        raise UsageError(str(e), prefix=False) from None


def _configs(cfg) -> list[tuple[int | None, object]]:
    """(shard, config) of every ordering group this host runs."""
    if cfg.shards() == 1:
        return [(None, cfg)]
    return [(s, cfg.for_shard(s)) for s in cfg.served_shards()]


def _tls(cfg):
    from kdsync.transport import TLSSettings

    t = cfg.resolved_tls()
    return TLSSettings(t.certfile, t.keyfile, t.cafile) if t else None


def _local(cfg, shard):
    from kdsync.contract import group_contract
    from kdsync.transport.handshake import Local

    return Local(group_contract(cfg, shard), listen=cfg.member.listen)


def _dial_address(addr: str) -> tuple[str, int]:
    from kdsync.config import parse_address

    host, port = parse_address(addr)
    return ("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host), port


def _running(cfg) -> int | None:
    """The pid of the process running this member here (its state directory's
    lock, or its supervisor's with --workers), if any."""
    from kdsync.state import StateDirLock

    return (StateDirLock(cfg.state_path()).held_by_other()
            or StateDirLock(cfg.state_path(), "supervisor.lock").held_by_other())


# ---------------------------------------------------------------- kdsync check
def check_kafka(cfg, timeout: float) -> list[Finding]:
    """The member's brokers: reachable, its source topics there, its global
    topics' partitions, the ACLs it needs (where the broker reports them)."""
    from confluent_kafka import KafkaException, TopicCollection
    from confluent_kafka.admin import AclOperation, AdminClient

    from kdsync.kafka.topic import admin_conf

    conf = {**admin_conf(cfg.kafka.consumer_conf()), "logger": _quiet_logger()}
    bootstrap = conf.get("bootstrap.servers")
    try:
        admin = AdminClient(conf)
        md = admin.list_topics(timeout=timeout)
    except KafkaException as e:
        return [Finding("error", f"kafka: cannot reach bootstrap.servers {bootstrap}: {e.args[0].str()}")]
    out = [Finding("ok", f"kafka: {bootstrap} answers ({len(md.brokers)} broker(s))")]
    t = cfg.topics
    names = t.fixed_names()
    present = sorted(n for n in md.topics if t.matches(n))
    if names is not None:
        for n in names:
            if n not in md.topics:
                out.append(Finding("warning", f"kafka: source topic {n!r} does not exist yet (the member waits "
                                              f"for it)"))
    else:
        out.append(Finding("ok" if present else "warning",
                           f"kafka: {len(present)} topic(s) match the source pattern" +
                           ("" if present else " (the member waits for one)")))
    want = t.partition_count()
    for n in present:
        g = md.topics.get(t.global_topic(n))
        if g is not None and len(g.partitions) != want:
            out.append(Finding("error", f"kafka: global topic {t.global_topic(n)!r} has {len(g.partitions)} "
                                        f"partition(s), the config wants {want} (topics.global_partitions / shards)"))
    if not present:
        return out
    try:
        fut = admin.describe_topics(TopicCollection(present[:50]), request_timeout=timeout,
                                    include_authorized_operations=True)
        ops = {n: f.result().authorized_operations for n, f in fut.items()}
    except Exception as e:  # a broker without DescribeTopics' authorized operations
        return out + [Finding("note", f"kafka: ACLs not checked ({str(e).splitlines()[0][:120]})")]
    if all(o is None for o in ops.values()):
        return out + [Finding("note", "kafka: ACLs not checked (the broker does not report authorized operations)")]
    for n, o in ops.items():
        names_ok = {x.name for x in (o or [])}
        if o is not None and not names_ok & {AclOperation.READ.name, AclOperation.ALL.name}:
            out.append(Finding("error", f"kafka: not allowed to READ source topic {n!r}"))
    return out


def _quiet_logger():
    import logging

    lg = logging.getLogger("kdsync.check.kafka")
    lg.addHandler(logging.NullHandler())
    lg.propagate = False
    return lg


async def _probe_peer(cfg, shard, peer: str, timeout: float) -> tuple[Finding, bool]:
    """One peer: (the finding, whether it is reachable and agrees)."""
    from kdsync.contract import show_wire
    from kdsync.transport import TransportError
    from kdsync.transport.handshake import ContractError, HandshakeError
    from kdsync.transport.tcp import probe

    addr = _dial_address(cfg.peers[peer].address)
    where = f"{peer} at {addr[0]}:{addr[1]}" + ("" if shard is None else f" (shard {shard})")
    local = _local(cfg, shard)
    try:
        res = await probe(addr, cfg.member.id, peer, cfg.secret_bytes(), local, "check", tls=_tls(cfg),
                          timeout=timeout)
    except ContractError as e:
        return Finding("error", f"peer {where}: {e}"), False
    except HandshakeError as e:
        return Finding("error", f"peer {where}: refused: {e}"), False
    except (TransportError, asyncio.TimeoutError, OSError) as e:
        return Finding("warning", f"peer {where}: not reachable ({e or 'timed out'})"), False
    if res.contract is None:
        return Finding("warning", f"peer {where}: reachable, an older release: its group contract is not "
                                  f"compared"), True
    return Finding("ok", f"peer {where}: agrees (protocol {res.contract.get('protocol.name')}, wire "
                         f"{show_wire(list(local.wire))})"), True


async def check_peers(cfg, shard, timeout: float) -> list[Finding]:
    others = [p for p in cfg.member_ids() if p != cfg.member.id]
    results = await asyncio.gather(*(_probe_peer(cfg, shard, p, timeout) for p in others))
    out = [f for f, _ in results]
    agree = 1 + sum(ok for _, ok in results)
    n = len(others) + 1
    if agree * 2 > n:
        out.append(Finding("ok", f"group: {agree} of {n} members reachable and agreeing (a majority)"))
    else:
        out.append(Finding("error", f"group: only {agree} of {n} members reachable and agreeing; a majority is "
                                    f"needed for the group to form"))
    return out


def check(path: str, timeout: float = 5.0) -> tuple[int, list[Finding]]:
    """`kdsync check`: (exit code, findings)."""
    cfg = _load(path)
    found = [Finding("ok", f"config: {path} is valid (member {cfg.member.id}, protocol {cfg.protocol.name}, "
                           f"{len(cfg.peers)} members)")]
    holder = _running(cfg)
    found.append(Finding("note", f"state: member {cfg.member.id} is running here (pid {holder})" if holder else
                         f"state: no member runs on {cfg.state_path()} now"))
    if cfg.member.role == "member":
        found += check_kafka(cfg, timeout)
    for shard, c in _configs(cfg):
        found += asyncio.run(check_peers(c, shard, timeout))
    return (1 if any(f.level == "error" for f in found) else 0), found


@app.command("check", help="Check a member's configuration, brokers and peers: would the group form? "
                           "One line per finding; exit 0 when it would, 1 on a finding, 2 on a bad config.")
def _check_cmd(config: _Config, timeout: _Timeout = 5.0) -> int:
    code, found = check(config, timeout)
    for f in found:
        print(f)
    return code


# ---------------------------------------------------------------- kdsync status
async def _ask(cfg, shard, timeout: float) -> dict:
    from kdsync.transport import TransportError
    from kdsync.transport.handshake import HandshakeError
    from kdsync.transport.tcp import probe

    me = cfg.member.id
    addr = _dial_address(cfg.member.listen)
    try:
        res = await probe(addr, me, me, cfg.secret_bytes(), _local(cfg, shard), "status", tls=_tls(cfg),
                          timeout=timeout)
    except HandshakeError as e:
        return {"member": me, "shard": shard, "error": f"its listen address {addr[0]}:{addr[1]} refused: {e}"}
    except (TransportError, asyncio.TimeoutError, OSError) as e:
        holder = _running(cfg)
        why = (f"running (pid {holder}) but not answering at {addr[0]}:{addr[1]} ({e or 'timed out'})" if holder
               else f"not running (nothing answers at {addr[0]}:{addr[1]})")
        return {"member": me, "shard": shard, "error": why}
    return res.status if res.status is not None else {"member": me, "shard": shard, "error": "no status answered"}


def status(path: str, timeout: float = 5.0) -> tuple[int, list[dict]]:
    """`kdsync status`: (exit code, one snapshot per shard this host runs)."""
    from kdsync.status import problems

    cfg = _load(path)
    snaps = [asyncio.run(_ask(c, shard, timeout)) for shard, c in _configs(cfg)]
    return (1 if any(problems(s) for s in snaps) else 0), snaps


@app.command("status", help="Where the group stands as this member sees it: per topic the view, each member's "
                            "link, the last durable position, what each stage holds, stalls and refusals. "
                            "Exit 0 when every topic is active and every peer linked, 1 otherwise, 2 bad config.")
def _status_cmd(config: _Config,
                as_json: Annotated[bool, typer.Option("--json", help="print the snapshot as JSON")] = False,
                timeout: _Timeout = 5.0) -> int:
    from kdsync.status import problems, render

    code, snaps = status(config, timeout)
    if as_json:
        print(json.dumps({"healthy": code == 0, "problems": [p for s in snaps for p in problems(s)],
                          "members": snaps}, indent=2))
    else:
        print(render(snaps))
    return code
