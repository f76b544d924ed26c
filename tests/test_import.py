"""`import jkv` stays light: no torch, transformers, redis, kvpress, gguf, nor the server's web
framework, metrics, tracing, ZeroMQ (KV events) or the router at import time."""

from __future__ import annotations

import subprocess
import sys


def test_import_jkv_is_light():
    code = (
        "import sys, jkv, jkv.cli; heavy = [m for m in ('torch', 'transformers', 'redis',"
        " 'kvpress', 'fastapi', 'starlette', 'uvicorn', 'opentelemetry', 'prometheus_client',"
        " 'jinja2', 'gguf', 'zmq', 'msgspec', 'sglang_router') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_submodules_the_readme_names_are_attributes():
    code = "import jkv; print(jkv.embedding.ModelEmbedder.__name__, jkv.embedding.fit_clusters)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
