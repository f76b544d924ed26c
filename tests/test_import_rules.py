"""The import rules of ARCHITECTURE.md, read from the source with `ast` (every import statement,
module level or inside a function):

- arrows: the kernels and the models import nothing of jkv; the response cache never imports JAX
  (nor does any project module it imports); the core, the policies and the output types never
  import the layers above them; nothing imports the CLI;
- no import circles between project modules;
- no project-internal imports inside functions (optional dependencies may load there);
- no private names imported across modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "jkv": ROOT / "jkv",
    "jkv_models": ROOT / "models",
    "jkv_kernels": ROOT / "pallas_kernels",
}
OURS = set(PACKAGES)


def module_name(path: Path) -> str:
    for pkg, folder in PACKAGES.items():
        if path.is_relative_to(folder):
            parts = [pkg, *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def project_files() -> dict[str, Path]:
    return {module_name(p): p for folder in PACKAGES.values() for p in sorted(folder.rglob("*.py"))}


def imports(path: Path, modules: set[str]):
    """(line, target module, names imported from it, inside a function) of every import."""
    tree = ast.parse(path.read_text(), str(path))
    in_function = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            in_function |= {id(n) for n in ast.walk(fn)}
    for node in ast.walk(tree):
        inside = id(node) in in_function
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, (), inside
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = tuple(a.name for a in node.names)
            subs = [n for n in names if f"{node.module}.{n}" in modules]
            for n in subs:  # `from jkv import kv` imports the module jkv.kv
                yield node.lineno, f"{node.module}.{n}", (), inside
            if len(subs) < len(names):
                yield node.lineno, node.module, tuple(n for n in names if n not in subs), inside


def imported_modules(folder: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """file -> the top-level names of every module it imports (relative imports stay inside)."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        out[str(path.relative_to(root))] = {t.split(".")[0] for _, t, _, _ in imports(path, set())}
    return out


def graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports at module level."""
    modules = set(files)
    return {
        m: {t for _, t, _, inside in imports(p, modules) if t in modules and not inside}
        for m, p in files.items()
    }


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or a self-import."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


RULES = [
    ("pallas_kernels", {"jkv", "jkv_models", "models"}),  # a kernel is usable alone
    ("models", {"jkv", "jkv_kernels", "pallas_kernels"}),  # a model knows nothing of serving
    ("jkv/response_cache", {"jax", "jaxlib", "flax"}),  # plain Python around bytes and strings
]


@pytest.mark.parametrize("folder, forbidden", RULES, ids=[r[0] for r in RULES])
def test_import_arrows(folder, forbidden):
    found = {
        f: sorted(names & forbidden)
        for f, names in imported_modules(ROOT / folder).items()
        if names & forbidden
    }
    assert not found, found


# module prefix -> project modules it must never import (directly)
LAYERS = {
    "jkv.core": [
        "jkv.generate",
        "jkv.prefill",
        "jkv.decode",
        "jkv.scoring",
        "jkv.request",
        "jkv.output",
        "jkv.response_cache",
        "jkv.cli",
        "jkv.policies",
    ],
    "jkv.policies": [
        "jkv.generate",
        "jkv.prefill",
        "jkv.decode",
        "jkv.scoring",
        "jkv.request",
        "jkv.response_cache",
        "jkv.cli",
        "jkv.core.step",
        "jkv.core.attention",
    ],
    "jkv.kv": ["jkv.core", "jkv.policies", "jkv.generate", "jkv.prefill"],
    "jkv.output": ["jkv.core", "jkv.kv", "jkv.policies", "jkv.generate", "jkv.prefill"],
    "jkv.prompt": ["jkv.core", "jkv.kv", "jkv.policies", "jkv.generate", "jkv.prefill"],
    "jkv.response_cache": [
        "jkv.generate",
        "jkv.prefill",
        "jkv.decode",
        "jkv.core",
        "jkv.policies",
        "jkv.request",
        "jkv.kv",
    ],
    # the one-shot path and the engine share core.step; neither runs through the other
    "jkv.generate": ["jkv.engine"],
    "jkv.prefill": ["jkv.engine"],
    "jkv.decode": ["jkv.engine"],
    "jkv.engine": ["jkv.generate", "jkv.cli", "jkv.response_cache"],
    "jkv.serve.openai": ["jkv.core", "jkv.kv", "jkv.engine", "jkv.generate"],  # plain dicts
}


ENGINE_ARRAY_FILES = ("runner.py", "ragged.py", "engine.py", "warmup.py", "recovery.py",
                      "policy_steps.py", "select.py", "replay.py", "rebuild.py", "programs.py",
                      "pool_size.py", "lockstep.py", "context_steps.py")  # fmt: skip


def test_the_engines_bookkeeping_is_plain_python():
    """ARCHITECTURE.md: the engine's pool, sequences and scheduler work on ints; arrays appear
    only in its runners (the gathering one and the flattened step) and the engine that hands
    them over (engine.py and the parts it is made of: its warmup, recovery, policy and context
    steps)."""
    arrays = {"jax", "jaxlib", "flax", "numpy"}
    found = {
        f: sorted(names & arrays)
        for f, names in imported_modules(ROOT / "jkv" / "engine").items()
        if names & arrays and Path(f).name not in ENGINE_ARRAY_FILES
    }
    assert not found, found


def test_layers_never_import_the_layers_above():
    files = project_files()
    edges = graph(files)
    bad = [
        (m, t)
        for m, targets in edges.items()
        for prefix, banned in LAYERS.items()
        if m == prefix or m.startswith(prefix + ".")
        for t in targets
        if any(t == b or t.startswith(b + ".") for b in banned)
    ]
    bad += [(m, t) for m, targets in edges.items() for t in targets if t == "jkv.cli"]
    # the server sits on top: only the CLI reaches it
    bad += [
        (m, t)
        for m, targets in edges.items()
        for t in targets
        if t.startswith("jkv.serve") and m != "jkv.cli" and not m.startswith("jkv.serve")
    ]
    assert not bad, bad


def test_the_response_cache_reaches_no_jax_through_project_modules():
    files = project_files()
    edges = graph(files)
    seen, todo = set(), [m for m in files if m.startswith("jkv.response_cache")]
    while todo:
        m = todo.pop()
        if m in seen or m == "jkv":  # the package root is the public face, not a dependency
            continue
        seen.add(m)
        todo += edges[m]
    heavy = {
        m: sorted(
            t for _, t, _, _ in imports(files[m], set()) if t.split(".")[0] in {"jax", "flax"}
        )
        for m in sorted(seen)
    }
    assert not {m: t for m, t in heavy.items() if t}


def test_no_import_circles():
    assert circles(graph(project_files())) == []


def test_no_project_imports_inside_functions():
    files = project_files()
    found = [
        f"{p.relative_to(ROOT)}:{line} {target}"
        for m, p in files.items()
        for line, target, _, inside in imports(p, set(files))
        if inside and target.split(".")[0] in OURS
    ]
    assert not found, found


def test_no_private_names_cross_modules():
    files = project_files()
    found = []
    for m, p in files.items():
        for line, target, names, _ in imports(p, set(files)):
            if target.split(".")[0] not in OURS:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private += [s for s in target.split(".")[1:] if s.startswith("_")]
            # a package-private module (jkv_kernels._backend) serves its own package
            private = [n for n in private if not (n == "_backend" and m.startswith("jkv_kernels"))]
            if private:
                found.append(f"{p.relative_to(ROOT)}:{line} {target} {private}")
    assert not found, found


def test_the_reader_sees_imports_inside_functions(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    import jax\n    from jkv.kv import bucket\n")
    assert imported_modules(tmp_path, tmp_path) == {"m.py": {"jax", "jkv"}}
    inside = [i for *_, i in imports(tmp_path / "m.py", set())]
    assert inside == [True, True]


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_model_runs_over_a_kv_state_in_one_place():
    """`jkv_models.llama.forward` over a KV state is called by `jkv.core.step` only (apart from it:
    EffiCache's gradient pass and the demo's trainer, the model without a cache); the attention
    callable is built there too, so prefill, decode, scoring and the engine share one step."""
    files = project_files()
    users: dict[str, set[str]] = {}
    for m, p in files.items():
        for _, target, names, _ in imports(p, set(files)):
            if target in ("jkv_models.llama", "jkv.core.attention"):
                users.setdefault(m, set()).update(set(names) & {"forward", "make_attention"})
    users = {m: sorted(n) for m, n in users.items() if n}
    assert users == {
        "jkv.core.step": ["forward", "make_attention"],
        "jkv.policies.efficache": ["forward"],  # d loss / d head gate over the prompt
        "jkv.demo.train": ["forward"],  # training: the model without a cache
    }
