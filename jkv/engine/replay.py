"""KVzip's replay in the engine (`jkv.policies.KVzip`, the one-shot path's `jkv.replay`): after a
prompt KVzip compresses has run on the flattened step, the model is asked to repeat the context
(the same requests as `jkv.replay.requests`), teacher-forced, over the row's own pages; each
replay query's attention scores the prompt's slots, read through the row's page table.

The replay's tokens are written into the row's pages after its prompt (`Sequence.scratch`
tokens of room, taken before the replay and given back by the compaction that follows), in
pieces of `REPLAY_CHUNK` tokens: one piece is one program whatever the prompt, its scores
(the most attention any of its queries gives a slot, `jkv.policies.kvzip.replay_scores`) read
over the row's first `span` slots (a power of two: the prompt and the replay so far). A slot's
score is the most any piece of any pass gave it, as the one-shot path's; the selection then
ranks every (layer, kv head, slot) of the row together (`KVzip.keep_all`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv import kv as kvlib
from jkv.core.paged import PagedRows
from jkv.engine import programs
from jkv.engine.plan import bucket
from jkv.engine.runner import PagedKV, Rows, token_index
from jkv.engine.select import pool_pass
from jkv.policies.kvzip import replay_scores
from jkv.replay import requests
from jkv_kernels import bits_take

REPLAY_CHUNK = 256  # replay tokens one program takes (a longer replay: several calls)


def replay_tokens(params, prompt: list[int], policy) -> list[tuple[list[int], int, int]]:
    """Each replay pass of `prompt`: (its token ids, the replayed piece's first and end
    positions in the prompt), as the one-shot path's (`jkv.replay.requests`)."""
    return requests(params, prompt, policy.chunk)


def scratch_tokens(params, prompt: list[int], policy) -> int:
    """The room past the prompt the replay writes into: its longest pass."""
    return max(len(ids) for ids, _, _ in replay_tokens(params, prompt, policy))


def replay_span(end: int, width: int) -> int:
    """The slots a piece's scores read: a power of two >= `end` (>= 256), at most `width`."""
    return min(bucket(end, 256), width)


@programs.jit(static_argnames=("config", "backend", "dtype", "span"),
              donate_argnames=("pool", "best"))  # fmt: skip
def replay_piece(weights, config, pool: PagedKV, rows: PagedRows, tokens, positions, piece, best,
                 row, *, backend: str, dtype: str, span: int):  # fmt: skip
    """One piece of a replay pass of one row (`rows`: one row whose `held` counts the prompt,
    the pass's earlier pieces and this one; `tokens` `[C]` at `positions` `[C]`): the model
    over it, its K and V written into the row's pages, every layer's queries scoring the row's
    first `span` slots. `piece` `[4]` int32: the replayed context's first and end positions,
    the sinks, the prompt's length (the slots a pass's softmax runs over: the piece, the sinks
    and the replay itself). `best` `[E, L, K, W]` float32: row `row`'s slot scores so far, raised
    to this piece's. Returns (best, the pool); both donated."""
    queries, pool = pool_pass(weights, config, pool, rows, tokens, positions, backend=backend,
                              dtype=dtype, write=True)  # fmt: skip
    kh, page = config.num_kv_heads, pool.page_size
    tables = rows.tables[:1, : -(-span // page)]
    index_rows = Rows(tables, rows.base[:1], rows.n_prefix[:1], rows.held[:1], jnp.zeros(1, bool))
    dense = jnp.broadcast_to(jnp.arange(span, dtype=jnp.int32), (1, kh, span))
    lengths = jnp.broadcast_to(rows.held[:1, None], (1, kh))
    live = dense < lengths[..., None]
    lo, hi, sink, n = piece[0], piece[1], piece[2], piece[3]
    flat = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # noqa: E731

    def one_layer(args):
        layer, q = args  # q: [C, N, H] this layer's rotated queries
        at = token_index(pool, index_rows, layer, kh, dense)  # [1, K, span]
        pos = jnp.where(live, flat(pool.positions)[at], -1)
        scale = None if pool.k_scale is None else bits_take(flat(pool.k_scale), at)
        k = bits_take(flat(pool.k), at)  # (as bits: XLA:CPU widens a whole narrow-float pool)
        part = (pos < sink) | ((pos >= lo) & (pos < hi)) | (pos >= n)
        view = kvlib.LayerKV(k=k, v=k, lengths=lengths, positions=pos, k_scale=scale,
                             v_scale=scale, scores=jnp.where(part, 0.0, -1.0))  # fmt: skip
        return replay_scores(view, q[None], positions[None], rows.q_len[:1])[0]  # [K, span]

    scores = jax.lax.map(one_layer, (jnp.arange(config.num_layers, dtype=jnp.int32), queries))
    mine = jax.lax.dynamic_index_in_dim(best, row, keepdims=False)  # [L, K, W]
    mine = mine.at[:, :, :span].max(scores)
    return jax.lax.dynamic_update_index_in_dim(best, mine, row, 0), pool


def pack_replay(table_row, group: int, prompt_len: int, done: int, ids: list[int],
                c: int = REPLAY_CHUNK):  # fmt: skip
    """Host arrays for `replay_piece`: one row (its page table `table_row` `[M]`) whose replay
    has written `done` tokens after its prompt of `prompt_len`, and now runs `ids` (at most
    `c`), padded to `c` tokens. Returns (`PagedRows`, tokens, positions)."""
    n = len(ids)
    first = prompt_len + done
    tokens, positions = np.zeros(c, np.int32), np.zeros(c, np.int32)
    tokens[:n], positions[:n] = ids, np.arange(first, first + n)
    tok_row, tok_slot = np.full(c, 1, np.int32), np.zeros(c, np.int32)
    tok_row[:n], tok_slot[:n] = 0, np.arange(first, first + n)
    one = lambda v: np.array([v], np.int32)  # noqa: E731
    rows = PagedRows(np.asarray(table_row, np.int32)[None], np.zeros((1, group), np.int32),
                     one(0), one(first + n), one(0), one(n), tok_row, tok_slot, np.int32(0),
                     np.int32(1))  # fmt: skip
    return rows, tokens, positions
