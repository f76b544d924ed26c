"""`jkv cache ...` through a parser built here, as jkv/cli.py wires it."""

from __future__ import annotations

import argparse
import json

import pytest

from jkv.response_cache import ResponseCache
from jkv.response_cache import cli as cache_cli

SETTINGS = {"temperature": 0.0}
ANSWER = {"text": "ok", "tokens": [1], "finish_reason": "stop"}


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="jkv")
    cache_cli.add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _dead_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


def test_invalidate_model_and_group_and_stats(redis_url, capsys):
    with ResponseCache(redis_url, node_id="server") as cache:
        cache.put("demo", "v1", "a", SETTINGS, ANSWER, group_id=4)
        cache.put("demo", "v1", "b", SETTINGS, ANSWER, group_id=5)
        capsys.readouterr()

        assert _run(["cache", "stats", "--redis-url", redis_url]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["models"]["demo"] == {"generation": 0, "keys_by_generation": {"0": 2}}

        assert _run(["cache", "invalidate-group", "demo", "4", "--redis-url", redis_url]) == 0
        assert json.loads(capsys.readouterr().out)["removed"] == 1
        assert cache.get("demo", "v1", "b", SETTINGS).level == "l1"

        assert _run(["cache", "invalidate-model", "demo", "--redis-url", redis_url]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out == {"model": "demo", "generation": 1, "removed": 1}


def test_stats_without_redis_prints_the_defaults(capsys):
    assert _run(["cache", "stats"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["redis"] is None and out["defaults"]["l1_max_entries"] == 1000


@pytest.mark.parametrize(
    "argv, named",
    [
        (["invalidate-model", "bad:name"], "'bad:name'"),
        (["invalidate-model", "{x}"], "'{x}'"),
        (["invalidate-group", "demo", "seven"], "'seven'"),
        (["invalidate-group", "demo", "-1"], "'-1'"),
    ],
    ids=["colon", "braces", "word_cluster", "negative_cluster"],
)
def test_bad_input_exits_2_with_one_line_naming_the_value(argv, named, redis_url, capsys):
    assert _run(["cache", *argv, "--redis-url", redis_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "Traceback" not in err


def test_bad_url_scheme_exits_2(capsys):
    assert _run(["cache", "invalidate-model", "demo", "--redis-url", "http://x:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'http://x:1'" in err


@pytest.mark.parametrize(
    "argv",
    [["invalidate-model", "demo"], ["invalidate-group", "demo", "3"], ["stats"]],
    ids=["model", "group", "stats"],
)
def test_unreachable_redis_exits_1_with_one_line(argv, capsys):
    url = _dead_url()
    assert _run(["cache", *argv, "--redis-url", url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreachable" in err and "Traceback" not in err


def test_missing_redis_url_is_an_argparse_error():
    with pytest.raises(SystemExit) as exit_:
        _run(["cache", "invalidate-model", "demo"])
    assert exit_.value.code == 2


def test_stats_and_invalidation_with_bad_values_in_redis(redis_url, redis_client, capsys):
    with ResponseCache(redis_url, node_id="server") as cache:
        cache.put("demo", "v1", "a", SETTINGS, ANSWER)
    redis_client.set("llm:gen:{demo}", "oops")
    redis_client.set(b"llm:response:\xff\xfe", b"x")  # not UTF-8, no model field
    capsys.readouterr()
    assert _run(["cache", "stats", "--redis-url", redis_url]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["models"]["demo"] == {"generation": None, "keys_by_generation": {"0": 1}}
    assert _run(["cache", "invalidate-model", "demo", "--redis-url", redis_url]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["removed"] == 1 and int(redis_client.get("llm:gen:{demo}")) == out["generation"]
