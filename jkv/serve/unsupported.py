"""OpenAI's request fields that jkv does not implement, accepted where they ask for the default.

Official clients and SDKs send some fields with their default value on every request
(`logprobs: false`, `response_format: {"type": "text"}`, `n: 1`, `tool_choice: "none"` with
no tools, ...). Such a value asks for what jkv does anyway, so it is accepted; any other value
is refused with 400 naming the field, never silently ignored. Values compare strictly: `false`
is not `0`, `"1"` is not `1` (a number may be written `0` or `0.0`).

Fields that change nothing in the answer (`user`, `metadata`, `parallel_tool_calls`,
`safety_identifier`, `prompt_cache_key`) are checked for their type and otherwise ignored.
Fields OpenAI does not define are ignored, as vLLM ignores them.
"""

from __future__ import annotations

import json
from typing import Any

# field -> the values that ask for the default (null is always accepted: the field is unset)
DEFAULTS: dict[str, tuple] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),  # chat: a bool; completions: an int (any int asks for logprobs)
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # without tools, neither calls one
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": ("medium",),
    "store": (False,),
    "service_tier": ("auto", "default"),
}
# field -> (the JSON type it must have, its name in messages)
IGNORED: dict[str, tuple[type | tuple[type, ...], str]] = {
    "user": (str, "a string"),
    "safety_identifier": (str, "a string"),
    "prompt_cache_key": (str, "a string"),
    "metadata": (dict, "an object"),
    "parallel_tool_calls": (bool, "true or false"),
}


def same(value: Any, default: Any) -> bool:
    """`value` is `default` with JSON's types kept apart (bools are not numbers)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, int | float):
        return isinstance(value, int | float) and value == default
    if type(value) is not type(default):
        return False
    if isinstance(default, dict | list):
        return json.dumps(value, sort_keys=True) == json.dumps(default, sort_keys=True)
    return value == default


def check(body: dict, bad) -> None:
    """Raises `bad(field, message)` for the first field of `body` set to a value jkv cannot
    honour (or of the wrong type); returns when every such field asks for the default."""
    for name, defaults in DEFAULTS.items():
        value = body.get(name)
        if value is None or any(same(value, d) for d in defaults):
            continue
        allowed = " or ".join(json.dumps(d) for d in defaults) or "null"
        raise bad(name, f"{name}={_short(value)} is not supported by jkv (only {allowed})")
    for name, (kind, spelled) in IGNORED.items():
        value = body.get(name)
        if value is not None and (not isinstance(value, kind) or _is_bool_for(value, kind)):
            raise bad(name, f"{name}={_short(value)}: expected {spelled}")


def _is_bool_for(value, kind) -> bool:
    return isinstance(value, bool) and kind is not bool


def _short(value) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
