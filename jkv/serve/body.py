"""A request, bounded: its headers' size (431), its body's size (413 before the rest is read),
the time the body takes to come (408), its encoding and media type (415), its JSON (400, nesting
depth included). Nothing here runs the model or the tokenizer.

`read` runs on the event loop (it only moves bytes); `loads` runs in a worker thread (parsing a
few MiB of JSON takes milliseconds that the loop must not wait for).
"""

from __future__ import annotations

import asyncio
import json

from jkv.serve.openai import APIError, bad

MiB = 2**20
MAX_BODY_BYTES = 2 * MiB  # a long prompt (~100k words) fits many times over
REQUEST_TIMEOUT_S = 30.0  # for a request's headers, then for its body (slow clients: 408)
MAX_HEADER_BYTES = 16 * 1024  # the request line and headers (h11's default; nginx's is 8 KiB)
MAX_DEPTH = 32  # OpenAI's bodies nest 4 deep (messages[i].content[j].text)
# What clients send JSON as: curl's -d default (form-urlencoded) and text/plain too, since
# many a script never sets the header; anything else is another format.
JSON_TYPES = ("application/json", "application/x-www-form-urlencoded", "text/plain")


def check_limit(name: str, value) -> int:
    """`value` if it is an integer >= 1; else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    return value


def too_large(limit: int, size: str) -> APIError:
    return APIError(
        413,
        f"the request body is {size}; this server reads at most {limit:,} bytes "
        "(jkv serve --max-body-bytes)",
        code="request_too_large",
    )


def headers_too_large() -> APIError:
    return APIError(
        431,
        f"the request line and headers are more than {MAX_HEADER_BYTES:,} bytes (an "
        "Authorization header or a cookie too long?)",
        code="request_header_fields_too_large",
        headers={"Connection": "close"},
    )


class HeaderLimit:
    """ASGI middleware: 431 for a request whose line and headers pass `MAX_HEADER_BYTES` (the
    HTTP protocol refuses those that arrive in pieces, `protocol.py`; this, those that came
    whole in one read)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
            size += sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > MAX_HEADER_BYTES:
                from fastapi.responses import JSONResponse

                err = headers_too_large()
                response = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def check_headers(headers, limit: int) -> None:
    """415 for a compressed or non-JSON body, 413 for a declared length past `limit`."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(
            415,
            f"Content-Encoding {encoding!r} is not supported; send the JSON body uncompressed",
            code="unsupported_media_type",
        )
    media = headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media and media not in JSON_TYPES and not media.endswith("+json"):
        raise APIError(
            415,
            f"Content-Type {media!r} is not supported; send the body as application/json",
            code="unsupported_media_type",
        )
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, f"{int(declared):,} bytes")


async def read(request, limit: int, timeout: float | None = None) -> bytes:
    """The body, or APIError (413 as soon as it is known to pass `limit`: from its declared
    length, or while it streams in; the server discards the rest unread; 408 when it has not
    all come within `timeout` seconds, and the connection closes)."""
    check_headers(request.headers, limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit, f"more than {limit:,} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s (jkv serve --request-timeout);"
            f" {size:,} bytes came",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return b"".join(chunks)


def loads(raw: bytes) -> dict:
    """The body as a JSON object nested at most `MAX_DEPTH` deep, or 400."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(None, f"the body is not valid JSON ({e}); expected a JSON object") from None
    if not isinstance(body, dict):
        raise bad(None, f"the body is a JSON {type(body).__name__}; expected a JSON object")
    if _depth_past(body, MAX_DEPTH):
        raise _too_deep()
    return body


def _too_deep() -> APIError:
    return bad(None, f"the body's JSON nests deeper than {MAX_DEPTH} levels")


def _depth_past(value, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` deep (no recursion: any depth)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False
