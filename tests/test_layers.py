"""Imports follow the layer table in docs/architecture.md, and no modules import each other.

The table's code block lists modules and packages (``llmlab/...``) in bands separated by
``▲`` lines, lowest first. A module may import from its own band and the bands below it;
every ``import`` in every module counts, lazy ones inside functions included. The package's
front door (``llmlab/__init__.py``, ``llmlab/__main__.py``) sits in the top band.

Within a band the table allows anything, so a second rule keeps the order inside it: no
import cycles, however long, between any llmlab modules (a package's ``__init__`` is a
module like any other; every import counts, lazy and ``TYPE_CHECKING`` ones included).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmlab"
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"llmlab/(?:\w+/)*(?:\w+\.py)?(?=[\s,]|$)")

# Upward imports that exist today, each with why (none since the engine core's third pass,
# issue 23, moved the built-in model's trainer out of models/). Do not add to this list:
# move the code instead.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def bands(text: str) -> list[list[str]]:
    """The table's bands, lowest first, each a list of ``llmlab/...`` paths."""
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    found: list[list[str]] = [[]]
    for line in block.splitlines():
        if "▲" in line:
            found.append([])
        else:
            found[-1].extend(PATH.findall(line))
    return [band for band in found if band]


def band_of(module_path: str, table: list[list[str]]) -> int | None:
    """The band of the longest table entry that is ``module_path`` or a folder holding it."""
    best, best_len = None, -1
    for index, band in enumerate(table):
        for entry in band:
            if (module_path == entry or (entry.endswith("/") and module_path.startswith(entry))
                    ) and len(entry) > best_len:
                best, best_len = index, len(entry)
    return best


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_file(name: str) -> str | None:
    """``llmlab.a.b`` -> ``llmlab/a/b.py`` or ``llmlab/a/b/`` (a package), as the table
    writes them; None when it is not a module of llmlab (an attribute, say)."""
    rel = name.replace(".", "/")
    if (ROOT / f"{rel}.py").exists():
        return f"{rel}.py"
    if (ROOT / rel / "__init__.py").exists():
        return f"{rel}/"
    return None


def imports_of(path: pathlib.Path) -> set[str]:
    """Every llmlab module ``path`` imports (``from llmlab.x import y`` counts as
    ``llmlab.x.y`` when ``y`` is a module, else ``llmlab.x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "llmlab")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "llmlab":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if module_file(sub) is not None else source)
    return found


def upward_imports(table: list[list[str]], modules: dict[str, set[str]]) -> list[str]:
    """``importer -> imported (band i -> band j > i)`` for every import that breaks the
    table, and ``importer: not in the table`` for a module the table does not place."""
    top = len(table) - 1
    problems = []
    for importer, imported in sorted(modules.items()):
        if importer in ("llmlab", "llmlab.__main__"):
            continue  # the front door: top band, imports anything
        here = band_of(module_file(importer) or "", table)
        if here is None:
            problems.append(f"{importer}: not in the layer table")
            continue
        for target in sorted(imported):
            there = top if target == "llmlab" else band_of(module_file(target) or "", table)
            if there is None:
                problems.append(f"{target} (imported by {importer}): not in the layer table")
            elif there > here and (importer, target) not in KNOWN_UPWARD:
                problems.append(f"{importer} -> {target} (band {here} -> {there})")
    return problems


def all_modules() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def import_cycles(modules: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of the import graph that hold a cycle (two or
    more modules, or one that imports itself), each sorted, in sorted order (Tarjan's
    algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(modules):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(modules[root])))]
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in modules:
                    continue  # not an llmlab module (an attribute import, say)
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(modules[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in modules[node]:
                        found.append(sorted(component))
    return sorted(found)


def cycle_path(component: list[str], modules: dict[str, set[str]], start: str | None = None
               ) -> str:
    """One shortest loop through ``start`` (default: the component's first module):
    ``a -> b -> a``."""
    start, members = start or component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(modules[node] & members):
                if target == start:
                    path = [start]
                    while node != start:
                        path.append(node)
                        node = came_from[node]
                    return " -> ".join([start, *reversed(path[1:]), start])
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{component} holds no cycle")


def test_no_import_cycles():
    modules = all_modules()
    cycles = import_cycles(modules)
    assert not cycles, (
        "import cycles (move the shared code to a lower module, or the function to the "
        "module that uses it):\n  " + "\n  ".join(
            f"{', '.join(component)}: {cycle_path(component, modules)}" for component in cycles
        )
    )


@pytest.mark.parametrize(
    "importer, planted, loop",
    [
        # two modules: the pool reaching back for its manager
        ("llmlab.cache.block_pool", "llmlab.cache.kv_cache_manager",
         "llmlab.cache.block_pool -> llmlab.cache.kv_cache_manager -> llmlab.cache.block_pool"),
        # three, across packages
        ("llmlab.cache.block_pool", "llmlab.scheduler.scheduler",
         "llmlab.cache.block_pool -> llmlab.scheduler.scheduler -> "
         "llmlab.cache.kv_cache_manager -> llmlab.cache.block_pool"),
        # a package's __init__ counts: roofline importing the package that imports it
        ("llmlab.sim.roofline", "llmlab.sim",
         "llmlab.sim.roofline -> llmlab.sim -> llmlab.sim.roofline"),
        # a module importing itself
        ("llmlab.request", "llmlab.request", "llmlab.request -> llmlab.request"),
    ],
)
def test_a_planted_import_cycle_is_caught(importer, planted, loop):
    modules = all_modules()
    assert not import_cycles(modules)
    modules[importer] = modules[importer] | {planted}
    cycles = import_cycles(modules)
    assert len(cycles) == 1 and importer in cycles[0]
    assert cycle_path(cycles[0], modules, start=importer) == loop


def test_no_module_imports_upward():
    table = bands(DOC.read_text())
    assert len(table) >= 5, "could not read the layer table in docs/architecture.md"
    problems = upward_imports(table, all_modules())
    assert not problems, "imports that break docs/architecture.md's layer table:\n  " + (
        "\n  ".join(problems))


def test_known_exceptions_still_exist():
    """An exception that is gone must leave the list, so the list cannot hide a new one."""
    modules = all_modules()
    stale = [pair for pair in KNOWN_UPWARD if pair[1] not in modules.get(pair[0], set())]
    assert not stale, f"remove from KNOWN_UPWARD: {stale}"


@pytest.mark.parametrize(
    "importer, planted",
    [
        ("llmlab.cache.block_pool", "llmlab.engine.engine"),  # cache reaching for the engine
        ("llmlab.request", "llmlab.sampling.sampler"),  # a leaf reaching into sampling
        ("llmlab.engine.builder", "llmlab.entrypoints.server.app"),  # the engine reaching for the server
        ("llmlab.models.llama", "llmlab"),  # anything below the top importing the front door
    ],
)
def test_a_planted_upward_import_is_caught(importer, planted):
    table = bands(DOC.read_text())
    modules = all_modules()
    assert not upward_imports(table, modules)
    modules[importer] = modules[importer] | {planted}
    assert upward_imports(table, modules) == [
        f"{importer} -> {planted} (band {band_of(module_file(importer), table)} -> "
        f"{len(table) - 1 if planted == 'llmlab' else band_of(module_file(planted), table)})"
    ]


def test_a_module_missing_from_the_table_is_caught():
    table = [[entry for entry in band if entry != "llmlab/threads.py"]
             for band in bands(DOC.read_text())]
    assert "llmlab.threads: not in the layer table" in upward_imports(table, all_modules())
