"""Checkpoint formats: Hugging Face folders in, jkv (orbax) folders in and out."""

from __future__ import annotations

from pathlib import Path

import jkv_models
from jkv.checkpoints.hf import load_hf
from jkv.checkpoints.names import choose_name
from jkv.checkpoints.orbax import is_saved, load_saved, read_meta, save, stored_name
from jkv.params import Params

__all__ = ["load", "load_hf", "load_saved", "save", "convert", "default_name"]
DEMO_NAME = "jkv-demo"


def load(
    path: str | Path,
    *,
    name: str | None = None,
    dtype: str | None = None,
    mesh=None,
    progress: bool = False,
) -> Params:
    """Loads a Hugging Face checkpoint folder, a folder written by `jkv.save`, or "demo" (the
    bundled demo model).

    Raises:
      ValueError: the path does not exist or holds neither format.
    """
    if str(path) == "demo":
        return load_demo(name=name, dtype=dtype, mesh=mesh)
    folder = _checkpoint_folder(path)
    if is_saved(folder):
        return load_saved(folder, name=name, dtype=dtype, mesh=mesh)
    return load_hf(folder, dtype=dtype, name=name, mesh=mesh, progress=progress)


def default_name(path: str | Path) -> str:
    """The name `load(path)` gives the model without `name=` (reads no weights): what
    `jkv info` shows and what `jkv cache invalidate-model` takes.

    Raises:
      ValueError: as `load`, when the path holds no checkpoint.
    """
    if str(path) == "demo":
        return DEMO_NAME
    folder = _checkpoint_folder(path).resolve()
    source = stored_name(folder, read_meta(folder)) if is_saved(folder) else folder.name
    return choose_name(None, source)


def _checkpoint_folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"path={str(path)!r} does not exist; expected a checkpoint folder")
    if not folder.is_dir():
        raise ValueError(f"path={str(path)!r} is a file; expected a checkpoint folder")
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
    hf_folder: str | Path,
    out_folder: str | Path,
    *,
    dtype: str | None = None,
    name: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Converts a Hugging Face checkpoint folder into a jkv folder (orbax weights); the model
    keeps the source folder's name (`default_name(hf_folder)`) unless `name` is given."""
    out = Path(out_folder)
    if out.exists() and any(out.iterdir()) and not overwrite:  # fail before the slow part
        raise ValueError(f"{out}: exists and is not empty; pass overwrite=True to replace it")
    params = load_hf(hf_folder, dtype=dtype, name=name, progress=progress)
    return save(params, out, overwrite=overwrite)
