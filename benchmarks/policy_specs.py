"""Policy specs of the quality benchmarks: `"snapkv:window=16,kernel=11,pool=max"` names a jkv
policy and the fields set beside its budget; each maps to the keywords of `jkv.generate` /
`jkv.prefill` and to the kvpress press of the same method, for the side-by-side rows of
benchmarks/quality.py (demo model) and benchmarks/quality_real.py (SmolLM2)."""

from __future__ import annotations

KVPRESS_FOR = {  # the kvpress press of the same method, for the side-by-side rows
    "snapkv": "snapkv",
    "streaming": "streaming",
    "h2o": "observed_attention",
    "pyramidkv": "pyramidkv",
    "quantile": "knorm",
    "adakv": "adakv",
    "kvzip": "kvzip",
}


def policy_spec(spec: str) -> tuple[str, dict]:
    """`"snapkv:window=16,kernel=11,pool=max"` -> ("snapkv", {"window": 16, ...}): a jkv
    policy name and the fields set beside the budget (ints, floats and true/false where they
    parse)."""
    name, _, fields = spec.partition(":")
    kw = {}
    for item in filter(None, fields.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"policy field {item!r} in {spec!r} must be key=value")
        kw[key] = _value(value)
    return name, kw


def _value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def policy_kw(spec: str | None, ratio: float) -> dict:
    """generate/prefill keywords of a policy spec keeping the fraction `ratio` (None: full)."""
    if spec is None:
        return {}
    name, fields = policy_spec(spec)
    if not fields:
        return dict(kv_policy=name, kv_budget=ratio)
    from jkv import policies

    if name == "quantile":  # Quantile keeps the fraction 1 - q, as resolve() builds it
        return dict(kv_policy=policies.Quantile(q=1.0 - ratio, **fields))
    return dict(kv_policy=policies.POLICIES[name](budget=ratio, **fields))


def kvpress_for(spec: str) -> tuple[str, dict] | None:
    """The kvpress press of a spec's method and the fields it shares with it (None: no peer)."""
    name, fields = policy_spec(spec)
    if name not in KVPRESS_FOR:
        return None
    press = KVPRESS_FOR[name]
    import quality_kvpress as qk

    shared = qk.METHODS[press][2]
    return press, {pf: fields[jf] for pf, jf in shared.items() if jf in fields}


def press_label(name: str, overrides: dict) -> str:
    return name + "".join(f" {k}={v}" for k, v in overrides.items())
