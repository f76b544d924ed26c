"""A prompt (text, UTF-8 bytes, token ids, or a batch of them) -> token-id lists, checked.

Plain Python and numpy: the response cache uses it without JAX.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def prompt_ids(params, prompt, index: int | None, special: bool = True) -> list[int]:
    """The token ids of one prompt (text, UTF-8 bytes or ids), checked against the vocabulary."""
    where = "prompt" if index is None else f"prompt[{index}]"
    if isinstance(prompt, bytes | bytearray):
        try:
            prompt = bytes(prompt).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{where} is bytes that are not UTF-8 (byte {prompt[e.start]:#04x} at offset "
                f"{e.start}); expected text, UTF-8 bytes or a list of token ids"
            ) from None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}={prompt!r} is empty or only whitespace; expected some text")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where} holds {prompt[e.start]!r} at index {e.start}, a lone surrogate that is "
                "not text (a mis-decoded byte?); expected a str that encodes as UTF-8"
            ) from None
        if params.tokenizer is None:
            raise ValueError(f"{where} is text but the params carry no tokenizer; pass token ids")
        ids = params.tokenizer.encode(prompt, add_special_tokens=special)
    elif isinstance(prompt, Sequence | np.ndarray) and all(
        isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt
    ):
        ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"{where}={prompt!r:.80} must be a str or a list of token ids")
    if not ids:
        raise ValueError(f"{where} is empty; expected at least one token")
    vocab = params.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{where} holds token id {bad[0]}; expected ids in [0, {vocab})")
    return ids


def is_batch(prompt) -> bool:
    """A list or tuple of prompts (str, bytes, id lists or arrays), not one list of ids."""
    return (
        isinstance(prompt, list | tuple)
        and bool(prompt)
        and all(isinstance(p, str | bytes | bytearray | list | tuple | np.ndarray) for p in prompt)
    )


def encode_prompts(params, prompt, *, continuation: bool = False):
    """Token-id lists for a prompt or a batch of prompts, and whether it was a batch.

    A `continuation` (text appended to a prefilled state) is encoded without the tokenizer's
    special tokens: no second `<s>` in the middle of the sequence.
    """
    if isinstance(prompt, list | tuple) and not prompt:
        raise ValueError("prompt=[] is empty; expected a str, a list of token ids, or a batch")
    if is_batch(prompt):
        return [prompt_ids(params, p, i, not continuation) for i, p in enumerate(prompt)], True
    return [prompt_ids(params, prompt, None, not continuation)], False
