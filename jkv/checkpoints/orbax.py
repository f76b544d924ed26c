"""jkv's own checkpoint folder: orbax-saved weights + config + tokenizer + metadata.

Layout of a folder written by `save` (and by `jkv convert`):
  jkv.json        {"format": 1, "name", "version", "config": ModelConfig fields}
  weights/        orbax checkpoint of the weights tree
  tokenizer.json  when the params carry a tokenizer (chat_template.jinja beside it when it has one)

The stored "version" is informative only: a load fingerprints the weights it restored (on
first use), since the files may have changed since they were saved.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from jkv import sharding
from jkv.checkpoints.finite import check_tree
from jkv.checkpoints.names import choose_name
from jkv.params import Params
from jkv.tokenizer import Tokenizer
from jkv_models.config import ModelConfig, RopeScaling
from jkv_models.llama import param_shapes, unstack_layers

FORMAT = 2  # 2: the decoder layers stacked (`jkv_models.llama.stack_layers`); 1: one per layer
READS = (1, 2)
MARKER = "jkv.json"


def _config_to_json(config: ModelConfig) -> dict:
    data = dataclasses.asdict(config)
    data["eos_token_ids"] = list(config.eos_token_ids)
    return data


def config_from_json(data: dict, source: str) -> ModelConfig:
    data = dict(data)
    if data.get("rope_scaling"):
        data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
    data["eos_token_ids"] = tuple(data.get("eos_token_ids") or ())
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{source}: unknown config field {unknown[0]!r}")
    return ModelConfig(**data)


def save(params: Params, folder: str | Path, *, overwrite: bool = False) -> Path:
    """Writes `params` to `folder` (created; must be empty unless `overwrite`).

    Raises:
      ValueError: the folder exists and is not empty (and `overwrite` is False).
    """
    import orbax.checkpoint as ocp

    folder = Path(folder).resolve()
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise ValueError(f"{folder}: exists and is not empty; pass overwrite=True to replace it")
    folder.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(folder / "weights", params.weights, force=True)
        ckptr.wait_until_finished()
    if params.tokenizer is not None:
        params.tokenizer.save(folder / "tokenizer.json")
    meta = {
        "format": FORMAT,
        "name": params.name,
        "version": params.version,
        "config": _config_to_json(params.config),
    }
    (folder / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def is_saved(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def load_saved(
    folder: str | Path, *, name: str | None = None, dtype: str | None = None, mesh=None
) -> Params:
    """Loads a folder written by `save`.

    Raises:
      ValueError: unreadable metadata, a newer format, weights that do not fit the config or
        hold NaN/Inf, or a `name` keys cannot hold.
    """
    import orbax.checkpoint as ocp

    folder = Path(folder).resolve()
    meta = read_meta(folder)
    name = choose_name(name, stored_name(folder, meta))
    config = config_from_json(meta["config"], str(folder / MARKER))
    cast = dtype is not None and dtype != config.dtype
    if cast:
        config = config.replace(dtype=dtype)

    def target(path, leaf):
        if mesh is None:
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        names = tuple(getattr(p, "key", str(p)) for p in path)
        return jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=sharding.param_sharding(names, leaf.shape, mesh)
        )

    shapes = param_shapes(config)
    if meta["format"] == 1:  # saved before the layers were stacked: restored, then stacked
        shapes = unstack_layers(shapes)
    abstract = jax.tree_util.tree_map_with_path(target, shapes)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            weights = ckptr.restore(folder / "weights", abstract)
    except Exception as e:  # orbax reports tree/shape mismatches in many forms; name the folder
        raise ValueError(
            f"{folder / 'weights'}: cannot restore weights for this config ({e})"
        ) from None
    check_tree(weights, str(folder / "weights"))
    tokenizer = Tokenizer.from_folder(
        folder, bos_token_id=config.bos_token_id, eos_token_ids=config.eos_token_ids
    )
    return Params(weights=weights, config=config, tokenizer=tokenizer, name=name, mesh=mesh)


def read_meta(folder: Path) -> dict:
    """The parsed `jkv.json` of a folder written by `save`.

    Raises:
      ValueError: unreadable, or a format this jkv does not read.
    """
    marker = folder / MARKER
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{marker}: cannot read jkv metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READS:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise ValueError(f"{marker}: format={found!r}; this jkv reads formats {READS}")
    return meta


def stored_name(folder: Path, meta: dict) -> str:
    """The text a saved folder's model is named from: the saved name, else the folder's."""
    name = meta.get("name")
    return name if isinstance(name, str) and name else folder.name
