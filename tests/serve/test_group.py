"""One engine over two processes (`jkv serve demo --coordinator ... --num-processes 2`), as two
hosts run it: 2 forced CPU devices each, jax.distributed over 127.0.0.1 (gloo), the model and
the pool sharded over the 4 devices (tp 4 over the demo's 2 kv heads: each repeated twice).
Process 0 serves HTTP; the official `openai` client's answers equal `jkv.generate` on one
device (of the kv-head-repeated model: what tp 4 computes) for a mixed workload sent at once.
A follower SIGKILLed under traffic: every request in flight ends with a 503 `group_lost`,
/health answers 503, and process 0 exits with status 3 within seconds; a follower started with
another prefill chunk runs the leader's plan and the answer is the same; one whose step hangs is
lost within --group-timeout, a 503 `group_lost` to the client; SIGTERM stops the group
gracefully (both exit 0). Every process started is stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from replicas_harness import free_run

import jkv
from jkv.serve import cli as serve_cli
from jkv.serve import group
from jkv.sharding import repeat_kv_heads

pytestmark = pytest.mark.slow

MIXED = [  # (prompt, settings): the full cache, SnapKV, StreamingLLM, one sampled with a seed
    ("the old farmer saw the red horse", {}),
    ("the little girl walked to the quiet river and saw", {"kv_policy": "snapkv", "kv_budget": 6}),
    ("the dog ran to the big house and the cat", {"kv_policy": "streaming", "kv_budget": 8}),
    ("a brave knight rode to the castle", {"temperature": 0.9, "seed": 5}),
]


class Group:
    """Both processes of the group; `url` the leader's."""

    def __init__(self, tmp_path, *flags: str, follower_flags=(), follower_code=None,
                 group_timeout="60"):  # fmt: skip
        """`follower_flags`: process 1's own flags after the group's; `follower_code`: Python
        run as process 1 instead of `jkv.cli` (it calls `jkv.cli.main` on its arguments)."""
        coordinator, port = free_run(2), free_run(1)
        devices = " --xla_force_host_platform_device_count=2"
        env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"] + devices, "JAX_PLATFORMS": "cpu"}
        if os.environ.get("JKV_TEST_COMPILE_CACHE_DIR"):  # the run's compiled programs
            env["JKV_COMPILE_CACHE"] = os.environ["JKV_TEST_COMPILE_CACHE_DIR"]
        self.logs = [tmp_path / f"process{i}.log" for i in range(2)]
        self.procs = []
        for i, log in enumerate(self.logs):
            run = ["-c", follower_code] if i and follower_code else ["-m", "jkv.cli"]
            own = list(follower_flags) if i else []
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, *run, "serve", "demo", "--port", str(port + i),
                     "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
                     "--process-id", str(i), "--group-timeout", group_timeout, *flags, *own],
                    env=env, stdout=out, stderr=subprocess.STDOUT,
                ))  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not self._healthy():
            assert all(p.poll() is None for p in self.procs), self.output()
            assert time.monotonic() < deadline, "the group did not come up\n" + self.output()
            time.sleep(0.3)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def output(self) -> str:
        return "\n".join(f"--- process {i}\n{log.read_text()[-3000:]}"
                         for i, log in enumerate(self.logs))  # fmt: skip

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


