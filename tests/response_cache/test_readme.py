"""Every fenced example of README.md and of docs/*.md runs as written, on the bundled demo model
(and SmolLM2 where a page loads it).

Python blocks of one page run in order in one namespace (the multi-device block in a subprocess
with 8 forced CPU devices), in a scratch folder; the names an example leaves to the reader
(`prompt`, `context`, ...) are bound first and its placeholders (`path/to/checkpoint`, `ckpt`,
the Redis URL) point at real things: the demo model, a real Redis server. A server example talks
to a real jkv server on a loopback port serving the demo model. `print(...)  # text` promises
`text` in what the block prints, and is checked (not for a server example, whose model is then
the demo's). Shell blocks: every `jkv` line without `[...]` synopsis runs through the CLI (`jkv
serve`, which would not return, excepted). It lives beside the cache tests for their Redis
fixture.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import Running, small_engine

import jkv
from jkv.cli import main
from jkv.serve.server import Server

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
PROMISED = re.compile(r"^\s*print\(.*\)\s+#\s*(.+?)\s*$", re.M)
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

PRELUDE = """
import jax
import numpy as np
import jkv
prompt = "The code for Rosa is 1 2 3 4 5 . The code for"
prompts = [prompt, "Pia is"]
context = "The code for Rosa is 1 2 3 4 5 . The code for Pia is 9 8 7 6 5 ."
question = " The code for Pia is"
cluster_id = 0
"""


def blocks(page: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall((ROOT / page).read_text()) if kind == lang]


def shell_lines(page: str) -> list[str]:
    lines = [
        line.split("#")[0].strip() for block in blocks(page, "sh") for line in block.splitlines()
    ]
    return [
        s for s in lines if s.startswith("jkv ") and "[" not in s and not s.startswith("jkv serve")
    ]


PYTHON_PAGES = [p for p in PAGES if blocks(p, "python")]
SHELL_PAGES = [p for p in PAGES if shell_lines(p)]


def test_the_pages_have_the_examples_this_runs():
    assert "README.md" in PYTHON_PAGES and len(PYTHON_PAGES) >= 8
    assert len(SHELL_PAGES) >= 2
    assert PROMISED.findall("\n".join(blocks("README.md", "python")))


def run_block(block: str, where: str, namespace: dict) -> None:
    """Runs one block in `namespace`; checks what its `print(...)  # text` lines promise."""
    running, promised = None, PROMISED.findall(block)
    if "http://127.0.0.1:8000/v1" in block:  # the server example: a real jkv server
        served = jkv.load("demo")
        running = Running(Server(served, small_engine(served)))
        block = block.replace("http://127.0.0.1:8000", running.url)
        block = block.replace('model="smollm2"', f'model="{served.name}"')
        promised = []  # the demo model's answer is not SmolLM2's
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block, where, "exec"), namespace)
    except Exception as e:
        pytest.fail(f"{where} failed: {e!r}\n{block}")
    finally:
        if running is not None:
            running.stop()
    for text in promised:
        assert text in out.getvalue(), f"{where} promised {text!r}, printed {out.getvalue()!r}"


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_examples_run(page, redis_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    subs = {
        '"path/to/checkpoint"': '"demo"',
        '"redis://localhost:6379/0"': repr(redis_url),
        '"ckpt"': '"demo"',
    }
    namespace: dict = {}
    exec(PRELUDE, namespace)
    for i, block in enumerate(blocks(page, "python")):
        where = f"{page} python block {i}"
        for old, new in subs.items():
            block = block.replace(old, new)
        if "jax.devices()" in block:  # the mesh example wants 8 devices: a process of its own
            code = PRELUDE + "params = jkv.load('demo')\n" + block
            env = {
                **os.environ,
                "XLA_FLAGS": os.environ["XLA_FLAGS"] + " --xla_force_host_platform_device_count=8",
            }
            proc = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
            )
            assert proc.returncode == 0, f"{where}:\n{block}\n{proc.stderr}"
            continue
        run_block(block, where, namespace)
    if isinstance(namespace.get("cache"), jkv.ResponseCache):
        namespace["cache"].close()


@pytest.mark.parametrize("page", SHELL_PAGES)
def test_shell_examples_run(page, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for line in shell_lines(page):
        argv = shlex.split(line.replace("OUT_DIR", str(tmp_path / "out")))[1:]
        assert main(argv) == 0, f"{page}: {line}: {capsys.readouterr().err}"
