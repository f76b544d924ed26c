"""KVzip's replay (`jkv.policies.KVzip`): after a prompt is prefilled, the model is asked to
repeat the context, teacher-forced, over the prompt's cache; its queries score every slot.

The request is the reference implementation's (kvpress's `KVzipPress.prepare`): "Repeat the
previous context exactly." and the chat template's turn change (the text that follows a user
message: end of turn, the assistant's header; "\\n" for a model without a template), then the
context. The context is the prompt after the chat's own prefix (the system turn and the user
header), when the prompt starts with it; a context longer than the policy's `chunk` is replayed
in pieces, each request naming the 8 tokens before its piece, each pass's softmax over its piece,
the sinks and itself. Each pass adds one prefill's work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jkv import kv as kvlib
from jkv.chat import render, special_tokens
from jkv.core.step import model_step, next_positions
from jkv.kv import fine_bucket
from jkv.policies.kvzip import OVERLAP, REPEAT, REPEAT_PART

_DUMMY = "dummy context"


def chat_frame(params) -> tuple[list[int], list[int]]:
    """(the ids a chat's first user message starts with, the ids that end a user turn and
    open the assistant's), as kvpress derives them from the chat template; ([], ids of "\\n")
    without a template, ([], []) without a tokenizer."""
    tok = params.tokenizer
    if tok is None:
        return [], []
    if tok.chat_template is None:
        return [], tok.encode("\n", add_special_tokens=False)
    sep = "\n" + "#" * len(_DUMMY)
    text = render([{"role": "user", "content": _DUMMY + sep}], tok.chat_template,
                  special_tokens(params))  # fmt: skip
    head, suffix = text.split(sep)
    prefix = head.split(_DUMMY)[0]
    return tok.encode(prefix, add_special_tokens=False), tok.encode(
        suffix, add_special_tokens=False
    )


def requests(params, prompt: list[int], chunk: int) -> list[tuple[list[int], int, int]]:
    """Each replay pass of `prompt`: (its token ids: the request, then one piece of the
    context, `chunk` tokens at most; the piece's first and end positions in the prompt)."""
    prefix, suffix = chat_frame(params)
    start = len(prefix) if prefix and prompt[: len(prefix)] == prefix else 0
    tok = params.tokenizer
    ask = [] if tok is None else tok.encode(REPEAT, add_special_tokens=False)
    ask_part = [] if tok is None else tok.encode(REPEAT_PART, add_special_tokens=False)
    out = []
    for lo in range(start, max(len(prompt), start + 1), chunk):
        hi = min(lo + chunk, len(prompt))
        head = ask if lo == start else ask_part + prompt[max(start, lo - OVERLAP) : lo]
        out.append((head + suffix + prompt[lo:hi], lo, hi))
    return out


def trimmed(layer: kvlib.LayerKV, s: int) -> kvlib.LayerKV:
    """`layer` with only its first `s` slots (every valid one among them)."""
    cut = lambda x: None if x is None else x[:, :, :s]  # noqa: E731
    return layer.replace(k=cut(layer.k), v=cut(layer.v), positions=cut(layer.positions),
                         k_scale=cut(layer.k_scale), v_scale=cut(layer.v_scale),
                         scores=cut(layer.scores))  # fmt: skip


@functools.partial(jax.jit, static_argnames=("config", "backend", "policy"))
def replay_pass(weights, config, state: kvlib.KVState, tokens, n_new, *, backend, policy):
    """One replay pass over a copy of `state` with room for `tokens` `[B, T]` (row b's first
    `n_new[b]` real), whose scores mark the slots the pass's softmax runs over (>= 0). Returns
    every layer's slot scores `[B, K, S]` (`KVzip.observe`; -1 outside the pass)."""
    s = state.layers[0].capacity
    kv = kvlib.with_room(state, tokens.shape[1])
    _, kv = model_step(
        weights, config, kv, tokens, next_positions(kv, tokens.shape[1]), n_new,
        policy=policy, backend=backend, logits_at=jnp.zeros_like(n_new),
    )  # fmt: skip
    return tuple(x.scores[:, :, :s] for x in kv.layers)


def replay(params, prompts: list[list[int]], state: kvlib.KVState, policy, backend: str):
    """`state` (the prompts prefilled, with a score per slot) with every slot scored by the
    replay of its row's context (`jkv.policies.KVzip`): a slot's score is the most any pass
    gave it; slots no pass replays (the chat's prefix) score 0. The passes run over the state
    cut to the prompts' length (`jkv.kv.fine_bucket`), not its power-of-two capacity."""
    per_row = [requests(params, p, policy.chunk) for p in prompts]
    key = policy.replay_key()
    capacity = state.layers[0].capacity
    s = min(capacity, fine_bucket(max(len(p) for p in prompts)))
    work = [trimmed(x, s) for x in state.layers]
    best = [jnp.zeros(x.lengths.shape + (s,), jnp.float32) for x in work]
    for i in range(max(len(r) for r in per_row)):
        batch = [r[i] if i < len(r) else ([], 0, 0) for r in per_row]
        tokens = np.zeros((len(prompts), fine_bucket(max(len(x[0]) for x in batch))), np.int32)
        for b, (ids, _, _) in enumerate(batch):
            tokens[b, : len(ids)] = ids
        n_new = np.array([len(x[0]) for x in batch], np.int32)
        lo = jnp.asarray([x[1] for x in batch], jnp.int32)[:, None, None]
        hi = jnp.asarray([x[2] for x in batch], jnp.int32)[:, None, None]
        # The slots this pass's softmax runs over score 0 going in, the others -1.
        part = [(x.positions < policy.sink) | ((x.positions >= lo) & (x.positions < hi))
                for x in work]  # fmt: skip
        layers = tuple(
            x.replace(scores=jnp.where(m, 0.0, -1.0)) for x, m in zip(work, part, strict=True)
        )
        scores = replay_pass(params.weights, params.config, state.replace(layers=layers),
                             tokens, n_new, backend=backend, policy=key)  # fmt: skip
        best = [jnp.maximum(b, v) for b, v in zip(best, scores, strict=True)]
    pad = ((0, 0), (0, 0), (0, capacity - s))
    return state.replace(
        layers=tuple(
            x.replace(scores=jnp.pad(v, pad)) for x, v in zip(state.layers, best, strict=True)
        )
    )
