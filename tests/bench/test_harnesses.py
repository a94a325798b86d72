"""Every benchmark harness under ``bench/`` still imports and parses ``--help``: the benches are
not run by the suite, so a rename elsewhere could break one unseen (two were, on 2026-11-27)."""

import contextlib
import importlib
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESSES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")


@pytest.fixture(autouse=True)
def repo_root_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # as `python -m bench.NAME` from the repository root


@pytest.mark.parametrize("name", HARNESSES)
def test_each_harness_imports_and_says_its_usage(name, monkeypatch):
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [f"bench.{name}", "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0 and "usage:" in out.getvalue()
