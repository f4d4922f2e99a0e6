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


def _module_state(tree: ast.Module) -> list[str]:
    """Mutable state of a module: `global` statements, and module-level
    names bound to a dict / list / set (literal or call) other than ALL_CAPS
    tables and __all__."""
    bad = [f"global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for n in tree.body:
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        value = getattr(n, "value", None)
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict", "deque"))
        for t in targets:
            if mutable and isinstance(t, ast.Name) and t.id != "__all__" and not t.id.isupper():
                bad.append(f"{t.id} (line {n.lineno})")
    return bad


def test_core_keeps_no_module_level_state():
    """Two nodes in one process (the simulator's, the in-memory network's)
    share nothing through a module: no cache or counter at module level (a
    shared decode cache is an object the driver passes in)."""
    bad = [f"{f.name}: {b}" for f in _modules() for b in _module_state(ast.parse(f.read_text()))]
    assert not bad, bad
    assert _module_state(ast.parse("_cache: dict = {}\nTABLE = {1: 2}\ndef f():\n    global n\n")) == [
        "global n", "_cache (line 1)"]


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
