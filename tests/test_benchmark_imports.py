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


def module_attributes(path: Path) -> list[tuple[str, str]]:
    """(module, attribute) of each `alias.attribute` in `path` where `alias` names one of our
    modules (`import jkv`, `from jkv.engine import engine as engine_module`): what a script
    reads or patches on a module."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in OURS:
                    if a.asname:  # import jkv.engine.engine as em
                        aliases[a.asname] = a.name
                    else:  # import jkv.engine: the name bound is jkv
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in OURS:
                for a in node.names:
                    try:
                        importlib.import_module(f"{node.module}.{a.name}")
                    except ModuleNotFoundError:
                        continue
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return sorted(
        {(aliases[n.value.id], n.attr) for n in ast.walk(tree)
         if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases}
    )  # fmt: skip


# What a script reads only from an older library, for runs against a commit before a change
OLDER = {"engine_host.py": {"jkv.engine.runner.pack"}}  # before engine core v2 (`NEW`)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_reads_only_module_attributes_that_exist(script):
    missing = [f"{m}.{a}" for m, a in module_attributes(script)
               if not hasattr(importlib.import_module(m), a)
               and f"{m}.{a}" not in OLDER.get(script.name, ())]  # fmt: skip
    assert not missing, f"{script.name} reads or patches names that do not exist: {missing}"


def test_the_check_sees_a_missing_module_attribute(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from jkv.engine import engine as em\n\nem.to_host = print\nem.read\n")
    assert module_attributes(bad) == [
        ("jkv.engine.engine", "read"),
        ("jkv.engine.engine", "to_host"),
    ]
    assert not hasattr(importlib.import_module("jkv.engine.engine"), "to_host")


def test_the_check_sees_a_missing_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jkv.serve.openai import DEFAULT_CHAT_TEMPLATE\n")
    names = imported_names(bad)
    assert names == [("jkv.serve.openai", "DEFAULT_CHAT_TEMPLATE")]
    assert not hasattr(importlib.import_module("jkv.serve.openai"), "DEFAULT_CHAT_TEMPLATE")
