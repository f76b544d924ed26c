"""Async scheduling: the engine dispatches step N+1 before reading step N's tokens, its decode
rows fed on the device from step N's output. Tokens equal scheduling off and `jkv.generate`;
an eos or a stop string read back a step late ends the request with generate's tokens and gives
every page back; an abort between dispatch and read-back drops the step's token."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import jkv
from jkv.engine import engine as engine_module
from jkv.engine import ragged
from jkv.engine.engine import Engine


@pytest.fixture(scope="module")
def demo(tiny_params):
    return tiny_params("llama")


@pytest.fixture(scope="module")
def prompts(demo):
    rng = random.Random(31)
    return [[rng.randrange(3, demo.config.vocab_size) for _ in range(rng.randint(5, 30))]
            for _ in range(4)]  # fmt: skip


def run(engine, prompts, **settings):
    """Adds the prompts, steps to the end: (tokens, text, finish reason) per request, and how
    many steps ended with a step dispatched and not read back."""
    rids = [engine.add_request(p, **settings) for p in prompts]
    got = {rid: ([], "", None) for rid in rids}
    ahead = 0
    while engine.has_work:
        for out in engine.step():
            toks, text, _ = got[out.request_id]
            got[out.request_id] = (toks + out.new_tokens, text + out.text, out.finish_reason)
        ahead += engine._pending is not None
    engine.pool.check()
    assert engine.pool.used_pages == 0 and not engine.scheduler.running
    return [got[rid] for rid in rids], ahead


def engine_for(params, async_scheduling=True):
    return Engine(params, num_pages=160, page_size=8, token_budget=64, chunk=32, max_running=4,
                  async_scheduling=async_scheduling)  # fmt: skip


def test_async_scheduling_runs_ahead_and_gives_the_same_tokens(demo, prompts):
    settings = dict(max_new_tokens=9, temperature=0.8, seed=5)
    on, ahead = run(engine_for(demo), prompts, **settings)
    off, not_ahead = run(engine_for(demo, False), prompts, **settings)
    assert ahead >= 8 and not_ahead == 0  # every decode step ran ahead of its read-back
    assert on == off
    assert [t for t, _, _ in on] == [list(jkv.generate(demo, p, **settings).tokens)
                                     for p in prompts]  # fmt: skip


def test_decode_inputs_come_from_the_last_step_on_the_device(demo, prompts, monkeypatch):
    """With the device-side feed cut (the placeholder goes in as the token), tokens change:
    the feed, not the host, supplies every decode step's input."""

    def cut(*args, **kwargs):
        args = list(args)
        args[9] = np.full_like(args[9], -1)  # from_last: nothing from the last step
        return ragged.ragged_step(*args, **kwargs)

    monkeypatch.setattr(engine_module, "ragged_step", cut)
    got, _ = run(engine_for(demo), prompts[:2], max_new_tokens=6)
    want = [list(jkv.generate(demo, p, max_new_tokens=6).tokens) for p in prompts[:2]]
    assert [t[:1] for t, _, _ in got] == [w[:1] for w in want]  # the prompt steps' tokens
    assert [t for t, _, _ in got] != want


def test_an_eos_read_back_late_ends_the_request_as_generate_does(demo, prompts):
    full = [list(jkv.generate(demo, p, max_new_tokens=12).tokens) for p in prompts]
    eos = full[0][4]  # the fifth token of the first answer ends every answer that has it
    params = dataclasses.replace(
        demo, config=dataclasses.replace(demo.config, eos_token_ids=(eos,))
    )
    got, ahead = run(engine_for(params), prompts, max_new_tokens=12)
    assert ahead > 0
    for (toks, _, reason), p, f in zip(got, prompts, full, strict=True):
        want = jkv.generate(params, p, max_new_tokens=12)
        assert toks == list(want.tokens) and reason == want.finish_reason
        assert reason == ("stop" if eos in f else "length")
    assert got[0][0] == full[0][: full[0].index(eos) + 1]  # the eos is the last token out


def test_a_stop_string_read_back_late_ends_the_request_as_generate_does(demo, prompts):
    full = [jkv.generate(demo, p, max_new_tokens=12) for p in prompts]
    stops = [r.text[len(r.text) // 2 : len(r.text) // 2 + 3] for r in full]
    engine = engine_for(demo)
    rids = [engine.add_request(p, max_new_tokens=12, stop=s)
            for p, s in zip(prompts, stops, strict=True)]  # fmt: skip
    got = {rid: ([], "", None) for rid in rids}
    while engine.has_work:
        for out in engine.step():
            toks, text, _ = got[out.request_id]
            got[out.request_id] = (toks + out.new_tokens, text + out.text, out.finish_reason)
    assert engine.pool.used_pages == 0
    for rid, p, s in zip(rids, prompts, stops, strict=True):
        want = jkv.generate(demo, p, max_new_tokens=12, stop=s)
        assert got[rid] == (list(want.tokens), want.text, "stop")


def test_an_abort_between_dispatch_and_read_back_drops_the_token(demo, prompts):
    engine = engine_for(demo)
    rids = [engine.add_request(p, max_new_tokens=8) for p in prompts[:2]]
    before, after = [], []
    while sum(len(o.new_tokens) for o in before if o.request_id == rids[0]) < 2:
        before += engine.step()
    assert set(engine._pending.samplers) == set(rids)  # its next token computed, not read
    assert engine.abort(rids[0])
    while engine.has_work:
        after += engine.step()
    want = [list(jkv.generate(demo, p, max_new_tokens=8).tokens) for p in prompts[:2]]
    got = [o.new_tokens for o in before if o.request_id == rids[0]]
    assert sum(got, []) == want[0][: len(sum(got, []))]
    assert not [o for o in after if o.request_id == rids[0]]  # nothing after the abort
    other = [t for o in before + after if o.request_id == rids[1] for t in o.new_tokens]
    assert other == want[1]
    engine.pool.check()
    assert engine.pool.used_pages == 0 and not engine.has_work
