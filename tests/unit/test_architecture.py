"""The architecture, checked from the source text (no library import): layers without cycles, small modules,
one place that reads the environment, a launcher the library never imports, lines of at most 120 characters.

Each check is a pure function over a folder, so the tests below also run it on a planted bad tree to show it
really detects what it claims to.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = "procgroup"
MAX_MODULE_LINES = 800
MAX_LINE = 120
#: the modules allowed to read the environment: the contract table and the launcher-identity mapping
ENV_READERS = {"procgroup.config", "procgroup.identity"}
ENV_GETTERS = {"env_str", "env_int", "env_float", "env_bool", "env_micros"}


def modules(src: Path, pkg: str = PKG) -> Dict[str, Path]:
    """Dotted module name -> file, for every .py file under ``src/pkg`` (``__init__`` kept as ``pkg.__init__``)."""
    out = {}
    for p in sorted((src / pkg).rglob("*.py")):
        out[".".join(p.relative_to(src).with_suffix("").parts)] = p
    return out


def _resolve(mods: Dict[str, Path], name: str) -> str | None:
    if name in mods:
        return name
    if name + ".__init__" in mods:
        return name + ".__init__"
    return None


def _import_targets(cur: str, node: ast.AST, mods: Dict[str, Path], pkg: str) -> List[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == pkg]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        parts = cur.split(".")[:-1]  # the module's package (for pkg.__init__ the package itself)
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != pkg:
        return []
    return [f"{base}.{a.name}" if _resolve(mods, f"{base}.{a.name}") else base for a in node.names]


def import_graph(src: Path, pkg: str = PKG) -> Dict[str, Set[str]]:
    """Edges module -> imported modules of the package: every import, also those inside functions.

    Package ``__init__`` modules are left out: they are re-export facades (lazy ones, here), and an edge
    through a facade is not a dependency between layers.
    """
    mods = modules(src, pkg)
    graph: Dict[str, Set[str]] = {}
    for m, p in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _import_targets(m, node, mods, pkg):
                    k = _resolve(mods, t)
                    if k and k != m:
                        edges.add(k)
        graph[m] = edges
    keep = {m for m in graph if not m.endswith(".__init__")}
    return {m: {t for t in e if t in keep} for m, e in graph.items() if m in keep}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on: Set[str] = set()
    stack: List[str] = []
    out: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: List[Tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def long_modules(src: Path, limit: int = MAX_MODULE_LINES) -> List[str]:
    return [
        f"{p.relative_to(src)} ({n} lines)"
        for p in sorted(src.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > limit
    ]


def long_c_sources(src: Path, limit: int = MAX_MODULE_LINES) -> List[str]:
    """The C sources and headers (the optional extensions) over ``limit`` lines: the same house rule as modules."""
    return [
        f"{p.relative_to(src)} ({n} lines)"
        for p in sorted(q for q in src.rglob("*") if q.suffix in (".c", ".h"))
        if (n := len(p.read_text().splitlines())) > limit
    ]


def long_lines(src: Path, limit: int = MAX_LINE) -> List[str]:
    out = []
    for p in sorted(src.rglob("*.py")):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if len(line) > limit:
                out.append(f"{p.relative_to(src)}:{i} ({len(line)} characters)")
    return out


def _is_os_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def environment_reads(src: Path, pkg: str = PKG) -> List[str]:
    """Places outside ENV_READERS that read the environment: ``os.environ[...]`` loads, ``os.environ.get``,
    ``os.getenv``, and the config getters called with ``os.environ`` or with no mapping (their default is the
    process environment).  Writing a child's environment (a copy, ``os.environ.copy()``, or a store into it)
    is not a read."""
    out = []
    for m, p in modules(src, pkg).items():
        if m in ENV_READERS:
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            where = f"{p.relative_to(src)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Subscript) and _is_os_environ(node.value) and isinstance(node.ctx, ast.Load):
                out.append(f"{where} os.environ[...]")
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Attribute) and f.attr == "get" and _is_os_environ(f.value):
                    out.append(f"{where} os.environ.get")
                elif (
                    isinstance(f, ast.Attribute)
                    and f.attr == "getenv"
                    and isinstance(f.value, ast.Name)
                    and f.value.id == "os"
                ):
                    out.append(f"{where} os.getenv")
                else:
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                    if name in ENV_GETTERS:
                        mapping = (
                            node.args[1]
                            if len(node.args) > 1
                            else next((k.value for k in node.keywords if k.arg == "environ"), None)
                        )
                        if mapping is None or _is_os_environ(mapping):
                            out.append(f"{where} {name}() on the process environment")
    return out


def proc_reads(src: Path, pkg: str = PKG) -> List[str]:
    """String literals naming a ``/proc`` path outside ``procgroup.procfs`` (docstrings are not code)."""
    out = []
    for m, p in modules(src, pkg).items():
        if m == f"{pkg}.procfs":
            continue
        tree = ast.parse(p.read_text(), str(p))
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if node.value.startswith("/proc") or "/proc/" in node.value.split(" ")[0]:
                    out.append(f"{p.relative_to(src)}:{node.lineno} {node.value!r}")
    return out


def launcher_imports(src: Path, pkg: str = PKG) -> List[str]:
    """Library modules that import the launcher (only the launcher itself and ``__main__`` may)."""
    graph = {}
    mods = modules(src, pkg)
    for m, p in mods.items():
        if m.startswith(f"{pkg}.launcher") or m == f"{pkg}.__main__":
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _import_targets(m, node, mods, pkg):
                    if t == f"{pkg}.launcher" or t.startswith(f"{pkg}.launcher."):
                        graph.setdefault(m, []).append(t)
    return [f"{m} imports {', '.join(sorted(set(ts)))}" for m, ts in sorted(graph.items())]


# ------------------------------------------------------------------------------------------------ the real tree
def test_no_import_cycles():
    found = cycles(import_graph(SRC))
    assert not found, "import cycles in src/procgroup (every import counts, also inside functions):\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_no_module_over_800_lines():
    found = long_modules(SRC)
    assert not found, f"modules over {MAX_MODULE_LINES} lines: split them along their seams:\n" + "\n".join(found)


def test_no_c_source_over_800_lines():
    found = long_c_sources(SRC)
    assert not found, (
        f"C sources over {MAX_MODULE_LINES} lines: split them by topic (one extension may build from several files "
        "sharing a private header, as transport/shm/_native*.c and _native.h; list them in setup.py):\n"
        + "\n".join(found)
    )


def test_only_config_and_identity_read_the_environment():
    found = environment_reads(SRC)
    assert not found, (
        "the environment is read outside procgroup.config / procgroup.identity; parse it once there "
        "(RuntimeConfig, or a getter with an explicit mapping) and pass the value down:\n" + "\n".join(found)
    )


def test_only_procfs_reads_proc():
    found = proc_reads(SRC)
    assert not found, "/proc is read outside procgroup.procfs; add a function there and call it:\n" + "\n".join(found)


def test_the_library_never_imports_the_launcher():
    found = launcher_imports(SRC)
    assert not found, "the launcher sits beside the library and is never imported by it:\n" + "\n".join(found)


def test_lines_at_most_120_characters():
    found = long_lines(SRC)
    assert not found, f"{len(found)} lines over {MAX_LINE} characters:\n" + "\n".join(found[:50])


# ------------------------------------------------------------------------------- each check on a planted tree
def _plant(tmp_path: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / PKG / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


def test_checks_find_what_is_planted(tmp_path):
    src = _plant(
        tmp_path,
        {
            "__init__.py": "from . import a\n",
            "a.py": "from .b import x\n",
            "b.py": "def f():\n    from . import c\n",  # inside a function: still an edge
            "c.py": "import procgroup.a\nimport os\nv = os.environ['X']\nw = os.environ.get('Y')\nz = os.getenv('Z')\n",
            "d.py": "from .config import env_str\nimport os\nq = env_str('A')\nr = env_str('B', os.environ)\n"
            "s = env_str('C', {})\nenv = dict(os.environ)\nos.environ['W'] = '1'\n",
            "config.py": "import os\nx = os.environ.get('OK')\n",
            "f.py": '"""Reads /proc/stat in the docstring only."""\nP = "/proc/self/status"\n',
            "launcher/__init__.py": "",
            "launcher/cli.py": "from ..a import x\n",
            "e.py": "from .launcher import cli\n" + "y = 1\n" * 801 + "# " + "x" * 130 + "\n",
            "ext/_big.c": "int x;\n" * 801,
            "ext/_big.h": "int y;\n" * 800,  # at the limit: allowed
        },
    )
    assert cycles(import_graph(src)) == [["procgroup.a", "procgroup.b", "procgroup.c"]]
    reads = environment_reads(src)
    assert [r.split(" ", 1)[1] for r in reads if r.startswith("procgroup/c.py")] == [
        "os.environ[...]",
        "os.environ.get",
        "os.getenv",
    ]
    assert sorted(r.split(":")[1].split(" ")[0] for r in reads if r.startswith("procgroup/d.py")) == ["3", "4"]
    assert not any(r.startswith("procgroup/config.py") for r in reads)
    assert launcher_imports(src) == ["procgroup.e imports procgroup.launcher.cli"]
    assert proc_reads(src) == ["procgroup/f.py:2 '/proc/self/status'"]
    assert long_modules(src) == ["procgroup/e.py (803 lines)"]
    assert long_lines(src) == ["procgroup/e.py:803 (132 characters)"]
    assert long_c_sources(src) == ["procgroup/ext/_big.c (801 lines)"]


def test_checks_pass_a_clean_tree(tmp_path):
    src = _plant(
        tmp_path,
        {
            "__init__.py": "from .a import x\n",
            "a.py": "from .b import y\nx = y\n",
            "b.py": "y = 1\n",
            "launcher/cli.py": "from ..a import x\n",
            "_small.c": "int x;\n" * 800,
        },
    )
    assert cycles(import_graph(src)) == []
    assert environment_reads(src) == launcher_imports(src) == long_modules(src) == long_lines(src) == []
    assert long_c_sources(src) == []
    assert proc_reads(src) == []


@pytest.mark.parametrize("n", [2, 3, 7])
def test_cycle_finder_on_rings(n):
    g = {f"m{i}": {f"m{(i + 1) % n}"} for i in range(n)}
    g["tail"] = {"m0"}
    assert cycles(g) == [sorted(f"m{i}" for i in range(n))]
