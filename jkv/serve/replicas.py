"""`jkv serve MODEL --replicas N`: N `jkv serve` processes behind sglang-router, one command.

    jkv serve demo --replicas 2 --port 8001 --router-port 30000 --redis-url redis://h:6379/0

starts replica i on `--port + i` (every other flag passed to each: the same model, keys,
tenants, engine settings and response-cache L2), then `sglang-router` (PyPI `sglang-router`,
a Rust binary; `python -m sglang_router.launch_router`) on `--router-host:--router-port` with
its cache-aware policy over them: it keeps an approximate radix tree of the request texts each
worker has seen and sends a request to the worker whose tree matches most of it (at least
`--cache-threshold` 0.3 of it; below that, or when loads differ by more than its balance
thresholds, to the least loaded worker). Its balance thresholds are set to 4 requests and
1.2x (sglang's defaults, 64 and 1.5, let a burst follow one tree to one worker); the
launcher's router flags (these, retries, health checks, breaker) come before `--router-args`,
which overrides any of them. Clients talk to the router with the replicas' API keys: it
forwards the `Authorization` header, and each replica decides the tenant.

The router is given no tokenizer and no model path, so it loads no tokenizer from a hub (it
logs "No tokenizer_path or model_path found for model unknown" and routes on the request's
text); HF_HUB_OFFLINE=1 is set for it all the same. Its own `/v1/models` answers "unknown"
(it asks no replica): ask a replica, or send the served name as `model`.

Failures. The router checks each replica's `/health` every `--router-health-interval` seconds
(2) and takes it out after 2 failures. A plain request whose replica dies is retried by the
router (up to 8 times, ~10 s of backoff in all) and answered by a live replica: its client sees
a slower answer, no error. A stream already under way on the dead replica is cut: its client
gets the chunks sent so far, then a broken connection (no `[DONE]`). A replica that exits is
started again by this launcher after `--restart-delay` seconds (1), on its port; the router's
health checks put it back once it answers (and its circuit breaker, opened by the failed
requests, after 10 s). SIGTERM / Ctrl-C stops the router first (no new requests), then the
replicas gracefully (in-flight requests finish, as one `jkv serve` does).

With `--kv-events-endpoint tcp://HOST:PORT` replica i publishes on PORT + 2 i (replay on
PORT + 2 i + 1 unless `--kv-events-replay-endpoint` is given, then offset by 2 i as well)
with `data_parallel_rank` i, vLLM's per-rank offsets, for a KV-aware indexer.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request

log = logging.getLogger("jkv.serve")
LAUNCHER_FLAGS = ("replicas", "router_port", "router_host", "router_policy", "router_args",
                  "router_health_interval", "router_metrics_port", "restart_delay")  # fmt: skip


def add_flags(s: argparse.ArgumentParser) -> None:
    """The launcher's flags on the `serve` parser."""
    s.add_argument("--replicas", type=int, default=1,
                   help="run N jkv serve processes (ports --port, --port + 1, ...) behind "
                   "sglang-router on --router-port")  # fmt: skip
    s.add_argument("--router-port", type=int, default=30000, help="the router's port")
    s.add_argument("--router-host", default=None, help="the router's address (default: --host)")
    s.add_argument("--router-policy", default="cache_aware",
                   choices=("cache_aware", "round_robin", "power_of_two", "random"),
                   help="sglang-router's routing policy")  # fmt: skip
    s.add_argument("--router-args", default="",
                   help="more sglang-router flags, one string, e.g. "
                   "'--balance-abs-threshold 8 --cache-threshold 0.5'")  # fmt: skip
    s.add_argument("--router-health-interval", type=int, default=2,
                   help="seconds between the router's /health checks of each replica")  # fmt: skip
    s.add_argument("--router-metrics-port", type=int, default=None,
                   help="the router's Prometheus port (default: --router-port + 1)")  # fmt: skip
    s.add_argument("--restart-delay", type=float, default=1.0,
                   help="seconds before a replica that exited is started again")  # fmt: skip


def check(args: argparse.Namespace) -> None:
    """Validates the launcher's flags (before anything starts).

    Raises:
        ValueError: naming the flag.
    """
    if not 1 <= args.replicas <= 64:
        raise ValueError(f"replicas={args.replicas}: expected 1 to 64")
    if not args.restart_delay >= 0:
        raise ValueError(f"restart_delay={args.restart_delay}: expected seconds >= 0")
    last = args.port + args.replicas - 1
    if args.port == 0 or last > 65535:
        raise ValueError(f"port={args.port} with replicas={args.replicas}: ports up to {last}")
    router = {args.router_port, _metrics_port(args)}
    clash = router & set(range(args.port, last + 1))
    if clash or len(router) < 2:
        raise ValueError(
            f"router_port={args.router_port} / router_metrics_port={_metrics_port(args)} "
            f"clash with the replicas' ports {args.port}-{last} or with each other"
        )
    try:
        shlex.split(args.router_args)
    except ValueError as e:
        raise ValueError(f"router_args={args.router_args!r}: {e}") from None


def _metrics_port(args: argparse.Namespace) -> int:
    return args.router_metrics_port or args.router_port + 1


