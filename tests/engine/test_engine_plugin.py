"""A KV policy is one file (docs/contributing.md, "Add a KV policy"): a module defining a
`KVPolicy` subclass that names itself is a policy by that name everywhere, with nothing else
edited: `kv_policy="<name>"` resolves it, `jkv.generate` runs it, and `jkv.Engine` serves it
(one that selects once: the engine's selection runs its `keep` over the pool in place; one that
evicts: its `ring` picks each new token's slot), warms it up and gives the request's own tokens. The file here is written by the test and imported as a
plugin would be; every part of jkv finds it through `jkv.policies.POLICIES`."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import jkv
from jkv.compile_time import programs_built
from jkv.engine.engine import Engine
from jkv.policies import POLICIES, resolve

PLUGIN = '''
"""Keeps the even positions first, newest first, then the odd ones: a rule no other policy has."""
import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jkv.policies.base import KVPolicy, top_n, valid_slots


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvenFirst(KVPolicy):
    name: ClassVar[str] = "even_first_test"

    def keep(self, layer_index, layer, ctx):
        pos = layer.positions
        score = jnp.where(pos % 2 == 0, 1 << 20, 0) + pos
        return top_n(score.astype(jnp.float32), valid_slots(layer), ctx.budgets[:, None])
'''


def imported(folder, name: str, source: str):
    """The module of one plugin file `<name>.py` holding `source`, imported as a plugin is."""
    path = folder / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    yield imported(tmp_path_factory.mktemp("plugin"), "even_first_test", PLUGIN).EvenFirst
    POLICIES.pop("even_first_test", None)


def want_kept(n: int, budget: int) -> list[int]:
    """numpy: the even positions, newest first, then the odd ones, `budget` of them."""
    order = sorted(range(n), key=lambda p: (p % 2 != 0, -p))
    return sorted(order[:budget])


class Kept(Engine):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.kept = {}

    def _compress(self, seq, src, row, counts, ring=None):
        where = np.asarray(self.device.positions).reshape(-1)
        at = np.asarray(src)[row].reshape(len(counts), -1)
        self.kept[seq.request_id] = [sorted(where[a[:c]].tolist()) for a, c in zip(at, counts,
                                                                                    strict=True)]  # fmt: skip
        return super()._compress(seq, src, row, counts, ring)


def test_one_file_is_a_policy_the_engine_serves(plugin, tiny_params):
    demo = tiny_params("llama")
    policy = resolve("even_first_test", 9)
    assert type(policy) is plugin and policy.budget == 9
    ids = [(11 * i) % (demo.config.vocab_size - 3) + 3 for i in range(27)]
    alone = list(jkv.generate(demo, ids, kv_policy="even_first_test", kv_budget=9,
                              max_new_tokens=6, kv_dtype="float32").tokens)  # fmt: skip
    engine = Kept(demo, num_pages=300, page_size=4, token_budget=32, chunk=16, max_running=2,
                  kv_dtype="float32")  # fmt: skip
    assert "even_first_test" in engine.served_policies()
    engine.warmup(kv_policies=["even_first_test"])
    built = programs_built()
    [got] = engine.generate([ids], kv_policy="even_first_test", kv_budget=9, max_new_tokens=6)
    assert programs_built() == built  # warmup compiled its selection
    assert got == alone
    assert all(heads == want_kept(len(ids), 9) for heads in engine.kept["req-0"])


RING_PLUGIN = '''
"""Keeps the newest tokens of the prompt, then evicts the oldest token for each new one (no
sinks, keys rotated): first in, first out."""
import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jkv.policies.base import KVPolicy, Ring, top_n, valid_slots


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fifo(KVPolicy):
    name: ClassVar[str] = "fifo_test"
    evicts: ClassVar[bool] = True

    budget: int | float = 8

    def keep(self, layer_index, layer, ctx):
        return top_n(layer.positions.astype(jnp.float32), valid_slots(layer), ctx.budgets[:, None])

    def write_slots(self, layer, q_pos, limit):
        oldest = jnp.argmin(jnp.where(valid_slots(layer), layer.positions, 1 << 30), axis=-1)
        full = layer.lengths >= limit[:, None]
        return jnp.where(full, oldest, layer.lengths).astype(jnp.int32)

    def ring(self, limit):
        return Ring(limit)  # the base rule: first in, first out
'''


@pytest.fixture(scope="module")
def ring_plugin(tmp_path_factory):
    yield imported(tmp_path_factory.mktemp("plugin"), "fifo_test", RING_PLUGIN).Fifo
    POLICIES.pop("fifo_test", None)


class Written(Engine):
    """Records the text position each ring token's step wrote, per slot."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.slots = {}

    def _dispatch_flat(self, scheduled):
        for r in scheduled:
            if r.row.held == 0 and r.row.limit > 1:  # a ring's token
                self.slots.setdefault(r.row.request_id, []).append((r.row.start, r.row.first))
        return super()._dispatch_flat(scheduled)


def test_one_file_is_an_evicting_policy_the_engine_serves(ring_plugin, tiny_params):
    """An evicting policy with its ring rule (`KVPolicy.ring`) is served with nothing else
    edited: the engine's tokens are `jkv.generate`'s (whose `write_slots` is the same rule on
    the device), and the ring ends holding the newest `budget` positions (numpy's count)."""
    demo = tiny_params("llama")
    assert ring_plugin.served
    ids = [(13 * i) % (demo.config.vocab_size - 3) + 3 for i in range(21)]
    budget, new = 8, 14
    alone = list(jkv.generate(demo, ids, kv_policy="fifo_test", kv_budget=budget,
                              max_new_tokens=new, kv_dtype="float32").tokens)  # fmt: skip
    engine = Written(demo, num_pages=300, page_size=4, token_budget=32, chunk=16, max_running=2,
                     kv_dtype="float32")  # fmt: skip
    assert "fifo_test" in engine.served_policies()
    [got] = engine.generate([ids], kv_policy="fifo_test", kv_budget=budget, max_new_tokens=new)
    assert got == alone
    # prompt positions 13..20 kept in slots 0..7; each decoded token (positions 21..33, the
    # last sampled token is never written) overwrites the oldest: slot (p - 21) % 8
    written = engine.slots["req-0"]
    assert [p for p, _ in written] == list(range(len(ids), len(ids) + new - 1))
    assert [slot for _, slot in written] == [(p - len(ids)) % budget for p, _ in written]


def test_a_name_is_one_policys(plugin):
    import dataclasses
    from typing import ClassVar

    from jkv.policies.base import KVPolicy

    with pytest.raises(ValueError, match="KV policy name 'snapkv': taken by SnapKV"):

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Another(KVPolicy):
            name: ClassVar[str] = "snapkv"

    assert POLICIES["snapkv"].__name__ == "SnapKV"
