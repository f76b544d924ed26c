"""Compilation is a function of bucketed shapes only: sampling values, budgets and
max_new_tokens are traced data, and a repeated workload compiles nothing."""

from __future__ import annotations

import contextlib
import importlib

import jax
import numpy as np
import pytest

import jkv
from jkv.kv import bucket

gen = importlib.import_module("jkv.generate")
pre = importlib.import_module("jkv.prefill")
compress_mod = importlib.import_module("jkv.policies.compress")

# Lowering to XLA, not the backend compile: with the tests' persistent compilation cache a
# program compiled once is read back instead of compiled, but every program that has to be
# built (a jit cache miss) is lowered first.
COMPILE_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@contextlib.contextmanager
def count_compiles():
    """Counts every program lowered to XLA (jitted rungs and eager ops alike), whether it is
    then compiled or read back from the persistent compilation cache."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _requests(seed: int, vocab: int, n: int = 20, policy: str | None = None):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        kw = dict(
            max_new_tokens=int(rng.integers(1, 33)),
            temperature=float(rng.choice([0.0, 0.7, 1.0, 1.3])),
            top_k=[None, 5, 40][int(rng.integers(3))],
            top_p=[None, 0.9, 0.5][int(rng.integers(3))],
            min_p=[None, 0.05][int(rng.integers(2))],
            logit_keep_ratio=[None, 0.5][int(rng.integers(2))],
            seed=int(rng.integers(2**32)),
        )
        if policy is not None:
            ratio = bool(rng.integers(2))
            kw.update(
                kv_policy=policy,
                kv_budget=float(rng.uniform(0.1, 0.9)) if ratio else int(rng.integers(4, 200)),
            )
        prompt = rng.integers(3, vocab, size=int(rng.integers(1, 121))).tolist()
        out.append((prompt, kw))
    return out


def _cache_sizes():
    return {
        "prefill": pre.prefill_step._cache_size(),
        "compress": compress_mod.compress._cache_size(),
        "start": gen.start._cache_size(),
        "decode": gen.decode._cache_size(),
    }


def _shape_buckets(params, requests):
    """The bucket sizes the requests need (prompt lengths and cache capacities) and their
    max_new_tokens buckets."""
    sizes, headrooms = set(), set()
    for prompt, kw in requests:
        sizes.add(bucket(len(prompt)))
        policy = jkv.policies.resolve(kw.get("kv_policy"), kw.get("kv_budget"))
        if policy is not None:
            caps = policy.capacities(params.config.num_layers, [len(prompt)], 0)
            sizes.update(caps)
        headrooms.add(bucket(kw["max_new_tokens"]))
    return sizes, headrooms


@pytest.mark.parametrize("policy", [None, "h2o"])  # snapkv: the test below
def test_compiles_are_bounded_by_buckets_and_a_repeat_compiles_nothing(tiny_params, policy):
    params = tiny_params("llama")
    requests = _requests(11, params.config.vocab_size, policy=policy)
    before = _cache_sizes()
    for prompt, kw in requests:
        jkv.generate(params, prompt, **kw)
    grown = {k: v - before[k] for k, v in _cache_sizes().items()}
    sizes, headrooms = _shape_buckets(params, requests)
    bound = len(sizes) * len(headrooms)
    print(
        f"{policy=}: compiled {grown}; size buckets {sorted(sizes)}, headroom buckets "
        f"{sorted(headrooms)}, bound {bound}"
    )
    assert grown["prefill"] <= bound
    assert grown["decode"] <= bound
    assert grown["start"] <= bound
    assert grown["compress"] <= (0 if policy is None else len(sizes) ** 2)
    with count_compiles() as seen:
        for prompt, kw in requests:
            jkv.generate(params, prompt, **kw)
    assert seen == [], f"the repeated workload compiled {len(seen)} times"


def test_temperature_and_budget_changes_share_one_compiled_step(tiny_params):
    params = tiny_params("llama")
    prompt = list(range(3, 40))
    jkv.generate(
        params, prompt, max_new_tokens=9, temperature=0.5, kv_policy="snapkv", kv_budget=20
    )
    with count_compiles() as seen:
        for temperature, budget, new in ((0.9, 24, 12), (1.5, 31, 16), (0.0, 17, 10)):
            jkv.generate(
                params,
                prompt,
                max_new_tokens=new,
                temperature=temperature,
                seed=4,
                kv_policy="snapkv",
                kv_budget=budget,
            )
    assert seen == []
