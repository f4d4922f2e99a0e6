"""kdsync/core stays free of I/O and of hidden randomness (STYLE.md §2)."""

import ast
import pathlib

CORE = pathlib.Path(__file__).resolve().parents[2] / "kdsync" / "core"
BANNED = {"socket", "asyncio", "time", "threading", "simpy", "confluent_kafka", "selectors", "multiprocessing", "os", "subprocess"}
RANDOM_FUNCS = {"random", "randrange", "randint", "choice", "shuffle", "sample", "uniform", "getrandbits", "seed", "gauss"}


def _modules():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 6
    return files


def test_core_imports_no_io():
    bad = []
    for f in _modules():
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Import):
                mods = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module:
                mods = [n.module]
            else:
                continue
            bad += [f"{f.name} imports {m}" for m in mods if m.split(".")[0] in BANNED]
    assert not bad, bad


def test_core_uses_only_injected_randomness():
    bad = []
    for f in _modules():
        tree = ast.parse(f.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module == "random":
                bad += [f"{f.name}: from random import {a.name}" for a in n.names if a.name != "Random"]
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name):
                if n.func.value.id == "random" and n.func.attr in RANDOM_FUNCS:
                    bad.append(f"{f.name}:{n.lineno} calls random.{n.func.attr}")
    assert not bad, bad


def test_protocol_modules_explain_themselves():
    for name in ("derecho.py", "mirror.py", "sequencer.py", "base.py"):
        doc = ast.get_docstring(ast.parse((CORE / name).read_text()))
        assert doc and "Theory of operation" in doc, name


def test_purity_check_catches_a_violation(tmp_path):
    # the walker itself must flag an import of socket
    tree = ast.parse("import socket\nfrom asyncio import sleep\n")
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(found) == 2


def test_every_variant_is_an_ordering_node():
    import random

    from kdsync.core import NodeConfig, OrderingNode, make_node

    for protocol in ("derecho", "sequencer", "mirror"):
        node = make_node(NodeConfig("a", ("a", "b", "c"), protocol=protocol), rng=random.Random(1))
        assert isinstance(node, OrderingNode), protocol
