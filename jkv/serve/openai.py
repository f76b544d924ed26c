"""OpenAI's wire format: request bodies -> jkv settings, results -> response bodies and SSE chunks.

Plain Python on dicts (no web framework, no JAX): the server calls `parse` on a decoded JSON body
and gets a `ParsedRequest` (the prompt, `jkv.generate`'s settings, streaming options, tenant),
or an `APIError` naming the field and what was expected, which the server sends as
OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`).

Defaults follow OpenAI's API: `temperature` 1, `top_p` 1, `max_tokens` 16 for completions and
"the rest of the context" for chat. jkv's own settings ride in the same body (the `openai`
client's `extra_body`): `kv_policy`, `kv_budget`, `logit_keep_ratio`, `top_k`, `min_p`, and
`cache_salt`, which narrows the tenant's prefix-cache pages and cached responses to the
requests that send it (the tenant itself is the API key's, decided by the server), and
`context`, a kept context's id (`POST /v1/contexts`) whose tokens come before the prompt.

A sampled request (temperature > 0) without a `seed` gets a fresh random seed and is never
answered from the response cache; a greedy one, or one with a seed, is deterministic.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import time
from typing import Any

from jkv.chat import ROLES, render
from jkv.serve import unsupported

SEED_RANGE = (0, 2**31 - 1)
# jkv's own settings in the body: their JSON types (their values are checked by
# `jkv.request.Request.build`, as for `jkv.generate`)
JKV_FIELDS = (
    ("kv_policy", (str, dict), 'a policy name or an object such as {"name": "snapkv", ...}'),
    ("kv_budget", (int, float), "a token count or a ratio"),
    ("logit_keep_ratio", (int, float), "a number"),
)


class APIError(Exception):
    """An error to send as OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def param_of(message: str, given: dict) -> str | None:
    """The body field a jkv error message is about: the setting it names first ("top_p=2: ..."
    -> "top_p"); a KV policy's own fields are the request's `kv_policy`, its budget
    `kv_budget` when the request gave one."""
    found = re.match(r"([A-Za-z_][\w.]*)\s*[=:]", message)
    head = found.group(1) if found else None
    if head is None or head in given or head.startswith("kv_policy"):
        return head
    if head == "budget" and "kv_budget" in given:
        return "kv_budget"
    return "kv_policy" if "kv_policy" in given else head


def http_error(status: int, method: str, path: str, detail) -> APIError:
    """What the web framework refuses before a handler runs (404 no such path, 405 method)."""
    if status == 404:
        message = f"Invalid URL ({method} {path}): no such endpoint"
    elif status == 405:
        message = f"{method} is not allowed on {path}"
    else:
        message = str(detail)
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return APIError(status, message, type=kind)


def internal_error(err: BaseException) -> APIError:
    """A bug's 500: its type, never its traceback (that goes to the log)."""
    return APIError(500, f"internal error: {type(err).__name__}", type="server_error")


def engine_error(err: BaseException) -> APIError:
    """A failed engine step (500): the request is not answered; retrying may succeed."""
    return APIError(
        500,
        f"the engine failed while generating ({type(err).__name__}); retry the request",
        type="server_error",
        code="engine_error",
    )


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt: str | list[int]  # text (chat: rendered by the template) or token ids
    settings: dict[str, Any]  # jkv.generate's keywords, max_new_tokens left to the server
    max_tokens: int | None  # None: the rest of the context (chat's default)
    stream: bool
    include_usage: bool
    cache_salt: str | None
    seeded: bool  # deterministic: greedy or an explicit seed (may use the response cache)
    context: str | None = None  # a context's id (POST /v1/contexts): its tokens come first

    @property
    def operation(self) -> str:
        """OpenTelemetry GenAI's operation name."""
        return "chat" if self.kind == "chat" else "text_completion"


def _number(body, name, low, high, *, low_open=False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(name, f"{name}={value!r}: expected a number")
    if value != value or value < low or value > high or (low_open and value == low):
        side = "(" if low_open else "["
        raise bad(name, f"{name}={value!r}: expected a number in {side}{low}, {high}]")
    return value


def _int(body, name, low, high=None):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"{name}={value!r}: expected an integer")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and <= {high}"
        raise bad(name, f"{name}={value!r}: expected an integer >= {low}{upper}")
    return value


def _stop(body):
    stop = body.get("stop")
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not items or len(items) > 4:
        raise bad("stop", f"stop={stop!r}: expected a string or a list of 1-4 strings")
    for s in items:
        if not isinstance(s, str) or not s:
            raise bad("stop", f"stop={stop!r}: every stop sequence must be a non-empty string")
    return stop


def prompt_of(body):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad("prompt", f"prompt={prompt!r} is empty; expected some text")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad(
            "prompt",
            f"prompt is a batch of {len(prompt)} prompts; jkv serves one prompt per request "
            "(send them as concurrent requests)",
        )
    raise bad("prompt", f"prompt={prompt!r:.80}: expected a string or a list of token ids")


