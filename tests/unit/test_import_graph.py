"""The library's import graph has no cycles (imports inside functions count), and dist.group is torch's class."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import procgroup

PKG_DIR = os.path.dirname(procgroup.__file__)
#: beside the library and never imported by it: checked by their own owners
OUTSIDE = ("procgroup.launcher", "procgroup.bench")


def _modules() -> Dict[str, str]:
    mods = {}
    for dp, _, fs in os.walk(PKG_DIR):
        for f in fs:
            if f.endswith(".py"):
                p = os.path.join(dp, f)
                rel = os.path.relpath(p, os.path.dirname(PKG_DIR))[:-3].replace(os.sep, ".")
                mods[rel] = p
    return mods


def _graph() -> Dict[str, Set[str]]:
    mods = _modules()

    def node(name: str) -> str:
        return name if name in mods else (name + ".__init__" if name + ".__init__" in mods else "")

    graph: Dict[str, Set[str]] = {}
    for m, p in mods.items():
        edges: Set[str] = set()
        with open(p) as fh:
            tree = ast.parse(fh.read())
        for n in ast.walk(tree):
            targets: List[str] = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = m.split(".")[:-1]
                if n.level:
                    base = base[: len(base) - (n.level - 1)]
                    mod = ".".join(base + ([n.module] if n.module else []))
                else:
                    mod = n.module or ""
                targets = [f"{mod}.{a.name}" if node(f"{mod}.{a.name}") else mod for a in n.names]
            for t in targets:
                k = node(t)
                if k and k != m:
                    edges.add(k)
        graph[m] = edges
    keep = {m for m in graph if not m.endswith("__init__") and not m.startswith(OUTSIDE)}
    return {m: {t for t in e if t in keep} for m, e in graph.items() if m in keep}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_in_the_library():
    graph = _graph()
    assert "procgroup.api" in graph and "procgroup.process_group" in graph
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_dist_group_is_torchs_class_not_a_module():
    import procgroup as dist

    assert isinstance(dist.group, type) and dist.group.WORLD is dist.GroupMember.WORLD
    assert not os.path.exists(os.path.join(PKG_DIR, "group.py"))
