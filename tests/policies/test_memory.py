"""The seed 2.1 calculator and the savings goals, on the real presets (shapes only)."""

from __future__ import annotations

import pytest

import jkv
from jkv.cli import main


def test_seed_worked_example():
    # b=8, L=2048, 32 heads, d=128, fp16: 268,435,456 bytes per layer
    r = jkv.memory("llama-2-7b", 8, 2048, max_new_tokens=0, kv_dtype="float16")
    assert r.per_layer[0] == 268_435_456 == 2 * 8 * 2048 * 32 * 128 * 2
    assert int(r) == 32 * 268_435_456


def test_gqa_and_fp8_and_snapkv_savings():
    bf16 = jkv.memory("llama-3.1-8b", 1, 131072, max_new_tokens=0, kv_dtype="bfloat16")
    assert bf16.per_layer[0] == 2 * 131072 * 8 * 128 * 2  # 8 kv heads, not 32
    fp8 = jkv.memory("llama-3.1-8b", 1, 131072, max_new_tokens=0, kv_dtype="float8_e4m3fn")
    assert 1 - fp8.total / bf16.total >= 0.49  # the seed claims 47.2%
    snap = jkv.memory(
        "llama-3.1-8b", 1, 131072, kv_dtype="float8_e4m3fn", kv_policy="snapkv", kv_budget=0.1
    )
    # 13,108 kept tokens, allocated in steps of 1,024 above 4,096 slots (13,312) plus the decode
    # headroom's 64: the allocation saves 94.8% (whole powers of two, 16,384, saved 93.6%).
    assert snap.slots[0] == 13312 + 64
    assert 1 - snap.total / bf16.total >= 0.945  # the goal


def test_policies_size_as_documented():
    stream = jkv.memory(
        "llama-3.1-8b", 32, 100_000, max_new_tokens=1000, kv_policy="streaming", kv_budget=1024
    )
    assert stream.slots == (1024,) * 32  # evicting: no decode headroom
    pyramid = jkv.memory("llama-3.1-8b", 1, 10_000, kv_policy="pyramidkv", kv_budget=1000)
    assert pyramid.slots[0] > pyramid.slots[-1]


@pytest.mark.parametrize(
    "args, match",
    [
        (("nope", 1, 10), r"preset='nope' is unknown"),
        (("llama-3.1-8b", 0, 10), r"batch=0 must be an integer >= 1"),
        (("llama-3.1-8b", 1, 10.5), r"seq_len=10.5 must be an integer >= 1"),
        ((3, 1, 10), r"model=3 must be a preset name"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        jkv.memory(*args)


def test_cli(capsys):
    assert (
        main(
            ["memory", "llama-2-7b", "--batch", "8", "--seq-len", "2048", "--kv-dtype", "float16"]
            + ["--max-new-tokens", "0"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "268,435,456" in out
    assert (
        main(
            [
                "memory",
                "llama-3.1-8b",
                "--seq-len",
                "4096",
                "--kv-policy",
                "snapkv",
                "--kv-budget",
                "0.1",
                "--json",
            ]
        )
        == 0
    )
    assert '"slots"' in capsys.readouterr().out
    assert main(["memory", "llama-3.1-8b", "--seq-len", "10", "--kv-budget", "abc"]) == 2
    assert "invalid budget 'abc'" in capsys.readouterr().err
