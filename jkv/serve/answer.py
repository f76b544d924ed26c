"""One admitted request's answer: the engine's outputs as one JSON body or as SSE events.

Whatever ends a request ends it in OpenAI's terms: a client that leaves aborts it (its pages go
back); a failed engine step is a 500 (streamed: an error event, then `data: [DONE]`); a server
that stops before the request is done answers 503 `server_shutdown` (streamed: an error event,
then `[DONE]`), so no client is cut off without being told why. The response cache is filled
(in a worker thread) only with a whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from jkv.serve import openai as oa

LOG = logging.getLogger("jkv.serve")


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


class Stopping(Exception):
    """The server is stopping and this request's time to finish ran out."""


def stopped() -> oa.APIError:
    return oa.APIError(
        503,
        "the server is shutting down and this request could not finish in time; retry it",
        type="server_error",
        code="server_shutdown",
        headers={"Retry-After": "1"},
    )


class Answer:
    """The engine's stream of one request, turned into the reply (`await answer.reply()`)."""

    def __init__(self, server, req, rid, rec, ids, settings, miss, span, request):
        self.server, self.req, self.rid, self.rec = server, req, rid, rec
        self.ids, self.miss, self.span, self.request = ids, miss, span, request
        # without max_tokens a request may run to the end of the context: admission reserves
        # what such a request typically needs, not all of it
        reserve = None if req.max_tokens is not None else server.reserve_tokens
        self.outputs = server.engine.stream(
            ids, request_id=rid, cache_salt=rec.tenant, reserve=reserve, **settings
        )
        self.text: list[str] = []
        self.tokens: list[int] = []
        context = settings.get("kv_state")  # a context's tokens come first (POST /v1/contexts)
        self.prompt_tokens = len(ids) + (0 if context is None else len(context.tokens[0]))
        self.queued = True
        server.in_flight += 1

    # -- bookkeeping ----------------------------------------------------------------------

    def _release(self) -> None:
        """The request no longer counts against the queue's limits (its first token came)."""
        if self.queued:
            self.queued = False
            self.server.queued_requests -= 1
            self.server.queued_tokens -= len(self.ids)

    def _take(self, out) -> None:
        self._release()
        rec = self.rec
        rec.scheduled = out.scheduled_at if rec.scheduled is None else rec.scheduled
        rec.cached_tokens = out.cached_tokens
        rec.pages, rec.preemptions = out.pages or rec.pages, out.preemptions
        rec.token(time.monotonic(), len(out.new_tokens))
        self.tokens.extend(out.new_tokens)
        self.text.append(out.text)
        if out.finished:
            rec.finish_reason = out.finish_reason

    async def _finish(self) -> dict:
        """A whole answer: the response cache is filled (Redis in a worker); its usage."""
        rec = self.rec
        rec.finished = time.monotonic()
        if self.miss is not None and rec.finish_reason in ("stop", "length"):
            answer = {"text": "".join(self.text), "tokens": self.tokens,
                      "finish_reason": rec.finish_reason}  # fmt: skip
            await asyncio.to_thread(_fill, self.miss, answer)
        return oa.usage(self.prompt_tokens, len(self.tokens), rec.cached_tokens, None)

    def _close(self, error: str | None = None) -> None:
        self._release()
        self.server.in_flight -= 1
        self.rec.error = error
        self.server.report(self.rec, self.span)

    async def _next(self, watch_client: bool):
        """The engine's next output; StopAsyncIteration at the end; ClientGone / Stopping."""
        request = self.request if watch_client else None
        return await until(self.outputs.__anext__(), request, self.server.stopping)

    # -- the reply --------------------------------------------------------------------------

    async def reply(self):
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        headers = {"x-jkv-cache": "miss", "x-request-id": self.rid}
        streaming = False
        try:
            if not self.req.stream:
                with contextlib.suppress(StopAsyncIteration):
                    while not self.rec.finish_reason:
                        self._take(await self._next(watch_client=True))
                use = await self._finish()
                self._close()
                body = oa.response(
                    self.req, self.rid, "".join(self.text), self.rec.finish_reason, use
                )
                return JSONResponse(body, headers=headers)
            first = await self._next(watch_client=True)
        except ClientGone:
            self.server.obs.aborted.inc()
            self._close("client_disconnected")
            return Response(status_code=499)
        except ValueError as e:  # what the engine refuses (a policy it does not serve, ...)
            self._close("400")
            raise oa.bad(oa.param_of(str(e), self.req.settings), str(e)) from None
        except Exception as e:  # a failed engine step: 500, nothing cached
            if isinstance(e, Stopping) or self.server.stopping.is_set():  # (its group lost)
                self._close(self.server.stop_error.code)
                raise self.server.stop_error from None
            self._close("500")
            LOG.exception("the engine failed serving %s", self.rid)
            raise oa.engine_error(e) from None
        except BaseException as e:
            self._close(type(e).__name__)
            raise
        else:
            self._take(first)
            streaming = True
            return StreamingResponse(self._events(first), media_type="text/event-stream",
                                     headers=headers)  # fmt: skip
        finally:
            if not streaming:  # done, or an early exit: that aborts the request
                await self.outputs.aclose()

    async def _events(self, first):
        req, rid = self.req, self.rid
        ending = None  # why the stream ends early: "500", "server_shutdown", or a disconnect
        try:
            yield oa.sse(oa.chunk(req, rid, first.text, first.finish_reason, first=True))
            try:
                while not self.rec.finish_reason:
                    out = await self._next(watch_client=False)  # Starlette watches the client
                    self._take(out)
                    if out.text or out.finished:
                        yield oa.sse(oa.chunk(req, rid, out.text, out.finish_reason))
            except StopAsyncIteration:
                pass
            except Exception as e:  # a failed engine step: an error event, then [DONE]
                if isinstance(e, Stopping) or self.server.stopping.is_set():  # (group lost)
                    ending = self.server.stop_error.code
                    yield oa.sse(self.server.stop_error.body())
                    yield oa.sse("[DONE]")
                    return
                LOG.exception("the engine failed serving %s", rid)
                ending = "500"
                yield oa.sse(oa.engine_error(e).body())
                yield oa.sse("[DONE]")
                return
            use = await self._finish()
            if req.include_usage:
                yield oa.sse({**oa.chunk(req, rid, None, None), "choices": [], "usage": use})
            yield oa.sse("[DONE]")
            ending = "done"
        finally:
            await self.outputs.aclose()  # an early exit aborts the request: its pages go back
            if ending is None:
                self.server.obs.aborted.inc()
            self._close(None if ending == "done" else ending or "client_disconnected")


def _fill(miss, answer: dict) -> None:
    try:
        miss.fill(answer)
    except Exception:  # the cache never fails an answer
        LOG.exception("response cache fill failed")


async def until(awaitable, request=None, stopping: asyncio.Event | None = None):
    """`awaitable`'s result; or, after cancelling it, ClientGone if `request`'s client
    disconnects first, Stopping if `stopping` is set first."""
    work = asyncio.ensure_future(awaitable)
    watches = {}

    async def gone():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    if request is not None:
        watches[asyncio.ensure_future(gone())] = ClientGone
    if stopping is not None:
        watches[asyncio.ensure_future(stopping.wait())] = Stopping
    try:
        await asyncio.wait({work, *watches}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            for watch, error in watches.items():
                if watch.done():
                    raise error()
        for watch in watches:
            watch.cancel()
    return work.result()
