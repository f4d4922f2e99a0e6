"""`[topics] replication_factor`, `min_insync_replicas` and `[topics.config]`:
validation (one line naming the key), creation of the global topic with them
by a real `kdsync run` member on a real Tansu broker, read back with the admin
API, and the warning for an existing global topic with weaker settings.

What Tansu 0.6.0 (the embedded broker) does with them, found by these tests
and by hand: it stores every topic config it is given and returns exactly
those from DescribeConfigs (no defaults, no validation: an unknown key or a
non-numeric retention.ms is accepted); it reports a replication factor of N
as N replica entries all naming its single node, and -1 (the broker default)
as 1.  It does not enforce min.insync.replicas (acks=all succeeds with one
replica) and keeps records past retention.ms in memory storage.  So these
tests check what kdsync asks for and what the cluster reports, which is what a
real Kafka cluster would then enforce.  noida-db enforces the replication
factor as Kafka does (at most its one broker): on it, the member refuses to
start with one line.
"""

from __future__ import annotations

import subprocess
import textwrap
import time

import pytest

from kdsync.config import ConfigError, config_from_dict
from kdsync.kafka.embedded import EmbeddedCluster
from kdsync.kafka.topic import ensure_topic, partition_count, topic_settings, weaker_settings

from helpers import member_command, refused_start, solo_config


def _cfg(topics: dict):
    return config_from_dict({"member": {"id": "dc1", "listen": "127.0.0.1:7401"}, "peers": {"dc1": "127.0.0.1:7401"},
                             "kafka": {"bootstrap.servers": "127.0.0.1:9092"}, "topics": {"source": "t", **topics}})


def test_defaults_send_nothing():
    t = _cfg({}).topics
    assert t.replication_factor is None and t.min_insync_replicas is None and t.config == {}
    assert t.global_topic_config() == {}


def test_settings_become_topic_configs():
    t = _cfg({"replication_factor": 3, "min_insync_replicas": 2,
              "config": {"retention.ms": 604800000, "cleanup.policy": "delete", "unclean.leader.election.enable": False}}).topics
    assert t.replication_factor == 3
    assert t.global_topic_config() == {"min.insync.replicas": "2", "retention.ms": "604800000",
                                       "cleanup.policy": "delete", "unclean.leader.election.enable": "false"}


@pytest.mark.parametrize("topics,expected", [
    ({"replication_factor": 0}, "config error: topics.replication_factor: Input should be greater than or equal to 1"),
    ({"min_insync_replicas": "two"}, "config error: topics.min_insync_replicas: Input should be a valid integer"),
    ({"replication_factor": 2, "min_insync_replicas": 3},
     "config error: topics.min_insync_replicas: 3 is more than replication_factor = 2: no write could ever succeed"),
    ({"min_insync_replicas": 2, "config": {"min.insync.replicas": 2}},
     'config error: topics.config."min.insync.replicas": set min_insync_replicas or config."min.insync.replicas", '
     'not both'),
    ({"config": {"retention.ms": [1]}},
     'config error: topics.config."retention.ms": a topic config value must be a string, number or boolean'),
    ({"config": {"Retention MS": 1}},
     'config error: topics.config."Retention MS": not a topic config name (lower-case letters, digits, . _ -)'),
    ({"config": "retention.ms=1"}, "config error: topics.config: must be a table of topic configs"),
])
def test_bad_settings_are_one_line_naming_the_key(topics, expected):
    with pytest.raises(ConfigError) as e:
        _cfg(topics)
    assert str(e.value).startswith(expected), str(e.value)
    assert "\n" not in str(e.value)


