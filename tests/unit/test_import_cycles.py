"""No import cycles between flashllm's modules: from no import a -> b does a chain of imports lead back to a.

pyproject's import-linter contracts (`lint-imports`, nox -s lint) keep the layers; a layer may still
hold a cycle inside it, and import-linter's acyclic_siblings contract judges whole packages, so
module cycles are checked here, on the same import graph (grimp, which import-linter is built on).
Imports inside functions count: moving an import into a function hides a cycle, it does not break it.
"""

from __future__ import annotations

from collections.abc import Iterable

import grimp

# Imports that run only when a module is the program (`if __name__ == "__main__"`), never when the
# library is imported; the layers contract in pyproject.toml ignores the same ones.
ENTRY_POINT_IMPORTS = {
    ("flashllm.llm", "flashllm.cli.predict"),  # `python -m flashllm.llm`, the PaddleNLP predictor habit
}


def import_cycles(graph: grimp.ImportGraph, ignored: Iterable[tuple[str, str]] = ()) -> list[tuple[str, ...]]:
    """Each cycle once, as the chain of modules a -> b -> ... -> a, found from its first import a -> b.

    The ignored (importer, imported) pairs are removed from `graph` first.
    """
    for importer, imported in ignored:
        graph.remove_import(importer=importer, imported=imported)
    cycles: dict[frozenset[str], tuple[str, ...]] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer) - {importer}):
            back = graph.find_shortest_chain(importer=imported, imported=importer, as_packages=False)
            if back is not None:
                cycles.setdefault(frozenset(back), (importer, *back))
    return sorted(cycles.values())


def test_flashllm_has_no_import_cycles() -> None:
    graph = grimp.build_graph("flashllm", cache_dir=None)
    stale = [pair for pair in ENTRY_POINT_IMPORTS if not graph.direct_import_exists(importer=pair[0], imported=pair[1])]
    assert not stale, (f"ENTRY_POINT_IMPORTS lists imports that no longer exist: {stale}; remove them here and "
                       "from ignore_imports in pyproject.toml")
    cycles = import_cycles(graph, ENTRY_POINT_IMPORTS)
    assert not cycles, "import cycles (move what both sides need down a layer):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_a_cycle_through_a_third_module_is_found_once() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.leaf"):
        graph.add_module(module)
    for importer, imported in (("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"), ("pkg.a", "pkg.leaf")):
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [("pkg.a", "pkg.b", "pkg.c", "pkg.a")]
    graph.add_import(importer="pkg.leaf", imported="pkg.c")  # a second cycle, a -> leaf -> c -> a
    assert len(import_cycles(graph)) == 2
    assert import_cycles(graph, {("pkg.c", "pkg.a")}) == []
