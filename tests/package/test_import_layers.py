"""Imports between pdserve's folders run one way.

Every module under src/pdserve is parsed (not imported), and each import of
`pdserve.*`, at module level or inside a function, is mapped to the top-level
folder it names (`scheduler`, `roles`, ...; the root modules `config`,
`client` and `llm` count as themselves). The folders must form no cycle, and
a few explicit rules hold: the planner imports nothing of pdserve, the engine
neither the router nor the deployment, the router neither the engine nor the
model code (text/ is its torch-free side), and the CLI and the benchmarks
sit on top.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "pdserve"

# Folder (or root module) -> the folders it must not import.
FORBIDDEN = {
    "scheduler": "*",   # the pure planner: no other pdserve folder
    "engine": {"router", "cluster", "sim", "cli", "config", "benchmarks"},
    "router": {"engine", "kernels", "cluster", "sim", "cli", "benchmarks"},
    "text": "*",        # tokenizers, chat, detokenizing, sampling parameters: no torch
}
ONLY_IMPORTED_BY = {
    "cli": {"cli"},
    "benchmarks": {"cli", "benchmarks"},
}

def _unit(module: str) -> str | None:
    """`pdserve.scheduler.plan` -> `scheduler`; `pdserve.config` -> `config`;
    `pdserve` itself (the package's __init__) -> None."""
    parts = module.split(".")
    if parts[0] != "pdserve" or len(parts) < 2:
        return None
    return parts[1]


def _is_module(name: str) -> bool:
    return (PKG / f"{name}.py").is_file() or (PKG / name / "__init__.py").is_file()


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every pdserve module `path` imports, with the line, resolving relative
    imports against the file's own package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = _module_name(path).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:      # relative: `from ..kernels import x`, `from . import x`
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "pdserve":    # `from pdserve import config` names a module;
                # `from pdserve import LLM` an attribute of the package's __init__
                found += [(f"pdserve.{a.name}" if _is_module(a.name) else "pdserve", node.lineno)
                          for a in node.names]
            else:
                found.append((mod, node.lineno))
    return [(m, line) for m, line in found if m == "pdserve" or m.startswith("pdserve.")]


def _unit_of_file(path: Path) -> str | None:
    rel = path.relative_to(PKG)
    if len(rel.parts) == 1:
        return None if rel.name == "__init__.py" else rel.stem
    return rel.parts[0]


@functools.cache
def _edges() -> dict[tuple[str, str], list[tuple[str, int, str]]]:
    """(from folder, to folder) -> [(file, line, imported module)]."""
    edges: dict[tuple[str, str], list[tuple[str, int, str]]] = defaultdict(list)
    for path in sorted(PKG.rglob("*.py")):
        src = _unit_of_file(path)
        if src is None:
            continue
        rel = str(path.relative_to(PKG.parents[1]))
        for mod, line in _imports(path):
            dst = _unit(mod)
            if dst is not None and dst != src:
                edges[(src, dst)].append((rel, line, mod))
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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


def _evidence(edges, src: str, dst: str) -> str:
    return "; ".join(f"{f}:{line} imports {mod}" for f, line, mod in edges[(src, dst)])


def test_the_walk_sees_the_package():
    edges = _edges()
    units = {u for pair in edges for u in pair}
    # the walk found the folders and the imports it is meant to judge
    assert {"scheduler", "kernels", "transfer", "engine", "router", "cluster", "sim", "cli",
            "benchmarks", "config"} <= units
    assert ("cli", "benchmarks") in edges
    assert not units - {p.stem for p in PKG.iterdir() if _is_module(p.stem)}, "not a module"
    # a relative import and `from pdserve import x` resolve to their folder
    assert _unit("pdserve.scheduler.plan") == "scheduler" and _unit("pdserve.config") == "config"


def test_no_cycle_between_folders():
    edges = _edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst in edges:
        graph[src].add(dst)
    problems = []
    for comp in _cycles(graph):
        inside = sorted((s, d) for s in comp for d in graph[s] if d in comp)
        problems.append(f"cycle between {', '.join(comp)}:\n" + "\n".join(
            f"  {s} -> {d}: {_evidence(edges, s, d)}" for s, d in inside))
    assert not problems, "\n".join(problems)


def test_explicit_layer_rules():
    edges = _edges()
    bad = []
    for (src, dst), where in sorted(edges.items()):
        forbidden = FORBIDDEN.get(src, set())
        why = None
        if forbidden == "*" or dst in forbidden:
            why = f"{src} must not import {dst}"
        elif dst in ONLY_IMPORTED_BY and src not in ONLY_IMPORTED_BY[dst]:
            why = f"only {', '.join(sorted(ONLY_IMPORTED_BY[dst]))} may import {dst}"
        if why is None:
            continue
        for w in where:
            bad.append(f"{why}: {w[0]}:{w[1]} imports {w[2]}")
    assert not bad, "\n".join(bad)


@functools.cache
def _file_graph() -> dict[str, set[str]]:
    """module -> the pdserve modules it imports (at module level, inside a
    function or under TYPE_CHECKING alike; a package's __init__ counts as
    the package)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in modules.items():
        for imported, _ in _imports(path):
            if imported in modules and imported != mod and not imported.endswith("_pb2"):
                graph[mod].add(imported)
    return graph


# Circles between files still to be broken (issue 52), each a set of modules.
# The list only shrinks: a new circle fails, and so does one that is gone
# but still listed.
KNOWN_FILE_CIRCLES: set[frozenset[str]] = set()


def test_no_new_circle_between_files():
    found = {frozenset(c) for c in _cycles(_file_graph())}
    assert not found - KNOWN_FILE_CIRCLES, f"new circles: {found - KNOWN_FILE_CIRCLES}"
    assert not KNOWN_FILE_CIRCLES - found, \
        f"broken, so take them off KNOWN_FILE_CIRCLES: {KNOWN_FILE_CIRCLES - found}"


def test_the_http_front_and_the_text_side_load_no_torch():
    """The router's process tokenizes and renders chats through text/, so
    importing its HTTP front loads neither torch nor a model family."""
    code = ("import sys, pdserve.router.http_api, pdserve.text.tokenizer, pdserve.text.chat, "
            "pdserve.text.detokenize, pdserve.text.sampling_params\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pdserve.kernels')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


# Nothing in the package reads outside it at run time: no sys.path edits, no
# paths climbed out of the package with parents[...] / parent.parent.
_PATH_HACKS = re.compile(r"sys\.path\b|\.parents\[|\.parent\.parent\b")


def test_no_path_hacks_in_the_package():
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PATH_HACKS.search(code):
                hits.append(f"{path.relative_to(PKG.parents[1])}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
