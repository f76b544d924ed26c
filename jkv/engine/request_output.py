"""What the engine hands back for a request, and the per-request state that produces it: its
settings, its text and stop strings, and how much of both was handed out."""

from __future__ import annotations

import dataclasses

from jkv.output import RowOutput
from jkv.request import Request


@dataclasses.dataclass
class RequestOutput:
    """What one step did for one request."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error", "context"; None while running
    cached_tokens: int  # prompt tokens taken from the prefix cache
    text: str = ""  # new text no later token can change (all of the rest once finished)
    scheduled_at: float | None = None  # time.monotonic() when a step first ran its prompt
    pages: int = 0  # pages it held in this step (all heads)
    preemptions: int = 0  # times it was preempted (its pages freed, its tokens recomputed)
    error: str | None = None  # finish_reason "error": what failed
    context: object = (
        None  # a prefill-only request's KV, a `jkv.KVContext` (finish_reason "context")
    )


class Row:
    """One request's settings, text and stop strings, and how much of both was handed out."""

    def __init__(self, req: Request, out: RowOutput | None):
        self.req, self.out = req, out
        self.context = None  # a KV context's (counts, slots) it starts from (`Engine._context`)
        self.context_policy = None  # prefill only: the policy its read-out context names
        self.tokens = 0  # tokens handed out
        self.pushed = 0  # tokens given to the stop-string search
        self.chars = 0  # characters of text handed out

    @property
    def stopped(self) -> bool:
        return self.out is not None and self.out.hit is not None

    def take(self, seq, final: bool, end: int | None = None) -> tuple[list[int], str]:
        """The tokens `seq` sampled since the last call (none past a stop string) and the new
        settled text; `end`: of its first `end` output tokens only (those read back)."""
        output = seq.output if end is None or end == len(seq.output) else seq.output[:end]
        if self.out is None:
            tokens = output[self.tokens :]
            self.tokens = len(output)
            return tokens, ""
        self.out.push(output[self.pushed :])
        self.pushed = len(output)
        upto = self.out.hit[1] if self.out.hit is not None else len(output)
        tokens = output[self.tokens : upto]
        self.tokens = max(self.tokens, upto)
        text = self.out.text if final or self.stopped else self.out.settled()
        delta, self.chars = text[self.chars :], max(self.chars, len(text))
        return tokens, delta
