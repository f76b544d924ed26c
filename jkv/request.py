"""One request's settings: the defaults, the validation and the prompt's token ids, in one place.

`DEFAULTS` lists every per-request setting with its default: `jkv.generate`'s and `jkv.stream`'s
keywords (their signatures are built from it), the response cache's key (`Request.key_values`)
and, later, the HTTP body. `Request.build` validates them against a model into a `Request`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
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


KV_DTYPE_ALIASES = {"fp8": "float8_e4m3fn"}  # what users type -> the dtype's name


def resolve_policy(kv_policy, kv_budget=None) -> policies.KVPolicy | None:
    """`jkv.policies.resolve`, which also takes a mapping of a policy's name and fields, e.g.
    `{"name": "snapkv", "window": 16, "kernel": 11, "pool": "max"}` (the HTTP body's form):
    the same as `SnapKV(window=16, kernel=11, pool="max")`, validated by the policy class.
    `kv_budget` beside it sets its budget (Quantile's kept fraction, as for a name).

    Raises:
      ValueError: an unknown name or field, a budget given twice, or what the policy refuses.
    """
    if not isinstance(kv_policy, Mapping):
        return policies.resolve(kv_policy, kv_budget)
    fields = dict(kv_policy)
    name = fields.pop("name", None)
    if not isinstance(name, str) or name not in policies.POLICIES:
        raise ValueError(
            f"kv_policy.name={name!r}: expected one of {', '.join(sorted(policies.POLICIES))}"
        )
    cls = policies.POLICIES[name]
    known = () if cls is None else [f.name for f in dataclasses.fields(cls) if f.init]
    for field in fields:
        if field not in known:
            have = f"its fields are {', '.join(known)}" if known else "it has no fields"
            raise ValueError(f"kv_policy.{field}: {name!r} has no such field; {have}")
    if kv_budget is None:
        return None if cls is None else cls(**fields)
    by_budget = "q" if cls is policies.Quantile else "budget"
    if by_budget in fields:
        raise ValueError(
            f"kv_budget={kv_budget!r} beside kv_policy.{by_budget}={fields[by_budget]!r}: "
            "give one of them"
        )
    return dataclasses.replace(policies.resolve(name, kv_budget), **fields)


def stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop={stop!r} must be a non-empty string or a list of them")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:  # (the response cache's key could not be packed)
            raise ValueError(
                f"stop={stop!r} holds {s[e.start]!r} at index {e.start} of {s!r}, a lone "
                "surrogate that is not text; expected strings that encode as UTF-8"
            ) from None
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
        kv_dtype = s["kv_dtype"]
        kv_dtype = (
            kvlib.validate_kv_dtype(KV_DTYPE_ALIASES.get(kv_dtype, kv_dtype)) if kv_dtype else None
        )
        policy = resolve_policy(s["kv_policy"], s["kv_budget"])
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
