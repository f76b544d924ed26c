"""The generation ladder: prefill -> decode_step -> decode loop -> generate / stream.

jit sits only at `prefill` (prompt length bucketed to a power of two, so recompiles stay
bounded) and `decode` (a `lax.while_loop` over decode steps inside one jit). The KV state and
the loop state are donated at both boundaries: the caller's copy is consumed, the new one
returned. Rows of a batch are independent: each has its own prompt length, position clock and
stop flag, and writes only its own real tokens into the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jkv import attention as attn
from jkv import compile_time, policies
from jkv import kv as kvlib
from jkv.kv import bucket
from jkv.limits import check_context, check_memory
from jkv.params import Params
from jkv.prefill import check_state, encode_prompts, prepare
from jkv.sampling import Sampling, SamplingArrays, check_seed, sample
from jkv.tokenizer import StreamDecoder
from jkv_models.config import ModelConfig
from jkv_models.llama import forward

Prompt = str | Sequence[int]
STOP_CHECK_EVERY = 16  # decode steps between host-side stop-string checks


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    text: str
    tokens: list[int]  # generated ids (a final eos included)
    finish_reason: str  # "stop" (eos or a stop string) | "length"
    kv_bytes: int  # bytes of the live KV state (K, V and fp8 scales) that served the request
    stats: dict[str, Any]
    cache: str | None = None  # which response-cache level answered: "l1" | "l2" | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode loop's carry. Every per-request setting is a per-row array."""

    kv: kvlib.KVState
    tokens: jax.Array  # [B, M] int32 generated ids (M: the max_new_tokens bucket), -1 where none
    count: jax.Array  # [B] int32 tokens generated so far per row
    max_new: jax.Array  # [B] int32 each row's max_new_tokens (<= M)
    done: jax.Array  # [B] bool: row hit eos / a stop string / its max_new_tokens
    last: jax.Array  # [B] int32 last generated token (input of the next step)
    sampling: SamplingArrays  # per-row settings and seeds
    step: jax.Array  # [] int32 decode steps run so far


# --------------------------------------------------------------------------- jitted rungs
def _is_stop(tok: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))


@functools.partial(jax.jit, static_argnames=("eos_ids", "slots"), donate_argnames=("kv",))
def start(
    logits,
    kv: kvlib.KVState,
    sampling: SamplingArrays,
    max_new,
    *,
    eos_ids: tuple[int, ...],
    slots: int,
) -> DecodeState:
    """Samples each row's first token from the prefill logits and builds the loop state with
    `slots` (the max_new_tokens bucket) places per row."""
    b = logits.shape[0]
    first = sample(logits, sampling, jnp.zeros((b,), jnp.int32))
    tokens = jnp.full((b, slots), -1, jnp.int32).at[:, 0].set(first)
    return DecodeState(
        kv=kv,
        tokens=tokens,
        count=jnp.ones((b,), jnp.int32),
        max_new=max_new,
        done=_is_stop(first, eos_ids) | (max_new <= 1),
        last=first,
        sampling=sampling,
        step=jnp.zeros((), jnp.int32),
    )


def decode_step(
    weights,
    config: ModelConfig,
    s: DecodeState,
    *,
    eos_ids: tuple[int, ...],
    backend: str,
) -> DecodeState:
    """One token for every unfinished row (finished rows neither write the cache nor advance)."""
    active = ~s.done
    n_new = active.astype(jnp.int32)
    attend = attn.make_attention(
        n_new,
        sliding_window=config.sliding_window,
        backend=backend,
        policy=s.kv.policy,
        limit=s.kv.limit,
        inv_freq=jnp.asarray(config.inv_freq()),
    )
    logits, layers = forward(
        weights,
        config,
        s.last[:, None],
        s.kv.next_position[:, None],
        s.kv.layers,
        attend,
        logits_at=jnp.zeros_like(n_new),
    )
    kv = s.kv.replace(layers=layers, next_position=s.kv.next_position + n_new)
    tok = sample(logits, s.sampling, s.count)
    rows = jnp.arange(tok.shape[0])
    # A finished row writes at index M, which the scatter drops.
    tokens = s.tokens.at[rows, jnp.where(active, s.count, s.tokens.shape[1])].set(tok, mode="drop")
    count = s.count + n_new
    done = s.done | (active & _is_stop(tok, eos_ids)) | (count >= s.max_new)
    return dataclasses.replace(
        s,
        kv=kv,
        tokens=tokens,
        count=count,
        done=done,
        last=jnp.where(active, tok, s.last),
        step=s.step + 1,
    )


