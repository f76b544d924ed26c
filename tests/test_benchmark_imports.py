"""Every name a benchmark script imports from jkv exists: the scripts run rarely (minutes to
hours each), so a rename inside the library would otherwise first show as a crash half-way
through a measurement."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("jkv", "pallas_kernels", "models")
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def imported_names(path: Path) -> list[tuple[str, str]]:
    """(module, name) of each `from <ours> import name` in `path`, at any depth of the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in OURS:
                out += [(node.module, a.name) for a in node.names if a.name != "*"]
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_imports_only_what_exists(script):
    missing = []
    for module, name in imported_names(script):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:  # a submodule imported by name
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{script.name} imports names that do not exist: {missing}"


def test_the_check_sees_a_missing_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jkv.serve.openai import DEFAULT_CHAT_TEMPLATE\n")
    names = imported_names(bad)
    assert names == [("jkv.serve.openai", "DEFAULT_CHAT_TEMPLATE")]
    assert not hasattr(importlib.import_module("jkv.serve.openai"), "DEFAULT_CHAT_TEMPLATE")
