"""The `jkv` command: generate, convert, info.

A user's mistake (bad flag, bad path, bad value) prints one line to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import jkv
from jkv import __version__
from jkv.checkpoints import DEMO_DIR, SMOLLM2, default_name, smollm2_file
from jkv.checkpoints import gguf as gguf_file
from jkv.checkpoints.hf import check_headers
from jkv.checkpoints.orbax import MARKER, config_from_json, read_meta
from jkv.compile_time import compile_cache_dir, use_compile_cache
from jkv.kv import KV_DTYPES
from jkv.memory import memory, token_bytes
from jkv.response_cache import cli as cache_cli
from jkv.serve import cli as serve_cli
from jkv_models.config import ModelConfig, preset


class UsageError(Exception):
    """A user's mistake: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; we print one line
        raise UsageError(message)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--logit-keep-ratio", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop", action="extend", nargs="+", default=None, help="stop strings (one or more)"
    )
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None)
    p.add_argument("--kv-policy", default=None, help="full, streaming, snapkv, h2o, ...")
    p.add_argument("--kv-budget", type=_budget, default=None, help="tokens, or a ratio (0.1)")
    p.add_argument("--backend", default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jkv", description="LLM inference for JAX with a small, honest KV cache")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", required=True, help="HF or jkv checkpoint folder")
    g.add_argument("--prompt", required=True)
    out = g.add_mutually_exclusive_group()
    out.add_argument("--stream", action="store_true", help="print pieces as they decode")
    out.add_argument("--json", action="store_true", help="print the result (and stats) as JSON")
    g.add_argument(
        "--allow-beyond-context",
        action="store_true",
        help="let the prompt plus new tokens run past the model's trained context",
    )
    g.add_argument(
        "--no-compile-cache",
        action="store_true",
        help=f"do not use JAX's persistent compilation cache (default: {compile_cache_dir()})",
    )
    _add_sampling(g)

    c = sub.add_parser("convert", help="convert an HF folder or a GGUF file to a jkv folder")
    c.add_argument("source", help="a Hugging Face folder, a .gguf file or 'smollm2'")
    c.add_argument("out_dir")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    c.add_argument("--name", default=None)
    c.add_argument("--overwrite", action="store_true")

    e = sub.add_parser("export-hf", help="write a checkpoint (or 'demo') as a Hugging Face folder")
    e.add_argument("model", help="a checkpoint folder or 'demo'")
    e.add_argument("out_dir")
    e.add_argument("--overwrite", action="store_true")

    i = sub.add_parser("info", help="architecture, parameter count and KV bytes per token")
    i.add_argument("model", help="a checkpoint folder or a preset name")
    i.add_argument("--json", action="store_true")

    cache_cli.add_subcommands(sub)
    serve_cli.add_subcommand(sub)

    m = sub.add_parser("memory", help="KV-cache bytes for a model, batch, context and policy")
    m.add_argument("model", help="a checkpoint folder or a preset name")
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--seq-len", type=int, required=True)
    m.add_argument("--max-new-tokens", type=int, default=64, help="as jkv generate (default 64)")
    m.add_argument("--kv-dtype", choices=KV_DTYPES + ("float16",), default=None)
    m.add_argument("--kv-policy", default=None)
    m.add_argument("--kv-budget", type=_budget, default=None)
    m.add_argument("--json", action="store_true")
    return parser


