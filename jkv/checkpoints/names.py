"""Model names: what `jkv.load` calls a model, shown the same by `jkv info`, the response-cache
keys and `jkv cache invalidate-model`.

A name defaults to the checkpoint folder's (a jkv folder keeps the name it was saved with, so
`jkv convert` keeps the source folder's), made valid for cache keys by
`jkv.response_cache.keys.derive_model_name` ("demo copy" -> "demo-copy"). A name given with `name=`
is used as is, or refused when keys cannot hold it.
"""

from __future__ import annotations

from jkv.response_cache.keys import check_model_name, derive_model_name


def choose_name(name: object, default_from: str) -> str:
    """`name` when given, else the valid name made from `default_from` (a folder's name).

    Raises:
        ValueError: `name` is given and cannot be a model name, with a valid suggestion.
    """
    if name is None:
        return derive_model_name(default_from)
    try:
        return check_model_name(name)
    except ValueError:
        hint = f"; e.g. name={derive_model_name(name)!r}" if isinstance(name, str) else ""
        raise ValueError(
            f"name={name!r} cannot name a model in cache keys; expected 1-128 characters from "
            f"A-Z a-z 0-9 . _ - / + @ starting with a letter or digit{hint}"
        ) from None