def test_bad_settings_in_a_file_exit_2(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text(textwrap.dedent("""
        [member]
        id = "dc1"
        listen = "127.0.0.1:7401"
        [peers]
        dc1 = "127.0.0.1:7401"
        [kafka]
        "bootstrap.servers" = "127.0.0.1:9092"
        [topics]
        source = "t"
        [topics.config]
        "retention.ms" = { days = 7 }
    """))
    r = subprocess.run(member_command(p), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == ('config error: topics.config."retention.ms": a topic config value must be a string, '
                                'number or boolean')


def test_weaker_settings_phrases():
    assert weaker_settings(3, {"min.insync.replicas": "2"}, 3, {"min.insync.replicas": "2"}) == []
    assert weaker_settings(1, {"min.insync.replicas": "1", "retention.ms": "1000"}, 3,
                           {"min.insync.replicas": "2", "retention.ms": "604800000", "cleanup.policy": "delete"}) == [
        "replication factor 1 < 3", "cleanup.policy not set (asked delete)", "min.insync.replicas 1 < 2",
        "retention.ms = 1000 (asked 604800000)"]
    assert weaker_settings(3, {"min.insync.replicas": "3"}, None, {"min.insync.replicas": "2"}) == []  # stronger


# ---------------------------------------------------------------- real broker, real member
def _run_solo_until_ready(tmp_path, bootstrap: str, source: str, topics_extra: str = "",
                          timeout: float = 60.0) -> str:
    """Create `source`, run a solo member on it (its config with `topics_extra`
    after [topics]) until its log says "topic ready", stop it (SIGTERM),
    return the log."""
    ensure_topic(bootstrap, source)
    cfg = solo_config(tmp_path / f"{source}.toml", bootstrap, source, topics_extra,
                      state_dir=tmp_path / f"state-{source}")
    log_path, what = tmp_path / f"{source}.log", "topic ready"
    with open(log_path, "wb") as log:
        p = subprocess.Popen(member_command(cfg), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while what not in log_path.read_text():
            assert p.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"no {what!r} within {timeout}s:\n{log_path.read_text()}"
            time.sleep(0.1)
    finally:
        p.terminate()
        assert p.wait(30) == 0, log_path.read_text()
    return log_path.read_text()


# what the orders and audit members ask for of their global topics
ASKED = textwrap.dedent("""\
    replication_factor = 3
    min_insync_replicas = 2
    [topics.config]
    "retention.ms" = 604800000
    """)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_member_creates_the_global_topic_with_the_settings_and_warns_about_weaker_ones(tmp_path):
    with EmbeddedCluster("settings", log_dir=tmp_path) as c:
        log = _run_solo_until_ready(tmp_path, c.bootstrap, "orders", ASKED + textwrap.dedent("""\
            "cleanup.policy" = "delete"
            "message.timestamp.type" = "LogAppendTime"
            """))
        assert "weaker" not in log
        rf, configs = topic_settings(c.bootstrap, "orders-global")
        assert rf == 3
        assert configs == {"min.insync.replicas": "2", "retention.ms": "604800000", "cleanup.policy": "delete",
                           "message.timestamp.type": "LogAppendTime"}

        # without settings: nothing is sent, the broker's defaults apply (Tansu: one replica, no configs)
        _run_solo_until_ready(tmp_path, c.bootstrap, "plain")
        assert topic_settings(c.bootstrap, "plain-global") == (1, {})

        # an existing global topic with weaker settings: kept as it is, one WARNING line says what is weaker
        ensure_topic(c.bootstrap, "audit-global", replication_factor=1, config={"min.insync.replicas": "1"})
        log = _run_solo_until_ready(tmp_path, c.bootstrap, "audit", ASKED)
        warn = [line for line in log.splitlines() if "weaker settings" in line]
        assert len(warn) == 1, log
        assert "level=warning" in warn[0] and "topic=audit-global" in warn[0]
        assert ('weaker="replication factor 1 < 3; min.insync.replicas 1 < 2; retention.ms not set '
                '(asked 604800000)"') in warn[0]
        assert topic_settings(c.bootstrap, "audit-global") == (1, {"min.insync.replicas": "1"})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_replication_factor_the_cluster_cannot_hold_stops_the_member_with_one_line(tmp_path):
    """noida, like a real Kafka cluster, refuses a replication factor above
    its broker count (Tansu accepts it and reports N replicas on its one
    node, above): the member stops at start, exit 1, one line naming the
    topic, what was asked and the broker's reason; nothing half made."""
    with EmbeddedCluster("one-broker", log_dir=tmp_path, broker="noida") as c:
        ensure_topic(c.bootstrap, "orders")
        cfg = solo_config(tmp_path / "orders.toml", c.bootstrap, "orders", ASKED)
        line, _ = refused_start(cfg, timeout=60)
        assert line.startswith("kdsync run: topics: creating orders-global (replication_factor=3, "), line
        assert "replication factor of 3 cannot be reached because only 1 broker(s) are registered" in line, line
        assert partition_count(c.bootstrap, "orders-global") == 0


def test_ensure_topics_makes_hundreds_at_once_and_warns_once_per_weaker_existing_topic(tmp_path, caplog):
    """A member with many source topics ensures their global and checkpoint
    topics in one batch (issue 26): every missing one created with its spec,
    existing ones left as they are (their own partition count returned), one
    WARNING per existing topic with weaker settings."""
    from kdsync.kafka.topic import TopicSpec, ensure_topics

    with EmbeddedCluster("dc1", log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "old-0", partitions=3)
        ensure_topic(c.bootstrap, "old-1", replication_factor=1, config={"min.insync.replicas": "1"})
        specs = [TopicSpec(f"new-{i:03d}", 2, 2, {"cleanup.policy": "compact"}) for i in range(300)]
        specs += [TopicSpec("old-0", 1), TopicSpec("old-1", 1, 2, {"min.insync.replicas": "2"}), specs[0]]
        with caplog.at_level("WARNING", logger="kdsync.kafka.topic"):
            have = ensure_topics(c.bootstrap, specs, timeout=30)
        assert len(have) == 302
        assert all(have[f"new-{i:03d}"] == 2 for i in range(300)) and have["old-0"] == 3 and have["old-1"] == 1
        assert topic_settings(c.bootstrap, "new-299") == (2, {"cleanup.policy": "compact"})
        warn = [r.getMessage() for r in caplog.records if "weaker settings" in r.getMessage()]
        assert len(warn) == 1 and caplog.records[-1].kv["topic"] == "old-1", warn
        # again: everything exists, nothing created, the same one warning
        caplog.clear()
        with caplog.at_level("WARNING", logger="kdsync.kafka.topic"):
            assert ensure_topics(c.bootstrap, specs, timeout=30) == have
        assert len([r for r in caplog.records if "weaker settings" in r.getMessage()]) == 1, [(r.getMessage(), getattr(r, "kv", None)) for r in caplog.records]


def test_empty_topics_finds_the_topics_that_never_held_a_record(tmp_path):
    """The start of a thousand new topics skips reading each one
    (kdsync.pipeline.prepare_topics): empty_topics asks ListOffsets for every
    partition at once, LIST_AT_ONCE per request.  A topic holding one
    multi-record batch (Tansu then reports too low an end) or one record in
    one partition of several is not empty."""
    from confluent_kafka import Producer

    from kdsync.kafka import topic as kt
    from kdsync.kafka.topic import TopicSpec, empty_topics, ensure_topics

    with EmbeddedCluster("dc1", log_dir=tmp_path) as c:
        specs = [TopicSpec(f"t-{i:03d}", 3) for i in range(250)]  # 750 partitions: two requests
        ensure_topics(c.bootstrap, specs, timeout=30)
        p = Producer({"bootstrap.servers": c.bootstrap, "linger.ms": 50})
        for k in range(5):  # one batch of five records
            p.produce("t-007", value=b"x", partition=0)
        p.produce("t-123", value=b"y", partition=2)
        assert p.flush(30) == 0
        parts = {s.name: 3 for s in specs}
        assert kt.LIST_AT_ONCE < 750
        empty = empty_topics(c.bootstrap, parts, timeout=30)
        assert empty == set(parts) - {"t-007", "t-123"}
