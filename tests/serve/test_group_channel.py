"""The serving group's step channel (`jkv.serve.group`) between two real engines on one device
each, no jax.distributed: the leader's engine here, a follower's in a subprocess. The follower,
which schedules nothing (it is told no request, and its own chunk differs from the leader's),
runs the leader's device calls and ends with the leader's pool and last tokens, bit for bit; a
follower whose engine has other shapes exits with status 4 before any step, as does one that
cannot run a call; one whose leader closes the channel, or falls silent past the timeout,
exits with status 3; a leader counts a follower that is killed (at once) or stopped (past the
timeout) as lost. Seconds each."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from replicas_harness import free_run

from jkv.engine.engine import Engine
from jkv.engine.sequence import EPOCHS
from jkv.serve import group

SETTINGS = dict(num_pages=256, max_running=4, token_budget=64, chunk=32)
FOLLOWER = textwrap.dedent(
    """
    import json, sys
    import jkv
    from jkv.engine.engine import Engine
    from jkv.serve import group
    sys.path.insert(0, sys.argv[4])
    from test_group_channel import state

    link = group.Follower("127.0.0.1", int(sys.argv[1]), 1, float(sys.argv[2]))
    engine = Engine(jkv.load("demo"), **json.loads(sys.argv[3]))
    link.serve(engine)
    print("STATE", state(engine), engine.stats()["steps"], flush=True)
    """
)


def state(engine) -> str:
    """A digest of the engine's device state: its pool's arrays and its last sampled tokens."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves((engine.device, engine._last_tok)):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def _follower(port: int, timeout: float = 5.0, **settings):
    """A follower process on `port` (its engine: SETTINGS updated by `settings`), killed (and
    resumed first if stopped) at the end."""
    own = json.dumps({**SETTINGS, **settings})
    proc = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, str(port), str(timeout), own, os.path.dirname(__file__)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)


@pytest.fixture
def lost():
    """The leader's exits, recorded instead of taken (the test process goes on)."""
    return []


def _leader(port: int, lost: list, timeout: float = 5.0) -> group.Leader:
    return group.Leader("127.0.0.1", port, 2, timeout, start_timeout=120, exit=lost.append)


def _wait(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_follower_runs_the_leaders_steps_without_scheduling(demo_params, lost):
    """The follower is told of no request and its chunk is 8 (the leader's 32, so its own plan
    for these prompts would differ): it runs the leader's device calls, SnapKV's selection and
    compaction and StreamingLLM's ring included, and ends with the leader's pool and last
    tokens, bit for bit, having stepped nothing itself."""
    for _ in range(3):  # this process made sequences before (a server's warmup does)
        next(EPOCHS)
    port = free_run(1)
    with _follower(port, chunk=8) as proc:
        leader = _leader(port, lost)
        engine = Engine(demo_params, **SETTINGS)
        leader.attach(engine)
        prompts = ["the old farmer saw the red horse and the little girl walked to the river",
                   "the dog ran to the big house and the cat", "a brave knight rode to the castle"]  # fmt: skip
        rids = [
            engine.add_request(prompts[0], max_new_tokens=6, kv_policy="snapkv", kv_budget=8),
            engine.add_request(prompts[1], max_new_tokens=5, stop=["zebra"],
                               kv_policy="streaming", kv_budget=8),
            engine.add_request(prompts[2], max_new_tokens=7, temperature=0.9, seed=3),
        ]  # fmt: skip
        gone = engine.add_request(prompts[0] + " and", max_new_tokens=30)
        got = {rid: [] for rid in rids}
        for n in range(200):
            if n == 3:
                engine.abort(gone)
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_tokens)
            if not engine.has_work:
                break
        leader.stop()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        theirs, their_steps = out.split("STATE ", 1)[1].split()
        assert theirs == state(engine), out
        assert their_steps == "0"  # its own engine never stepped
        assert len(got[gone]) < 30 and all(len(got[r]) >= 5 for r in rids), got
        assert not lost


def test_a_follower_of_another_engine_exits_before_any_step(demo_params, lost):
    """A follower whose pool has other shapes (128 pages, the leader's 256) exits with status
    4 when the leader's engine attaches, naming the difference; the leader then sees it gone."""
    port = free_run(1)
    with _follower(port, num_pages=128) as proc:
        leader = _leader(port, lost)
        leader.attach(Engine(demo_params, **SETTINGS))
        assert proc.wait(120) == group.DIVERGED_EXIT, proc.stdout.read()
        said = proc.stdout.read()
        assert "this process's engine differs from the leader's" in said, said
        assert _wait(lambda: leader.lost_reason is not None, 10)


