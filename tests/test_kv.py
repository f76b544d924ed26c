"""The functional KV state: ragged appends, no wrap-around, byte accounting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv import kv


def test_append_ragged_rows_and_drop_past_capacity():
    state = kv.init_state(
        num_layers=1, batch=2, num_kv_heads=2, head_dim=4, capacity=6, dtype="float32"
    )
    layer = state.layers[0]
    k_new = jnp.arange(2 * 4 * 2 * 4, dtype=jnp.float32).reshape(2, 4, 2, 4) + 1
    pos = jnp.broadcast_to(jnp.arange(4), (2, 4))
    layer = kv.append(layer, k_new, -k_new, pos, jnp.array([3, 4]))
    np.testing.assert_array_equal(layer.lengths, [[3, 3], [4, 4]])
    np.testing.assert_array_equal(layer.positions[0, 0], [0, 1, 2, -1, -1, -1])
    np.testing.assert_array_equal(layer.k[0, 1, :3], k_new[0, :3, 1])
    assert np.all(np.asarray(layer.k[0, :, 3:]) == 0)  # row 0's padding token was not written
    # 4 more tokens into row 1 (length 4, capacity 6): 2 fit, 2 are dropped, nothing wraps.
    layer = kv.append(layer, k_new, -k_new, pos + 4, jnp.array([0, 4]))
    np.testing.assert_array_equal(layer.lengths, [[3, 3], [6, 6]])
    np.testing.assert_array_equal(layer.k[1, 0, :4], k_new[1, :4, 0])
    np.testing.assert_array_equal(layer.k[1, 0, 4:], k_new[1, :2, 0])


def test_per_layer_capacities_and_bytes():
    state = kv.init_state(
        num_layers=3, batch=2, num_kv_heads=4, head_dim=8, capacity=[16, 8, 4], dtype="bfloat16"
    )
    assert [x.capacity for x in state.layers] == [16, 8, 4]
    assert kv.nbytes(state) == 2 * 2 * 4 * 8 * 2 * (16 + 8 + 4)
    assert kv.used_bytes(state) == 0
    fp8 = kv.init_state(
        num_layers=1, batch=1, num_kv_heads=1, head_dim=128, capacity=10, dtype="float8_e4m3fn"
    )
    bf16 = kv.init_state(
        num_layers=1, batch=1, num_kv_heads=1, head_dim=128, capacity=10, dtype="bfloat16"
    )
    assert kv.nbytes(fp8) / kv.nbytes(bf16) <= 0.51  # scales counted


def test_state_is_a_pytree_that_jit_donates():
    state = kv.init_state(
        num_layers=2, batch=1, num_kv_heads=1, head_dim=4, capacity=3, dtype="float32"
    )
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert len(leaves) == 2 * 4 + 2  # k, v, lengths, positions per layer; next_position, limit
    bump = jax.jit(lambda s: s.replace(next_position=s.next_position + 1), donate_argnums=0)
    out = bump(state)
    assert int(out.next_position[0]) == 1 and out.dtype == "float32"


def test_bad_capacity_list_and_dtype():
    with pytest.raises(ValueError, match=r"capacity has 2 entries; expected one per layer \(3\)"):
        kv.init_state(
            num_layers=3, batch=1, num_kv_heads=1, head_dim=4, capacity=[4, 4], dtype="float32"
        )
    with pytest.raises(ValueError, match=r"kv_dtype='float64' is not supported"):
        kv.validate_kv_dtype("float64")


def test_capacity_buckets_are_powers_of_two_then_sixteenths():
    from jkv.kv import capacity_bucket

    assert [capacity_bucket(n) for n in (1, 16, 17, 4096)] == [16, 16, 32, 4096]
    for n in (4097, 5000, 13108, 16385, 100_000, 131_072):
        c = capacity_bucket(n)
        p = 1 << (n - 1).bit_length()  # numpy-free reference: the next power of two
        assert n <= c <= p and c % (p // 16) == 0 and (c - n) < p // 16, (n, c)
