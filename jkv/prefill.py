"""Prompt -> KV state: the first rung of the generation ladder, and `jkv.prefill`.

`prefill_step` is the jitted forward over a padded prompt batch (lengths bucketed to powers of
two, `jkv.kv.bucket`, so recompiles stay bounded). `prepare` builds the state a request decodes from: a fresh
cache, or a copy of a given state grown for the new tokens, then prefill, then the KV policy's
compression, so what the policy drops never reaches the decode loop.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv import attention as attn
from jkv import kv as kvlib
from jkv import policies
from jkv.kv import bucket, headroom
from jkv.limits import check_context, check_memory
from jkv.params import Params
from jkv.policies.compress import compress, grow
from jkv_models.config import ModelConfig
from jkv_models.llama import forward


@functools.partial(
    jax.jit, static_argnames=("config", "backend", "policy", "all_logits"), donate_argnames=("kv",)
)
def prefill_step(
    weights,
    config: ModelConfig,
    tokens: jax.Array,
    n_new: jax.Array,
    kv: kvlib.KVState,
    *,
    backend: str = "xla",
    policy=None,
    all_logits: bool = False,
):
    """Runs the prompt `[B, T]` (row b's first n_new[b] tokens are real) through the model.

    Returns (logits float32 `[B, V]` at each row's last real token, or `[B, T, V]` with
    `all_logits`; the filled KV state).
    """
    t = tokens.shape[1]
    positions = kv.next_position[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
    attend = attn.make_attention(
        n_new,
        sliding_window=config.sliding_window,
        backend=backend,
        policy=policy,
        limit=kv.limit,
        inv_freq=jnp.asarray(config.inv_freq()),
    )
    logits, layers = forward(
        weights,
        config,
        tokens,
        positions,
        kv.layers,
        attend,
        logits_at=None if all_logits else jnp.maximum(n_new - 1, 0),
    )
    return logits, kv.replace(layers=layers, next_position=kv.next_position + n_new)


# ------------------------------------------------------------------ prompts
def _as_ids(params: Params, prompt, index: int | None, special: bool = True) -> list[int]:
    where = "prompt" if index is None else f"prompt[{index}]"
    if isinstance(prompt, bytes | bytearray):
        try:
            prompt = bytes(prompt).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{where} is bytes that are not UTF-8 (byte {prompt[e.start]:#04x} at offset "
                f"{e.start}); expected text, UTF-8 bytes or a list of token ids"
            ) from None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}={prompt!r} is empty or only whitespace; expected some text")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where} holds {prompt[e.start]!r} at index {e.start}, a lone surrogate that is "
                "not text (a mis-decoded byte?); expected a str that encodes as UTF-8"
            ) from None
        if params.tokenizer is None:
            raise ValueError(f"{where} is text but the params carry no tokenizer; pass token ids")
        ids = params.tokenizer.encode(prompt, add_special_tokens=special)
    elif isinstance(prompt, Sequence | np.ndarray) and all(
        isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt
    ):
        ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"{where}={prompt!r:.80} must be a str or a list of token ids")
    if not ids:
        raise ValueError(f"{where} is empty; expected at least one token")
    vocab = params.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{where} holds token id {bad[0]}; expected ids in [0, {vocab})")
    return ids


def encode_prompts(params: Params, prompt, *, continuation: bool = False):
    """Token-id lists for a prompt or a batch of prompts, and whether it was a batch.

    A `continuation` (text appended to a prefilled state) is encoded without the tokenizer's
    special tokens: no second `<s>` in the middle of the sequence.
    """
    if isinstance(prompt, list | tuple) and not prompt:
        raise ValueError("prompt=[] is empty; expected a str, a list of token ids, or a batch")
    is_batch = isinstance(prompt, list | tuple) and all(
        isinstance(p, str | bytes | bytearray | list | tuple | np.ndarray) for p in prompt
    )
    if is_batch:
        return [_as_ids(params, p, i, not continuation) for i, p in enumerate(prompt)], True
    return [_as_ids(params, prompt, None, not continuation)], False


# ------------------------------------------------------------------ the state a request needs
def check_state(state, cfg: ModelConfig, batch: int, kv_dtype: str | None) -> None:
    if not isinstance(state, kvlib.KVState):
        raise ValueError(
            f"kv_state is a {type(state).__name__}; expected the KVState that jkv.prefill returned"
        )
    if state.batch_size != batch:
        raise ValueError(f"kv_state holds {state.batch_size} rows but {batch} prompts were given")
    layer = state.layers[0]
    got = (len(state.layers), layer.k.shape[1], layer.k.shape[3])
    want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    if got != want:
        raise ValueError(
            "kv_state was made by another model: it holds (layers, kv heads, head dim) = "
            f"{got}; these params expect {want}"
        )
    if kv_dtype is not None and kv_dtype != state.dtype:
        raise ValueError(f"kv_dtype={kv_dtype!r} differs from the kv_state's {state.dtype!r}")


def prepare(
    params: Params,
    prompts: list[list[int]],
    *,
    policy,
    kv_dtype: str,
    backend: str,
    max_new_tokens: int,
    kv_state: kvlib.KVState | None = None,
):
    """Prefills `prompts` into a state ready to decode `max_new_tokens` more tokens per row.

    Without `kv_state`: a fresh cache; the policy (if any) compresses the prompt's cache.
    With `kv_state` (from `jkv.prefill`): the prompts continue it, uncompressed (its policy
    keeps evicting if it evicts); the given state is left intact.

    Every compiled shape is a bucket: the prompt's (`bucket`), the decode headroom's
    (`headroom`) and the capacities a policy asks for; budgets travel as per-row data.

    Returns:
      (logits `[B, V]` at each row's last token, the state).
    """
    cfg = params.config
    lengths = [len(p) for p in prompts]
    t = bucket(max(lengths))
    tokens = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    tokens, n_new = jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)

    if kv_state is not None:
        key = kv_state.policy
        evicting = key is not None and key.evicts
        kv = grow(kv_state, t + (0 if evicting else headroom(max_new_tokens)))
    else:
        key = None if policy is None else policy.jit_key()
        capacity = t if policy is not None else t + headroom(max_new_tokens)
        limits = None if policy is None else policy.row_limits(lengths)
        kv = empty_state(cfg, len(prompts), capacity, kv_dtype, policy=key, limit=limits)
    if params.mesh is not None:
        from jkv.sharding import shard_kv

        kv = shard_kv(kv, params.mesh)
    logits, kv = prefill_step(params.weights, cfg, tokens, n_new, kv, backend=backend, policy=key)
    if kv_state is None and policy is not None:
        kv = compress(
            params.weights,
            cfg,
            kv,
            tokens,
            n_new,
            jnp.asarray(policy.row_budgets(lengths)),
            policy=key,
            capacities=policy.capacities(cfg.num_layers, lengths, max_new_tokens),
            backend=backend,
        )
    elif kv_state is not None and key is not None and key.evicts:
        # Back to the fixed capacity: the policy's rule picks what the new tokens displace.
        kv = compress(
            params.weights,
            cfg,
            kv,
            tokens,
            n_new,
            kv.limit,
            policy=key,
            capacities=tuple(x.capacity for x in kv_state.layers),
            backend=backend,
        )
    return logits, kv


def prefill(
    params: Params,
    context,
    *,
    kv_policy=None,
    kv_budget=None,
    kv_dtype=None,
    backend=None,
    allow_beyond_context: bool = False,
) -> kvlib.KVState:
    """Prefills (and compresses) a context once, to continue later from the returned state.

    `jkv.generate(params, question, kv_state=state)` then appends the question to the
    compressed context and decodes: kvpress's question-agnostic protocol, the honest way to
    score compression (the policy never sees the question). The state can serve many
    questions; each generate call works on a copy.

    Args:
      params: from `jkv.load`.
      context: a str, token ids, or a batch of either.
      kv_policy, kv_budget: a `jkv.policies.KVPolicy`, or a name with a budget (tokens or a
        ratio of the context).
      kv_dtype: KV storage dtype (default: the params' dtype).
      backend: attention backend ("xla", "pallas", "pallas_interpret").
      allow_beyond_context: accept a context longer than the model's trained one (as in
        `jkv.generate`).

    Returns:
      The `KVState` (its `policy` attached).
    """
    if not isinstance(params, Params):
        raise ValueError(f"params is a {type(params).__name__}; expected jkv.Params")
    policy = policies.resolve(kv_policy, kv_budget)
    kv_dtype = kvlib.validate_kv_dtype(kv_dtype or params.kv_dtype)
    backend = attn.validate_backend(backend)
    prompts, _ = encode_prompts(params, context)
    lengths = [len(p) for p in prompts]
    rerank_within = max(policy.row_limits(lengths)) if policy and policy.raw_keys else None
    check_context(
        params.config, lengths, 0, rerank_within=rerank_within, allowed=allow_beyond_context
    )
    check_memory(params, lengths, 0, policy=policy, kv_dtype=kv_dtype)
    _, state = prepare(
        params, prompts, policy=policy, kv_dtype=kv_dtype, backend=backend, max_new_tokens=0
    )
    return state


def empty_state(
    cfg: ModelConfig, batch: int, capacity: int, dtype: str, *, policy=None, limit=None
):
    """An empty KV state shaped for `cfg` that carries `policy` (a `jit_key()`) and the row
    budgets `limit`, with the per-slot score array when that policy accumulates one."""
    return kvlib.init_state(
        num_layers=cfg.num_layers,
        batch=batch,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        capacity=capacity,
        dtype=dtype,
        scores=policy is not None and policy.observes,
        policy=policy,
        limit=limit,
    )


def _one_text(params: Params, text, what: str, *, continuation: bool = False) -> list[int]:
    """The ids of the one text a scoring function takes (at least 2 tokens)."""
    if not isinstance(params, Params):
        raise ValueError(f"params is a {type(params).__name__}; expected jkv.Params")
    rows, is_batch = encode_prompts(params, text, continuation=continuation)
    if is_batch:
        raise ValueError(f"{what} takes one text; got a batch of {len(rows)}")
    if len(rows[0]) < 2:
        raise ValueError(f"text has {len(rows[0])} token(s); scoring needs at least 2")
    return rows[0]


def score(params: Params, text, *, kv_state: kvlib.KVState | None = None, backend=None):
    """Log-probabilities the model gives each next token of `text` (one row), continuing
    `kv_state` if given (e.g. a context compressed by a policy): perplexity under compression.

    Returns:
      float32 numpy `[n - 1]`: log p(token_i | the state and text[:i]) for i = 1..n-1.
    """
    ids = _one_text(params, text, "score", continuation=kv_state is not None)
    backend = attn.validate_backend(backend)
    t = bucket(len(ids))
    tokens = np.zeros((1, t), np.int32)
    tokens[0, : len(ids)] = ids
    cfg = params.config
    if kv_state is not None:
        check_state(kv_state, params.config, 1, None)
        kv, policy = grow(kv_state, t), kv_state.policy
    else:
        kv, policy = empty_state(cfg, 1, t, params.kv_dtype), None
    logits, _ = prefill_step(
        params.weights,
        cfg,
        jnp.asarray(tokens),
        jnp.asarray([len(ids)], jnp.int32),
        kv,
        backend=backend,
        policy=policy,
        all_logits=True,
    )
    logp = np.asarray(jax.nn.log_softmax(logits[0, : len(ids) - 1], axis=-1))
    return logp[np.arange(len(ids) - 1), np.asarray(ids[1:])].astype(np.float32)


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def _teacher_forced(weights, config: ModelConfig, ids, kv, *, backend: str):
    """log p(ids[i + 1] | ids[:i + 1]) fed one token at a time through the decode path
    (`kv.policy` applied at every step, as in generation): float32 `[n - 1]`."""
    attend = attn.make_attention(
        jnp.ones((1,), jnp.int32),
        sliding_window=config.sliding_window,
        backend=backend,
        policy=kv.policy,
        limit=kv.limit,
        inv_freq=jnp.asarray(config.inv_freq()),
    )

    def step(kv, tok):
        logits, layers = forward(
            weights,
            config,
            tok[None, None],
            kv.next_position[:, None],
            kv.layers,
            attend,
            logits_at=jnp.zeros((1,), jnp.int32),
        )
        kv = kv.replace(layers=layers, next_position=kv.next_position + 1)
        return kv, jax.nn.log_softmax(logits[0].astype(jnp.float32))

    _, logp = jax.lax.scan(step, kv, ids[:-1])
    return logp[jnp.arange(ids.shape[0] - 1), ids[1:]]


def stream_score(params: Params, text, *, policy=None, backend=None):
    """Per-token log-probabilities of `text` (one row) decoded token by token, the way
    StreamingLLM measures perplexity: with `policy` (an evicting policy of integer budget, e.g.
    `StreamingLLM(budget=256)`) the cache never holds more than its budget however long the text;
    with None, a full cache of the whole text (the contrast past the trained context).

    Returns:
      float32 numpy `[n - 1]`: log p(token_i | text[:i]) for i = 1..n-1.
    """
    ids = _one_text(params, text, "stream_score")
    backend = attn.validate_backend(backend)
    policy = policies.resolve(policy)
    cfg = params.config
    if policy is None:
        kv = empty_state(cfg, 1, len(ids), params.kv_dtype)
    elif policy.evicts and isinstance(policy.budget, int):
        cap = policy.capacities(cfg.num_layers, [len(ids)], 0)[0]
        kv = empty_state(
            cfg,
            1,
            cap,
            params.kv_dtype,
            policy=policy.jit_key(),
            limit=policy.row_limits([len(ids)]),
        )
    else:
        raise ValueError(
            f"policy={policy.describe()} must evict at a fixed integer budget (e.g. "
            "StreamingLLM(budget=256)); a fractional budget needs the whole text up front"
        )
    out = _teacher_forced(params.weights, cfg, jnp.asarray(ids, jnp.int32), kv, backend=backend)
    return np.asarray(out, np.float32)
