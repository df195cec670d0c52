"""troupe's sub-packages import each other without cycles and only downwards (read with `ast`;
nothing is imported).

A node is one sub-package (runtime, sync, compress, strategies, cluster, singa, script,
bench, ...) or one top-level module (distopt, graphstep, cli, util, and ``troupe`` for the
package's own ``__init__``). Every import counts, also one inside a function (a lazy import
hides a cycle from Python, not from the design); only imports under ``if TYPE_CHECKING:``
are left out, since they never run. Cycles inside one sub-package (runtime.comm <->
runtime.launch) are allowed. `LAYERS` orders the nodes: each imports only from layers
below its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = SRC / "troupe"
KNOWN_PACKAGES = ("runtime", "sync", "compress", "strategies", "cluster", "observe", "reliability", "bench",
                  "launcher", "partition", "algorithms", "singa", "script", "sharding")
LAYERS = (
    ("__main__",),
    ("cli",),
    ("bench", "launcher"),  # the command's workers: troupe bench's harness; troupe run's plan, ranks, restarts
    ("troupe",),  # the facade: troupe.DistOpt, troupe.data, ... each loaded on first use
    ("distopt", "partition", "script", "algorithms", "sharding"),  # what a training script calls
    ("cluster",),
    ("singa",),  # below cluster: cluster's configuration reads SINGA's job files through singa.jobfile
    ("graphstep",),  # graph mode's option list is the regime table's
    ("strategies",),
    ("sync", "reliability"),
    ("compress", "runtime"),
    ("observe", "util"),
)
"""Every node, top layer first: a node imports only from the layers below its own."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Is `name` (troupe.a.b) a module or package in the source tree?"""
    rel = Path(*name.split("."))
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def node_of(name: str) -> str:
    """The graph node a troupe module belongs to: its sub-package, or itself at the top level."""
    parts = name.split(".")
    if len(parts) == 1:
        return "troupe"
    return parts[1]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import statements inside ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for inner in node.body:
                    skip.update(id(n) for n in ast.walk(inner))
    return skip


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """The troupe modules the file at `path` imports at run time, with line numbers."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_in(source: str, me: str, is_package: bool) -> list[tuple[str, int]]:
    """The troupe modules that module `me` (with this `source`) imports at run time."""
    package = me if is_package else me.rpartition(".")[0]
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "troupe"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "troupe":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # `from troupe.x import y`: y is a submodule, or a name defined in troupe.x
                out.append((sub if is_module(sub) else base, node.lineno))
    return out


def package_graph() -> dict[str, dict[str, list[str]]]:
    """node -> imported node -> the imports making that edge ("troupe/a.py:12 imports troupe.b.c")."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src = node_of(module_name(path))
        graph.setdefault(src, {})
        for target, line in imported_modules(path):
            dst = node_of(target)
            if dst != src:
                where = f"{path.relative_to(SRC)}:{line} imports {target}"
                graph[src].setdefault(dst, []).append(where)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The groups of nodes that import each other, directly or not (Tarjan; sorted, so stable)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(g for g in groups if len(g) > 1)


def cycle_in(group: list[str], graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """One cycle through the group's first node (first == last), following edges inside the group."""
    start, members = group[0], set(group)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first: the shortest cycle back to start
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    cycle = [node]
                    while cycle[-1] != start:
                        cycle.append(parent[cycle[-1]])
                    return cycle[::-1] + [start]  # cycle ends at start: reversed, it begins there
                if nxt in members and nxt not in parent:
                    parent[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle in {group}")


def describe(cycle: list[str], graph: dict[str, dict[str, list[str]]]) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        lines.append(f"    {a} -> {b}: " + "; ".join(graph[a][b][:3]))
    return "\n".join(lines)


def test_graph_sees_the_known_packages():
    graph = package_graph()
    present = [p for p in KNOWN_PACKAGES if (ROOT / p / "__init__.py").is_file()]
    assert {"runtime", "sync", "compress", "strategies", "cluster", "singa", "script"} <= set(present)
    for p in present:
        assert p in graph, p
    # edges are found at all: the facade re-exports, the reducer talks through the Communicator
    assert graph["troupe"] and "runtime" in graph["sync"]


def test_relative_lazy_and_type_checking_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import comm\n"
        "from ..sync.bucket import Bucket\n"
        "if TYPE_CHECKING:\n"
        "    from troupe.opt import DistOpt\n"
        "def f():\n"
        "    import troupe.cluster.workers.colocated\n"
    )
    found = {name for name, _ in imports_in(source, "troupe.runtime.launch", is_package=False)}
    assert found == {"troupe.runtime.comm", "troupe.sync.bucket", "troupe.cluster.workers.colocated"}


def test_cycle_report_names_the_imports():
    graph = {"a": {"b": ["a.py:1 imports b"]}, "b": {"c": ["b.py:2 imports c"]}, "c": {"a": ["c.py:3 imports a"]},
             "d": {"a": ["d.py:1 imports a"]}}
    groups = strongly_connected(graph)
    assert groups == [["a", "b", "c"]]
    text = describe(cycle_in(groups[0], graph), graph)
    assert text.startswith("a -> b -> c -> a") and "c.py:3 imports a" in text


def test_no_cycle_between_packages():
    graph = package_graph()
    groups = strongly_connected(graph)
    edges = "\n".join(f"  {a} -> {', '.join(sorted(bs))}" for a, bs in sorted(graph.items()) if bs)
    report = "\n".join(f"  {describe(cycle_in(g, graph), graph)}" for g in groups)
    assert not groups, f"import cycles between troupe's packages:\n{report}\nall edges:\n{edges}"


def test_every_import_runs_down_the_layers():
    graph = package_graph()
    layer = {node: k for k, nodes in enumerate(LAYERS) for node in nodes}
    unplaced = sorted(set(graph) - set(layer))
    assert not unplaced, f"nodes in no layer of LAYERS (place each where its imports put it): {unplaced}"
    upward = [f"  {a} (layer {layer[a]}) -> {b} (layer {layer[b]}): " + "; ".join(graph[a][b][:3])
              for a in sorted(graph) for b in sorted(graph[a]) if layer[b] <= layer[a]]
    assert not upward, "imports that run up or across the layers:\n" + "\n".join(upward)


@pytest.mark.process
def test_troupe_loads_no_torch_module_beyond_import_torch():
    # Every rank of every job pays for what troupe's names import: torch.distributed.checkpoint
    # (about 1 s), torch._dynamo and the like are imported where they are used, not here.
    import json
    import subprocess
    import sys

    code = ("import json, sys, torch; before = set(sys.modules); import troupe; "
            "[getattr(troupe, name) for name in troupe.__all__]; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    heavy = [m for m in loaded if m.startswith("torch")]
    assert heavy == [], f"import troupe loads {heavy[:10]}"


@pytest.mark.process
def test_the_command_line_starts_without_torch():
    # `troupe run` only makes a ticket, reads the cluster text and starts processes: the
    # supervisor of every job (and of every restart) would otherwise spend 2-3 s importing torch.
    import subprocess
    import sys

    code = ("import sys, troupe, troupe.cli; from troupe.cluster.configuration.sources import resolve; "
            "troupe.cli.build_parser().parse_args(['run', '-n', '2', 'x.py']); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
