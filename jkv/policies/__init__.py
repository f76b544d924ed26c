"""KV compression policies that make the cache physically smaller.

Pass one to `jkv.generate(..., kv_policy=SnapKV(budget=256))` or by name
(`kv_policy="snapkv", kv_budget=256`). Names: full, streaming, snapkv, snapkv_segments, h2o,
pyramidkv, adakv, efficache, quantile, kvzip, and any other policy class that names itself
(`KVPolicy.__init_subclass__`: every module of this package is imported, so a new policy is one
file here).
"""

from __future__ import annotations

import importlib
import pkgutil

from jkv.policies.adakv import AdaKV
from jkv.policies.base import REGISTRY, KVPolicy
from jkv.policies.efficache import EffiCache
from jkv.policies.h2o import H2O
from jkv.policies.importance import token_importance
from jkv.policies.kvzip import KVzip
from jkv.policies.pyramidkv import PyramidKV
from jkv.policies.quantile import Quantile
from jkv.policies.segments import SnapKVSegments, segment_report
from jkv.policies.snapkv import SnapKV
from jkv.policies.streaming import StreamingLLM


def _discover() -> None:
    """Imports every module of this package: each policy class in one registers itself by its
    `name` (`KVPolicy.__init_subclass__`), so a new file here is a new policy."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_discover()
POLICIES: dict[str, type[KVPolicy] | None] = REGISTRY  # live: a policy defined later joins it


def resolve(kv_policy, kv_budget=None) -> KVPolicy | None:
    """A policy object (None for the full cache) from a policy, a name, or None.

    Raises:
      ValueError: unknown name, a budget beside a policy object or the full cache, bad budget.
    """
    if isinstance(kv_policy, KVPolicy):
        if kv_budget is not None:
            raise ValueError(
                f"kv_budget={kv_budget!r} given beside a policy object; set "
                f"{type(kv_policy).__name__}(budget=...) instead"
            )
        return None if type(kv_policy) is KVPolicy else kv_policy
    if kv_policy is None or kv_policy == "full":
        if kv_budget is not None:
            raise ValueError(
                f"kv_budget={kv_budget!r} needs a compressing kv_policy, not the full cache"
            )
        return None
    if not isinstance(kv_policy, str) or kv_policy not in POLICIES:
        raise ValueError(
            f"kv_policy={kv_policy!r} is unknown; expected a KVPolicy or one of {sorted(POLICIES)}"
        )
    cls = POLICIES[kv_policy]
    return cls() if kv_budget is None else cls.from_budget(kv_budget)


__all__ = [
    "POLICIES",
    "AdaKV",
    "EffiCache",
    "H2O",
    "KVPolicy",
    "KVzip",
    "PyramidKV",
    "Quantile",
    "SnapKV",
    "SnapKVSegments",
    "StreamingLLM",
    "resolve",
    "segment_report",
    "token_importance",
]
