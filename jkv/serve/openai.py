"""OpenAI's wire format: request bodies -> jkv settings, results -> response bodies and SSE chunks.

Plain Python on dicts (no web framework, no JAX): the server calls `parse` on a decoded JSON body
and gets a `ParsedRequest` (the prompt, `jkv.generate`'s settings, streaming options, tenant),
or an `APIError` naming the field and what was expected, which the server sends as
OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`).

Defaults follow OpenAI's API: `temperature` 1, `top_p` 1, `max_tokens` 16 for completions and
"the rest of the context" for chat. jkv's own settings ride in the same body (the `openai`
client's `extra_body`): `kv_policy`, `kv_budget`, `logit_keep_ratio`, `top_k`, `min_p`, and
`cache_salt`, which keeps a tenant's prefix-cache pages and cached responses its own.

A sampled request (temperature > 0) without a `seed` gets a fresh random seed and is never
answered from the response cache; a greedy one, or one with a seed, is deterministic.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any

from jkv.chat import ROLES, render

# Fields OpenAI defines that jkv does not implement: refused unless at their neutral value.
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "top_logprobs": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "suffix": None,
    "tools": None,
    "response_format": None,
}
SEED_RANGE = (0, 2**31 - 1)


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

    @property
    def operation(self) -> str:
        """OpenTelemetry GenAI's operation name."""
        return "chat" if self.kind == "chat" else "text_completion"


def loads(raw: bytes) -> dict:
    """The body as a JSON object, or 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(None, f"the body is not valid JSON ({e}); expected a JSON object") from None
    if not isinstance(body, dict):
        raise bad(None, f"the body is a JSON {type(body).__name__}; expected a JSON object")
    return body


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


def _prompt(body):
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


def _messages(body) -> list[dict]:
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
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(
                        f"{where}.content",
                        f"{where}.content holds {part!r:.60}; jkv reads text parts only",
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content={content!r:.60}: expected a string")
        out.append({"role": role, "content": content})
    return out


def render_chat(messages: list[dict], template: str | None, special: dict[str, str]) -> str:
    """The prompt text of a conversation (`jkv.chat.render`); 400 when the template refuses."""
    try:
        return render(messages, template, special)
    except ValueError as e:
        raise bad("messages", str(e)) from None


def parse(kind: str, body: dict, *, chat_template=None, special=None) -> ParsedRequest:
    """A completions (`kind="completion"`) or chat body -> `ParsedRequest`, or APIError."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"model={model!r}: expected the served model's name (GET /v1/models)")
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral and not (name == "logit_bias" and not value):
            raise bad(name, f"{name}={value!r:.60} is not supported by jkv (only {neutral!r})")
    if kind == "chat":
        prompt = render_chat(_messages(body), chat_template, special or {})
        max_tokens = _int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", 1)
    else:
        prompt = _prompt(body)
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
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", f"stream_options={options!r}: expected an object")
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
    for name in ("kv_policy", "kv_budget", "logit_keep_ratio"):
        if body.get(name) is not None:
            settings[name] = body[name]
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
    )


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
