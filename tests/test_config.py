"""Config loading: the spec's minimal TOML, every optional section, one-line
errors naming the key, and the original positional form with derecho.cfg."""

import subprocess
import sys
import textwrap

import pytest

import kdsync.config
from kdsync.config import ConfigError, find_derecho_cfg, legacy_config, load_config

MINIMAL = """
[member]
id = "dc1"
listen = "127.0.0.1:7401"

[peers]
dc1 = "127.0.0.1:7401"
dc2 = "127.0.0.1:7402"
dc3 = "127.0.0.1:7403"

[kafka]
"bootstrap.servers" = "127.0.0.1:9092"

[topics]
source = "test"
global_suffix = "-global"
"""


def write(tmp_path, text, name="kdsync.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_minimal_spec_config(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.member.id == "dc1" and cfg.member.role == "member"
    assert cfg.member_ids() == ("dc1", "dc2", "dc3")
    assert cfg.peer_addresses()["dc2"] == ("127.0.0.1", 7402)
    assert cfg.topics.global_topic("test") == "test-global"
    assert cfg.kafka.consumer_conf() == {"bootstrap.servers": "127.0.0.1:9092"}
    assert cfg.kafka.trust_read_committed is False  # the broker is probed; not a librdkafka property
    assert "trust_read_committed" not in load_config(write(tmp_path, MINIMAL.replace(
        '"bootstrap.servers" = "127.0.0.1:9092"', '"bootstrap.servers" = "127.0.0.1:9092"\ntrust_read_committed = true'),
        "t.toml")).kafka.producer_conf()
    assert cfg.protocol.name == "derecho" and cfg.transport.kind == "auto"
    assert cfg.secret_bytes() is None and cfg.metrics.listen is None
    assert cfg.state_path() == tmp_path / ".kdsync-state" / "dc1"


def test_optional_sections(tmp_path):
    (tmp_path / "secret").write_text("s3cret\n")
    for f in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / f).write_text("x")
    cfg = load_config(write(tmp_path, MINIMAL.replace('dc3 = "127.0.0.1:7403"', 'arb = { address = "127.0.0.1:7409", role = "witness" }')
                            .replace('source = "test"', 'source = { allow = "^app-", deny = "-tmp$" }\nglobal_partitions = 4') + """
state_dir = "st"
[kafka.consumer]
"fetch.wait.max.ms" = 5
[kafka.producer]
"linger.ms" = 2
"enable.idempotence" = true
[transport]
kind = "tcp"
secret_file = "secret"
tls = { certfile = "c.pem", keyfile = "k.pem", cafile = "ca.pem" }
[protocol]
name = "mirror"
tick_ms = 5
suspect_ms = 100
[metrics]
listen = "127.0.0.1:9464"
""".replace("state_dir = \"st\"\n", "").replace("[kafka.consumer]", "[kafka.consumer]") ))
    assert cfg.roles() == {"arb": "witness"}
    assert cfg.kafka.consumer_conf()["fetch.wait.max.ms"] == 5
    assert cfg.kafka.producer_conf() == {"bootstrap.servers": "127.0.0.1:9092", "linger.ms": 2, "enable.idempotence": True}
    assert cfg.secret_bytes() == b"s3cret"
    assert cfg.resolved_tls().cafile == str(tmp_path / "ca.pem")
    assert cfg.protocol.ticks(cfg.protocol.suspect_ms) == 20
    assert cfg.topics.matches("app-orders") and not cfg.topics.matches("app-x-tmp")
    assert not cfg.topics.matches("app-orders-global") and not cfg.topics.matches("other")
    assert cfg.topics.global_partitions == 4


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t + '\n[peers.dc9]\naddress = "nohost"\n', None),
    (lambda t: t.replace('dc3 = "127.0.0.1:7403"', 'dc3 = "127.0.0.1:99999"'), "config error: peers.dc3.address: port 99999 out of range 1..65535"),
    (lambda t: t.replace('id = "dc1"', 'id = "dc7"'), "config error: member.id: 'dc7' must be listed in [peers]"),
    (lambda t: t.replace('source = "test"', 'source = "bad name"'), "config error: topics.source: 'bad name' is not a valid Kafka topic name"),
    (lambda t: t.replace('source = "test"', 'source = { allow = "(" }'), None),
    (lambda t: t + '\n[protocol]\nname = "paxos"\n', None),
    (lambda t: t + '\n[protocol]\ntick_ms = -1\n', None),
    (lambda t: t + '\n[bogus]\nx = 1\n', "config error: bogus: unknown key"),
    (lambda t: t.replace('"bootstrap.servers" = "127.0.0.1:9092"', '"bootstrap.servers" = "127.0.0.1:9092"\n"x.y" = [1]'),
     "config error: kafka.x.y: librdkafka property must be a string, number or boolean"),
    (lambda t: t.replace('[kafka]\n"bootstrap.servers" = "127.0.0.1:9092"', ''), None),
    (lambda t: t.replace('"bootstrap.servers" = "127.0.0.1:9092"', '"bootstrap.servers" = "127.0.0.1:9092"\n'
                                                                    'trust_read_committed = "yes"'),
     "config error: kafka.trust_read_committed: must be true or false, got 'yes'"),
    (lambda t: t.replace('"bootstrap.servers" = "127.0.0.1:9092"', '"bootstrap.servers" = "127.0.0.1:9092"\n'
                                                                    '"isolation.level" = "read_uncommitted"'),
     "config error: kafka.\"isolation.level\": 'read_uncommitted': kdsync reads its source read_committed "
     "(aborted records never enter the order); leave it out"),
    (lambda t: t + '\n[kafka.consumer]\n"isolation.level" = "read_uncommitted"\n',
     "config error: kafka.consumer.\"isolation.level\": 'read_uncommitted': kdsync reads its source "
     "read_committed (aborted records never enter the order); leave it out"),
    (lambda t: t + '\n[transport]\nsecret = "a"\nsecret_file = "b"\n', None),
    (lambda t: t + '\n[transport]\ntls = { certfile = "missing.pem", keyfile = "k" }\n', "config error: transport.tls.certfile: no such file 'missing.pem'"),
    (lambda t: t + "\n[[[", None),
])
def test_bad_config_is_one_line_naming_the_key(tmp_path, edit, expected):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, edit(MINIMAL)))
    msg = str(ei.value)
    assert msg.startswith("config error: ") and "\n" not in msg
    if expected:
        assert msg == expected


