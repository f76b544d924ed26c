"""Every fenced example of README.md runs as written, on the bundled demo model.

Python blocks run in order in one namespace (the multi-device block in a subprocess with 8
forced CPU devices); the names an example leaves to the reader (`prompt`, `context`, ...) are
bound first and its placeholders (`path/to/checkpoint`, `hf_dir`, the Redis URL) point at real
things: the demo model, its Hugging Face export, a real Redis server. Shell blocks: every `jkv`
line without `[...]` synopsis runs through the CLI. It lives beside the cache tests for their
Redis fixture.
"""

from __future__ import annotations

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


def readme_blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall((ROOT / "README.md").read_text()) if kind == lang]


def test_readme_has_the_examples_this_runs():
    assert len(readme_blocks("python")) >= 4 and readme_blocks("sh")


def test_python_examples_run(redis_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hf_dir = jkv.export_hf(jkv.load("demo"), tmp_path / "hf_dir")
    subs = {
        '"path/to/checkpoint"': '"demo"',
        '"redis://localhost:6379/0"': repr(redis_url),
        '"hf_dir"': repr(str(hf_dir)),
        '"ckpt"': '"demo"',
    }
    namespace: dict = {}
    exec(PRELUDE, namespace)
    for i, block in enumerate(readme_blocks("python")):
        for old, new in subs.items():
            block = block.replace(old, new)
        if "jax.devices()" in block:  # the mesh example wants 8 devices: a process of its own
            code = PRELUDE + "params = jkv.load('demo')\n" + block
            env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
            proc = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
            )
            assert proc.returncode == 0, f"README python block {i}:\n{block}\n{proc.stderr}"
            continue
        running = None
        if "http://127.0.0.1:8000/v1" in block:  # the server example: a real jkv server
            params = jkv.load("demo")
            running = Running(Server(params, small_engine(params)))
            block = block.replace("http://127.0.0.1:8000", running.url)
        try:
            exec(compile(block, f"README python block {i}", "exec"), namespace)
        except Exception as e:
            pytest.fail(f"README python block {i} failed: {e!r}\n{block}")
        finally:
            if running is not None:
                running.stop()
    namespace["cache"].close()


def test_shell_examples_run(tmp_path, capsys):
    lines = [
        line.split("#")[0].strip()
        for block in readme_blocks("sh")
        for line in block.splitlines()
        if line.startswith("jkv ") and "[" not in line
    ]
    assert lines
    for line in lines:
        argv = shlex.split(line.replace("OUT_DIR", str(tmp_path / "out")))[1:]
        assert main(argv) == 0, f"{line}: {capsys.readouterr().err}"
