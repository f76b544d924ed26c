"""The engine's host work per decode step, alone: the scheduler, the page tables and the packing
of a step's arrays (no model, no device), on a Llama-3.1-8B shape (32 layers x 8 kv heads,
pages of 16 tokens), 64 rows decoding after prompts of 2K and 16K tokens.

    python benchmarks/engine_host.py            # prints the table, writes results/engine_host.json

Each row is prefilled through the real scheduler first (a stand-in 'model' samples token 7);
then `--steps` decode steps are timed: `schedule()`, packing (`ragged.pack_ragged`, the
flattened step's, and the per-row sampling settings the engine builds) and `finish_step()`.
The same script runs on the code before engine core v2 (commit 03c7c01: one page table per
(layer, kv head)), where `runner.pack` took (rows, layers, kv heads, page size, chunk); it
detects which it has (between the two, a version packed for the gathering step,
`runner.pack`, which is gone).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from jkv.engine import runner
from jkv.engine.page_pool import PagePool
from jkv.engine.scheduler import Scheduler
from jkv.engine.sequence import Sequence

LAYERS, KV_HEADS, PAGE = 32, 8, 16  # Llama-3.1-8B
NEW = hasattr(runner, "RowTables")  # engine core v2
V3 = importlib.util.find_spec("jkv.engine.plan") is not None  # plain RowPlans


def setup(rows: int, prompt: int, new_tokens: int):
    group = LAYERS * KV_HEADS
    pages = rows * (-(-(prompt + new_tokens) // PAGE) + 1) * group + 1
    pool = PagePool(pages, PAGE, group)
    sched = Scheduler(pool, num_layers=LAYERS, num_kv_heads=KV_HEADS, token_budget=8192,
                      chunk=2048, max_running=rows, admission="optimistic")  # fmt: skip
    for i in range(rows):
        # distinct prompts (no prefix sharing): every row holds its own pages
        sched.add(Sequence(f"r{i}", [(i * 7919 + t) % 50000 + 3 for t in range(prompt)],
                           new_tokens, arrival=0))  # fmt: skip
    tables = runner.RowTables(rows, -(-(prompt + new_tokens) // PAGE) + 2) if NEW else None
    while any(s.prefilling for s in sched.by_id.values()) or sched.waiting:
        plan = sched.schedule()
        sched.finish_step(plan, {s.seq.request_id: 7 for s in plan.scheduled if s.samples})
    return sched, tables, group


def packed(plan, tables, group, chunk=2048):
    if NEW:
        from jkv.engine.ragged import pack_ragged

        rows = [getattr(s, "row", s) for s in plan.scheduled]  # plain rows (engine core v3)
        return pack_ragged(rows, tables, group, PAGE, most=chunk)
    return runner.pack(plan.scheduled, LAYERS, KV_HEADS, PAGE, chunk)


def sampling_arrays(n: int):
    """The host part of the engine's per-row sampling settings (numpy columns)."""
    cols = [np.array([0.0] * n, np.float32), np.array([0] * n, np.int32),
            np.array([1.0] * n, np.float32), np.array([0.0] * n, np.float32)]  # fmt: skip
    return cols


def measure(rows: int, prompt: int, steps: int) -> dict:
    # rows admitted early decode while later ones prefill: room for all of that
    sched, tables, group = setup(rows, prompt, steps + rows * prompt // 8192 + 2)
    times = {"schedule": [], "pack": [], "finish": [], "total": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        packed(plan, tables, group)
        sampling_arrays(len(plan.scheduled))
        t2 = time.perf_counter()
        sched.finish_step(plan, {s.seq.request_id: 7 for s in plan.scheduled if s.samples})
        if NEW:
            tables.keep_only({s.request_id for s in sched.running})
        t3 = time.perf_counter()
        assert len(plan.scheduled) == rows and all(s.n == 1 for s in plan.scheduled)
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            times[name].append(dt * 1e3)
    return {f"{k}_ms": round(statistics.median(v), 3) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompts", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--stem", default="engine_host")
    args = ap.parse_args(argv)
    table = []
    for prompt in args.prompts:
        row = dict(rows=args.rows, prompt=prompt, **measure(args.rows, prompt, args.steps))
        table.append(row)
        print(row, flush=True)
    code = (
        "per-(layer, kv head) tables" if not NEW
        else "engine core v3 (plain RowPlans)" if V3
        else "engine core v2 (one table per row)"
    )  # fmt: skip
    print(
        f"\nhost work per decode step, {args.rows} rows, Llama-3.1-8B shape ({LAYERS} layers x "
        f"{KV_HEADS} kv heads), pages of {PAGE}; {code}; median of {args.steps} steps, ms"
    )
    print(f"{'prompt':>7s} {'schedule':>9s} {'pack':>8s} {'finish':>8s} {'total':>8s}")
    for r in table:
        print(f"{r['prompt']:7d} {r['schedule_ms']:9.3f} {r['pack_ms']:8.3f} "
              f"{r['finish_ms']:8.3f} {r['total_ms']:8.3f}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(code=code, layers=LAYERS, kv_heads=KV_HEADS, page_size=PAGE,
                  steps=args.steps, rows=table,
                  machine=dict(python=platform.python_version(), cpus=os.cpu_count()))  # fmt: skip
    (out / f"{args.stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / (args.stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
