"""One request's settings: the defaults, the validation and the prompt's token ids, in one place.

`DEFAULTS` lists every per-request setting with its default: `jkv.generate`'s and `jkv.stream`'s
keywords (their signatures are built from it), the response cache's key (`Request.key_values`)
and, later, the HTTP body. `Request.build` validates them against a model into a `Request`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import ClassVar

from jkv import kv as kvlib
from jkv import policies
from jkv.core.backends import validate_backend
from jkv.core.sampling import Sampling, check_seed
from jkv.params import Params

# Every setting of a request and its default (the order is the keywords' order).
DEFAULTS = dict(
    max_new_tokens=64,
    temperature=0.0,
    top_k=None,
    top_p=None,
    min_p=None,
    logit_keep_ratio=None,
    seed=0,
    stop=None,
    kv_dtype=None,
    backend=None,
    kv_policy=None,
    kv_budget=None,
    allow_beyond_context=False,
)
# Settings that change the output, in the response cache's key order (`allow_beyond_context`
# only permits a request, and kv_budget is part of the resolved policy).
KEY_NAMES = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "logit_keep_ratio",
    "seed",
    "stop",
    "kv_policy",
    "kv_dtype",
    "backend",
)


def stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop={stop!r} must be a non-empty string or a list of them")
    return items


@dataclasses.dataclass(frozen=True)
class Request:
    """Validated settings of one generate / stream call (shared by every row of a batch)."""

    max_new_tokens: int
    sampling: Sampling
    seed: int
    stop: tuple[str, ...]
    kv_dtype: str | None
    backend: str
    policy: policies.KVPolicy | None = None
    allow_beyond_context: bool = False
    key_names: ClassVar[tuple[str, ...]] = KEY_NAMES  # what `key_values` returns, in order

    @classmethod
    def build(cls, params: Params, **settings) -> Request:
        """Validates `settings` (names of `DEFAULTS`; missing ones take their default)."""
        unknown = sorted(set(settings) - set(DEFAULTS))
        if unknown:
            raise ValueError(
                f"unknown setting {unknown[0]!r}; expected one of {', '.join(DEFAULTS)}"
            )
        s = {**DEFAULTS, **settings}
        if not isinstance(params, Params):
            raise ValueError(
                f"params is a {type(params).__name__}; expected jkv.Params (from jkv.load)"
            )
        n = s["max_new_tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_new_tokens={n!r} must be a positive integer")
        check_seed(s["seed"])
        if not isinstance(s["allow_beyond_context"], bool):
            raise ValueError(
                f"allow_beyond_context={s['allow_beyond_context']!r} must be True or False"
            )
        kv_dtype = kvlib.validate_kv_dtype(s["kv_dtype"]) if s["kv_dtype"] else None
        policy = policies.resolve(s["kv_policy"], s["kv_budget"])
        window = params.config.sliding_window
        if policy is not None and policy.raw_keys and window is not None:
            raise ValueError(
                f"kv_policy={policy.name!r} rotates keys to positions within its cache, which "
                f"the model's sliding_window={window} (in text positions) cannot follow; use "
                "another policy or the full cache"
            )
        temperature = s["temperature"]
        return cls(
            max_new_tokens=n,
            sampling=Sampling(
                temperature=float(temperature)
                if isinstance(temperature, int | float) and not isinstance(temperature, bool)
                else temperature,
                top_k=s["top_k"],
                top_p=s["top_p"],
                min_p=s["min_p"],
                logit_keep_ratio=s["logit_keep_ratio"],
            ),
            seed=s["seed"],
            stop=stop_strings(s["stop"]),
            kv_dtype=kv_dtype,
            backend=validate_backend(s["backend"]),
            policy=policy,
            allow_beyond_context=s["allow_beyond_context"],
        )

    def key_values(self, params: Params) -> tuple:
        """The settings that change the output, resolved, in `KEY_NAMES` order (the response
        cache's key): the policy by its description, the kv dtype the weights give by default."""
        s = self.sampling
        return (
            self.max_new_tokens,
            s.temperature,
            s.top_k,
            s.top_p,
            s.min_p,
            s.logit_keep_ratio,
            self.seed,
            self.stop,
            None if self.policy is None else self.policy.describe(),
            self.kv_dtype or params.kv_dtype,  # the weights' dtype: a cast changes the default
            self.backend,
        )


def signature(fn, *, before: Sequence[str], after: dict) -> inspect.Signature:
    """`fn`'s signature for help(): the positional names `before`, then every setting of
    `DEFAULTS` as a keyword with its default, then the keywords of `after` (name -> default)."""
    pos = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in before]
    kw = [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d)
        for n, d in {**DEFAULTS, **after}.items()
    ]
    return inspect.signature(fn).replace(parameters=pos + kw)
