"""Needles in a real haystack: English text that ships with Python, chat prompts for a real model.

The haystack is CPython's own documentation (`pydoc_data.topics`, in every CPython install),
cut into sentences. RULER's needle tasks (Hsieh et al. 2024, "RULER: What's the Real Context
Size of Your Long-Context Language Models?"):
  niah_single   one needle "One of the special magic numbers for <key> is: <5 digits>." at a
                given depth; the question asks for it;
  niah_multikey `keys` needles with distinct keys (the asked one at the given depth, the
                others at random depths); the question asks for one.
The prompt is the model's chat: a user message holding the text then the question, and the
assistant's turn begun with RULER's answer prefix ("The special magic number for <key>
mentioned in the provided text is"), split into the context's ids and the question's ids so a
policy can compress the context before it sees the question (question-agnostic) or after
(query-aware: the two concatenated).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from jkv.chat import render, special_tokens

KEYS = ("Mara", "Tobin", "Iris", "Quill", "Soren", "Lena", "Odile", "Pavel", "Nadia", "Ezra",
        "Yusuf", "Greta", "Hollis", "Ines", "Joaquin", "Kaia")  # fmt: skip
INTRO = "Some special magic numbers are hidden within the following text. Memorize them."
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
_SPLIT = "\x00"  # where the context ends inside the rendered chat


@functools.cache
def sentences() -> tuple[str, ...]:
    """The English sentences of pydoc's topics (prose lines only: no code, no tables)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            lines = [x.strip() for x in para.splitlines()]
            if not lines or any(
                not x or x.startswith((">>>", "...", "*", "+", "|", "=")) for x in lines
            ):
                continue
            text = " ".join(lines)
            if text.count(" ") < 6 or not text[0].isupper():
                continue
            out += [s for s in re.split(r"(?<=[.!?])\s+", text) if len(s) > 20]
    return tuple(out)


def english_text(chars: int) -> str:
    """`chars` characters of the haystack's sentences, in order."""
    text, out = 0, []
    for s in sentences():
        out.append(s)
        text += len(s) + 1
        if text >= chars:
            break
    return " ".join(out)[:chars]


@dataclasses.dataclass(frozen=True)
class Needle:
    context_ids: list[int]  # chat prefix + intro + haystack with the needles
    question_ids: list[int]  # question, end of turn, assistant turn, answer prefix
    answer: str  # the asked value's 5 digits
    depth: float  # where the asked needle sits, 0 (start) .. 1 (end)
    key: str


def _haystack(tokenizer, n_tokens: int, rng) -> list[str]:
    """Consecutive sentences from a random start, about `n_tokens` tokens in all."""
    pool = sentences()
    start = int(rng.integers(0, len(pool) // 2))
    out, count = [], 0
    for s in pool[start:] + pool[:start]:
        out.append(s)
        count += len(tokenizer.encode(" " + s, add_special_tokens=False))
        if count >= n_tokens:
            break
    return out


def make_needle(params, n_tokens: int, depth: float, rng, *, keys: int = 1) -> Needle:
    """A niah_single (`keys=1`) or niah_multikey prompt of about `n_tokens` context tokens.

    Raises:
      ValueError: `depth` outside [0, 1], `keys` outside 1..len(KEYS), or no tokenizer.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"{depth=} must be in [0, 1]")
    if not 1 <= keys <= len(KEYS):
        raise ValueError(f"{keys=} must be in 1..{len(KEYS)}")
    tok = params.tokenizer
    if tok is None:
        raise ValueError("make_needle needs params with a tokenizer")
    names = [KEYS[i] for i in rng.choice(len(KEYS), size=keys, replace=False)]
    values = [str(int(v)) for v in rng.integers(10_000, 100_000, size=keys)]
    text = _haystack(tok, n_tokens, rng)
    spots = [round(depth * len(text))] + [int(rng.integers(0, len(text) + 1)) for _ in names[1:]]
    # insert from the back so earlier spots keep their meaning
    for spot, name, value in sorted(zip(spots, names, values, strict=True), reverse=True):
        text.insert(spot, NEEDLE.format(key=name, value=value))
    content = f"{INTRO}\n\n{' '.join(text)}{_SPLIT}\n\n{QUESTION.format(key=names[0])}"
    rendered = render([{"role": "user", "content": content}], tok.chat_template,
                      special_tokens(params))  # fmt: skip
    context, question = rendered.split(_SPLIT)
    question += ANSWER_PREFIX.format(key=names[0])
    return Needle(
        context_ids=tok.encode(context, add_special_tokens=False),
        question_ids=tok.encode(question, add_special_tokens=False),
        answer=values[0],
        depth=depth,
        key=names[0],
    )


def answered(text: str, answer: str) -> bool:
    """Whether the first number in `text` (digits, spaces between them allowed) is `answer`."""
    found = re.search(r"\d[\d ]*", text)
    return found is not None and found.group(0).replace(" ", "") == answer
