"""Canonical keys: what must map to one key, and what must not."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.response_cache import is_cacheable, normalize_prompt, request_hash
from jkv.response_cache import keys as K

BASE = {
    "temperature": 0.0,
    "top_k": None,
    "top_p": 1.0,
    "min_p": None,
    "logit_keep_ratio": 0.5,
    "seed": None,
    "max_new_tokens": 64,
    "stop": ["\n\n"],
    "kv_policy": {"name": "snapkv", "budget": 256, "window": 32},
    "kv_dtype": "bfloat16",
}
words = st.text(st.characters(blacklist_categories=["Zs", "Cc", "Zl", "Zp"]), min_size=1)
spaces = st.text(st.sampled_from(" \t\n\r\x0b\x0c\u00a0\u2003"), min_size=1, max_size=4)
maybe_spaces = st.text(st.sampled_from(" \t\n\r"), max_size=3)


@given(st.lists(words, min_size=1, max_size=8), st.data())
def test_whitespace_variants_share_one_key_when_normalisation_is_asked_for(ws, data):
    canonical = " ".join(ws)
    variant = data.draw(maybe_spaces)
    for w in ws:
        variant += w + data.draw(spaces)
    assert normalize_prompt(variant) == canonical
    norm = {"normalize_whitespace": True}
    assert request_hash("t", "v1", variant, BASE, **norm) == request_hash(
        "t", "v1", canonical, BASE, **norm
    )
    # by default a text is hashed as the model would read it: whitespace counts
    if variant != canonical:
        assert request_hash("t", "v1", variant, BASE) != request_hash("t", "v1", canonical, BASE)
    assert request_hash("t", "v1", canonical, BASE) != request_hash(
        "t", "v1", canonical, BASE, **norm
    )


def _changed(value):
    """A different value of the same setting (or a new one)."""
    if value is None:
        return 1
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, "x"]
    return {**value, "budget": value["budget"] + 1}


@settings(max_examples=200)
@given(st.sampled_from(sorted(BASE)), words)
def test_changing_any_setting_changes_the_key(name, prompt):
    before = request_hash("t", "v1", prompt, BASE)
    assert request_hash("t", "v1", prompt, {**BASE, name: _changed(BASE[name])}) != before
    without = {k: v for k, v in BASE.items() if k != name}
    assert request_hash("t", "v1", prompt, without) != before  # absent differs from None too


@given(words, st.text(max_size=20), st.text(min_size=1, max_size=20))
def test_model_version_and_tenant_change_the_key(prompt, version, tenant):
    before = request_hash("t", version, prompt, BASE)
    assert request_hash("t", version + "'", prompt, BASE) != before
    if tenant != "t":
        assert request_hash(tenant, version, prompt, BASE) != before


@given(st.lists(st.integers(0, 2**31), max_size=50))
def test_token_prompts_hash_by_value_and_never_equal_text(tokens):
    h = request_hash("t", "v1", tokens, BASE)
    assert h == request_hash("t", "v1", tuple(tokens), BASE)
    assert h == request_hash("t", "v1", np.array(tokens, dtype=np.int64), BASE)
    assert h != request_hash("t", "v1", " ".join(map(str, tokens)), BASE)
    assert h != request_hash("t", "v1", [*tokens, 0], BASE)


def test_documented_value_rules():
    def h(**change):
        return request_hash("t", "v1", "p", {**BASE, **change})

    assert h(top_p=1) != h(top_p=1.0)  # ints and floats are distinct
    assert h(seed=1) != h(seed=True)  # so are bools and ints
    assert h(stop=("\n\n",)) == h(stop=["\n\n"])  # tuples equal lists
    assert h(max_new_tokens=np.int64(64)) == h(max_new_tokens=64)  # numpy scalars by value
    assert h(top_p=np.float64(0.5)) == h(top_p=0.5)
    reordered = {"window": 32, "budget": 256, "name": "snapkv"}
    assert h(kv_policy=reordered) == h()  # nested dicts are sorted
    assert request_hash("t", "v1", "p", dict(reversed(BASE.items()))) == h()


def test_settings_memo_never_confuses_equal_but_different_values():
    hasher = K.KeyHasher()
    a = hasher.digest("t", "v", "p", {"seed": 1, "temperature": 0})
    b = hasher.digest("t", "v", "p", {"seed": True, "temperature": 0})
    c = hasher.digest("t", "v", "p", {"seed": 1.0, "temperature": 0})
    assert len({a, b, c}) == 3
    assert a == K.KeyHasher().digest("t", "v", "p", {"seed": 1, "temperature": 0})


def test_hash_is_stable_across_releases():
    # Changing this value breaks every stored key: bump KEY_SCHEMA instead.
    digest = request_hash("default", "v1", "Hello world", {"temperature": 0.0})
    assert K.KEY_SCHEMA == 2  # 2: text is hashed exactly ("s"), or normalised if asked ("w")
    header = b'["jkv-key",2,"default","v1",{"temperature":0.0}]'
    framed = len(header).to_bytes(8, "little") + header + b"s" + b"Hello world"
    assert digest == hashlib.sha256(framed).hexdigest()
    assert digest == "7c96c753f1474d3e5308116206ae5c4ac06bfe154f82a61a200ba755b94bdd5f"
    spaced = request_hash("default", "v1", " Hello\n world ", {"temperature": 0.0},
                          normalize_whitespace=True)  # fmt: skip
    normalised = len(header).to_bytes(8, "little") + header + b"w" + b"Hello world"
    assert spaced == hashlib.sha256(normalised).hexdigest()


def test_key_format_and_hash_tag():
    key = K.response_key("meta-llama/Llama-3.2-1B", 4, "ab" * 32)  # 0xab % 64 = 0x2b
    assert key == "llm:response:{meta-llama/Llama-3.2-1B:2b}:4:" + "ab" * 32
    assert K.lease_key(key) == "llm:lease:{meta-llama/Llama-3.2-1B:2b}:4:" + "ab" * 32
    assert K.group_key("m", 4, 9, 0x2B) == "llm:group:{m:2b}:4:9"
    assert K.generation_of(K.response_key("m", 12, "ff" * 32)) == 12
    assert K.generation_of("llm:response:no-tag") is None


def test_a_models_keys_spread_over_every_bucket_and_patterns_match_only_its_own():
    import fnmatch
    import hashlib

    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(2000)]
    keys = [K.response_key("m", 0, d) for d in digests]
    assert len({k[: k.index("}")] for k in keys}) == K.BUCKETS
    assert all(fnmatch.fnmatchcase(k, K.response_pattern("m")) for k in keys)
    other = K.response_key("m2", 0, digests[0])  # a name the first one begins
    assert not fnmatch.fnmatchcase(other, K.response_pattern("m"))
    group = K.group_key("m", 3, 17, 5)
    assert fnmatch.fnmatchcase(group, K.group_pattern("m", 17))
    assert not fnmatch.fnmatchcase(group, K.group_pattern("m", 7))
    assert len(K.group_keys("m", 3, 17)) == K.BUCKETS


@pytest.mark.parametrize("name", ["a:b", "{a}", "a}", "a*", "a?", "a[1]", "a b", "", "-a", 3])
def test_model_names_that_would_break_keys_are_rejected(name):
    with pytest.raises(ValueError, match="model_name="):
        K.check_model_name(name)


@pytest.mark.parametrize(
    "text, name",
    [
        ("demo copy", "demo-copy"),
        ("Llama-3.2-1B", "Llama-3.2-1B"),
        ("  my: {model}*? ", "my-model"),
        ("-._x", "x"),
        ("über model", "ber-model"),
        ("???", "model"),
        ("x" * 300, "x" * 128),
    ],
)
def test_a_valid_name_is_derived_from_any_text(text, name):
    assert K.derive_model_name(text) == name == K.check_model_name(name)


def test_a_refused_name_suggests_a_valid_one():
    with pytest.raises(ValueError, match=r"model_name='demo copy' .* e\.g\. 'demo-copy'"):
        K.check_model_name("demo copy")


def test_settings_objects_key_like_their_mapping():
    settings = K.Settings(BASE)
    assert settings == BASE and settings.cacheable and dict(settings) == BASE
    hasher = K.KeyHasher()
    assert hasher.digest("t", "v1", "p q", settings) == request_hash("t", "v1", "p q", BASE)
    normalising = K.KeyHasher(normalize_whitespace=True)
    assert normalising.digest("t", "v1", "p q", settings) == request_hash(
        "t", "v1", "p  q", BASE, normalize_whitespace=True
    )
    assert not K.Settings({"temperature": 0.5}).cacheable
    with pytest.raises(ValueError, match=r"settings\['top_p'\]=inf"):
        K.Settings({**BASE, "top_p": float("inf")})


@pytest.mark.parametrize(
    "settings_, cacheable",
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0}, True),
        ({"temperature": 0.8}, False),
        ({"temperature": 0.8, "seed": 0}, True),
        ({"temperature": 0.8, "seed": True}, False),
        ({"temperature": 0.8, "top_k": 1}, True),
        ({}, False),
        ({"temperature": None}, False),
    ],
)
def test_is_cacheable(settings_, cacheable):
    assert is_cacheable(settings_) is cacheable