@functools.partial(
    jax.jit,
    static_argnames=("config", "eos_ids", "backend"),
    donate_argnames=("state",),
)
def decode(
    weights,
    config: ModelConfig,
    state: DecodeState,
    limit: jax.Array,
    *,
    eos_ids: tuple[int, ...],
    backend: str = "xla",
) -> DecodeState:
    """Runs decode steps until every row is done or `state.step` reaches `limit`.

    `limit` is traced, so streaming (one step per call) and whole-request decoding share one
    compiled loop; so are the sampling settings, budgets and max_new_tokens of every row.
    """
    step = functools.partial(decode_step, weights, config, eos_ids=eos_ids, backend=backend)
    return jax.lax.while_loop(lambda s: (s.step < limit) & ~jnp.all(s.done), step, state)


# --------------------------------------------------------------------------- host side
def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop={stop!r} must be a non-empty string or a list of them")
    return items


@dataclasses.dataclass
class Request:
    """Validated settings of one generate / stream call."""

    max_new_tokens: int
    sampling: Sampling
    seed: int
    stop: tuple[str, ...]
    kv_dtype: str
    backend: str
    policy: policies.KVPolicy | None = None
    allow_beyond_context: bool = False

    @classmethod
    def build(
        cls,
        params: Params,
        *,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        min_p,
        logit_keep_ratio,
        seed,
        stop,
        kv_dtype,
        backend,
        kv_policy=None,
        kv_budget=None,
        allow_beyond_context=False,
    ) -> Request:
        if not isinstance(params, Params):
            raise ValueError(
                f"params is a {type(params).__name__}; expected jkv.Params (from jkv.load)"
            )
        if (
            not isinstance(max_new_tokens, int)
            or isinstance(max_new_tokens, bool)
            or max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
        check_seed(seed)
        if not isinstance(allow_beyond_context, bool):
            raise ValueError(f"allow_beyond_context={allow_beyond_context!r} must be True or False")
        kv_dtype = kvlib.validate_kv_dtype(kv_dtype) if kv_dtype else None
        policy = policies.resolve(kv_policy, kv_budget)
        window = params.config.sliding_window
        if policy is not None and policy.raw_keys and window is not None:
            raise ValueError(
                f"kv_policy={policy.name!r} rotates keys to positions within its cache, which "
                f"the model's sliding_window={window} (in text positions) cannot follow; use "
                "another policy or the full cache"
            )
        return cls(
            max_new_tokens=max_new_tokens,
            sampling=Sampling(
                temperature=float(temperature),
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                logit_keep_ratio=logit_keep_ratio,
            ),
            seed=seed,
            stop=_stop_strings(stop),
            kv_dtype=kv_dtype,
            backend=attn.validate_backend(backend),
            policy=policy,
            allow_beyond_context=allow_beyond_context,
        )


def _check_limits(params, lengths, req: Request, kv_state, kv_dtype) -> bool:
    """The trained context and the free memory, before anything is allocated; returns whether
    the request runs past the context (allowed by `allow_beyond_context`)."""
    start, rerank_within, policy = 0, None, req.policy
    if kv_state is not None:
        start = int(np.max(np.asarray(kv_state.next_position)))
        if kv_state.policy is not None and kv_state.policy.raw_keys:
            rerank_within = int(np.max(np.asarray(kv_state.limit)))
    elif policy is not None and policy.raw_keys:
        rerank_within = int(max(policy.row_limits(lengths)))
    beyond = check_context(
        params.config,
        lengths,
        req.max_new_tokens,
        start=start,
        rerank_within=rerank_within,
        allowed=req.allow_beyond_context,
    )
    check_memory(params, lengths, req.max_new_tokens, policy=policy, kv_dtype=kv_dtype, start=start)
    return beyond


class Session:
    """One batch in flight: prefill at construction, then `advance` runs decode chunks."""

    def __init__(self, params: Params, prompts: list[list[int]], req: Request, kv_state=None):
        self.params, self.req = params, req
        cfg = params.config
        self.prompt_lengths = [len(p) for p in prompts]
        b = len(prompts)
        if kv_state is not None:
            check_state(kv_state, cfg, b, req.kv_dtype)
            if req.policy is not None:
                raise ValueError(
                    "kv_policy given beside kv_state: the state keeps the policy "
                    "it was prefilled with"
                )
        kv_dtype = kv_state.dtype if kv_state is not None else req.kv_dtype or params.kv_dtype
        self.eos_ids = tuple(sorted(set(cfg.eos_token_ids)))
        self.policy = req.policy if kv_state is None else kv_state.policy
        self.beyond_context = _check_limits(params, self.prompt_lengths, req, kv_state, kv_dtype)
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
        self.prefill_s = time.perf_counter() - t0 - self._compile_since(self.compile_start)
        self.decode_s = 0.0
        self.stopped_by_string = [None] * b  # (cut index in text, token count) per row
        self._host_tokens = None

    @staticmethod
    def _compile_since(start: tuple[float, int]) -> float:
        return compile_time.totals()[0] - start[0]

    @property
    def finished(self) -> bool:
        return bool(np.all(np.asarray(self.state.done)))

    def advance(self, steps: int) -> None:
        """Runs up to `steps` decode steps, then applies stop strings on the host."""
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
        self.decode_s += time.perf_counter() - t0 - self._compile_since(c0)
        self._host_tokens = None
        if self.req.stop:
            self._apply_stop_strings()

    def row_tokens(self, i: int) -> list[int]:
        if self._host_tokens is None:
            self._host_tokens = (np.asarray(self.state.tokens), np.asarray(self.state.count))
        tokens, count = self._host_tokens
        return tokens[i, : count[i]].tolist()

    def _apply_stop_strings(self) -> None:
        newly_done = []
        for i in range(len(self.prompt_lengths)):
            if self.stopped_by_string[i] is not None:
                continue
            hit = self._find_stop(self.row_tokens(i))
            if hit is not None:
                self.stopped_by_string[i] = hit
                newly_done.append(i)
        if newly_done:
            done = np.asarray(self.state.done).copy()
            done[newly_done] = True
            self.state = dataclasses.replace(self.state, done=jnp.asarray(done))

    def _find_stop(self, ids: list[int]) -> tuple[int, int] | None:
        tok = self.params.tokenizer
        text = tok.decode(ids)
        cuts = [text.find(s) for s in self.req.stop if s in text]
        if not cuts:
            return None
        cut = min(cuts)
        # The fewest tokens whose text already contains the stop string.
        n = next(
            n
            for n in range(1, len(ids) + 1)
            if any(s in tok.decode(ids[:n]) for s in self.req.stop)
        )
        return cut, n

    def run(self) -> None:
        chunk = STOP_CHECK_EVERY if self.req.stop else self.req.max_new_tokens
        while not self.finished:
            self.advance(chunk)

    def results(self) -> list[GenerationResult]:
        kv_bytes = kvlib.nbytes(self.state.kv)
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
            "kv_bytes_used": kvlib.used_bytes(self.state.kv),
            "kv_bookkeeping_bytes": kvlib.bookkeeping_bytes(self.state.kv),
            "kv_capacity": [x.capacity for x in self.state.kv.layers],
            "kv_policy": None if self.policy is None else self.policy.describe(),
            "batch_size": len(self.prompt_lengths),
            "beyond_context": self.beyond_context,
        }
        if isinstance(self.policy, policies.SnapKVSegments):  # decoded tokens left out
            appended = np.asarray(self.state.count) - 1
            stats_common["kv_segments"] = policies.segment_report(self.state.kv, appended)
        out = []
        for i, plen in enumerate(self.prompt_lengths):
            ids = self.row_tokens(i)
            reason = "length"
            if ids and ids[-1] in self.eos_ids:
                reason = "stop"
            text = None
            if self.stopped_by_string[i] is not None:
                cut, n = self.stopped_by_string[i]
                ids, reason = ids[:n], "stop"
                text = self.params.tokenizer.decode(ids)[:cut]
            if text is None:
                text = self.params.tokenizer.decode(ids) if self.params.tokenizer else ""
            out.append(
                GenerationResult(
                    text=text,
                    tokens=ids,
                    finish_reason=reason,
                    kv_bytes=kv_bytes,
                    stats={**stats_common, "prompt_tokens": plen, "generated_tokens": len(ids)},
                )
            )
        return out


