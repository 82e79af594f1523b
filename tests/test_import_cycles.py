"""No import cycles between the product's modules (so that the layout shows the architecture).

The graph counts every import that runs: at module level and inside functions (an import inside a function only
runs later; it still ties the two modules together). Imports under ``if TYPE_CHECKING:`` never run and do not
count. A cycle is a strongly connected component of more than one module; the few function-level imports that
close a cycle on purpose are listed in LAZY_ALLOWED, each with why it stays.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ace import processes

PACKAGES = ("ace", "fleet", "speculation")

# (importer, imported): a function-level import that closes a cycle, and why it stays. Nothing else may.
LAZY_ALLOWED = {
    ("speculation.offline.demo.shipped", "speculation.offline.demo.build"): (
        "the export command reads the builder's recipes; installing the shipped models at start loads no torch"
    ),
    ("speculation.engine.eagle", "speculation.engine.eagle3"): (
        "a head is loaded by its format: the EAGLE-3 head extends the EAGLE head's drafter"
    ),
    ("speculation.worker.openmp", "speculation.worker.batching"): (
        "whether the process keeps one OpenMP team depends on batching being on; openmp sets the OpenMP "
        "environment before torch loads, so it imports nothing heavy at module level"
    ),
    ("speculation.worker.costs", "speculation.worker.generation"): (
        "the remote calibration times prod's own RemoteTarget, built by generation.build (to go when building a "
        "path moves out of generation)"
    ),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(processes.REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that runs, with whether it is inside a function (lazy)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child, lazy)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, lazy))
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def import_graph(*, lazy_allowed: dict | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports; a function-level import listed in lazy_allowed is left out."""
    allowed = lazy_allowed or {}
    files = [p for pkg in PACKAGES for p in (processes.REPO_ROOT / pkg).rglob("*.py") if "migrations" not in p.parts]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node, lazy in _imports(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` depends on the submodule; `from mod import name` on the module
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in modules] or [node.module]
            edges.update(t for t in targets if t in modules and t != name and not (lazy and (name, t) in allowed))
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_product_has_no_import_cycles():
    assert cycles(import_graph(lazy_allowed=LAZY_ALLOWED)) == []


def test_the_check_counts_imports_inside_functions():
    # given: a module whose only import of another runs inside a function, and one under TYPE_CHECKING
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import fleet.models\n"
        "def later():\n    from speculation import limits\n"
    )
    # then: the function's import counts (lazy), the type-checking one does not
    seen = [(ast.unparse(node), lazy) for node, lazy in _imports(tree)]
    assert seen == [("from typing import TYPE_CHECKING", False), ("from speculation import limits", True)]


def test_the_gateway_never_imports_the_worker_and_nothing_below_it_imports_the_gateway():
    # the web process queues jobs by task name (speculation.jobs.queue); services, selectors, jobs and fleet are
    # what the gateway is built on
    graph = import_graph()
    below = ("speculation.services", "speculation.selectors", "speculation.jobs", "speculation.worker", "fleet")
    into_worker = [(a, b) for a in graph for b in graph[a] if a.startswith("speculation.gateway.")]
    assert [(a, b) for a, b in into_worker if b.startswith("speculation.worker")] == []
    into_gateway = [(a, b) for a in graph for b in graph[a] if b.startswith("speculation.gateway")]
    assert [(a, b) for a, b in into_gateway if a.startswith(below)] == []


def test_the_check_sees_a_cycle():
    # given: a graph where a imports b and b imports a (and c is on its own)
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    # then: the cycle is reported, the lone module is not
    assert cycles(graph) == [["a", "b"]]
