"""benchmarks/contexts.py end to end on the demo model with a real Redis: each configuration's
context is made, written and read back through Redis whole, asked every question one after
another and all at once, and recomputed; a 25% context holds about a quarter of the full one's
bytes; the JSON holds every row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import contexts  # noqa: E402


def test_contexts_tiny_run(tmp_path, redis_server):
    out = tmp_path / "contexts.json"
    argv = ["--model", "demo", "--tokens", "100", "--questions", "2", "--recompute", "1",
            "--no-peer", "--redis-url", redis_server.url, "--out", str(out),
            "--configs", "full", "SnapKV 25%"]  # fmt: skip
    assert contexts.main(argv) == 0
    got = json.loads(out.read_text())
    rows = {r["config"]: r for r in got["rows"]}
    assert set(rows) == {"full", "SnapKV 25%"}  # KVzip's row runs the same code
    for r in rows.values():
        assert len(r["ttft_cached"]) == 2 and len(r["answers"]) == 2 and len(r["ttft_redis"]) == 1
        assert r["redis_load_gbps"] > 0 and r["ttft_recompute_p50"] > 0
        assert r["blob_bytes"] > r["bytes"]  # the header on top
    assert 0.2 < rows["SnapKV 25%"]["bytes_vs_full"] < 0.35