def _budget(text: str) -> int | float:
    """A token count ("256") or a ratio ("0.1")."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        msg = f"invalid budget {text!r}: a token count or a ratio"
        raise argparse.ArgumentTypeError(msg) from None


def _read_config(model: str) -> tuple[ModelConfig, str]:
    """The config of a preset or a checkpoint folder, without loading any weights."""

    path = {"demo": DEMO_DIR, SMOLLM2: None}.get(model, Path(model))
    path = smollm2_file() if path is None else path
    if path.is_file() and gguf_file.is_gguf(path):
        return gguf_file.check_headers(path), "gguf"
    if path.is_dir():
        if (path / MARKER).is_file():
            meta = read_meta(path)
            if not isinstance(meta.get("config"), dict):
                raise ValueError(f"{path / MARKER}: holds no config")
            return config_from_json(meta["config"], str(path / MARKER)), "jkv"
        if (path / "config.json").is_file():
            return check_headers(path), "hugging face"  # every tensor's header, no data
        raise ValueError(f"model={model!r} holds no config.json or jkv.json")
    if path.exists():
        raise ValueError(f"model={model!r} is a file; expected a checkpoint folder or preset")
    try:
        return preset(model), "preset"
    except ValueError:
        raise ValueError(f"model={model!r} is neither a checkpoint folder nor a preset") from None


def cmd_info(args) -> int:

    cfg, kind = _read_config(args.model)
    info = {
        "model": args.model,
        "name": args.model if kind == "preset" else default_name(args.model),
        "source": kind,
        "architecture": cfg.architecture,
        "parameters": cfg.num_params(),
        "dtype": cfg.dtype,
        "layers": cfg.num_layers,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "sliding_window": cfg.sliding_window,
        # K, V and (fp8) their scales, all layers
        "kv_bytes_per_token": {d: cfg.num_layers * token_bytes(cfg, d) for d in KV_DTYPES},
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if key == "kv_bytes_per_token":
            for dtype, n in value.items():
                print(f"{'kv bytes/token ' + dtype:<32} {n:,}")
        else:
            print(f"{key:<32} {value:,}" if isinstance(value, int) else f"{key:<32} {value}")
    return 0


def cmd_convert(args) -> int:
    out = jkv.convert(
        args.source,
        args.out_dir,
        dtype=args.dtype,
        name=args.name,
        overwrite=args.overwrite,
        progress=True,
    )
    print(f"wrote {out}")
    return 0


def cmd_export_hf(args) -> int:
    out = jkv.export_hf(jkv.load(args.model), args.out_dir, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_generate(args) -> int:
    if not args.no_compile_cache:
        use_compile_cache()
    params = jkv.load(args.model)
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        logit_keep_ratio=args.logit_keep_ratio,
        seed=args.seed,
        stop=args.stop,
        kv_dtype=args.kv_dtype,
        backend=args.backend,
        kv_policy=args.kv_policy,
        kv_budget=args.kv_budget,
        allow_beyond_context=args.allow_beyond_context,
    )
    if args.stream:
        for piece in jkv.stream(params, args.prompt, **kwargs):
            print(piece, end="", flush=True)
        print()
        return 0
    result = jkv.generate(params, args.prompt, **kwargs)
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": result.tokens,
                    "finish_reason": result.finish_reason,
                    "kv_bytes": result.kv_bytes,
                    "stats": result.stats,
                },
                indent=2,
            )
        )
    else:
        print(result.text)
    return 0


def cmd_memory(args) -> int:
    cfg, _ = _read_config(args.model)
    r = memory(
        cfg,
        args.batch,
        args.seq_len,
        max_new_tokens=args.max_new_tokens,
        kv_dtype=args.kv_dtype,
        kv_policy=args.kv_policy,
        kv_budget=args.kv_budget,
    )
    if args.json:
        print(json.dumps(dataclasses.asdict(r), indent=2))
        return 0
    dtype = args.kv_dtype or cfg.dtype
    print(
        f"{args.model}: batch {args.batch}, {args.seq_len} tokens, kv {dtype}, "
        f"policy {args.kv_policy or 'full'}"
        + (f" (budget {args.kv_budget})" if args.kv_budget else "")
    )
    print(f"{'layer':>5} {'slots':>8} {'bytes':>16}")
    for i, (slots, n) in enumerate(zip(r.slots, r.per_layer, strict=True)):
        print(f"{i:>5} {slots:>8,} {n:>16,}")
    print(
        f"total {r.total:,} bytes ({r.total / 2**30:.3f} GiB): K+V {r.kv:,}, fp8 scales "
        f"{r.scales:,}; positions/lengths {r.bookkeeping:,} more"
    )
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "convert": cmd_convert,
    "info": cmd_info,
    "memory": cmd_memory,
    "export-hf": cmd_export_hf,
}


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    """Every subcommand's name, in the order `jkv --help` lists them."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.version:
            print(f"jkv {__version__}")
            return 0
        if args.command is None:
            raise UsageError("a command is required: " + ", ".join(_commands(parser)))
        if args.command == "cache":
            return cache_cli.run(args)
        if args.command == "serve":
            return serve_cli.run(args)
        return COMMANDS[args.command](args)
    except (UsageError, ValueError) as e:
        message = str(e).replace("pass overwrite=True", "pass --overwrite")  # the CLI's spelling
        print(f"jkv: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `jkv ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
