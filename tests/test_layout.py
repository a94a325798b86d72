"""The package layers (docs/ARCHITECTURE.md, *Layout*): the verifier and the drafter never import each other;
the core (verifier, drafter, scheduler, lm) never imports the HTTP API, which only the daemons'
entry points (launch) put in front of it; the shared layers (lm, serving, api, scheduler, proto)
import neither the verifier nor the drafter, nor the launcher."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "verifier": {"drafter", "launch", "api"},
    "drafter": {"verifier", "launch", "api"},
    "api": {"verifier", "drafter", "launch"},
    "serving": {"verifier", "drafter", "launch", "api"},
    "lm": {"verifier", "drafter", "launch", "api", "serving"},
    "scheduler": {"verifier", "drafter", "launch", "api", "serving", "lm"},
}


def imported_packages(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        out |= {n.split(".")[1] for n in names if n.startswith("goodspeed.") and n.count(".") >= 1}
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_import_only_downwards(package):
    bad = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & FORBIDDEN[package]) for p in (ROOT / package).rglob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}


def module_imports(path: Path) -> set[str]:
    """The ``goodspeed.*`` modules a file imports at run time, deferred imports inside functions
    included; imports under ``if TYPE_CHECKING:`` (annotations only) left out."""
    out: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("goodspeed."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("goodspeed."):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from package import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return out


def test_no_module_imports_itself_through_others():
    """No import cycle among the package's modules (deferred imports count: they hide a cycle,
    they do not remove it); reported as the modules of each cycle."""
    modules = {}
    for package in ("api", "drafter", "launch", "lm", "proto", "scheduler", "serving", "verifier"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            name = "goodspeed." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    graph = {name: module_imports(path) & modules.keys() for name, path in modules.items()}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert cycles == []