def _together(calls) -> list:
    out = [None] * len(calls)

    def run(i):
        try:
            out[i] = calls[i]()
        except Exception as err:  # noqa: BLE001 - returned and checked
            out[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_two_processes_answer_as_one_device_and_stop_gracefully(tmp_path, demo_params):
    g = Group(tmp_path, "--no-response-cache")
    try:
        client = g.client()
        got = _together([
            lambda p=p, s=s: client.completions.create(
                model="jkv-demo", prompt=p, max_tokens=8,
                temperature=s.get("temperature", 0.0), seed=s.get("seed"),
                extra_body={k: v for k, v in s.items() if k.startswith("kv_")},
            ).choices[0].text
            for p, s in MIXED
        ])  # fmt: skip
        repeated = repeat_kv_heads(demo_params, 2)  # tp 4 over 2 kv heads
        want = [
            jkv.generate(repeated, p, max_new_tokens=8, **{"temperature": 0.0, **s}).text
            for p, s in MIXED
        ]
        assert got == want, g.output()
        g.procs[0].send_signal(signal.SIGTERM)  # the leader stops the group: both exit 0
        assert [p.wait(60) for p in g.procs] == [0, 0], g.output()
    finally:
        g.close()


def test_a_killed_follower_ends_requests_with_503_and_the_group_exits(tmp_path):
    g = Group(tmp_path, "--no-response-cache")
    try:
        client = g.client()
        _together([lambda i=i: client.completions.create(  # the steps below compiled
            model="jkv-demo", prompt=f"the cat {i} sat on the", max_tokens=3, temperature=0.0
        ) for i in range(3)])  # fmt: skip
        started = threading.Barrier(4)
        seen: dict[int, object] = {}

        def long(i):  # a stream's lines, once its first token came and the others' too
            body = {"model": "jkv-demo", "prompt": f"the cat {i} sat on the", "max_tokens": 250,
                    "temperature": 0.0, "stream": True}  # fmt: skip
            lines = []
            with httpx.stream("POST", g.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 1:
                            started.wait(180)
            return lines

        threads = [threading.Thread(target=lambda i=i: seen.__setitem__(i, long(i)))
                   for i in range(3)]  # fmt: skip
        for t in threads:
            t.start()
        started.wait(240)
        killed = time.monotonic()
        g.procs[1].send_signal(signal.SIGKILL)
        for t in threads:
            t.join(60)
        ended = time.monotonic() - killed
        # a stream that already sent tokens ends with an error event, then [DONE]
        for i in range(3):
            lines = seen[i]
            assert lines[-1] == "data: [DONE]", (i, lines[-3:], g.output())
            error = json.loads(lines[-2][len("data: ") :])["error"]
            assert error["code"] == "group_lost", error
            assert "process 1 of the serving group is lost" in error["message"], error
        assert ended < group.DRAIN_S + 5, ended
        try:
            health = httpx.get(g.url + "/health", timeout=2)
            assert health.status_code == 503 and "serving group is lost" in health.text
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model="jkv-demo", prompt="the dog", max_tokens=2)
            assert refused.value.status_code == 503
        except httpx.TransportError:  # it had exited already
            pass
        assert g.procs[0].wait(30) == group.LOST_EXIT, g.output()
        assert time.monotonic() - killed < group.DRAIN_S + 30
    finally:
        g.close()


def _lost_within(g, client, bound: float) -> float:
    """A request sent now ends with a 503 `group_lost` (or the leader is gone) within `bound`
    seconds; returns the seconds it took."""
    sent = time.monotonic()
    try:
        with pytest.raises(openai.APIStatusError) as lost:
            client.completions.create(model="jkv-demo", prompt=LONG, max_tokens=4,
                                      temperature=0.0, timeout=bound + 30)  # fmt: skip
        assert lost.value.status_code == 503, lost.value
        assert lost.value.body["code"] == "group_lost", lost.value.body
    except openai.APIConnectionError:  # the leader exited before answering
        pass
    took = time.monotonic() - sent
    assert took < bound, (took, g.output())
    return took


LONG = " ".join(["the old farmer saw the red horse"] * 4)  # more tokens than a chunk of 8


def test_a_follower_with_another_chunk_runs_the_leaders_plan(tmp_path, demo_params):
    """Process 1 started with another prefill chunk (8 tokens, the leader's 128): it schedules
    nothing and runs the leader's steps, so a long prompt (its own plan would have differed: it
    exited with status 4 when followers scheduled for themselves) is answered as on one
    device, and both stop with status 0."""
    g = Group(tmp_path, "--no-response-cache", follower_flags=("--chunk", "8"))
    try:
        got = g.client().completions.create(
            model="jkv-demo", prompt=LONG, max_tokens=6, temperature=0.0
        )  # fmt: skip
        want = jkv.generate(repeat_kv_heads(demo_params, 2), LONG, max_new_tokens=6,
                            temperature=0.0)  # fmt: skip
        assert got.choices[0].text == want.text, g.output()
        g.procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(60) for p in g.procs] == [0, 0], g.output()
    finally:
        g.close()


