"""jkv.request: one settings table behind generate's keywords, validation and the cache key."""

from __future__ import annotations

import inspect

import pytest

import jkv
from jkv.request import DEFAULTS, KEY_NAMES, Request
from jkv.response_cache.front import request_settings


def test_generate_and_stream_take_every_setting_with_its_default():
    for fn in (jkv.generate, jkv.stream):
        params = inspect.signature(fn).parameters
        settings = {n: p.default for n, p in params.items() if n in DEFAULTS}
        assert settings == DEFAULTS
        assert list(params) == ["params", "prompt", *DEFAULTS, "kv_state", "cache"]


def test_every_setting_that_changes_the_output_is_in_the_cache_key():
    # kv_budget lives in the resolved policy's description; allow_beyond_context only permits.
    assert set(KEY_NAMES) == set(DEFAULTS) - {"kv_budget", "allow_beyond_context"}
    assert Request.key_names == KEY_NAMES


def test_an_unknown_setting_is_named(tiny_params):
    params = tiny_params("llama")
    with pytest.raises(ValueError, match="unknown setting 'temprature'; expected one of"):
        jkv.generate(params, [5, 6, 7], temprature=0.5)
    with pytest.raises(ValueError, match="unknown setting 'kv_polcy'"):
        list(jkv.stream(jkv.load("demo"), "what", kv_polcy="snapkv"))


def test_defaults_fill_what_is_not_given(tiny_params):
    params = tiny_params("llama")
    req = Request.build(params, max_new_tokens=5, kv_policy="snapkv", kv_budget=8)
    assert req.max_new_tokens == 5 and req.seed == DEFAULTS["seed"] and req.stop == ()
    assert req.policy.budget == 8 and req.sampling.temperature == 0.0
    key = request_settings(req, params)
    assert list(key) == list(KEY_NAMES)
    assert key["kv_policy"]["budget"] == 8 and key["kv_dtype"] == params.kv_dtype


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(temperature="hot"), "temperature='hot' must be a finite number"),
        (dict(max_new_tokens=0), "max_new_tokens=0 must be a positive integer"),
        (dict(stop=[""]), "stop=\\[''\\] must be a non-empty string"),
        (dict(stop=["ok", "a\ud800"]), "holds '\\\\ud800' at index 1 of 'a\\\\ud800', a lone"),
        (dict(backend="tpu"), "backend='tpu' is not supported"),
    ],
)
def test_bad_values_are_named(tiny_params, bad, message):
    with pytest.raises(ValueError, match=message):
        Request.build(tiny_params("llama"), **bad)


def test_a_policy_by_its_fields_is_the_policy_object(tiny_params):
    from jkv.policies import Quantile, SnapKV

    params = tiny_params("llama")
    fields = {"name": "snapkv", "window": 16, "kernel": 11, "pool": "max"}
    want = SnapKV(budget=0.25, window=16, kernel=11, pool="max")
    assert Request.build(params, kv_policy={**fields, "budget": 0.25}).policy == want
    assert Request.build(params, kv_policy=fields, kv_budget=0.25).policy == want
    assert Request.build(params, kv_policy={"name": "quantile"}, kv_budget=0.3).policy == (
        Quantile(q=0.7)
    )
    assert Request.build(params, kv_policy={"name": "full"}).policy is None
    for bad, message in (
        ({**fields, "windw": 3}, r"kv_policy.windw: 'snapkv' has no such field; its fields"),
        ({**fields, "kernel": 4}, r"kernel=4 must be odd"),
        ({**fields, "window": 16.0}, r"window=16.0 must be an integer"),
        ({"name": "snap"}, r"kv_policy.name='snap': expected one of"),
        ({"name": "full", "budget": 3}, r"kv_policy.budget: 'full' has no such field"),
    ):
        with pytest.raises(ValueError, match=message):
            Request.build(params, kv_policy=bad)
    with pytest.raises(ValueError, match=r"kv_budget=0.5 beside kv_policy.budget=0.25"):
        Request.build(params, kv_policy={**fields, "budget": 0.25}, kv_budget=0.5)


def test_fp8_names_float8_e4m3fn(tiny_params):
    req = Request.build(tiny_params("llama"), kv_dtype="fp8")
    assert req.kv_dtype == "float8_e4m3fn"
