"""docs/ is the user's reference: these checks keep it from drifting silently.

Every key of the member config (the pydantic models), every scenario key,
every metric a member exports and every option of every command is in the
docs, with the config defaults on the key's row; relative links resolve; and
nothing outside tests/ points users at the internal specs (shared/specs),
which they never get."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from kdsync.config import Config, KafkaSection, PeerEntry, TopicFilter
from tool_helpers import kdsync_metrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP_DIRS = {".git", ".venv", "tests", "__pycache__", ".pytest_cache", ".hypothesis", "build", ".benchmarks",
             "node_modules"}


def _text_files():
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts) or not p.is_file():
            continue
        try:
            yield rel, p.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary


def test_nothing_outside_tests_points_at_shared_specs():
    bad = []
    for rel, text in _text_files():
        for n, line in enumerate(text.splitlines(), 1):
            if "shared/specs" in line or re.search(r"(?<![\w/])interfaces\.md", line):
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "point at docs/ instead:\n" + "\n".join(bad)


def _config_keys(model: type[BaseModel], prefix: str):
    """(dotted key, default or None) of every field users can set, recursively."""
    for name, f in model.model_fields.items():
        if f.exclude:
            continue  # internal (base_dir)
        key = f"{prefix}{name}"
        default = None if f.is_required() or f.default_factory is not None else f.default
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield f"[{key}]", None  # a section: a heading, then its keys
        else:
            yield key, default
        if getattr(ann, "__origin__", None) is dict:
            continue  # peers: documented as peers.<id>
        subs = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        for sub in subs:
            if sub is KafkaSection:
                continue  # free-form librdkafka properties, documented as kafka.<property>
            yield from _config_keys(sub, key + ".")


def _all_config_keys():
    keys = list(_config_keys(Config, ""))
    keys += [(f"topics.source.{k}", d) for k, d in _config_keys(TopicFilter, "")]  # source = { allow, deny }
    keys += [(f"peers.<id>.{k}", d) for k, d in _config_keys(PeerEntry, "")]  # peers.<id> = { address, role }
    keys += [("peers.<id>", None), ("kafka.<property>", None)]
    keys += [(f"kafka.{k}", None) for k in ("consumer", "producer")]
    keys += [(f"kafka.{k}", f.default) for k, f in KafkaSection.model_fields.items() if k not in ("consumer", "producer")]
    return keys


def test_every_config_key_is_documented_with_its_default():
    text = (DOCS / "config.md").read_text().split("## The original form")[0]  # then derecho.cfg keys
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `([^`]+)` \|", line)
        if m:
            rows[m.group(1)] = line
    missing = []
    for key, default in _all_config_keys():
        if key == "peers":
            continue  # the section itself; its entries are peers.<id>
        if key.startswith("["):
            assert f"## `{key}`" in text, f"docs/config.md has no heading for section {key}"
            continue
        if key not in rows and f"## `[{key}]`" not in text:  # an optional section: its heading
            missing.append(key)
            continue
        if key not in rows:
            continue
        if default is not None:
            shown = (f'"{default}"' if isinstance(default, str) else str(default).lower() if isinstance(default, bool)
                     else str(default))  # as TOML writes it
            cell = rows[key].split("|")[2]  # the default column
            assert re.search(rf"`{re.escape(shown)}`", cell), f"docs/config.md: {key} default is {shown}, not {cell}"
    assert not missing, f"config keys missing from docs/config.md: {missing}"
    assert "topics.replication_factor" in rows and "broker's default" in rows["topics.replication_factor"]
    # and the docs name no key the models do not have
    known = {k for k, _ in _all_config_keys()}
    for key in rows:
        assert key in known or key in ("peers",), f"docs/config.md documents unknown key {key}"


def test_every_scenario_key_is_documented():
    from sim.scenario import ExpectSpec, FaultSpec, KafkaSpec, LinkSpec, MemberCostSpec, MemberSpec, Scenario, WorkloadSpec

    text = (DOCS / "scenario.md").read_text()
    want = [f"`{n}" for n in Scenario.model_fields]  # a key, or the first part of its sub-keys
    want += [f"`members[].{n}`" for n in MemberSpec.model_fields]
    want += [f"`kafka.{n}`" for n in KafkaSpec.model_fields]
    want += [f"`workload[].{n}`" for n in WorkloadSpec.model_fields if n not in ("start_s", "stop_s", "at_s")]
    want += [f"`faults[].{(f.alias or n)}`" for n, f in FaultSpec.model_fields.items()]
    want += [f"`expect.{n}`" for n in ExpectSpec.model_fields]
    want += [f"`member_cost.{n}`" for n in MemberCostSpec.model_fields]
    want += [f"link `{n}`" for n in LinkSpec.model_fields]
    want += ["`network.default`", "`network.links`", "`start_s`", "`stop_s`", "`at_s`"]
    missing = [w for w in want if w not in text]
    assert not missing, f"scenario keys missing from docs/scenario.md: {missing}"


def test_every_metric_is_documented_with_its_labels():
    text = (DOCS / "metrics.md").read_text()
    for name, (kind, samples) in kdsync_metrics().items():
        shown = name + "_total" if kind == "counter" else name
        row = next((line for line in text.splitlines() if line.startswith(f"| `{shown}` |")), None)
        assert row is not None, f"{shown} missing from docs/metrics.md"
        assert f"| {kind} |" in row, (shown, kind)


def _labels():
    """Label names of every family, from a scrape-like collection."""
    from types import SimpleNamespace

    from kdsync.observability.metrics import MemberMetrics

    peer = SimpleNamespace(bytes_in=1, bytes_out=1, frames_in=1, frames_out=1, connected=True, refused=0, refusals={})
    m = MemberMetrics(peers=lambda: {"dc2": peer}, cores=lambda: {"t": {"delivered": 1}})
    m.view_id.labels("t").set(1)
    m.live_members.labels("t").set(1)
    m.set_status("t", "active")
    m.delivered.labels("t").set(1)
    m.input_lag.labels("t", "0").set(1)
    m.latency.labels("t").observe(0.1)
    m.consumed.labels("t").inc()
    m.written.labels("t").inc()
    m.bad_messages.labels("dc2").inc()
    out = {}
    for fam in m.registry.collect():
        for s in fam.samples:
            out.setdefault(fam.name, set()).update(k for k in s.labels if k != "le")
    return out


def test_metric_labels_in_docs_match():
    text = (DOCS / "metrics.md").read_text()
    for name, labels in _labels().items():
        row = next(line for line in text.splitlines() if re.match(rf"\| `{name}(_total)?` \|", line))
        documented = set(re.findall(r"`(\w+)`", row.split("|")[3]))
        assert documented == labels, (name, documented, labels)


COMMANDS = [["run"], ["demo"], ["audit"], ["archive"], ["compact"], ["restore"], ["offsets", "sync"],
            ["offsets", "translate"], ["check"], ["status"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_every_option_is_documented(cmd):
    text = (DOCS / "commands.md").read_text()
    r = subprocess.run([sys.executable, "-m", "kdsync.cli", *cmd, "--help"], capture_output=True, text=True,
                       timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", r.stdout)) - {"--help"}
    assert options, r.stdout
    missing = [o for o in sorted(options) if f"`{o}" not in text]
    assert not missing, f"kdsync {' '.join(cmd)}: options missing from docs/commands.md: {missing}"
    assert f"kdsync {' '.join(cmd)}" in text


@pytest.mark.parametrize("cmd", [["run"], ["swarm"], ["calibrate"]])
def test_every_sim_option_is_documented(cmd):
    text = (DOCS / "commands.md").read_text()
    r = subprocess.run([sys.executable, "-m", "sim.cli", *cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for o in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", r.stdout)) - {"--help"}):
        assert f"`{o}" in text, o


def test_relative_links_resolve():
    for md in list(DOCS.glob("*.md")) + [ROOT / "README.md"]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target:
                continue
            assert (md.parent / target).exists(), f"{md.relative_to(ROOT)} links to missing {target}"
