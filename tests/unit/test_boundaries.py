"""Import boundaries the tools enforce: the .importlinter contracts hold, and no service package imports in a
cycle (data flows one way through a service: no module imports back from its caller)."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.name for p in (ROOT / "services" / "hetmesh").iterdir() if (p / "__init__.py").exists())


def test_import_contracts_hold(capsys: pytest.CaptureFixture[str]) -> None:
    from importlinter.application.use_cases import lint_imports
    from importlinter.configuration import configure

    configure()
    ok = lint_imports(str(ROOT / ".importlinter"), cache_dir=None, no_logo=True)
    assert ok, capsys.readouterr().out[-3000:]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # imports under TYPE_CHECKING are left out: a type hint is no dependency at run time
    return grimp.build_graph("hetmesh", cache_dir=None, exclude_type_checking_imports=True)


def _cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Strongly connected components of more than one module inside `package` (Tarjan)."""
    nodes = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v) & nodes:
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

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("service", SERVICES)
def test_no_import_cycle_inside_a_service(graph: grimp.ImportGraph, service: str) -> None:
    assert _cycles(graph, f"hetmesh.{service}") == []


@pytest.mark.parametrize("package", ["costmodel", "placement", "planner", "sim", "batching"])
def test_no_import_cycle_inside_a_core(graph: grimp.ImportGraph, package: str) -> None:
    assert _cycles(graph, f"hetmesh.{package}") == []
