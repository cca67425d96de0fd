"""The package's rooms and who may import whom (docs/design/index.md, "Layers"): the
import-linter contracts of pyproject.toml hold, there is no import cycle at all (type
annotations counted), and the server shares behaviour by holding parts, not by bases."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]

def _graph(*, type_checking: bool = False) -> grimp.ImportGraph:
    graph = grimp.build_graph("aps", include_external_packages=False, exclude_type_checking_imports=not type_checking,
                               cache_dir=None)
    # `from .. import _core` reads as an import of the package itself: the native extension has no
    # .py file for the graph to see. It imports nothing of aps, so the edge is dropped here.
    for importer in list(graph.find_modules_that_directly_import("aps")):
        if all("_core" in d["line_contents"] for d in graph.get_import_details(importer=importer, imported="aps")):
            graph.remove_import(importer=importer, imported="aps")
    return graph


def _cycles(graph: grimp.ImportGraph) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_import_contracts_hold():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_there_is_no_import_cycle_lazy_imports_included():
    assert _cycles(_graph()) == []


def test_there_is_no_import_cycle_type_annotations_included():
    """A part that names its host in an annotation depends on it: it names a Protocol instead."""
    assert _cycles(_graph(type_checking=True)) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [{"p.a", "p.b", "p.c"}]


def test_inside_the_library_only_the_native_extension_is_imported_through_the_package():
    """What the contracts' "aps.** -> aps" ignores is only ``from .. import _core``: any other
    import of the package root (``import aps``) would pull in both sides."""
    graph = grimp.build_graph("aps", include_external_packages=False, cache_dir=None)
    others = sorted(
        f"{importer}:{d['line_number']}: {d['line_contents']}"
        for importer in graph.find_modules_that_directly_import("aps")
        if not importer.startswith("aps.testing")  # the test helpers sit above everything, as tests/ does
        for d in graph.get_import_details(importer=importer, imported="aps")
        if "_core" not in d["line_contents"]
    )
    assert others == []


@pytest.mark.parametrize("package", ["aps.server.engine.jobs", "aps.server.engine.lane", "aps.server.engine.stats"])
def test_the_jobs_and_the_statistics_do_not_import_the_engine_even_for_types(package):
    graph = _graph(type_checking=True)
    modules = {package} | (graph.find_descendants(package) if graph.find_children(package) else set())
    for module in modules:
        assert "aps.server.engine.engine" not in graph.find_modules_directly_imported_by(module), module


def test_the_engine_contract_names_every_module_of_the_server_outside_the_engine():
    """"The engine does no I/O" forbids the rest of the server module by module: a new module
    of the server is forbidden to the engine too."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"].startswith("The engine does no I/O")]
    server = ROOT / "aps" / "server"
    modules = {f"aps.server.{p.stem}" for p in server.glob("*.py") if p.stem != "__init__"}
    modules |= {f"aps.server.{p.name}" for p in server.iterdir() if (p / "__init__.py").exists() and p.name != "engine"}
    assert modules - set(contract["forbidden_modules"]) == set()


def _server_classes() -> dict[str, tuple[str, list[str]]]:
    """Every class of aps/server: its module and the names of its bases."""
    classes = {}
    for path in (ROOT / "aps" / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (str(path.relative_to(ROOT)), [ast.unparse(b).split(".")[-1] for b in node.bases])
    return classes


def test_the_server_shares_behaviour_by_holding_parts_not_by_inheriting_them():
    """A class of aps/server derives from a class of its own only where that class is a
    Protocol or an abstract base that defines a family of kinds (the optimizers, the sync
    policies, the lane's jobs, the request handlers): never a concrete class or a mixin."""
    classes = _server_classes()

    def abstract(name: str) -> bool:  # an ABC or a Protocol, or a family inside one (ApplyOnArrival)
        bases = classes[name][1]
        return bool({"ABC", "Protocol"} & set(bases)) or any(b in classes and abstract(b) for b in bases)

    mixed = {f"{name} ({module}): {base}" for name, (module, bases) in classes.items()
             for base in bases if base in classes and not abstract(base)}
    assert mixed == set()


def test_the_package_has_at_most_twelve_top_level_modules():
    modules = [p.name for p in (ROOT / "aps").iterdir()
               if p.suffix == ".py" or (p.suffix == ".so" and p.name.startswith("_core"))]
    assert len(modules) <= 12, sorted(modules)


def test_no_module_of_the_server_the_wire_the_client_or_the_checkpoint_format_is_over_1000_lines():
    """Split by concern instead (session: admission, intake and the requests; checkpoint:
    format, reading, directory, resume; the client: the protocol core, the blocking and the
    asyncio drivers, recovery, payloads, arguments)."""
    long = {}
    for room in ("server", "wire", "client", "checkpoint", "lab", "cli", "testing"):
        for path in (ROOT / "aps" / room).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            if lines > 1000:
                long[str(path.relative_to(ROOT))] = lines
    assert long == {}
