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
