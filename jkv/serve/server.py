"""`jkv serve`: an OpenAI-compatible HTTP server around one `jkv.Engine`.

    server = Server(jkv.load("demo"), engine, response_cache=jkv.ResponseCache())
    uvicorn.run(server.app, port=8000)     # or: jkv serve demo --port 8000

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
server-sent events ending with `data: [DONE]`), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus).

A request's way: JSON body -> `openai.parse` (400 on anything malformed) -> its prompt's token
ids -> `jkv.request.Request.build` (400 naming the bad setting) -> the response cache, when the
request is deterministic (greedy or seeded; the tenant's `cache_salt` is part of the key): a hit
answers at once, marked by the `x-jkv-cache` header and `usage.jkv_cache` -> admission (503 with
`Retry-After` past `max_queued_requests` requests or `max_queued_tokens` prompt tokens waiting
for their first token) -> `Engine.stream` (the engine steps in a worker thread; every request
shares its steps) -> SSE chunks or one JSON body -> the response cache is filled -> metrics,
the trace's spans, one JSON log line. A client that leaves (mid-stream or while waiting) aborts
its request: its pages go back to the pool at once.

FastAPI and prometheus-client (the `serve` extra) are imported where they are used, so that
`import jkv.cli` stays light. (No `from __future__ import annotations` here: FastAPI reads the
handlers' `request: Request` annotations, which name a local import.)
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jkv.chat import special_tokens as special_tokens_of
from jkv.prompt import prompt_ids
from jkv.request import Request as Settings
from jkv.response_cache import front
from jkv.serve import openai as oa
from jkv.serve.metrics import Observability, RequestRecord
from jkv.tokenizer import read_chat_template

LOG = logging.getLogger("jkv.serve")
RETRY_AFTER_S = 1  # what a 503 asks the client to wait


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


class Server:
    """The ASGI app (`server.app`) and what it shares between requests.

    Args:
        params: the model (`jkv.load`).
        engine: the `jkv.Engine` serving it.
        model_name: the name clients send as `model` (default: `params.name`).
        response_cache: a `jkv.ResponseCache` answering deterministic requests first, or None.
        max_queued_requests / max_queued_tokens: admitted requests (and their prompt tokens)
            that have not had their first token yet; past either, 503 with Retry-After.
        chat_template: Jinja chat template (default: the tokenizer's, else
            `jkv.chat.DEFAULT_CHAT_TEMPLATE`).
        special_tokens: names the template may use (bos_token, eos_token).
        defaults: settings for requests that do not give them (kv_policy, kv_budget).
        span_exporter: an OpenTelemetry span exporter (default: OTLP when OTEL_* is set).
    """

    def __init__(
        self,
        params,
        engine,
        *,
        model_name: str | None = None,
        response_cache=None,
        max_queued_requests: int = 512,
        max_queued_tokens: int = 262144,
        chat_template: str | None = None,
        special_tokens: dict | None = None,
        defaults: dict | None = None,
        span_exporter=None,
    ):
        for name, value in (("max_queued_requests", max_queued_requests),
                            ("max_queued_tokens", max_queued_tokens)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        self.params, self.engine, self.cache = params, engine, response_cache
        self.name = model_name or params.name
        self.max_queued_requests, self.max_queued_tokens = max_queued_requests, max_queued_tokens
        if chat_template is None and params.tokenizer is not None:
            chat_template = params.tokenizer.chat_template
        self.chat_template = chat_template
        self.special = {**special_tokens_of(params), **(special_tokens or {})}
        self.defaults = defaults or {}
        self.obs = Observability(engine, self.name, span_exporter=span_exporter)
        self.queued_requests = 0
        self.queued_tokens = 0
        self.in_flight = 0
        self.created = int(time.time())
        self.app = self._build()

    # -- the app ----------------------------------------------------------------------------

    def _build(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response
        from prometheus_client import CONTENT_TYPE_LATEST

        @contextlib.asynccontextmanager
        async def lifespan(app):
            # Engine steps, cache lookups and request adds run in worker threads: enough of
            # them that hundreds of waiting requests never starve the engine's step.
            loop = asyncio.get_running_loop()
            pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="jkv-serve")
            loop.set_default_executor(pool)
            yield
            pool.shutdown(wait=False)

        app = FastAPI(title="jkv", lifespan=lifespan, docs_url=None, redoc_url=None)

        @app.exception_handler(oa.APIError)
        async def api_error(request, err: oa.APIError):
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

        @app.exception_handler(Exception)
        async def unexpected(request, err: Exception):
            LOG.exception("unexpected error serving %s", request.url.path)
            body = oa.APIError(500, f"internal error: {type(err).__name__}", type="server_error")
            return JSONResponse(body.body(), status_code=500)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {
                "object": "list",
                "data": [
                    {
                        "id": self.name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "jkv",
                        "max_model_len": self.engine.max_model_len,
                    }
                ],
            }

        @app.get("/metrics")
        async def metrics():
            data = await asyncio.to_thread(self.obs.render)
            return Response(data, media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._serve("completion", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._serve("chat", request)

        return app

    # -- one request ------------------------------------------------------------------------

    async def _serve(self, kind: str, request):
        arrival = time.monotonic()
        try:
            req = oa.parse(
                kind,
                oa.loads(await request.body()),
                chat_template=self.chat_template,
                special=self.special,
            )
            if req.model != self.name:
                raise oa.APIError(
                    400,
                    f"model={req.model!r} is not served here; this server serves {self.name!r}",
                    param="model",
                    code="model_not_found",
                )
            ids, settings, jreq = self._settings(req)
        except oa.APIError:
            self.obs.reject("invalid_request")
            raise
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        rec = RequestRecord(rid, req.operation, arrival, tenant=req.cache_salt)
        rec.prompt_tokens, rec.max_tokens = len(ids), settings["max_new_tokens"]
        rec.temperature, rec.top_p = jreq.sampling.temperature, req.settings["top_p"]
        rec.seed = jreq.seed if req.seeded else None
        span = self.obs.start_span(rec, request.headers)
        try:
            hit = await self._lookup(req, jreq, ids, rec)
            if hit is not None:
                return self._cached(req, rid, rec, hit, span)
            self._admit(len(ids))
            return await self._generate(req, rid, rec, ids, settings, jreq, span, request)
        except BaseException as err:
            if not rec.reported:
                rec.error = str(err.status) if isinstance(err, oa.APIError) else type(err).__name__
                self._report(rec, span)
            raise

    def _settings(self, req: oa.ParsedRequest):
        """The prompt's ids, `jkv.generate`'s settings and their validated form, or 400."""
        try:
            # a chat's template placed its special tokens; a completion's prompt gets the bos
            # token as jkv.generate gives it
            ids = prompt_ids(self.params, req.prompt, None, special=req.kind != "chat")
        except ValueError as e:
            raise oa.bad("messages" if req.kind == "chat" else "prompt", str(e)) from None
        context = self.engine.max_model_len
        if len(ids) > context:
            raise oa.bad(
                "messages" if req.kind == "chat" else "prompt",
                f"the prompt is {len(ids)} tokens; this model serves at most {context} "
                "(prompt plus max_tokens)",
                code="context_length_exceeded",
            )
        if len(ids) > self.max_queued_tokens:
            raise oa.bad(
                "prompt",
                f"the prompt is {len(ids)} tokens, more than this server's "
                f"max_queued_tokens={self.max_queued_tokens}",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else context - len(ids) + 1
        settings = {**self.defaults, **req.settings, "max_new_tokens": max_tokens}
        try:
            jreq = Settings.build(self.params, **settings)
        except ValueError as e:
            raise oa.bad(_param(str(e)), str(e)) from None
        if len(ids) + max_tokens - 1 > context:
            raise oa.bad(
                "max_tokens",
                f"a prompt of {len(ids)} tokens plus max_tokens={max_tokens} needs "
                f"{len(ids) + max_tokens - 1} positions; this model serves {context}",
                code="context_length_exceeded",
            )
        return ids, settings, jreq

    def _cache_settings(self, req, jreq) -> dict:
        return {**front.request_settings(jreq, self.params), "cache_salt": req.cache_salt}

    async def _lookup(self, req, jreq, ids, rec):
        if self.cache is None or not req.seeded:
            return None
        t0 = time.monotonic()
        found = await asyncio.to_thread(
            self.cache.get, self.name, self.params.identity, ids, self._cache_settings(req, jreq)
        )
        rec.lookup = (t0, time.monotonic())
        self.obs.lookup(None if found is None else found.level)
        return found

    def _cached(self, req, rid, rec, hit, span):
        from fastapi.responses import JSONResponse, StreamingResponse

        record = hit.record
        now = time.monotonic()
        rec.cache, rec.finish_reason = hit.level, record.finish_reason
        rec.token(now, len(record.tokens))
        use = oa.usage(rec.prompt_tokens, len(record.tokens), 0, hit.level)
        headers = {"x-jkv-cache": hit.level, "x-request-id": rid}
        self._report(rec, span)
        if not req.stream:
            body = oa.response(req, rid, record.text, record.finish_reason, use)
            return JSONResponse(body, headers=headers)

        async def events():
            yield oa.sse(oa.chunk(req, rid, record.text, None, first=True))
            yield oa.sse(oa.chunk(req, rid, None, record.finish_reason))
            if req.include_usage:
                yield oa.sse({**oa.chunk(req, rid, None, None), "choices": [], "usage": use})
            yield oa.sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    def _admit(self, tokens: int) -> None:
        """Refuses (503) a request past the queue's limits, at once."""
        over = None
        if self.queued_requests + 1 > self.max_queued_requests:
            over = f"{self.queued_requests} requests wait (max_queued_requests)"
        elif self.queued_tokens + tokens > self.max_queued_tokens:
            over = f"{self.queued_tokens} prompt tokens wait (max_queued_tokens)"
        if over is not None:
            self.obs.reject("queue_full")
            raise oa.APIError(
                503,
                f"the server is at capacity: {over}; retry after {RETRY_AFTER_S} s",
                type="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.queued_requests += 1
        self.queued_tokens += tokens

    async def _generate(self, req, rid, rec, ids, settings, jreq, span, request):
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        queued = [True]

        def release():
            if queued[0]:
                queued[0] = False
                self.queued_requests -= 1
                self.queued_tokens -= len(ids)

        outputs = self.engine.stream(ids, request_id=rid, cache_salt=req.cache_salt, **settings)
        text: list[str] = []
        tokens: list[int] = []
        self.in_flight += 1

        def take(out) -> None:
            release()
            now = time.monotonic()
            rec.scheduled = out.scheduled_at if rec.scheduled is None else rec.scheduled
            rec.cached_tokens = out.cached_tokens
            rec.pages, rec.preemptions = out.pages or rec.pages, out.preemptions
            rec.token(now, len(out.new_tokens))
            tokens.extend(out.new_tokens)
            text.append(out.text)
            if out.finished:
                rec.finish_reason = out.finish_reason

        def finish() -> dict:
            rec.finished = time.monotonic()
            self._fill(req, jreq, ids, "".join(text), tokens, rec.finish_reason)
            return oa.usage(len(ids), len(tokens), rec.cached_tokens, None)

        def close(error: str | None = None) -> None:
            release()
            self.in_flight -= 1
            rec.error = error
            self._report(rec, span)

        headers = {"x-jkv-cache": "miss", "x-request-id": rid}
        try:
            if not req.stream:

                async def collect():
                    async for out in outputs:
                        take(out)

                await _unless_gone(request, collect())
                use = finish()
                close()
                body = oa.response(req, rid, "".join(text), rec.finish_reason, use)
                return JSONResponse(body, headers=headers)
            first = await _unless_gone(request, outputs.__anext__())
        except ClientGone:
            self.obs.aborted.inc()
            close("client_disconnected")
            return Response(status_code=499)
        except ValueError as e:  # what the engine refuses (a policy it does not serve, ...)
            close("400")
            raise oa.bad(_param(str(e)), str(e)) from None
        except BaseException as e:
            close(type(e).__name__)
            raise
        take(first)

        async def events():
            done = False
            try:
                yield oa.sse(oa.chunk(req, rid, first.text, first.finish_reason, first=True))
                async for out in outputs:  # ends after the finished one (none if first was)
                    take(out)
                    if out.text or out.finished:
                        yield oa.sse(oa.chunk(req, rid, out.text, out.finish_reason))
                use = finish()
                if req.include_usage:
                    yield oa.sse({**oa.chunk(req, rid, None, None), "choices": [], "usage": use})
                yield oa.sse("[DONE]")
                done = True
            finally:
                await outputs.aclose()  # an early exit aborts the request: its pages go back
                if not done:
                    self.obs.aborted.inc()
                close(None if done else "client_disconnected")

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    def _fill(self, req, jreq, ids, text, tokens, finish_reason) -> None:
        if self.cache is None or not req.seeded or finish_reason not in ("stop", "length"):
            return
        result = {"text": text, "tokens": tokens, "finish_reason": finish_reason}
        try:
            self.cache.put(
                self.name, self.params.identity, ids, self._cache_settings(req, jreq), result
            )
        except Exception:  # the cache never fails an answer
            LOG.exception("response cache fill failed")

    def _report(self, rec, span) -> None:
        rec.reported = True
        self.obs.done(rec, span)


async def _unless_gone(request, awaitable):
    """`awaitable`'s result, or ClientGone (after cancelling it) if the client disconnects
    first."""
    work = asyncio.ensure_future(awaitable)

    async def gone():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            if watch.done():
                raise ClientGone()
        watch.cancel()
    return work.result()


def _param(message: str) -> str | None:
    """The setting a jkv error message names first ("top_p=2: ..." -> "top_p")."""
    head = message.split("=", 1)[0]
    return head if head.isidentifier() else None


def chat_template_of(model: str) -> tuple[str | None, dict]:
    """The chat template (`jkv.tokenizer.read_chat_template`) and special tokens in a model
    folder's tokenizer_config.json, if any."""
    folder = Path(model)
    if not folder.is_dir():
        return None, {}
    config = folder / "tokenizer_config.json"
    special = {}
    if config.is_file():
        data = json.loads(config.read_text())
        for name in ("bos_token", "eos_token"):
            value = data.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[name] = value
    return read_chat_template(folder), special
