"""The `jkv` command: generate, convert, info; user mistakes are one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jkv
from jkv.cli import main


def test_generate_text_and_json(hf_checkpoint, capsys):
    folder = hf_checkpoint("llama")
    assert (
        main(
            [
                "generate",
                "--model",
                str(folder),
                "--prompt",
                "w1 w2 w3",
                "--max-new-tokens",
                "6",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    want = jkv.generate(jkv.load(folder), "w1 w2 w3", max_new_tokens=6)
    assert out["tokens"] == want.tokens and out["text"] == want.text
    assert (
        main(
            [
                "generate",
                "--model",
                str(folder),
                "--prompt",
                "w1 w2 w3",
                "--max-new-tokens",
                "6",
                "--stream",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == want.text + "\n"


def test_convert_then_info(hf_checkpoint, tmp_path, capsys):
    out_dir = tmp_path / "jkv-model"
    assert main(["convert", str(hf_checkpoint("qwen2")), str(out_dir), "--dtype", "bfloat16"]) == 0
    assert (out_dir / "jkv.json").is_file()
    capsys.readouterr()
    assert main(["info", str(out_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "Qwen2ForCausalLM" and info["dtype"] == "bfloat16"
    assert info["source"] == "jkv"
    assert jkv.load(out_dir).config.dtype == "bfloat16"


def test_info_preset(capsys):
    assert main(["info", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248" in out
    assert "kv bytes/token bfloat16" in out and "131,072" in out
    # fp8: one byte per K and V element plus a 2-byte scale per (kv head, token) for each
    assert "kv bytes/token float8_e4m3fn" in out and f"{32 * 8 * (2 * 128 + 2 * 2):,}" in out


def test_info_shows_the_name_the_cache_uses(hf_checkpoint, tmp_path, capsys):
    import shutil

    folder = tmp_path / "demo copy"
    shutil.copytree(hf_checkpoint("llama"), folder)
    assert main(["info", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == jkv.load(folder).name == "demo-copy"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "a command is required"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["generate", "--prompt", "hi"], "the following arguments are required: --model"),
        (
            ["generate", "--model", "/no/such/dir", "--prompt", "hi"],
            "path='/no/such/dir' does not exist",
        ),
        (["info", "/no/such/dir"], "is neither a checkpoint folder nor a preset"),
        (["convert", "/no/such/dir", "/no/such/out"], "/no/such/dir/config.json: no such file"),
        (["info", "llama-3.1-8b", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_user_mistakes_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jkv: error: ")
    assert message in err


def test_bad_value_flag(hf_checkpoint, capsys):
    folder = str(hf_checkpoint("llama"))
    assert main(["generate", "--model", folder, "--prompt", "w1", "--max-new-tokens", "abc"]) == 2
    assert "invalid int value: 'abc'" in capsys.readouterr().err
    assert main(["generate", "--model", folder, "--prompt", "w1", "--top-p", "7"]) == 2
    assert "top_p=7.0 must be in (0, 1]" in capsys.readouterr().err


def test_console_script_exit_code_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "jkv.cli", "info", "nope-model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "jkv: error: model='nope-model' is neither a checkpoint folder nor a preset"
    )


def run_cli(*argv, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "jkv.cli", *argv],
        capture_output=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        **kw,
    )


def test_non_utf8_prompt_is_one_line():
    proc = run_cli(b"generate", b"--model", b"demo", b"--prompt", b"The \xff code")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err
    assert err.startswith("jkv: error: prompt holds '\\udcff' at index 4, a lone surrogate")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--json", "--stream"], "argument --stream: not allowed with argument --json"),
        (["--seed", str(2**70)], f"seed={2**70} must be an integer in [0, 2**64)"),
        (["--max-new-tokens", str(10**9)], "more than the model's trained context"),
    ],
)
def test_generate_mistakes_are_one_line(extra, message, capsys):
    assert main(["generate", "--model", "demo", "--prompt", "The code", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jkv: error: ") and message in err and err.count("\n") == 1


def test_several_stop_strings_after_one_flag(hf_checkpoint, capsys):
    folder = str(hf_checkpoint("llama"))
    argv = ["generate", "--model", folder, "--prompt", "w1 w2", "--max-new-tokens", "8"]
    assert main([*argv, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["text"]
    first, second = full.split()[1], full.split()[3]
    assert main([*argv, "--json", "--stop", first, second]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["text"] == full[: full.index(first)]
    assert got["stats"]["beyond_context"] is False and got["stats"]["compile_s"] >= 0


def test_a_closed_pipe_is_not_a_traceback():
    code = (
        "import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
        "from jkv.cli import main\n"
        "sys.exit(main(['info', 'llama-3.1-8b']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr == ""


def test_export_hf_names_the_flag_and_keeps_the_mode(tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export-hf", "demo", str(out)]) == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # model.safetensors like its siblings
    capsys.readouterr()
    assert main(["export-hf", "demo", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite" in err and "overwrite=True" not in err


def test_info_reads_the_headers_it_reports(hf_checkpoint, tmp_path, capsys):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("llama"), folder)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:16] = b"{garbage"  # the JSON header of every tensor's name, dtype and shape
    (folder / "model.safetensors").write_bytes(bytes(data))
    assert main(["info", str(folder)]) == 2
    assert "model.safetensors: not a readable safetensors file" in capsys.readouterr().err


def test_second_cli_run_reads_compiled_programs(tmp_path):
    argv = ["generate", "--model", "demo", "--prompt", "The code", "--max-new-tokens", "4"]
    env = {"JKV_COMPILE_CACHE": str(tmp_path / "xla")}
    runs = [run_cli(*argv, "--json", env=env, text=True) for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr
    first, second = (json.loads(p.stdout)["stats"] for p in runs)
    assert first["compile_cache_hits"] == 0 and any((tmp_path / "xla").iterdir())
    assert second["compile_cache_hits"] > 0
    assert json.loads(runs[0].stdout)["text"] == json.loads(runs[1].stdout)["text"]