HANGS = """
import os, sys, threading
from jkv.engine.lockstep import Replayer
run = Replayer.call
def hang(self, *args):  # once the test's file exists, a call never returns (the GIL free)
    if os.path.exists(os.environ["JKV_TEST_HANG"]):
        threading.Event().wait()
    return run(self, *args)
Replayer.call = hang
from jkv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_follower_stuck_in_a_step_is_lost_within_the_group_timeout(tmp_path, monkeypatch):
    """Process 1's step hangs (a patched call that waits forever once a file appears) while its
    heartbeat thread runs on: the step watch stops its beats, so it is lost within
    --group-timeout (15 s) + DRAIN_S: the request ends with a 503 `group_lost` and both exit
    with status 3 (before, a process stuck in a step kept beating and was never lost)."""
    flag = tmp_path / "hang"
    monkeypatch.setenv("JKV_TEST_HANG", str(flag))
    g = Group(tmp_path, "--no-response-cache", follower_code=HANGS, group_timeout="15")
    try:
        client = g.client()
        done = client.completions.create(
            model="jkv-demo", prompt=LONG, max_tokens=4, temperature=0.0
        )  # compiled: the steps are quick now
        assert done.choices[0].text
        flag.touch()
        _lost_within(g, client, 15 + group.DRAIN_S + 20)
        assert g.procs[1].wait(30) == group.LOST_EXIT, g.output()
        assert "stuck in a step" in g.output()
        assert g.procs[0].wait(30) == group.LOST_EXIT, g.output()
    finally:
        g.close()


def test_sigterm_exits_in_time_while_a_step_is_stuck_in_a_collective(tmp_path):
    """A follower frozen mid-stream (SIGSTOP) holds the leader's step in a collective, as a
    long compile would: SIGTERM still ends the leader by --shutdown-timeout + DRAIN_S + EXIT_S,
    the stream told why (it waited for the step: until --group-timeout found the follower)."""
    g = Group(tmp_path, "--no-response-cache", "--shutdown-timeout", "1",
              "--group-timeout", "300")  # fmt: skip
    lines: list[str] = []
    first = threading.Event()

    def read():
        body = {"model": "jkv-demo", "prompt": "the cat sat on the", "max_tokens": 250,
                "temperature": 0.0, "stream": True}  # fmt: skip
        with httpx.stream("POST", g.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(240), g.output()
        g.procs[1].send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # the leader's next step waits for the follower
        signalled = time.monotonic()
        g.procs[0].send_signal(signal.SIGTERM)
        bound = 1 + serve_cli.DRAIN_S + serve_cli.EXIT_S
        assert g.procs[0].wait(bound + 10) == 0, g.output()
        assert time.monotonic() - signalled < bound + 10
        reader.join(10)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2][len("data: ") :])["error"]["code"] == "server_shutdown"
        assert "without waiting for the engine's step" in g.output()
    finally:
        g.procs[1].send_signal(signal.SIGCONT)
        g.close()


def test_group_flags_are_checked():
    for args, match in (
        (("x:1", 2, 0), "HOST:PORT"),
        (("127.0.0.1:99999", 2, 0), "HOST:PORT"),
        (("127.0.0.1:5000", 1, 0), "--num-processes 1"),
        (("127.0.0.1:5000", 2, 2), r"--process-id 2: expected an int in \[0, 1\]"),
    ):
        if args[0] == "x:1":
            assert group.check(*args) == ("x", 1)
            continue
        with pytest.raises(ValueError, match=match):
            group.check(*args)