def replica_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, i: int) -> list[str]:
    """`jkv serve ...` of replica `i`: every flag the user set, but the launcher's, with its
    own --port and KV-event endpoints."""
    argv = ["serve", args.model]
    for action in parser._actions:  # argparse keeps its actions there
        name = action.dest
        if not action.option_strings or name in LAUNCHER_FLAGS or name == "help":
            continue
        value = getattr(args, name, None)
        if name == "port":
            value = args.port + i
        elif name in ("kv_events_endpoint", "kv_events_replay_endpoint") and value:
            value = _offset(value, 2 * i)
        elif name == "kv_events_rank" and args.kv_events_endpoint:
            value = i
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, value if isinstance(value, str) else _text(value)]
    if args.kv_events_endpoint and not args.kv_events_replay_endpoint:
        argv += ["--kv-events-replay-endpoint", _offset(args.kv_events_endpoint, 2 * i + 1)]
    return argv


def _text(value) -> str:
    import json

    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _offset(endpoint: str, by: int) -> str:
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r}: replicas need a tcp:// endpoint with a port")
    return f"{head}:{int(port) + by}"


def router_argv(args: argparse.Namespace) -> list[str]:
    host = args.router_host or args.host
    workers = [f"http://{args.host}:{args.port + i}" for i in range(args.replicas)]
    return [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", host, "--port", str(args.router_port),
        "--worker-urls", *workers,
        "--policy", args.router_policy,
        # sglang's balance thresholds (64, 1.5) let every request of a burst follow one tree to
        # one worker; at 4 and 1.2 a burst is split (a trial: 160 concurrent requests, 77/83).
        "--balance-abs-threshold", "4", "--balance-rel-threshold", "1.2",
        "--health-check-interval-secs", str(args.router_health_interval),
        "--health-failure-threshold", "2", "--health-success-threshold", "1",
        "--health-check-timeout-secs", "2", "--health-check-endpoint", "/health",
        # Its circuit breaker opens on a dead replica's failed requests; closed again after
        # 10 s (sglang's default is 60 s), a restarted replica is back soon after it answers.
        "--cb-timeout-duration-secs", "10",
        # A plain request whose replica died is retried (on a 5xx or a lost connection): 8
        # times from 200 ms, 1.5x each (~10 s in all), longer than the health checks take to
        # remove that replica (2 intervals), so the retry lands on a live one.
        "--retry-max-retries", "8", "--retry-initial-backoff-ms", "200",
        "--retry-max-backoff-ms", "4000",
        "--prometheus-host", host, "--prometheus-port", str(_metrics_port(args)),
        "--log-level", "warn",
        *shlex.split(args.router_args),
    ]  # fmt: skip


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Replicas:
    """The replicas and the router as child processes, restarted replicas included."""

    def __init__(self, parser, args) -> None:
        self.parser, self.args = parser, args
        self.procs: list[subprocess.Popen | None] = [None] * args.replicas
        self.restarts = [0] * args.replicas
        self.router: subprocess.Popen | None = None
        self.stopping = threading.Event()

    def url(self, i: int) -> str:
        return f"http://{self.args.host}:{self.args.port + i}"

    def start_replica(self, i: int) -> None:
        argv = [sys.executable, "-m", "jkv.cli", *replica_argv(self.parser, self.args, i)]
        self.procs[i] = subprocess.Popen(argv)
        log.info("replica %d: pid %d on %s", i, self.procs[i].pid, self.url(i))

    def start(self, timeout: float = 600.0) -> None:
        for i in range(self.args.replicas):
            self.start_replica(i)
        deadline = time.monotonic() + timeout
        for i in range(self.args.replicas):
            while not _healthy(self.url(i)):
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"replica {i} exited ({self.procs[i].returncode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {i} did not answer /health in {timeout} s")
                time.sleep(0.5)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.router = subprocess.Popen(router_argv(self.args), env=env)
        host = self.args.router_host or self.args.host
        router_url = f"http://{host}:{self.args.router_port}"
        while not _healthy(router_url):
            if self.router.poll() is not None:
                raise RuntimeError(f"sglang-router exited ({self.router.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router did not answer on {router_url}")
            time.sleep(0.2)
        log.info("sglang-router (%s) on %s/v1", self.args.router_policy, router_url)

    def supervise(self) -> None:
        """Until stopped: a replica that exited is started again after --restart-delay
        seconds; the router exiting ends the deployment."""
        while not self.stopping.wait(0.5):
            if self.router.poll() is not None:
                log.error("sglang-router exited (%s): stopping", self.router.returncode)
                return
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None and not self.stopping.wait(self.args.restart_delay):
                    self.restarts[i] += 1
                    log.warning("replica %d exited (%s): restart %d", i, proc.returncode,
                                self.restarts[i])  # fmt: skip
                    self.start_replica(i)

    def stop(self, timeout: float) -> None:
        """The router first (no new requests), then the replicas (SIGTERM: they drain)."""
        self.stopping.set()
        for proc in [self.router, *self.procs]:
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            if proc is self.router:
                _wait(proc, 10)
        for proc in self.procs:
            if proc is not None:
                _wait(proc, timeout)


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Runs the replicas and the router until SIGTERM / Ctrl-C. Returns the exit code."""
    check(args)
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise ValueError(
            "--replicas needs sglang-router (pip install sglang-router==0.3.2)"
        ) from None
    group = Replicas(parser, args)
    stop = lambda signum, frame: group.stopping.set()
    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        group.start()
        group.supervise()
        return 0 if group.stopping.is_set() else 1
    except RuntimeError as e:
        print(f"jkv: error: {e}", file=sys.stderr)
        return 1
    finally:
        group.stop(args.shutdown_timeout + 10)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
