"""Checks of infra/ that can run here: shell syntax, shellcheck, the
generated kdsync configs, and `vagrant validate` (the VMs themselves need
VirtualBox or libvirt, which CI does not have)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kdsync.config import load_config
from tool_helpers import ensure_tool as _ensure_tool

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
SCRIPTS = sorted(INFRA.rglob("*.sh"))
SITES = "dc1=192.168.56.11:7401:member,dc2=192.168.56.12:7401:member,dc3=192.168.56.13:7401:member,arb=192.168.56.14:7401:witness"


def test_infra_has_the_scripts():
    names = {p.relative_to(INFRA).as_posix() for p in SCRIPTS}
    for want in (
        "rdma-vm/run-tests.sh",
        "rdma-vm/build-image.sh",
        "rdma-vm/guest-init.sh",
        "rdma-vm/guest-boot.sh",
        "vagrant/bench.sh",
        "vagrant/provision/base.sh",
        "vagrant/provision/kafka.sh",
        "vagrant/provision/netem.sh",
        "vagrant/provision/kdsync.sh",
        "vagrant/provision/gen-config.sh",
    ):
        assert want in names
    assert (INFRA / "vagrant" / "Vagrantfile").is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(INFRA).as_posix())
def test_shell_syntax(script):
    shell = "sh" if script.read_text().startswith("#!/bin/sh") else "bash"
    r = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.timeout(900)
def test_shellcheck():
    shellcheck = _ensure_tool("shellcheck", "shellcheck")
    r = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("site,ip,role", [("dc2", "192.168.56.12", "member"), ("arb", "192.168.56.14", "witness")])
def test_generated_config_is_valid(tmp_path, site, ip, role):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    r = subprocess.run(
        ["bash", str(INFRA / "vagrant/provision/gen-config.sh"), site, ip, role, SITES, "derecho", "auto", str(secret), str(tmp_path / "state")],
        capture_output=True,
        text=True,
        check=True,
    )
    path = tmp_path / f"{site}.toml"
    path.write_text(r.stdout)
    cfg = load_config(path)
    assert cfg.member.id == site and cfg.member.role == role
    assert cfg.member.listen == f"{ip}:7401"
    assert sorted(cfg.peer_addresses()) == ["arb", "dc1", "dc2", "dc3"]
    assert cfg.roles() == {"arb": "witness"}
    assert cfg.transport.kind == "auto"


def test_netem_rejects_a_bad_delay(tmp_path):
    # Fails on input validation before touching tc (the address is on no interface here either way).
    r = subprocess.run(["bash", str(INFRA / "vagrant/provision/netem.sh"), "203.0.113.7", "10.0.0.1=fast"], capture_output=True, text=True)
    assert r.returncode != 0


@pytest.mark.timeout(900)
def test_vagrant_validate(tmp_path):
    vagrant = _ensure_tool("vagrant", "vagrant")
    env = dict(os.environ, VAGRANT_HOME=str(tmp_path / "vagrant.d"), KDSYNC_SECRET="validate-only", VAGRANT_CHECKPOINT_DISABLE="1")
    # No VirtualBox/libvirt here: validate everything but the provider blocks.
    r = subprocess.run(
        [vagrant, "validate", "--ignore-provider"], cwd=INFRA / "vagrant", capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0 and "validated successfully" in r.stdout, r.stdout + r.stderr
    bad = dict(env, KDSYNC_DELAYS="dc1-dc9=10")
    r = subprocess.run([vagrant, "validate", "--ignore-provider"], cwd=INFRA / "vagrant", capture_output=True, text=True, env=bad, timeout=300)
    assert r.returncode != 0 and "KDSYNC_DELAYS" in (r.stdout + r.stderr)
