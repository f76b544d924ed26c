"""The engine for asyncio callers: one async iterator of outputs per request, all of them sharing
the engine's steps, which run in a worker thread while the event loop stays free.

Adding a request is checking it and posting a message (`Engine.add_request`), so a stream
cancelled at any point, before its first output included, leaves nothing behind: its `finally`
posts the abort, which the next step (or, with none running, the abort itself) takes in.
"""

from __future__ import annotations

import asyncio

from jkv.prompt import prompt_ids


class RequestFailed(RuntimeError):
    """A step that ran this request raised; the engine went on without it."""

    def __init__(self, request_id: str, error: str):
        super().__init__(f"request {request_id!r} failed: {error}")
        self.request_id, self.error = request_id, error


class Streams:
    """`stream()` and the task that steps the engine while any request is in it (mixed into
    `Engine`)."""

    def __init__(self):
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its stream's outputs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._driver: asyncio.Task | None = None

    async def stream(self, prompt, **settings):
        """Adds a request and yields its `RequestOutput`s as the engine steps. Leaving the
        iteration early (or being cancelled) aborts the request and its pages go back. Takes
        `add_request`'s arguments; a text prompt is tokenised in a worker thread.

        Raises:
          ValueError: as `add_request`.
          RequestFailed: a step that ran it raised (the engine goes on).
        """
        rid = settings.pop("request_id", None)
        rid = f"stream-{next(self._ids)}" if rid is None else rid
        self._loop = asyncio.get_running_loop()
        if rid in self._queues:  # refused before anything is replaced: the first stream goes on
            raise ValueError(f"request_id={rid!r} is already streaming; expected a new id")
        queue = self._queues[rid] = asyncio.Queue()  # before the request: no output is missed
        try:
            if isinstance(prompt, str | bytes | bytearray):
                prompt = await asyncio.to_thread(self._prompt_ids, prompt)
            self.add_request(prompt, request_id=rid, **settings)
        except BaseException:
            self._queues.pop(rid, None)
            raise
        self._start_driver()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if out.error is not None:
                    finished = True
                    raise RequestFailed(rid, out.error)
                finished = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def _prompt_ids(self, prompt) -> list[int]:
        return prompt_ids(self.params, prompt, None)

    def _start_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = self._loop.create_task(self._drive())

    async def _drive(self) -> None:
        """Steps the engine while it has work, handing each output to its stream's queue."""
        try:
            while self.has_work:
                await asyncio.to_thread(self.step)  # it hands each output to its stream
        except Exception as err:  # step() fails requests, not itself; if it did, none hangs
            self._fail_streams(f"{type(err).__name__}: {err}")
            raise

    def _fail_streams(self, error: str) -> None:
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(self._failed_output(rid, error))

    def _deliver(self, outs) -> None:
        """Hands outputs to their streams' queues, from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for out in outs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                loop.call_soon_threadsafe(queue.put_nowait, out)
