"""The import arrows that hold today, read from the source with `ast` (every import statement,
module level or inside a function): the kernels and the models import nothing of jkv, the models
nothing of the kernels' users, and the response cache never imports JAX."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(folder: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """file -> the top-level names of every module it imports (relative imports stay inside)."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(root))] = names
    return out


RULES = [
    ("pallas_kernels", {"jkv", "jkv_models", "models"}),  # a kernel is usable alone
    ("models", {"jkv", "jkv_kernels", "pallas_kernels"}),  # a model knows nothing of serving
    ("jkv/cache", {"jax", "jaxlib", "flax"}),  # plain Python around bytes and strings
]


@pytest.mark.parametrize("folder, forbidden", RULES, ids=[r[0] for r in RULES])
def test_import_arrows(folder, forbidden):
    found = {
        f: sorted(names & forbidden)
        for f, names in imported_modules(ROOT / folder).items()
        if names & forbidden
    }
    assert not found, found


def test_the_reader_sees_imports_inside_functions(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    import jax\n    from jkv.kv import bucket\n")
    assert imported_modules(tmp_path, tmp_path) == {"m.py": {"jax", "jkv"}}