def generate(
    params: Params,
    prompt,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    logit_keep_ratio: float | None = None,
    seed: int = 0,
    stop=None,
    kv_dtype: str | None = None,
    backend: str | None = None,
    kv_policy=None,
    kv_budget: int | float | None = None,
    kv_state=None,
    cache=None,
    allow_beyond_context: bool = False,
):
    """Generates a continuation of `prompt` (or of each prompt of a batch).

    Args:
      params: from `jkv.load` (weights + config + tokenizer).
      prompt: a string, a list of token ids, or a list of either (a batch; rows may differ in
        length and each row's output equals its output alone).
      max_new_tokens: upper bound on generated tokens per row.
      temperature: 0 is greedy; otherwise softmax sampling at this temperature.
      top_k, top_p, min_p: sampling filters (None: off).
      logit_keep_ratio: keep only this fraction of the highest logits (seed 2.4).
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
      kv_state: a state from `jkv.prefill` to continue (the prompt is appended to it; the
        state itself is not consumed).
      cache: a `jkv.ResponseCache`: answers come from L1, then L2 (Redis), then the model,
        which fills both. The key normalises whitespace; the model reads the prompt exactly
        as given. `result.cache` is "l1", "l2", "coalesced" or None (this call generated); a
        hit reports the `kv_bytes` and stats of the generation that produced it, plus
        `stats["cache"]`. Not used with `kv_state` (the state is not part of the key).
      allow_beyond_context: let the prompt plus `max_new_tokens` run past the model's trained
        context (`max_position_embeddings`); refused otherwise, except under StreamingLLM with a
        budget within the context. `stats["beyond_context"]` says whether it did.

    Returns:
      A `GenerationResult`, or a list of them for a batch.

    Raises:
      ValueError: naming the bad argument.
    """
    req = Request.build(
        params,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        logit_keep_ratio=logit_keep_ratio,
        seed=seed,
        stop=stop,
        kv_dtype=kv_dtype,
        backend=backend,
        kv_policy=kv_policy,
        kv_budget=kv_budget,
        allow_beyond_context=allow_beyond_context,
    )
    if req.stop and params.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; these params carry none")
    if cache is not None and kv_state is None:
        from jkv.cached import generate_cached

        return generate_cached(params, prompt, req, cache, _run)
    prompts, is_batch = encode_prompts(params, prompt, continuation=kv_state is not None)
    results = _run(params, prompts, req, kv_state)
    return results if is_batch else results[0]