def _check_length(param: str, n: int, max_chars: int | None) -> None:
    if max_chars is not None and n > max_chars:
        raise bad(
            param,
            f"the prompt is {n:,} characters (or token ids); this server reads at most "
            f"{max_chars:,}, more than its context can hold",
            code="context_length_exceeded",
        )


def messages_of(body) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages={messages!r:.80}: expected a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where}={m!r:.80}: expected an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role={role!r}: expected one of {ROLES}")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                at = f"{where}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(at, f"{at} holds {part!r:.60}; jkv reads text parts only")
                if not isinstance(part.get("text"), str):
                    raise bad(
                        f"{at}.text", f"{at}.text={part.get('text')!r:.60}: expected a string"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content={content!r:.60}: expected a string")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{where}.name", f"{where}.name={name!r:.60}: expected a string")
        out.append({"role": role, "content": content} | ({"name": name} if name else {}))
    return out


def render_chat(
    messages: list[dict], template: str | None, special: dict[str, str], generation: bool = True
) -> str:
    """The prompt text of a conversation (`jkv.chat.render`; `generation`: with the assistant
    turn's opening); 400 when the template refuses."""
    try:
        return render(messages, template, special, generation_prompt=generation)
    except ValueError as e:
        raise bad("messages", str(e)) from None


def parse(
    kind: str, body: dict, *, chat_template=None, special=None, max_chars: int | None = None
) -> ParsedRequest:
    """A completions (`kind="completion"`) or chat body -> `ParsedRequest`, or APIError.

    A prompt longer than `max_chars` (characters of text, all messages' together, or token
    ids) is refused before it is templated."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"model={model!r}: expected the served model's name (GET /v1/models)")
    unsupported.check(body, bad)
    if kind == "chat":
        messages = messages_of(body)
        _check_length("messages", sum(len(m["content"]) for m in messages), max_chars)
        prompt = render_chat(messages, chat_template, special or {})
        max_tokens = _int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", 1)
    else:
        prompt = prompt_of(body)
        _check_length("prompt", len(prompt), max_chars)
        max_tokens = _int(body, "max_tokens", 1)
        max_tokens = 16 if max_tokens is None else max_tokens
    temperature = _number(body, "temperature", 0, 2)
    temperature = 1.0 if temperature is None else float(temperature)
    top_p = _number(body, "top_p", 0, 1, low_open=True)
    top_k = body.get("top_k")
    if top_k is not None and top_k != -1:
        top_k = _int(body, "top_k", 1)
    else:
        top_k = None
    min_p = _number(body, "min_p", 0, 1)
    seed = _int(body, "seed", *SEED_RANGE)
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise bad("stream", f"stream={stream!r}: expected true or false")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise bad("stream_options", f"stream_options={options!r:.60}: expected an object")
    for name in ("include_usage", "include_obfuscation"):  # jkv never obfuscates: no padding
        if options.get(name) is not None and not isinstance(options[name], bool):
            where = f"stream_options.{name}"
            raise bad(where, f"{where}={options[name]!r:.60}: expected true or false")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad("cache_salt", f"cache_salt={salt!r}: expected a non-empty string")
    greedy = temperature == 0 or top_k == 1
    settings = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=None if top_p in (None, 1) else float(top_p),
        min_p=None if not min_p else float(min_p),
        seed=seed if seed is not None else (0 if greedy else secrets.randbelow(SEED_RANGE[1])),
        stop=_stop(body),
    )
    settings.update(jkv_settings(body))
    context = body.get("context")
    if context is not None and (not isinstance(context, str) or not context):
        raise bad("context", f"context={context!r:.60}: expected a context id (POST /v1/contexts)")
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        settings=settings,
        max_tokens=max_tokens,
        stream=bool(stream),
        include_usage=bool(options.get("include_usage", False)),
        cache_salt=salt,
        seeded=greedy or seed is not None,
        context=context,
    )


def jkv_settings(body: dict) -> dict:
    """jkv's own settings of a body (`kv_policy`, `kv_budget`, `logit_keep_ratio`), their JSON
    types checked; `jkv serve`'s flags of the same names go through here too."""
    out = {}
    for name, kinds, spelled in JKV_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise bad(name, f"{name}={value!r:.60}: expected {spelled}")
        out[name] = value
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached: int, cache: str | None) -> dict:
    """OpenAI's usage object; `jkv_cache` says which response-cache level answered (None: the
    model generated)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "jkv_cache": cache,
    }


def response(req: ParsedRequest, rid: str, text: str, finish: str, use: dict) -> dict:
    """A whole (non-streamed) completion or chat completion."""
    if req.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": use,
    }


def chunk(req: ParsedRequest, rid: str, text: str | None, finish: str | None, *, first=False):
    """One streamed chunk; `text=None` with `finish=None`: the usage-only chunk's frame."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": req.model,
            "choices": [choice]}  # fmt: skip


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
