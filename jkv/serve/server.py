"""`jkv serve`: an OpenAI-compatible HTTP server around one `jkv.Engine`.

    server = Server(jkv.load("demo"), engine, response_cache=jkv.ResponseCache())
    uvicorn.run(server.app, port=8000)     # or: jkv serve demo --port 8000

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
server-sent events ending with `data: [DONE]`, and `context: "<id>"` to start from a kept
context), `POST /v1/contexts`, `GET` / `DELETE /v1/contexts/{id}` (`contexts.py`),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus), `GET /openapi.json` (the schema;
behind the key as the API is).

A request's way: its API key -> the tenant (401 without one, when keys are set; `auth.py`) ->
the body, bounded (408 / 413 / 415; `body.py`) -> in a worker thread: JSON (depth-checked), `openai.
parse` (400 on anything malformed), the prompt's token ids, `jkv.request.Request.build` (400
naming the bad setting) -> the response cache, when the request is deterministic (greedy or
seeded), keyed by the tenant and the client's `cache_salt` within it: a hit answers at once,
marked by the `x-jkv-cache` header and `usage.jkv_cache` -> admission (503 with `Retry-After`
past `max_queued_requests` requests or `max_queued_tokens` prompt tokens waiting for their
first token) -> `Engine.stream` (the engine steps in a worker thread; every request shares its
steps) -> SSE chunks or one JSON body (`answer.py`) -> the response cache is filled (a worker
thread) -> metrics, the trace's spans, one JSON log line. A client that leaves (mid-stream or
while waiting) aborts its request: its pages go back to the pool. Every error is OpenAI's
error JSON.

FastAPI and prometheus-client (the `serve` extra) are imported where they are used, so that
`import jkv.cli` stays light. (No `from __future__ import annotations` here: FastAPI reads the
handlers' `request: Request` annotations, which name a local import.)
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jkv.chat import special_tokens as special_tokens_of
from jkv.prompt import prompt_ids
from jkv.request import KV_DTYPE_ALIASES
from jkv.request import Request as Settings
from jkv.response_cache import front
from jkv.response_cache.miss import Lookup
from jkv.serve import auth, body
from jkv.serve import openai as oa
from jkv.serve.answer import Answer, stopped
from jkv.serve.contexts import ContextStore, RedisContexts, ttl_of
from jkv.serve.metrics import Observability, RequestRecord
from jkv.tokenizer import read_chat_template

LOG = logging.getLogger("jkv.serve")
RETRY_AFTER_S = 1  # what a 503 asks the client to wait
CHARS_PER_TOKEN = 32  # a prompt longer than this per token of the context cannot fit in it
REJECTED = {408: "timeout", 413: "too_large", 415: "unsupported_media_type"}  # -> its reason


class Server:
    """The ASGI app (`server.app`) and what it shares between requests.

    Args:
        params: the model (`jkv.load`).
        engine: the `jkv.Engine` serving it.
        model_name: the name clients send as `model` (default: `params.name`).
        response_cache: a `jkv.ResponseCache` answering deterministic requests first, or None.
        api_keys: `jkv.serve.auth.Keys` or a mapping of API key -> tenant name: requests
            without one get 401, and each tenant has caches of its own. None: no keys, one
            tenant (for trusted clients only).
        protect_health_metrics: /health and /metrics need a key too (else they are open).
        max_body_bytes: larger request bodies get 413, unread.
        request_timeout: seconds a client has to send a request's headers, then its body;
            past them, 408 (the headers' limit is the HTTP protocol's: `protocol.py`).
        max_prompt_chars: longer prompts (text, or all messages' text) get 400 before they are
            templated or tokenised (default: 32 per token of the engine's max_model_len).
        max_queued_requests / max_queued_tokens: admitted requests (and their prompt tokens)
            that have not had their first token yet; past either, 503 with Retry-After.
        reserve_tokens: output tokens the engine's admission reserves pages for when a request
            gives no max_tokens (it may run to the end of the context, but reserving all of it
            would admit a few such requests at a time; past the reserve it takes pages as they
            come, preempted by the engine's rule when they run out).
        chat_template: Jinja chat template (default: the tokenizer's, else
            `jkv.chat.DEFAULT_CHAT_TEMPLATE`).
        special_tokens: names the template may use (bos_token, eos_token).
        defaults: settings for requests that do not give them (kv_policy, kv_budget).
        span_exporter: an OpenTelemetry span exporter (default: OTLP when OTEL_* is set).
        context_host_bytes: host RAM for the KV of contexts (`POST /v1/contexts`); past it the
            least recently used one's KV is dropped and prefilled again when next named.
        max_context_bytes_per_tenant: the KV bytes one tenant's contexts may hold (None: any).
        context_redis_url: Redis (or a Redis Cluster) where contexts are written too, and read
            from when this server does not hold them: replicas on one Redis share contexts.
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
        reserve_tokens: int = 128,
        chat_template: str | None = None,
        special_tokens: dict | None = None,
        defaults: dict | None = None,
        max_body_bytes: int = body.MAX_BODY_BYTES,
        request_timeout: float = body.REQUEST_TIMEOUT_S,
        max_prompt_chars: int | None = None,
        api_keys=None,
        protect_health_metrics: bool = False,
        span_exporter=None,
        context_host_bytes: int = 1 << 30,
        max_context_bytes_per_tenant: int | None = None,
        context_redis_url: str | None = None,
    ):
        for name, value in (("max_queued_requests", max_queued_requests),
                            ("max_queued_tokens", max_queued_tokens),
                            ("reserve_tokens", reserve_tokens)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        self.params, self.engine, self.cache = params, engine, response_cache
        if api_keys is not None and not isinstance(api_keys, auth.Keys):
            api_keys = auth.Keys(api_keys)
        self.keys = api_keys or None
        self.protect_health_metrics = bool(protect_health_metrics)
        self.max_body_bytes = body.check_limit("max_body_bytes", max_body_bytes)
        if isinstance(request_timeout, bool) or not (
            isinstance(request_timeout, int | float) and request_timeout > 0
        ):
            raise ValueError(f"{request_timeout=}: expected seconds > 0")
        self.request_timeout = float(request_timeout)
        if max_prompt_chars is None:
            max_prompt_chars = CHARS_PER_TOKEN * engine.max_model_len
        self.max_prompt_chars = body.check_limit("max_prompt_chars", max_prompt_chars)
        self.name = model_name or params.name
        self.max_queued_requests, self.max_queued_tokens = max_queued_requests, max_queued_tokens
        self.reserve_tokens = reserve_tokens
        if chat_template is None and params.tokenizer is not None:
            chat_template = params.tokenizer.chat_template
        self.chat_template = chat_template
        self.special = {**special_tokens_of(params), **(special_tokens or {})}
        self.defaults = _checked_defaults(params, defaults or {})
        self.obs = Observability(engine, self.name, span_exporter=span_exporter)
        self.stopping = asyncio.Event()  # set: requests still running end with a 503
        self.stop_error = stopped()  # ... this one
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once it runs
        self.queued_requests = 0
        self.queued_tokens = 0
        self.in_flight = 0
        self.created = int(time.time())
        redis = None
        if context_redis_url is not None:
            redis = RedisContexts(context_redis_url, params.version)
        self.contexts = ContextStore(context_host_bytes, max_context_bytes_per_tenant, redis=redis)
        self.app = self._build()

    # -- the app ----------------------------------------------------------------------------

    def _build(self):
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.exceptions import HTTPException as StarletteHTTPException

        @contextlib.asynccontextmanager
        async def lifespan(app):
            # Engine steps, cache lookups and request adds run in worker threads: enough of
            # them that hundreds of waiting requests never starve the engine's step.
            loop = self.loop = asyncio.get_running_loop()
            pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="jkv-serve")
            loop.set_default_executor(pool)
            yield
            pool.shutdown(wait=False)

        # no /docs or /redoc; the OpenAPI schema below, behind the key as every API route
        app = FastAPI(title="jkv", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)  # fmt: skip
        app.add_middleware(body.HeaderLimit)

        @app.exception_handler(oa.APIError)
        async def api_error(request, err: oa.APIError):
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, err: StarletteHTTPException):  # 404, 405, ...
            error = oa.http_error(err.status_code, request.method, request.url.path, err.detail)
            return JSONResponse(error.body(), status_code=err.status_code, headers=err.headers)

        @app.exception_handler(RequestValidationError)
        async def invalid(request, err: RequestValidationError):  # 422
            first = (err.errors() or [{}])[0]
            where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
            error = oa.APIError(422, f"{where}: {first.get('msg', 'invalid')}", param=where)
            return JSONResponse(error.body(), status_code=422)

        @app.exception_handler(Exception)
        async def unexpected(request, err: Exception):
            LOG.exception("unexpected error serving %s", request.url.path)
            return JSONResponse(oa.internal_error(err).body(), status_code=500)

        @app.get("/health")
        async def health(request: Request):
            if self.protect_health_metrics:
                self._tenant(request)
            if not getattr(self.engine, "healthy", True):
                why = getattr(self.engine, "health_error", None) or "a step failed"
                raise oa.APIError(
                    503,
                    f"the engine is not healthy ({why}) and it has not recovered",
                    type="server_error",
                    code="engine_unhealthy",
                )
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models(request: Request):
            self._tenant(request)
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
        async def metrics(request: Request):
            if self.protect_health_metrics:
                self._tenant(request)
            data = await asyncio.to_thread(self.obs.render)
            return Response(data, media_type=CONTENT_TYPE_LATEST)

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request):
            self._tenant(request)
            return app.openapi()

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._serve("completion", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._serve("chat", request)

        @app.post("/v1/contexts")
        async def create_context(request: Request):
            return await self._create_context(request)

        @app.get("/v1/contexts/{context_id}")
        async def get_context(context_id: str, request: Request):
            tenant = self._tenant(request)
            return (await asyncio.to_thread(self.contexts.get, context_id, tenant)).describe()

        @app.delete("/v1/contexts/{context_id}")
        async def delete_context(context_id: str, request: Request):
            await asyncio.to_thread(self.contexts.delete, context_id, self._tenant(request))
            return {"id": context_id, "object": "context.deleted", "deleted": True}

        return app

    # -- one request ------------------------------------------------------------------------

    def _tenant(self, request) -> str | None:
        """The tenant of the request's API key (None without keys), or 401."""
        if self.keys is None:
            return None
        try:
            return self.keys.tenant(request.headers.get("authorization"))
        except oa.APIError:
            self.obs.reject("unauthorized")
            raise

    async def _serve(self, kind: str, request):
        arrival = time.monotonic()
        tenant = self._tenant(request)  # before the body is read
        if self.stopping.is_set():
            raise self.stop_error
        try:
            raw = await body.read(request, self.max_body_bytes, self.request_timeout)
            # JSON, templating and tokenisation in a worker: the loop never waits on them
            req, ids, settings, jreq, entry = await asyncio.to_thread(
                self._prepare, kind, raw, tenant
            )
        except oa.APIError as err:
            self.obs.reject(REJECTED.get(err.status, "invalid_request"))
            raise
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        salt = auth.cache_salt(tenant, req.cache_salt)  # a client's salt narrows its tenant's
        rec = RequestRecord(rid, req.operation, arrival, tenant=salt, tenant_name=tenant)
        rec.prompt_tokens = len(ids) + (0 if entry is None else len(entry.tokens))
        rec.max_tokens = settings["max_new_tokens"]
        rec.temperature, rec.top_p = jreq.sampling.temperature, req.settings["top_p"]
        rec.seed = jreq.seed if req.seeded else None
        span = self.obs.start_span(rec, request.headers)
        try:
            found = None
            if entry is None:  # a context's answers are not cached (its KV shapes them)
                found = await self._lookup(req, jreq, ids, rec)
            else:
                settings = {**settings, "kv_state": await self._context_kv(entry)}
            if isinstance(found, Lookup):
                return self._cached(req, rid, rec, found, span)
            self._admit(len(ids))
            return await Answer(self, req, rid, rec, ids, settings, found, span, request).reply()
        except Exception as err:  # an answer in OpenAI's error JSON, the connection kept
            if not isinstance(err, oa.APIError):
                LOG.exception("request %s failed", rid)
                err = oa.internal_error(err)
            if not rec.reported:
                rec.error = str(err.status)
                self.report(rec, span)
            raise err from None
        except BaseException as err:  # cancelled: the server is stopping
            if not rec.reported:
                rec.error = type(err).__name__
                self.report(rec, span)
            raise

    def _prepare(self, kind: str, raw: bytes, tenant=None):
        """A body -> (its request, the prompt's ids, the settings, their validated form, the
        context it names or None)."""
        data = body.loads(raw)
        req = oa.parse(
            kind,
            data,
            chat_template=self.chat_template,
            special=self.special,
            max_chars=self.max_prompt_chars,
        )
        self._check_kv_dtype(data.get("kv_dtype"))
        if req.model != self.name:
            raise oa.APIError(
                400,
                f"model={req.model!r} is not served here; this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )
        entry = None
        if req.context is not None:
            entry = self.contexts.get(req.context, tenant)
            for name in ("kv_policy", "kv_budget"):
                if name in req.settings:
                    raise oa.bad(
                        name,
                        f"{name} given beside context={req.context!r}: the context was "
                        "compressed when it was created (POST /v1/contexts)",
                    )
        return req, *self._settings(req, entry), entry

    def _check_kv_dtype(self, value) -> None:
        """A body's `kv_dtype`: the server's own is accepted (it changes nothing), any other
        value is 400 (never ignored): the pool stores one dtype, the server's."""
        if value is None:
            return
        name = KV_DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value
        if name != self.engine.kv_dtype:
            raise oa.bad(
                "kv_dtype",
                f"kv_dtype={value!r}: the KV cache's dtype is one per server, set when it starts "
                f"(jkv serve --kv-dtype); this one stores {self.engine.kv_dtype}",
            )

    def _settings(self, req: oa.ParsedRequest, entry=None):
        """The prompt's ids, `jkv.generate`'s settings and their validated form, or 400. After
        a context (`entry`), the prompt continues its tokens: no special tokens, and the
        context's tokens count against the model's length."""
        try:
            # a chat's template placed its special tokens; a completion's prompt gets the bos
            # token as jkv.generate gives it, unless it continues a context
            special = req.kind != "chat" and entry is None
            ids = prompt_ids(self.params, req.prompt, None, special=special)
        except ValueError as e:
            raise oa.bad("messages" if req.kind == "chat" else "prompt", str(e)) from None
        bos = self.params.config.bos_token_id
        if entry is not None and len(ids) > 1 and ids[0] == bos:  # a template's bos: one already
            ids = ids[1:]
        before = 0 if entry is None else len(entry.tokens)
        context = self.engine.max_model_len - before
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
        defaults = self.defaults
        if "kv_policy" in req.settings:  # the server's budget belongs to the server's policy
            defaults = {k: v for k, v in defaults.items() if k != "kv_budget"}
        if entry is not None:  # its context's policy shaped its KV already
            defaults = {k: v for k, v in defaults.items() if k not in ("kv_policy", "kv_budget")}
        settings = {**defaults, **req.settings, "max_new_tokens": max_tokens}
        try:
            jreq = Settings.build(self.params, **settings)
        except ValueError as e:
            raise oa.bad(oa.param_of(str(e), req.settings), str(e)) from None
        # the KV dtype the engine runs (--kv-dtype), so the response cache's key holds it
        jreq = dataclasses.replace(jreq, kv_dtype=self.engine.kv_dtype)
        if len(ids) + max_tokens - 1 > context:
            raise oa.bad(
                "max_tokens",
                f"a prompt of {len(ids)} tokens plus max_tokens={max_tokens} needs "
                f"{len(ids) + max_tokens - 1} positions; this model serves {context}",
                code="context_length_exceeded",
            )
        return ids, settings, jreq

    async def _create_context(self, request):
        """`POST /v1/contexts`: `model`, `prompt` or `messages`, `kv_policy`, `kv_budget`,
        `ttl` -> the context object, once the engine prefilled (and compressed) it."""
        tenant = self._tenant(request)
        if self.stopping.is_set():
            raise self.stop_error
        raw = await body.read(request, self.max_body_bytes, self.request_timeout)
        ids, settings, ttl = await asyncio.to_thread(self._prepare_context, raw)
        self._admit(len(ids))
        try:
            kv = await self._prefill(ids, settings)
        finally:
            self.queued_requests -= 1
            self.queued_tokens -= len(ids)
        name = getattr(kv.policy, "name", None) or "full"
        entry = await asyncio.to_thread(self.contexts.add, tenant, ids, settings, name, kv, ttl)
        return entry.describe()

    def _prepare_context(self, raw: bytes):
        """A context's body -> (its token ids, its KV settings, its ttl), or 400."""
        data = body.loads(raw)
        if not isinstance(data, dict):
            raise oa.bad(None, "expected a JSON object")
        if data.get("model") != self.name:
            raise oa.APIError(
                400,
                f"model={data.get('model')!r}: this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )
        kind = "chat" if "messages" in data else "completion"
        if kind == "chat" and "prompt" in data:
            raise oa.bad("prompt", "give prompt or messages, not both")
        if kind == "chat":
            messages = oa.messages_of(data)
            text = oa.render_chat(messages, self.chat_template, self.special, generation=False)
        else:
            text = oa.prompt_of(data)
        try:
            ids = prompt_ids(self.params, text, None, special=kind != "chat")
        except ValueError as e:
            raise oa.bad("messages" if kind == "chat" else "prompt", str(e)) from None
        if len(ids) >= self.engine.max_model_len:
            raise oa.bad(
                "prompt",
                f"the context is {len(ids)} tokens; this model serves {self.engine.max_model_len}"
                " (context, question and answer together)",
                code="context_length_exceeded",
            )
        settings = oa.jkv_settings(data)
        if "kv_policy" not in settings:
            settings = {**{k: v for k, v in self.defaults.items()
                           if k in ("kv_policy", "kv_budget")}, **settings}  # fmt: skip
        try:
            Settings.build(self.params, **settings)
        except ValueError as e:
            raise oa.bad(oa.param_of(str(e), settings), str(e)) from None
        return ids, settings, ttl_of(data)

    async def _prefill(self, ids, settings):
        """The context of `ids` (a `jkv.KVContext`), prefilled by the engine's step."""
        rid = f"ctx-prefill-{uuid.uuid4().hex}"
        outputs = self.engine.stream(ids, request_id=rid, prefill_only=True, **settings)
        try:
            async for out in outputs:
                if out.finished and out.context is not None:
                    return out.context
        except ValueError as e:  # the engine's own checks (a policy it cannot read out, ...)
            raise oa.bad(oa.param_of(str(e), settings), str(e)) from None
        raise oa.internal_error(RuntimeError("the context's prefill ended without its KV"))

    async def _context_kv(self, entry):
        """`entry`'s KV: from host RAM, or prefilled again from its tokens (evicted)."""
        kv = await asyncio.to_thread(self.contexts.take, entry)
        if kv is None:
            kv = await self._prefill(list(entry.tokens), entry.settings)
            self.contexts.put(entry, kv)
        return kv

    async def _lookup(self, req, jreq, ids, rec):
        """The response cache's hit (a `Lookup`), or the `Miss` the answer fills; None when
        the request is not deterministic or there is no cache. In a worker (Redis)."""
        if self.cache is None or not req.seeded:
            return None
        t0 = time.monotonic()
        key = front.key(self.params, jreq, salt=rec.tenant)
        # no flight to join: a request that waited on another would hold a worker thread
        found = await asyncio.to_thread(front.lookup, self.cache, key, ids, coalesce=False)
        rec.lookup = (t0, time.monotonic())
        self.obs.lookup(found.level if isinstance(found, Lookup) else None)
        return found

    def _cached(self, req, rid, rec, hit, span):
        from fastapi.responses import JSONResponse, StreamingResponse

        record = hit.record
        now = time.monotonic()
        rec.cache, rec.finish_reason = hit.level, record.finish_reason
        rec.token(now, len(record.tokens))
        use = oa.usage(rec.prompt_tokens, len(record.tokens), 0, hit.level)
        headers = {"x-jkv-cache": hit.level, "x-request-id": rid}
        self.report(rec, span)
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

    def stop_requests(self, reason: oa.APIError | None = None) -> int:
        """Ends every request still running with a `server_shutdown` error, or `reason`
        (streamed: an error event, then [DONE]) and refuses new ones with it: what a stopping
        server does once its grace period is over (or when its serving group lost a process).
        Returns how many were running. Call it on the loop."""
        self.stop_error = stopped() if reason is None else reason
        self.stopping.set()
        if self.in_flight:
            LOG.warning("stopping: %d requests still running end with 503", self.in_flight)
        return self.in_flight

    def report(self, rec, span) -> None:
        """A request's metrics, spans and log line (once)."""
        rec.reported = True
        self.obs.done(rec, span)


def _checked_defaults(params, defaults: dict) -> dict:
    """The server's defaults, checked as a request's body fields are (types, then values)."""
    try:
        typed = oa.jkv_settings(defaults)
    except oa.APIError as e:
        raise ValueError(e.message) from None
    Settings.build(params, **{**defaults, **typed})  # raises ValueError naming the setting
    return dict(defaults)


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
