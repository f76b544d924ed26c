"""The serving group's step channel (`jkv.serve.group`) between two real engines on one device
each, no jax.distributed: the leader's engine here, a follower's in a subprocess. The follower,
told only the leader's messages, takes the same steps and samples the same tokens (the
lockstep's premise: the engine's host side is deterministic given its messages); a follower
whose plan differs from the digest the leader sends before running its step exits with status
4 before running it; one whose leader closes the
channel, or falls silent past the timeout, exits with status 3; a leader counts a follower
that is killed (at once) or stopped (past the timeout) as lost. Seconds each."""

from __future__ import annotations

import contextlib
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
import pytest
from replicas_harness import free_run

from jkv.engine.engine import Engine
from jkv.engine.scheduler import StepPlan
from jkv.engine.sequence import EPOCHS
from jkv.serve import group

SETTINGS = dict(num_pages=256, max_running=4, token_budget=32, chunk=16)
FOLLOWER = textwrap.dedent(
    f"""
    import json, sys
    import jkv
    from jkv.engine.engine import Engine
    from jkv.serve import group

    link = group.Follower("127.0.0.1", int(sys.argv[1]), 1, float(sys.argv[2]))
    engine = Engine(jkv.load("demo"), **{SETTINGS!r})
    got, step = {{}}, engine.step

    def observed():
        outs = step()
        for out in outs:
            got.setdefault(out.request_id, []).extend(out.new_tokens)
        return outs

    engine.step = observed
    link.serve(engine)
    print("TOKENS", json.dumps(got), flush=True)
    """
)


@contextlib.contextmanager
def _follower(port: int, timeout: float = 5.0):
    """A follower process on `port`, killed (and resumed first if stopped) at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, str(port), str(timeout)],
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


def test_a_follower_takes_the_leaders_steps(demo_params, lost):
    for _ in range(3):  # this process made sequences before (a server's warmup does)
        next(EPOCHS)
    port = free_run(1)
    with _follower(port) as proc:
        leader = _leader(port, lost)
        engine = Engine(demo_params, **SETTINGS)
        engine.lockstep = leader
        prompts = ["the old farmer saw the red horse", "the dog ran to the big house and the cat",
                   "a brave knight rode to the castle and the king"]  # fmt: skip
        rids = [  # (policies across processes: tests/serve/test_group.py)
            engine.add_request(prompts[0], max_new_tokens=6),
            engine.add_request(prompts[1], max_new_tokens=5, stop=["zebra"]),
            engine.add_request(prompts[2], max_new_tokens=7, temperature=0.9, seed=3),
        ]  # fmt: skip
        gone = engine.add_request(prompts[0] + " and", max_new_tokens=30)
        got = {rid: [] for rid in rids}
        for n in range(200):
            if n == 3:
                engine.abort(gone)  # an abort reaches the follower too
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_tokens)
            if not engine.has_work:
                break
        leader.stop()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        theirs = json.loads(out.split("TOKENS ", 1)[1])
        assert theirs == got, (theirs, got)
        assert len(got[gone]) < 30 and all(len(got[r]) >= 5 for r in rids), got
        assert not lost


@pytest.mark.parametrize("case", ["another plan", "no step"])
def test_a_follower_whose_plan_differs_exits_before_running_it(lost, case):
    """The leader sends its plan's digest once planned, before running the step: a follower
    whose own plan differs (the leader claims an empty step where the follower schedules the
    request it was told of) exits with status 4 before running its step, as does one that
    planned no step where the leader ran one."""
    port = free_run(1)
    with _follower(port) as proc:
        leader = _leader(port, lost)
        if case == "another plan":
            leader.taken("add", dict(prompt=[5, 6, 7, 8, 9], request_id="r", max_new_tokens=3))
        leader.tick()
        leader.planned(StepPlan([], []))
        assert proc.wait(120) == group.DIVERGED_EXIT, proc.stdout.read()
        said = proc.stdout.read()
        if case == "another plan":
            assert "step 1's plan differs from the leader's" in said, said
            assert "stopping before it runs" in said, said
        else:
            assert "the leader ran a step this process planned none for" in said, said
        assert _wait(lambda: leader.lost_reason is not None, 10)  # then it is lost to the leader


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
        assert took < 2.5 if how == "killed" else 2.5 < took < 8, (
            took
        )  # closed: before the 3 s timeout
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
