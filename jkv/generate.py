"""The one-shot path: `jkv.generate` and `jkv.stream`.

A `Session` is one batch in flight: prefill (`jkv.prefill.prepare`: model steps over the
prompt, then the policy's compression), then chunks of the fused decode loop (`jkv.decode`),
with stop strings and text from `jkv.output` on the host between chunks. The response cache,
when given, is around the generation: the prompt's ids are looked up, misses generate here,
and their results fill the cache (`jkv.response_cache.front`, as `jkv serve` does).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

from jkv import compile_time
from jkv import kv as kvlib
from jkv.chat import chat_prompt
from jkv.core.sampling import SamplingArrays
from jkv.decode import decode, start
from jkv.kv import bucket
from jkv.limits import check_context, check_memory
from jkv.output import GenerationResult, RowOutput
from jkv.params import Params
from jkv.prefill import check_state, prepare
from jkv.prompt import encode_prompts, is_batch
from jkv.request import Request, signature
from jkv.response_cache import front
from jkv.response_cache.miss import Lookup

STOP_CHECK_EVERY = 16  # decode steps between host-side stop-string checks


def check_limits(params, lengths, req: Request, kv_state, kv_dtype) -> bool:
    """The trained context and the free memory, before anything is allocated; returns whether
    the request runs past the context (allowed by `allow_beyond_context`)."""
    start_at, rerank_within, policy = 0, None, req.policy
    if kv_state is not None:
        start_at = int(np.max(np.asarray(kv_state.next_position)))
        if kv_state.policy is not None and kv_state.policy.raw_keys:
            rerank_within = int(np.max(np.asarray(kv_state.limit)))
    elif policy is not None and policy.raw_keys:
        rerank_within = int(max(policy.row_limits(lengths)))
    beyond = check_context(
        params.config,
        lengths,
        req.max_new_tokens,
        start=start_at,
        rerank_within=rerank_within,
        allowed=req.allow_beyond_context,
    )
    check_memory(
        params, lengths, req.max_new_tokens, policy=policy, kv_dtype=kv_dtype, start=start_at
    )
    return beyond


def compile_since(mark: tuple[float, int]) -> float:
    return compile_time.totals()[0] - mark[0]


class Session:
    """One batch in flight: prefill at construction, then `advance` runs decode chunks."""

    def __init__(
        self,
        params: Params,
        prompts: list[list[int]],
        req: Request,
        kv_state=None,
        *,
        text: bool = False,
    ):
        self.params, self.req = params, req
        cfg = params.config
        self.prompt_lengths = [len(p) for p in prompts]
        b = len(prompts)
        if kv_state is not None:
            kv_state = check_state(kv_state, params, b, req.kv_dtype)
            if req.policy is not None:
                raise ValueError(
                    "kv_policy given beside kv_state: the state keeps the policy "
                    "it was prefilled with"
                )
        kv_dtype = kv_state.dtype if kv_state is not None else req.kv_dtype or params.kv_dtype
        self.eos_ids = tuple(sorted(set(cfg.eos_token_ids)))
        self.policy = req.policy if kv_state is None else kv_state.policy
        self.beyond_context = check_limits(params, self.prompt_lengths, req, kv_state, kv_dtype)
        self.compile_start = compile_time.totals()
        t0 = time.perf_counter()
        logits, kv = prepare(
            params,
            prompts,
            policy=req.policy,
            kv_dtype=kv_dtype,
            backend=req.backend,
            max_new_tokens=req.max_new_tokens,
            kv_state=kv_state,
        )
        self.state = start(
            logits,
            kv,
            SamplingArrays.build([req.sampling] * b, [req.seed] * b),
            jnp.full((b,), req.max_new_tokens, jnp.int32),
            eos_ids=self.eos_ids,
            slots=bucket(req.max_new_tokens),
        )
        self.state.tokens.block_until_ready()
        self.prefill_s = time.perf_counter() - t0 - compile_since(self.compile_start)
        self.decode_s = 0.0
        self._host_tokens = None
        # Text as it decodes, only where something reads it before the end (stop strings, a
        # stream); otherwise each row is decoded once, at the end.
        self.outputs = None
        if req.stop or text:
            self.outputs = [RowOutput(params.tokenizer, req.stop) for _ in range(b)]
            self._read_text()

    @property
    def finished(self) -> bool:
        return bool(np.all(np.asarray(self.state.done)))

    def advance(self, steps: int) -> None:
        """Runs up to `steps` decode steps, then reads the new text (stop strings) on the host."""
        t0, c0 = time.perf_counter(), compile_time.totals()
        limit = jnp.asarray(int(self.state.step) + steps, jnp.int32)
        self.state = decode(
            self.params.weights,
            self.params.config,
            self.state,
            limit,
            eos_ids=self.eos_ids,
            backend=self.req.backend,
        )
        self.state.count.block_until_ready()
        self.decode_s += time.perf_counter() - t0 - compile_since(c0)
        self._host_tokens = None
        if self.outputs is not None:
            self._read_text()

    def row_tokens(self, i: int) -> list[int]:
        if self._host_tokens is None:
            self._host_tokens = (np.asarray(self.state.tokens), np.asarray(self.state.count))
        tokens, count = self._host_tokens
        return tokens[i, : count[i]].tolist()

    def _read_text(self) -> None:
        """Feeds each row's new tokens to its output; a row whose text now holds a stop string
        is marked done (the device loop skips it from the next step on)."""
        newly_done = []
        for i, out in enumerate(self.outputs):
            if out.hit is not None:
                continue
            ids = self.row_tokens(i)
            out.push(ids[len(out.detok.ids) :])
            if out.hit is not None:
                newly_done.append(i)
        if newly_done:
            done = np.asarray(self.state.done).copy()
            done[newly_done] = True
            self.state = dataclasses.replace(self.state, done=jnp.asarray(done))

    def run(self) -> None:
        chunk = STOP_CHECK_EVERY if self.req.stop else self.req.max_new_tokens
        while not self.finished:
            self.advance(chunk)

    def results(self) -> list[GenerationResult]:
        # Every array of the dense state has the batch as its leading axis, the same capacity
        # for every row: a row's share of the allocation is the batch's over B.
        batch_bytes = kvlib.nbytes(self.state.kv)
        kv_bytes = batch_bytes // len(self.prompt_lengths)
        generated = int(np.asarray(self.state.count).sum())
        decoded = generated - len(self.prompt_lengths)  # the first token comes from prefill
        compiled, hits = (
            a - b for a, b in zip(compile_time.totals(), self.compile_start, strict=True)
        )
        stats_common = {
            "compile_s": compiled,  # tracing + XLA compilation, left out of the times below
            "compile_cache_hits": hits,  # programs read from JAX's persistent cache
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": decoded / self.decode_s if self.decode_s > 0 else 0.0,
            "batch_kv_bytes": batch_bytes,  # the whole batch's allocation
            "kv_bookkeeping_bytes": kvlib.bookkeeping_bytes(self.state.kv),
            "kv_capacity": [x.capacity for x in self.state.kv.layers],
            "kv_policy": None if self.policy is None else self.policy.describe(),
            "batch_size": len(self.prompt_lengths),
            "beyond_context": self.beyond_context,
        }
        if self.policy is not None:  # decoded tokens left out of what compression achieved
            stats_common.update(self.policy.report(self.state.kv, np.asarray(self.state.count) - 1))
        out = []
        tokenizer = self.params.tokenizer
        for i, plen in enumerate(self.prompt_lengths):
            ids = self.row_tokens(i)
            reason = "stop" if ids and ids[-1] in self.eos_ids else "length"
            hit = None if self.outputs is None else self.outputs[i].hit
            if hit is not None:
                ids, reason = ids[: hit[1]], "stop"
                text = self.outputs[i].text
            else:
                text = tokenizer.decode(ids) if tokenizer else ""
            out.append(
                GenerationResult(
                    text=text,
                    tokens=ids,
                    finish_reason=reason,
                    kv_bytes=kv_bytes,
                    stats={
                        **stats_common,
                        "kv_bytes_used": kvlib.used_bytes(self.state.kv, i),
                        "prompt_tokens": plen,
                        "generated_tokens": len(ids),
                    },
                )
            )
        return out


def generate(params: Params, prompt, *, kv_state=None, cache=None, **settings):
    """Generates a continuation of `prompt` (or of each prompt of a batch).

    Args:
      params: from `jkv.load` (weights + config + tokenizer).
      prompt: a string, a list of token ids, or a list of either (a batch; rows may differ in
        length and each row's output equals its output alone).
      max_new_tokens: upper bound on generated tokens per row (default 64).
      temperature: 0 is greedy; otherwise softmax sampling at this temperature.
      top_k, top_p, min_p: sampling filters (None: off).
      logit_keep_ratio: keep only this fraction of the highest logits.
      seed: PRNG seed; the same seed gives the same samples.
      stop: a string or list of strings; generation of a row ends when its text contains one
        (the text is cut before it). The model's eos tokens always stop a row.
      kv_dtype: KV storage dtype: "float32", "bfloat16" or "float8_e4m3fn" (E4M3 values with a
        bfloat16 scale per row, kv head and token; ~0.51x the bf16 bytes). Default: the
        params' dtype.
      backend: attention backend: "xla" (default on CPU), "pallas" (default on GPU) or
        "pallas_interpret" (the Pallas kernels interpreted, any machine; slow).
      kv_policy: a `jkv.policies.KVPolicy` (e.g. `SnapKV(budget=256)`) or a name ("full",
        "streaming", "snapkv", "h2o", "pyramidkv", "adakv", "efficache", "quantile", ...);
        it compresses the prompt's cache after prefill and keeps its budget while decoding.
      kv_budget: with a policy name: tokens kept (int) or a ratio of each prompt (float).
      allow_beyond_context: let the prompt plus `max_new_tokens` run past the model's trained
        context (`max_position_embeddings`); refused otherwise, except under StreamingLLM with a
        budget within the context. `stats["beyond_context"]` says whether it did.
      kv_state: a `jkv.KVContext` from `jkv.prefill` (or `KVContext.from_bytes`) to continue:
        the prompt is appended to it, the context itself is not consumed; one computed by other
        weights, another model's shape or another kv dtype is a ValueError.
      cache: a `jkv.ResponseCache`: answers come from L1, then L2 (Redis), then the model,
        which fills both. The key holds the prompt as the model reads it: token ids, or the
        text exactly (whitespace normalised only for a tokenizer that cannot see it; see
        `jkv.response_cache.front`), so prompts the model tells apart never share an
        answer. `result.cache`
        is "l1", "l2", "coalesced" or None (this call generated); a hit reports the
        `kv_bytes` and stats of the generation that produced it, plus `stats["cache"]`.
        Identical concurrent calls of one prompt generate once. Not used with `kv_state`
        (the state is not part of the key).

    The settings and their defaults are `jkv.request.DEFAULTS`.

    Returns:
      A `GenerationResult`, or a list of them for a batch.

    Raises:
      ValueError: naming the bad argument.
    """
    req = Request.build(params, **settings)
    if req.stop and params.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; these params carry none")
    if cache is not None and kv_state is None:
        return through_cache(params, prompt, req, cache)
    prompts, batch = encode_prompts(params, prompt, continuation=kv_state is not None)
    results = run(params, prompts, req, kv_state)
    return results if batch else results[0]


def through_cache(params, prompt, req, cache):
    """`generate` through the response cache: every row looked up (by `front.prompt_key`: a
    text hit costs no tokenisation), the misses generated together, then filled. Rows of a
    batch with the same key generate once ("coalesced"); a single prompt also waits for an
    identical call generating in another thread instead of generating again."""
    batch = is_batch(prompt)
    rows = list(prompt) if batch else [prompt]
    keys = [front.prompt_key(params, p) for p in rows]
    encoded = None
    if any(k is None for k in keys):  # token ids (or bytes): checked, then keyed by the ids
        encoded, _ = encode_prompts(params, prompt)
        keys = [encoded[i] if k is None else k for i, k in enumerate(keys)]
    key = front.key(params, req)
    results: list = [None] * len(rows)
    misses, followers, leaders = [], [], {}  # leaders: a row's key -> the row generating it
    for i, k in enumerate(keys):
        found = front.lookup(cache, key, k, coalesce=not batch)
        if isinstance(found, Lookup):
            results[i] = front.result_of(found)
            continue
        first = leaders.setdefault(k if isinstance(k, str) else tuple(k), i) if found.cached else i
        (misses if first == i else followers).append((i, found if first == i else first))
    if misses:
        try:  # every row encoded: an error names the right one
            encoded = encoded or encode_prompts(params, prompt)[0]
            made = run(params, [encoded[i] for i, _ in misses], req)
        except BaseException as e:  # nothing cached; a call waiting on a key learns of it
            for _, miss in misses:
                miss.abandon(e)
            raise
        for (i, miss), res in zip(misses, made, strict=True):
            results[i] = front.generated(res, miss.fill(res))
    for i, first in followers:
        results[i] = front.coalesced(results[first])
    return results if batch else results[0]


def run(params: Params, prompts: list[list[int]], req: Request, kv_state=None):
    """One result per row of `prompts` (token ids), generated together."""
    session = Session(params, prompts, req, kv_state=kv_state)
    session.run()
    return session.results()


def chat(params: Params, messages, *, kv_state=None, cache=None, **settings):
    """`generate` of a conversation: the messages rendered by the model's chat template
    (`params.tokenizer.chat_template`, as the server renders them; `jkv.chat` module), the
    model writing the assistant's turn. The other arguments are `generate`'s.

    Args:
      messages: a list of {"role", "content"} dicts ("system", "user", "assistant", ...), or
        a list of such lists (a batch, as `generate`'s list of prompts).

    Returns:
      A `GenerationResult`, or a list of them for a batch.

    Raises:
      ValueError: naming the bad message or setting.
    """
    if (
        isinstance(messages, list | tuple)
        and messages
        and all(isinstance(m, list | tuple) for m in messages)
    ):
        prompts = [chat_prompt(params, m) for m in messages]
    else:
        prompts = chat_prompt(params, messages)
    return generate(params, prompts, kv_state=kv_state, cache=cache, **settings)


def stream(params: Params, prompt, *, kv_state=None, cache=None, **settings) -> Iterator[str]:
    """Yields the text of one prompt's continuation piece by piece as it decodes.

    Takes the same keyword arguments as `generate` (`cache=` included: a hit is one piece);
    a batch is not accepted.
    """
    req = Request.build(params, **settings)
    if params.tokenizer is None:
        raise ValueError("stream needs a tokenizer to produce text; these params carry none")
    if cache is not None and kv_state is None:
        return (yield from _stream_through_cache(params, prompt, req, cache))
    return (yield from stream_pieces(params, prompt, req, kv_state))


def _stream_through_cache(params, prompt, req, cache):
    """A hit in one piece; a miss streamed, its result filled once the stream ended (a stream
    closed early fills nothing). Concurrent identical misses each stream their own."""
    if is_batch(prompt):
        raise ValueError(f"stream takes one prompt; got a batch of {len(prompt)}")
    k = front.prompt_key(params, prompt)
    found = front.lookup(
        cache, front.key(params, req), encode_prompts(params, prompt)[0][0] if k is None else k,
        coalesce=False,
    )  # fmt: skip
    if isinstance(found, Lookup):
        result = front.result_of(found)
        if result.text:
            yield result.text
        return result
    result = yield from stream_pieces(params, prompt, req)
    return front.generated(result, found.fill(result))


def stream_pieces(params: Params, prompt, req: Request, kv_state=None):
    """Text pieces of one prompt's continuation; returns its GenerationResult."""
    prompts, batch = encode_prompts(params, prompt, continuation=kv_state is not None)
    if batch:
        raise ValueError(f"stream takes one prompt; got a batch of {len(prompts)}")
    session = Session(params, prompts, req, kv_state=kv_state, text=True)
    out = session.outputs[0]
    emitted = 0
    while True:
        final = session.finished
        text = out.text if final else out.settled()
        if len(text) > emitted:
            yield text[emitted:]
            emitted = len(text)
        if final:
            return session.results()[0]
        session.advance(1)


generate.__signature__ = signature(
    generate, before=("params", "prompt"), after={"kv_state": None, "cache": None}
)
chat.__signature__ = signature(
    chat, before=("params", "messages"), after={"kv_state": None, "cache": None}
)
stream.__signature__ = signature(
    stream, before=("params", "prompt"), after={"kv_state": None, "cache": None}
)