def test_key_named_in_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^config error: peers\.dc9\.address: "):
        load_config(write(tmp_path, MINIMAL + '\n[peers.dc9]\naddress = "nohost"\n'))
    with pytest.raises(ConfigError, match=r"^config error: protocol\.name: "):
        load_config(write(tmp_path, MINIMAL + '\n[protocol]\nname = "paxos"\n'))
    with pytest.raises(ConfigError, match=r"kafka.*bootstrap\.servers"):
        load_config(write(tmp_path, MINIMAL.replace('"bootstrap.servers" = "127.0.0.1:9092"', '')))
    with pytest.raises(ConfigError, match=r"cannot read"):
        load_config(tmp_path / "nope.toml")


def test_witness_needs_no_kafka(tmp_path):
    cfg = load_config(write(tmp_path, """
        [member]
        id = "arb"
        listen = "127.0.0.1:7409"
        role = "witness"
        [peers]
        dc1 = "127.0.0.1:7401"
        arb = "127.0.0.1:7409"
        """))
    assert cfg.roles() == {"arb": "witness"} and cfg.topics is None


DERECHO_CFG = """
[DERECHO]
leader_ip = 127.0.0.1
leader_gms_port = 23580
local_id = 2
local_ip = 127.0.0.1
gms_port = 23590
"""


