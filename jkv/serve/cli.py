"""`jkv serve MODEL [...]`: loads the model, builds the engine and runs the server with uvicorn
until SIGTERM or Ctrl-C (then it stops accepting connections, lets in-flight requests finish
for up to --shutdown-timeout seconds, and exits)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import jkv
from jkv.checkpoints import DEMO_DIR
from jkv.compile_time import use_compile_cache
from jkv.serve.metrics import JsonFormatter
from jkv.serve.server import Server, chat_template_of


def add_subcommand(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over OpenAI's HTTP API")
    s.add_argument("model", help="'demo', a Hugging Face folder or a jkv folder")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the name clients send as model")
    s.add_argument("--kv-policy", default=None, help="the default KV policy of requests")
    s.add_argument("--kv-budget", type=float, default=None, help="its budget (ratio or tokens)")
    s.add_argument("--kv-dtype", default=None, help="float32, bfloat16 or fp8 (one per server)")
    s.add_argument("--num-pages", type=int, default=1024, help="KV pool pages")
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--max-running", type=int, default=32, help="requests decoding at once")
    s.add_argument("--token-budget", type=int, default=256, help="tokens per engine step")
    s.add_argument("--chunk", type=int, default=128, help="prefill chunk (tokens)")
    s.add_argument("--attention-mass", action="store_true", help="keep H2O's mass in the pool")
    s.add_argument("--recycle", choices=("lazy", "watermark"), default="lazy",
                   help="when cached pages are taken back (default lazy, as vLLM)")  # fmt: skip
    s.add_argument("--recycle-below", type=float, default=0.15, help="the watermark's free share")
    s.add_argument("--admission-headroom", type=float, default=0.05,
                   help="pool share a new request must leave free")  # fmt: skip
    s.add_argument("--admission", choices=("reserve", "optimistic"), default="reserve",
                   help="reserve: pages for max_tokens at admission; optimistic: preempt later")  # fmt: skip
    s.add_argument("--redis-url", default=None, help="the response cache's L2 (Redis)")
    s.add_argument("--no-response-cache", action="store_true")
    s.add_argument("--max-queued-requests", type=int, default=512)
    s.add_argument("--max-queued-tokens", type=int, default=262144)
    s.add_argument("--warmup", action="store_true", help="compile every step shape first")
    s.add_argument("--shutdown-timeout", type=float, default=30.0)
    s.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ValueError(
            f"jkv serve needs the serve extra ({e}): pip install 'jkv[serve]'"
        ) from None

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("jkv")
    root.handlers[:] = [handler]
    root.setLevel(args.log_level.upper())
    root.propagate = False

    use_compile_cache()
    params = jkv.load(args.model)
    if args.served_model_name:
        params = params.replace(name=args.served_model_name)
    engine = jkv.Engine(
        params,
        num_pages=args.num_pages,
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
    )
    defaults = {}
    if args.kv_policy is not None:
        defaults["kv_policy"] = args.kv_policy
        if args.kv_budget is not None:
            defaults["kv_budget"] = int(args.kv_budget) if args.kv_budget >= 1 else args.kv_budget
    if args.warmup:
        seconds = engine.warmup(kv_policies=[args.kv_policy] if args.kv_policy else ())
        logging.getLogger("jkv.serve").info("warmed up in %.1f s", seconds)
    cache = None
    if not args.no_response_cache:
        cache = jkv.ResponseCache(args.redis_url)
    template, special = chat_template_of(DEMO_DIR if args.model == "demo" else args.model)
    server = Server(
        params,
        engine,
        response_cache=cache,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        chat_template=template,
        special_tokens=special,
        defaults=defaults,
    )
    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=args.shutdown_timeout,
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
    try:
        uvicorn.Server(config).run()
    finally:
        if cache is not None:
            cache.close()
    logging.getLogger("jkv.serve").info("stopped (%s)", ", ".join(map(str, stopped)) or "done")
    return 0
