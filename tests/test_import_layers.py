"""Import layering: no cycles between the parts of ``kvstore``, and the SDK never imports ``kvstore``.

The rule. A part is a subpackage of ``kvstore`` (``kvstore.node``, ``kvstore.transport``,
``kvstore.master``, ...) or one of its top-level modules (``kvstore.units``,
``kvstore.cli``, ...). Part A depends on part B when any module of A imports anything of B,
wherever the import statement stands: at module level, inside a function, or under
``if TYPE_CHECKING:``. The graph of those dependencies must have no cycle, so that every
part can be read, tested and replaced with only the parts below it. Imports inside a part
are not constrained here.

The imports are read from the source (the AST of every module), not by importing it, so a
lazy import kept to dodge a cycle is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvstore"
SDK = ROOT / "client"


def _module_name(path: Path, base: Path, prefix: str) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


def _imports(path: Path, module: str) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``path``; ``from X import y`` yields
    X.y as well as X, since y may be a module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            found.extend((f"{base}.{alias.name}", node.lineno) for alias in node.names)
    return found


def _part(module: str) -> str | None:
    """The part of ``kvstore`` a module belongs to, or None outside the package."""
    parts = module.split(".")
    if parts[0] != "kvstore":
        return None
    if len(parts) == 1:
        return "kvstore"
    candidate = PACKAGE / parts[1]
    if candidate.is_dir() or candidate.with_suffix(".py").exists():
        return f"kvstore.{parts[1]}"
    return "kvstore"  # a name defined in kvstore/__init__.py


def part_graph() -> dict[str, dict[str, list[str]]]:
    """{part: {part it imports: ["file:line", ...]}}."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path, PACKAGE, "kvstore")
        source = _part(module)
        edges = graph.setdefault(source, {})
        for name, line in _imports(path, module):
            target = _part(name)
            where = f"{path.relative_to(ROOT)}:{line}"
            if target is not None and target != source and where not in edges.get(target, ()):
                edges.setdefault(target, []).append(where)
    return graph


def find_cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components with more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_find_cycles_sees_a_cycle():
    graph = {"a": {"b": ["x:1"]}, "b": {"c": ["x:2"]}, "c": {"a": ["x:3"]}, "d": {"a": ["x:4"]}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b": ["x:1"]}, "b": {}}) == []


def test_relative_and_lazy_imports_count(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from . import sibling\nfrom ..up import thing\ndef f():\n    import kvstore.node.store\n")
    names = {name for name, _ in _imports(module, "kvstore.transport.m")}
    assert {"kvstore.transport.sibling", "kvstore.up.thing", "kvstore.node.store"} <= names


def test_no_import_cycles_between_parts():
    graph = part_graph()
    assert {"kvstore.node", "kvstore.transport", "kvstore.master", "kvstore.scheduler"} <= set(graph)
    report = []
    for component in find_cycles(graph):
        report.append(" <-> ".join(component))
        for source in component:
            for target in component:
                for where in graph[source].get(target, [])[:3]:
                    report.append(f"    {source} -> {target}  ({where})")
    assert not report, "import cycles between kvstore's parts:\n" + "\n".join(report)


def test_scheduler_and_transport_sit_below_master_and_node():
    graph = part_graph()
    assert "kvstore.master" not in graph["kvstore.scheduler"], graph["kvstore.scheduler"].get("kvstore.master")
    assert "kvstore.node" not in graph["kvstore.transport"], graph["kvstore.transport"].get("kvstore.node")


def test_the_sdk_never_imports_kvstore():
    offending = []
    for path in sorted(SDK.rglob("*.py")):
        for name, line in _imports(path, _module_name(path, SDK, "kvstore_client")):
            if name == "kvstore" or name.startswith("kvstore."):
                offending.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not offending, "client/ (kvstore_client) imports kvstore:\n" + "\n".join(offending)