def test_legacy_positional_form(tmp_path):
    p = write(tmp_path, DERECHO_CFG, "derecho.cfg")
    cfg = legacy_config(3, "127.0.0.1:9092", "test", p)
    assert cfg.member.id == "m2" and cfg.member.listen == "127.0.0.1:23590"
    assert cfg.peer_addresses() == {"m0": ("127.0.0.1", 23580), "m1": ("127.0.0.1", 23581), "m2": ("127.0.0.1", 23590)}
    assert cfg.kafka.common()["bootstrap.servers"] == "127.0.0.1:9092" and cfg.topics.source == "test"
    p2 = write(tmp_path, DERECHO_CFG + "members = 10.0.0.1:1, 10.0.0.2:2, 10.0.0.3:3\n", "d2.cfg")
    assert legacy_config(3, "b:1", "t", p2).peer_addresses()["m1"] == ("10.0.0.2", 2)
    with pytest.raises(ConfigError, match=r"DERECHO\.local_id: 2 is not in 0\.\.1"):
        legacy_config(2, "b:1", "t", p)
    with pytest.raises(ConfigError, match=r"DERECHO\.gms_port"):
        legacy_config(3, "b:1", "t", write(tmp_path, DERECHO_CFG.replace("gms_port = 23590", ""), "d3.cfg"))
    with pytest.raises(ConfigError, match="DERECHO_CONF_FILE"):
        legacy_config(3, "b:1", "t", tmp_path / "missing.cfg")


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    p = write(tmp_path, MINIMAL.replace('id = "dc1"', 'id = "dc7"'))
    r = subprocess.run([sys.executable, "-m", "kdsync.cli", "run", "--config", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "config error: member.id: 'dc7' must be listed in [peers]"
    r = subprocess.run([sys.executable, "-m", "kdsync.cli", "run", "3", "127.0.0.1:1", "t"], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "DERECHO_CONF_FILE": str(tmp_path / "none.cfg")})
    assert r.returncode == 2 and "DERECHO_CONF_FILE" in r.stderr and "Traceback" not in r.stderr


def test_derecho_cfg_search_order(tmp_path):
    """$DERECHO_CONF_FILE, then ./derecho.cfg, then /etc/derecho/derecho.cfg
    (here a stand-in path: tests never write to /etc)."""
    cwd, etc = tmp_path / "cwd", tmp_path / "etc" / "derecho.cfg"
    cwd.mkdir()
    etc.parent.mkdir()
    named = write(tmp_path, DERECHO_CFG, "named.cfg")
    with pytest.raises(ConfigError, match=r"^config error: no derecho.cfg in the working directory nor '.*/etc/"
                                          r"derecho.cfg', and DERECHO_CONF_FILE is not set"):
        find_derecho_cfg({}, cwd, etc)
    etc.write_text(DERECHO_CFG)
    assert find_derecho_cfg({}, cwd, etc) == etc
    (cwd / "derecho.cfg").write_text(DERECHO_CFG)
    assert find_derecho_cfg({}, cwd, etc) == cwd / "derecho.cfg"
    assert find_derecho_cfg({"DERECHO_CONF_FILE": str(named)}, cwd, etc) == named
    with pytest.raises(ConfigError, match=r"cannot read '.*/none.cfg' \(named by DERECHO_CONF_FILE\)"):
        find_derecho_cfg({"DERECHO_CONF_FILE": str(tmp_path / "none.cfg")}, cwd, etc)
    assert kdsync.config.DERECHO_SYSTEM_CFG == "/etc/derecho/derecho.cfg"


@pytest.mark.parametrize("section, kind", [("", "tcp"), ("[RDMA]\nprovider = verbs\n", "rdma"),
                                           ("[RDMA]\nprovider = sockets\n", "tcp"),
                                           ("[RDMA]\nprovider = TCP\n", "tcp"), ("[RDMA]\ndomain = eth0\n", "tcp")])
def test_rdma_provider_picks_the_transport(tmp_path, section, kind):
    notes = []
    cfg = legacy_config(3, "b:1", "t", write(tmp_path, DERECHO_CFG + section, "derecho.cfg"), notes)
    assert cfg.transport.kind == kind
    (msg, fields), = notes
    assert msg == "transport from derecho.cfg" and fields["transport"] == kind
    assert fields["provider"] == (section.split("= ")[1].strip() if "provider" in section else "-")


def test_unknown_rdma_provider_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^config error: RDMA.provider: 'psm2' in .*derecho.cfg is not supported "
                                          r"\(verbs -> rdma; sockets or tcp -> tcp\)$"):
        legacy_config(3, "b:1", "t", write(tmp_path, DERECHO_CFG + "[RDMA]\nprovider = psm2\n", "derecho.cfg"))


def test_checkpoint_and_kafka_log_keys(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "[checkpoint]\ninterval_ms = 2000\npositions = 50\n"
                            "[log]\nkafka_interval_ms = 0\n"))
    assert (cfg.checkpoint.interval_ms, cfg.checkpoint.positions, cfg.log.kafka_interval_ms) == (2000, 50, 0)
    d = load_config(write(tmp_path, MINIMAL, "d.toml"))
    assert (d.checkpoint.interval_ms, d.checkpoint.positions, d.log.kafka_interval_ms) == (10000, 100000, 5000)
    with pytest.raises(ConfigError, match="^config error: checkpoint.interval_ms: Input should be greater than or "
                                          "equal to 100$"):
        load_config(write(tmp_path, MINIMAL + "[checkpoint]\ninterval_ms = 5\n", "e.toml"))


def test_protocol_timing_defaults_keep_an_idle_member_cheap():
    """Issue 9: a tick every 50 ms and a heartbeat every 100 ms by default (an
    idle member's CPU is mostly ticks and heartbeats), suspicion after 5
    heartbeats, retransmission within a few ticks."""
    from kdsync.config import ProtocolSection

    p = ProtocolSection()
    assert (p.tick_ms, p.heartbeat_ms, p.suspect_ms, p.retransmit_ms) == (50, 100, 500, 50)
    assert (p.ticks(p.heartbeat_ms), p.ticks(p.suspect_ms), p.ticks(p.retransmit_ms)) == (2, 10, 1)


def test_clock_ticks_every_5_ms_unless_told_otherwise(tmp_path):
    """Issue 42 (no hand tuning): `clock` reports every tick while a slot
    waits and acknowledges far slots with the next tick's reports, so its
    own default tick is 5 ms (docs/wan.md: 12.6 -> 7.3 peer messages per
    event over five regions); a tick_ms that is set is kept, and the other
    protocols keep 50 ms."""
    from kdsync.config import CLOCK_TICK_MS, TICK_MS

    def tick(extra: str) -> float:
        return load_config(write(tmp_path, MINIMAL + "[protocol]\n" + extra, "p.toml")).protocol.tick_ms

    assert tick('name = "clock"\n') == CLOCK_TICK_MS == 5
    assert tick('name = "clock"\ntick_ms = 50\n') == 50
    assert tick('name = "derecho"\n') == tick("") == TICK_MS == 50
    c = load_config(write(tmp_path, MINIMAL + '[protocol]\nname = "clock"\n', "c.toml")).protocol
    assert (c.ticks(c.heartbeat_ms), c.ticks(c.suspect_ms)) == (20, 100)  # the same times, in 5 ms ticks