def test_a_follower_that_cannot_run_a_call_exits(demo_params, lost):
    port = free_run(1)
    with _follower(port) as proc:
        leader = _leader(port, lost)
        leader.attach(Engine(demo_params, **SETTINGS))
        leader.tick()
        leader._send(("call", "jkv.engine.runner:no_such_program", ((), {})))
        assert proc.wait(120) == group.DIVERGED_EXIT, proc.stdout.read()
        said = proc.stdout.read()
        assert "the leader's jkv.engine.runner:no_such_program failed here" in said, said
        assert _wait(lambda: leader.lost_reason is not None, 10)


@pytest.mark.parametrize("how", ["closed", "silent"])
def test_a_follower_that_loses_its_leader_exits(lost, how):
    port = free_run(1)
    with _follower(port, timeout=3.0) as proc:
        leader = _leader(port, lost, timeout=3.0)
        time.sleep(1.5)  # heartbeats flowing
        assert proc.poll() is None
        start = time.monotonic()
        if how == "closed":
            for _, ch in leader.channels:
                ch.close()
        else:  # the leader's heartbeats stop; its channel stays open
            leader._stopped.set()
        assert proc.wait(60) == group.LOST_EXIT, proc.stdout.read()
        assert "the leader is lost" in proc.stdout.read()
        if how == "silent":
            assert time.monotonic() - start > 2.0  # the timeout, not an error


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_leader_counts_a_killed_or_hung_follower_lost(lost, how):
    port = free_run(1)
    told = []
    with _follower(port, timeout=3.0) as proc:
        leader = _leader(port, lost, timeout=3.0)
        leader.on_lost = told.append
        time.sleep(1.5)
        assert leader.lost_reason is None
        start = time.monotonic()
        proc.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        assert _wait(lambda: told, 15), leader.lost_reason
        took = time.monotonic() - start
        assert told == [leader.lost_reason] and "process 1 of the serving group" in told[0]
        assert ("closed" if how == "killed" else "silent for 3 s") in told[0], told
        # closed: before the 3 s timeout; silent: 3 s after the last heartbeat, which came up
        # to HEARTBEAT_S before the stop (2.42 s once, on a fresh clone)
        quiet = 3.0 - group.HEARTBEAT_S
        assert took < quiet if how == "killed" else quiet < took < 8, took
        with pytest.raises(RuntimeError, match="serving group is lost"):
            leader.tick()  # a step after that fails at once
        assert _wait(lambda: lost == [group.LOST_EXIT], group.DRAIN_S + 5)


def _watched(step, timeout: float = 0.3, seconds: float = 1.5) -> list:
    """What `StepWatch.stuck` said, polled as the heartbeat thread does, while another thread
    runs `step(release)` inside a step (`enter` .. `leave`) for about `seconds`."""
    watch, release, said = group.StepWatch(timeout), threading.Event(), []
    entered = threading.Event()

    def run():
        watch.enter()
        entered.set()
        try:
            step(release)
        finally:
            watch.leave()

    worker = threading.Thread(target=run)
    worker.start()
    entered.wait(10)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        said.append(watch.stuck())
        time.sleep(0.05)
    release.set()
    worker.join(30)
    return said


def test_a_step_is_stuck_only_when_not_building_a_program():
    """A step whose thread spends longer than the timeout tracing one program (a long compile:
    no program finished yet) is never stuck; one waiting outside JAX (a collective for a hung
    process) is, once past the timeout. (The watch that counted only finished programs called
    a compile longer than the timeout a hang.)"""

    def compiling(release):
        def traced(x):
            release.wait(30)  # inside jax.jit's tracing: building a program
            return x + 1

        jax.jit(traced).lower(jnp.zeros((3,), jnp.float32))

    assert not any(_watched(compiling)), "a long trace was called stuck"
    said = _watched(lambda rel: rel.wait(30))
    assert said[-1] is not None and "stuck in a step" in said[-1], said
    assert said[0] is None  # within the timeout, not yet
