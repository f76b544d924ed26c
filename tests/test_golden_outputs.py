"""Greedy outputs of the demo model on a fixed prompt set, byte for byte as recorded.

The reference (tests/golden/demo_greedy.json) was written by this file's `record()` from the
code at the commit that added it; a refactoring of the core must leave every token in place.
After a deliberate change of the model or of a policy's maths, rerun
`python tests/test_golden_outputs.py` and say why in the commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import jkv
from jkv.demo.haystack import make_example

GOLDEN = Path(__file__).parent / "golden" / "demo_greedy.json"
SETTINGS = {
    "full": {},
    "full fp8": {"kv_dtype": "float8_e4m3fn"},
    "snapkv 0.5": {"kv_policy": "snapkv", "kv_budget": 0.5},
    "streaming 0.5": {"kv_policy": "streaming", "kv_budget": 0.5},
    "h2o 64": {"kv_policy": "h2o", "kv_budget": 64},
}


def prompts() -> list[str]:
    rng = np.random.default_rng(2024)
    # retrieval answers only: their logits are far apart, so no near-tie can flip a token
    # between machines
    return [make_example(rng, n, f).prompt for n, f in ((496, 4), (256, 8), (256, 1), (384, 2))]


def outputs(params) -> dict[str, list[list[int]]]:
    batch = prompts()
    return {
        name: [r.tokens for r in jkv.generate(params, batch, max_new_tokens=12, **kw)]
        for name, kw in SETTINGS.items()
    }


def record() -> None:
    GOLDEN.parent.mkdir(exist_ok=True)
    rows = outputs(jkv.load("demo"))
    lines = [f"  {json.dumps(name)}: {json.dumps(tokens)}" for name, tokens in rows.items()]
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")


@pytest.mark.slow
def test_greedy_outputs_are_the_recorded_ones():
    want = json.loads(GOLDEN.read_text())
    got = outputs(jkv.load("demo"))
    for name in SETTINGS:
        assert got[name] == want[name], name


if __name__ == "__main__":
    record()
