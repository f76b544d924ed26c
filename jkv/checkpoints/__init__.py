"""Checkpoint formats: Hugging Face folders in, jkv (orbax) folders in and out."""

from __future__ import annotations

from pathlib import Path

from jkv.checkpoints.hf import load_hf
from jkv.checkpoints.orbax import is_saved, load_saved, save
from jkv.params import Params

__all__ = ["load", "load_hf", "load_saved", "save", "convert"]


def load(
    path: str | Path,
    *,
    name: str | None = None,
    dtype: str | None = None,
    mesh=None,
    progress: bool = False,
) -> Params:
    """Loads a Hugging Face checkpoint folder or a folder written by `jkv.save`.

    Raises:
      ValueError: the path does not exist or holds neither format.
    """
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"path={str(path)!r} does not exist; expected a checkpoint folder")
    if not folder.is_dir():
        raise ValueError(f"path={str(path)!r} is a file; expected a checkpoint folder")
    if is_saved(folder):
        return load_saved(folder, name=name, dtype=dtype, mesh=mesh)
    if (folder / "config.json").is_file():
        return load_hf(folder, dtype=dtype, name=name, mesh=mesh, progress=progress)
    raise ValueError(
        f"path={str(path)!r} holds neither a Hugging Face checkpoint (config.json + *.safetensors) "
        f"nor a jkv checkpoint (jkv.json)"
    )


def convert(
    hf_folder: str | Path,
    out_folder: str | Path,
    *,
    dtype: str | None = None,
    name: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Converts a Hugging Face checkpoint folder into a jkv folder (orbax weights)."""
    out = Path(out_folder)
    if out.exists() and any(out.iterdir()) and not overwrite:  # fail before the slow part
        raise ValueError(f"{out}: exists and is not empty; pass overwrite=True to replace it")
    params = load_hf(hf_folder, dtype=dtype, name=name, progress=progress)
    return save(params, out, overwrite=overwrite)
