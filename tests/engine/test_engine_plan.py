"""A step's plan is plain data (`jkv.engine.plan.RowPlan`): what the runner packs is fixed when
the scheduler plans the step, and packing reads and changes no live sequence. Before, a plan
held the live `Sequence` objects and packing read them (so booking a step's tokens before its
arrays were packed moved every row's slots) and wrote StreamingLLM's ring (so packing twice
advanced the ring twice)."""

from __future__ import annotations

import dataclasses

import numpy as np

import jkv
from jkv.engine.engine import Engine
from jkv.engine.page_pool import PagePool
from jkv.engine.ragged import pack_ragged
from jkv.engine.runner import RowTables
from jkv.engine.scheduler import Scheduler
from jkv.engine.sequence import Sequence
from jkv.policies import StreamingLLM


def packed(rows, width: int = 16):
    """The arrays `pack_ragged` makes of `rows`, as plain numpy (a fresh page table)."""
    tables = RowTables(8, width)
    paged, tokens, positions = pack_ragged(rows, tables, 4, 4, most=64)
    out = {f.name: getattr(paged, f.name) for f in dataclasses.fields(paged)}
    out.update(tokens=tokens, positions=positions)
    return {k: np.asarray(v) for k, v in out.items() if v is not None}


def test_booking_a_step_changes_nothing_its_plan_packs():
    """Three requests, some decoding and one prefilling: the arrays packed from a plan are the
    same before and after the scheduler books the step (its sampled tokens appended, a request
    finished, its pages freed), as async scheduling books a step before reading it back."""
    pool = PagePool(200, 4, 4)
    sched = Scheduler(pool, num_layers=2, num_kv_heads=2, token_budget=24, chunk=8,
                      max_running=3)  # fmt: skip
    for i, (prompt, new) in enumerate([(10, 6), (5, 3), (60, 4)]):
        sched.add(Sequence(f"r{i}", list(range(3, 3 + prompt)), new, arrival=i))
    for _ in range(2):
        plan = sched.schedule()
        sched.finish_step(plan, {s.seq.request_id: 7 for s in plan.scheduled if s.samples})
    plan = sched.schedule()
    assert {s.n for s in plan.scheduled} > {1}  # decode rows and a prefill chunk
    rows = [s.row for s in plan.scheduled]
    want = packed(rows)
    finished = sched.finish_step(plan, {s.seq.request_id: 9 for s in plan.scheduled if s.samples})
    assert finished  # a request ended and gave its pages back
    got = packed(rows)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert [s.row for s in plan.scheduled] == rows  # frozen: nothing rewrote them


def test_packing_a_streaming_ring_twice_gives_the_same_step(tiny_params):
    """StreamingLLM's ring, decoding past its budget: every step packed twice from its plan
    gives the same arrays (the ring's slot was taken once, when the step was planned), and the
    tokens are still `jkv.generate`'s."""
    seen = []

    class Twice(Engine):
        def _dispatch_flat(self, scheduled):
            rows = [r.row for r in scheduled]
            sched = self.scheduler
            first = pack_ragged(rows, self.rows, sched.group, self.pool.page_size, 64)
            again = pack_ragged(rows, self.rows, sched.group, self.pool.page_size, 64)
            for a, b in zip(jax_leaves(first), jax_leaves(again), strict=True):
                np.testing.assert_array_equal(a, b)
            seen.append(any(r.rank_sink is not None and r.held == 0 for r in rows))  # the ring
            return super()._dispatch_flat(scheduled)

    demo = tiny_params("llama")
    prompt = [(7 * i) % (demo.config.vocab_size - 3) + 3 for i in range(11)]
    policy = StreamingLLM(budget=8, sink=2)
    engine = Twice(demo, num_pages=400, page_size=4, token_budget=32, chunk=16,
                   kv_dtype="float32")  # fmt: skip
    [got] = engine.generate([prompt], kv_policy=policy, max_new_tokens=12)
    assert sum(seen) >= 10  # the ring's decode steps were packed twice
    want = jkv.generate(demo, prompt, kv_policy=policy, max_new_tokens=12,
                        kv_dtype="float32")  # fmt: skip
    assert got == list(want.tokens)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_a_plans_blocks_follow_every_change_and_are_not_copied_otherwise():
    """`Sequence.plan_blocks`: the plan's block ids are the sequence's at every step: after
    they grow, and after they are replaced by as many others (a new epoch: preempted and taken
    again, compacted); between changes the same tuple is reused (a long row's blocks are not
    copied every step)."""
    seq = Sequence("r", [1, 2, 3], max_tokens=4, arrival=0)
    seq.blocks = [5, 6]
    first = seq.plan_blocks()
    assert first == (5, 6) and seq.plan_blocks() is first
    seq.blocks += [7]
    assert seq.plan_blocks() == (5, 6, 7)
    seq.blocks, seq.epoch = [9, 10, 11], seq.epoch + 1000  # replaced, the same length
    assert seq.plan_blocks() == (9, 10, 11)
