"""No import cycle, between files or between top-level packages, TYPE_CHECKING imports included.

`lint-imports` (tests/unit/test_layers.py) checks the layers between named packages; a cycle
between two files of one package, or a loop through TYPE_CHECKING imports, passes it. This test
builds the whole import graph with grimp (import-linter's own) and lists each cycle with the
imports that close it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grimp

PACKAGES = ("broker", "models", "services", "workers")


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node, each sorted (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(edges.get(target, ())))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return sorted(found)


def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False)


def module_edges(g: grimp.ImportGraph) -> dict[str, set[str]]:
    return {module: set(g.find_modules_directly_imported_by(module)) for module in g.modules}


def package_edges(modules: Mapping[str, set[str]]) -> dict[str, set[str]]:
    top: dict[str, set[str]] = {package: set() for package in PACKAGES}
    for importer, imported in modules.items():
        top[importer.split(".")[0]] |= {name.split(".")[0] for name in imported}
    for package, imported in top.items():
        imported.discard(package)
    return top


def describe(g: grimp.ImportGraph, component: list[str]) -> str:
    """The imports inside one cycle, with their lines."""
    members = set(component)
    lines = [" <-> ".join(component)]
    for importer in component:
        for imported in sorted(g.find_modules_directly_imported_by(importer) & members):
            for detail in g.get_import_details(importer=importer, imported=imported):
                lines.append(f"    {importer}:{detail['line_number']} {detail['line_contents']}")
    return "\n".join(lines)


def test_no_cycle_between_files() -> None:
    g = graph()
    cycles = strongly_connected(module_edges(g))
    assert not cycles, "import cycles between files:\n" + "\n".join(describe(g, c) for c in cycles)


def test_no_cycle_between_top_level_packages() -> None:
    g = graph()
    top = package_edges(module_edges(g))
    cycles = strongly_connected(top)
    witnesses = [
        f"{a} -> {b}: {sorted(g.find_shortest_chains(importer=a, imported=b))}"
        for component in cycles
        for a in component
        for b in sorted(top[a] & set(component))
    ]
    assert not cycles, "import cycles between top-level packages:\n" + "\n".join(witnesses)


def test_the_cycle_finder_sees_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert strongly_connected(edges) == [["a", "b", "c"]]
    assert package_edges({"workers.x": {"services.y"}, "services.y": {"workers.z"}}) == {
        "broker": set(),
        "models": set(),
        "services": {"workers"},
        "workers": {"services"},
    }
