"""Lazy modules: the `researcher` command starts without the study runtime, and loads it when used."""

from __future__ import annotations

import subprocess
import sys

import pytest

from researcher.lazy import lazy_module

HEAVY = ("mlflow", "langgraph", "scipy", "torch", "transformers")


def test_a_lazy_module_runs_its_code_at_the_first_attribute_access(tmp_path, monkeypatch):
    (tmp_path / "counted_module.py").write_text("import builtins\nbuiltins._counted_loads = getattr(builtins, '_counted_loads', 0) + 1\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import builtins

    module = lazy_module("counted_module")
    try:
        assert getattr(builtins, "_counted_loads", 0) == 0
        assert module.VALUE == 7
        assert builtins._counted_loads == 1
        assert lazy_module("counted_module") is sys.modules["counted_module"]  # never loaded twice
        assert builtins._counted_loads == 1
    finally:
        sys.modules.pop("counted_module", None)
        if hasattr(builtins, "_counted_loads"):
            del builtins._counted_loads


def test_an_unknown_module_is_an_import_error_at_once():
    with pytest.raises(ImportError, match="no_such_module_here"):
        lazy_module("no_such_module_here")


def test_the_researcher_command_line_loads_no_heavy_framework_until_a_command_needs_it():
    probe = f"import sys, researcher.cli.main; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"
