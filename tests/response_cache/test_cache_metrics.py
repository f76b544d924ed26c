"""Histograms and the rate-limited error log."""

from __future__ import annotations

import logging

from jkv.response_cache.metrics import Histogram, RateLimitedLog


def test_histogram_buckets_are_cumulative_like_prometheus():
    h = Histogram((0.001, 0.01))
    for ns in (500_000, 1_000_000, 5_000_000, 50_000_000):
        h.observe_ns(ns)
    snap = h.snapshot()
    assert snap["buckets"] == {"0.001": 2, "0.01": 3, "+Inf": 4}
    assert snap["count"] == 4 and abs(snap["sum"] - 0.0565) < 1e-12


def test_rate_limited_log_keeps_one_line_per_kind_per_interval(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("jkv.response_cache.metrics.time.monotonic", lambda: now[0])
    errlog = RateLimitedLog(interval=10.0)
    with caplog.at_level(logging.WARNING, logger="jkv.response_cache"):
        assert errlog.warning("connection", "down")
        assert not errlog.warning("connection", "down")
        assert not errlog.warning("connection", "down")
        assert errlog.warning("timeout", "slow")  # another kind has its own budget
        now[0] += 10.0
        assert errlog.warning("connection", "still down")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[-1].endswith("still down (2 similar messages suppressed)")