def _run(params: Params, prompts: list[list[int]], req: Request, kv_state=None):
    session = Session(params, prompts, req, kv_state=kv_state)
    session.run()
    return session.results()


def stream(params: Params, prompt, *, cache=None, **kwargs) -> Iterator[str]:
    """Yields the text of one prompt's continuation piece by piece as it decodes.

    Takes the same keyword arguments as `generate` (`cache=` included: a hit is one piece);
    a batch is not accepted.
    """
    kv_state = kwargs.pop("kv_state", None)
    req = Request.build(params, **{**_GENERATE_DEFAULTS, **kwargs})
    if params.tokenizer is None:
        raise ValueError("stream needs a tokenizer to produce text; these params carry none")
    if cache is not None and kv_state is None:
        from jkv.cached import stream_cached

        return (yield from stream_cached(params, prompt, req, cache, _stream))
    return (yield from _stream(params, prompt, req, kv_state))


def _stream(params: Params, prompt, req: Request, kv_state=None):
    """Text pieces of one prompt's continuation; returns its GenerationResult."""
    prompts, is_batch = encode_prompts(params, prompt, continuation=kv_state is not None)
    if is_batch:
        raise ValueError(f"stream takes one prompt; got a batch of {len(prompts)}")
    session = Session(params, prompts, req, kv_state=kv_state)
    pieces = StreamDecoder(params.tokenizer)
    emitted = 0
    hold = max((len(s) for s in req.stop), default=1) - 1  # a stop string may still be forming
    seen = 0
    while True:
        ids = session.row_tokens(0)
        for token in ids[seen:]:
            pieces.push(token)
        seen = len(ids)
        text = pieces.emitted
        cut = session.stopped_by_string[0]
        if cut is not None:
            text = text[: cut[0]]
        final = session.finished
        upto = len(text) if final else max(emitted, len(text) - hold)
        if upto > emitted:
            yield text[emitted:upto]
            emitted = upto
        if final:
            return session.results()[0]
        session.advance(1)


_GENERATE_DEFAULTS = dict(
    max_new_tokens=64,
    temperature=0.0,
    top_k=None,
    top_p=None,
    min_p=None,
    logit_keep_ratio=None,
    seed=0,
    stop=None,
    kv_dtype=None,
    backend=None,
    kv_policy=None,
    kv_budget=None,
    allow_beyond_context=False,
)


@functools.partial(jax.jit, static_argnames=("config",))
def _logits(weights, config, tokens):
    t = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    return forward(weights, config, tokens, positions)[0]


def logits(params: Params, token_ids) -> jax.Array:
    """Float32 logits `[B, T, V]` for token ids `[B, T]` (or `[T]`), no cache, causal."""
    if not isinstance(params, Params):
        raise ValueError(f"params is a {type(params).__name__}; expected jkv.Params")
    try:
        ids = np.asarray(token_ids)
    except ValueError:
        raise ValueError("token_ids rows differ in length; expected a rectangular [B, T]") from None
    if ids.dtype == object or not np.issubdtype(ids.dtype, np.integer) and ids.size:
        raise ValueError(f"token_ids must be integer ids; got dtype {ids.dtype}")
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"token_ids has shape {ids.shape}; expected [B, T] with T >= 1")
    vocab = params.config.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(
            f"token_ids holds id {int(ids.max() if ids.max() >= vocab else ids.min())};"
            f" expected ids in [0, {vocab})"
        )
    return _logits(params.weights, params.config, jnp.asarray(ids, jnp.int32))
