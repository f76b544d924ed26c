"""The demo task: find a 5-digit code hidden in simple English filler (a needle in a haystack).

Text format (canonical form: every token separated by one space, so a word-level tokenizer
round-trips it exactly, and `text.split()` are its tokens):

  <filler sentences> The code for Alice 4 0 9 1 7 . <more filler> The code for Omar 2 ...
  Question : what is the code for Alice ? The code for Alice     <- the prompt
  4 0 9 1 7                                                      <- the answer (then `</s>`)

- Filler comes from a small grammar over the word list below (`The old farmer carried a red
  basket to the market .`), so free-text continuation is meaningful and the vocabulary stays
  small. A haystack's filler is a window cut from a longer story, so it may begin mid-sentence.
- 1-8 facts `The code for <name> d d d d d .` (10 tokens each) sit between filler sentences at
  random depths; names in one document are distinct; the question asks about one of them.
- The question restates the asked fact's own prefix (`The code for <name>`), so the answer
  follows the name as in the document: its first digit is a one-token induction copy (find the
  earlier `<name>`, copy what came next). Both more distant forms were measured not to train in
  hours on a CPU: `... ? Answer :` (the name 3 tokens back) and `The code for <name> is` in
  fact and question (the name 2 tokens back: first digit at chance after 1,500 steps).
- Digits are separate tokens; `<s>` starts every document and `</s>` follows the answer.

API (all randomness from a caller-owned `numpy.random.Generator`, so a seed fixes everything):
  make_example(rng, num_tokens, num_facts) -> Example(prompt, answer, meta)
  make_filler(rng, num_tokens) -> plain filler text of exactly `num_tokens` tokens
  split_examples(seed, n, num_tokens, num_facts) -> (context, question, answer) triples
  make_batch(rng, batch_size, seq_len, ...) -> Batch(tokens, weights, answer_mask) for training
  VOCAB (token strings; id = index), encode(text) -> ids without the tokenizers library.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

SPECIALS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
DIGITS = tuple("0123456789")
PUNCT = (".", ",", "?", ":")
CODE_LEN = 5
MAX_FACTS = 8

NAMES = tuple(
    """
    Alice Bruno Clara Daniel Elena Felix Greta Hugo Irene Jonas Karla Lucas Maria Nadia Oscar
    Paula Quentin Rosa Samuel Tilda Ulrich Vera Walter Xenia Yusuf Zora Adam Beatrice Carlos
    Diana Edgar Fiona Gustav Helen Igor Julia Kevin Laura Martin Nora Otto Petra Rafael Sofia
    Tomas Ursula Victor Wanda Yara Zeno Anton Bianca Cyril Dora Emil Frida Georg Hanna Ivan
    Jana Karl Lena Marco Nina Olga Pedro Ruth Simon Tanja Uwe Viktor Wilma Yvonne Albert Berta
    Conrad Delia Erik Flora Gregor Heidi Isaac Jasmin Kurt Lydia Milan Nelly Oliver Pia Roman
    Selma Theo Ulla Vincent Agnes Boris Celia David Emma Franz Gloria Henry Ida Jakob Klara Leo
    Mila Noah Olivia Paul Rita Stefan Thea Viola Arthur Bella Chris Dina Ella Fabian Gina Harald
    Ines Jorge Kira Lars Magda Nils Orla Piet Rolf Sara Tobias Vanessa Alma Benno Cora Dirk Eva
    Fritz Gerda Hilde Ingo Josef Kai Luise Moritz Nele Omar Philipp Ronja Sven Tessa Valentin
    Amira Bernd Chiara Dennis Esther Finn Gabriel Hedwig Ilse Jonah Kim Lotte Malte Naomi Oskar
    Pablo Regina Silke Till Verena Anke Bodo Carla Dieter Elif Falk Grete Heinz Inga Jule Konrad
    Liam Mats Nicole Olaf Rainer Sabine Timo Wiebke Xaver
    """.split()
)

# The grammar's word classes. "code", "is", "Question" and "what" never occur in filler, so a
# fact and the question stand out from the haystack by their words alone. ("is" and "Answer"
# belonged to the facts and question of an earlier format; they stay in the vocabulary so the
# tokenizer is unchanged.)
_AGENTS = tuple(
    """farmer baker teacher child dog cat bird horse fox sailor doctor girl boy woman man
    fisher miller painter hunter singer tailor driver nurse student king queen goat rabbit""".split()
)
_PLACES = tuple(
    """river market house garden forest hill village school kitchen bridge road field lake
    town shop tower barn harbor station library church square valley beach""".split()
)
_THINGS = tuple(
    """box apple book letter lamp basket coat bread cup stone rope hat boat chair table bell
    map flower ball cake bottle blanket candle drum kite plate ring shoe wheel window""".split()
)
_ADJECTIVES = tuple(
    """old young small big red green blue quiet happy tired brave kind tall little warm cold
    dark bright heavy clean""".split()
)
_VERBS_T = tuple(
    """saw found carried painted opened bought sold lost washed dropped liked kept fixed
    watched took brought gave closed pushed pulled""".split()
)
_VERBS_I = tuple("""slept sang waited laughed rested smiled danced cried stayed worked""".split())
_VERBS_GO = tuple("""walked ran went came hurried""".split())
_PREPS = tuple("""near behind under beside in by""".split())
_TIMES = (
    "In the morning",
    "At night",
    "After lunch",
    "Before dawn",
    "Every day",
    "On Sunday",
    "Later",
    "Then",
)
_WEATHER = tuple("""rain snow wind sun""".split())

# Words the fact and question templates use that filler may also use ("the", "for", "and", ...).
_TEMPLATE_WORDS = ("The", "code", "for", "is", "Question", "what", "the", "Answer")
_GLUE = ("A", "a", "and", "to", "It", "was", "there", "back", "home", "with", "of", "very")


def _words_in(phrases) -> list[str]:
    return [w for p in phrases for w in p.split()]


def _build_vocab() -> tuple[str, ...]:
    seen: dict[str, None] = {}
    groups = (
        SPECIALS,
        PUNCT,
        DIGITS,
        _TEMPLATE_WORDS,
        _GLUE,
        _AGENTS,
        _PLACES,
        _THINGS,
        _ADJECTIVES,
        _VERBS_T,
        _VERBS_I,
        _VERBS_GO,
        _PREPS,
        _words_in(_TIMES),
        _WEATHER,
        NAMES,
    )
    for group in groups:
        for word in group:
            seen.setdefault(word, None)
    return tuple(seen)


VOCAB: tuple[str, ...] = _build_vocab()
_IDS = {w: i for i, w in enumerate(VOCAB)}
if set(NAMES) & (set(VOCAB[: len(VOCAB) - len(NAMES)])):
    raise RuntimeError("a name collides with a filler word")  # a bug in the lists above


def encode(text: str) -> list[int]:
    """Token ids of canonical text (space-separated tokens), without `<s>`; unknown -> `<unk>`."""
    return [_IDS.get(w, UNK_ID) for w in text.split()]


def decode(ids) -> str:
    """Canonical text of token ids (specials dropped)."""
    return " ".join(VOCAB[int(i)] for i in ids if int(i) not in (UNK_ID, BOS_ID, EOS_ID))


# ------------------------------------------------------------------------------------ filler
def _pick(rng: np.random.Generator, words) -> str:
    return words[int(rng.integers(len(words)))]


def _noun_phrase(rng, nouns, *, capital=False) -> list[str]:
    det = ("The", "A") if capital else ("the", "a")
    out = [_pick(rng, det)]
    if rng.random() < 0.5:
        out.append(_pick(rng, _ADJECTIVES))
    out.append(_pick(rng, nouns))
    return out


def _sentence(rng: np.random.Generator) -> list[str]:
    kind = int(rng.integers(6))
    if kind == 0:  # The old farmer carried a red basket to the market .
        s = _noun_phrase(rng, _AGENTS, capital=True) + [_pick(rng, _VERBS_T)]
        s += _noun_phrase(rng, _THINGS)
        if rng.random() < 0.5:
            s += ["to"] + _noun_phrase(rng, _PLACES)
    elif kind == 1:  # A tired dog slept under the bridge .
        s = _noun_phrase(rng, _AGENTS, capital=True) + [_pick(rng, _VERBS_I)]
        if rng.random() < 0.7:
            s += [_pick(rng, _PREPS)] + _noun_phrase(rng, _PLACES)
    elif kind == 2:  # In the morning , the baker walked to the village .
        s = _pick(rng, _TIMES).split() + [","] + _noun_phrase(rng, _AGENTS)
        s += [_pick(rng, _VERBS_GO), "to"] + _noun_phrase(rng, _PLACES)
    elif kind == 3:  # The girl found a cup and smiled .
        s = _noun_phrase(rng, _AGENTS, capital=True) + [_pick(rng, _VERBS_T)]
        s += _noun_phrase(rng, _THINGS) + ["and", _pick(rng, _VERBS_I)]
    elif kind == 4:  # The lake was very quiet .
        s = _noun_phrase(rng, _PLACES, capital=True) + ["was"]
        if rng.random() < 0.3:
            s.append("very")
        s.append(_pick(rng, _ADJECTIVES))
    else:  # It was cold and there was snow in the valley .
        s = ["It", "was", _pick(rng, _ADJECTIVES), "and", "there", "was", _pick(rng, _WEATHER)]
        s += ["in"] + _noun_phrase(rng, _PLACES)
    return s + ["."]


def _filler_words(rng: np.random.Generator, num_tokens: int) -> tuple[list[str], list[int]]:
    """At least `num_tokens` words of whole sentences, and the index where each sentence starts."""
    words: list[str] = []
    starts: list[int] = []
    while len(words) < num_tokens:
        starts.append(len(words))
        words += _sentence(rng)
    return words, starts


def make_filler(rng: np.random.Generator, num_tokens: int) -> str:
    """Plain filler text of exactly `num_tokens` tokens, starting at a sentence start.

    For free-text continuation and perplexity; the text is cut at the end (mid-sentence).

    Args:
      rng: the random source.
      num_tokens: tokens in the text (`<s>` not counted).

    Returns:
      canonical text (tokens separated by single spaces).

    Raises:
      ValueError: `num_tokens` < 1.
    """
    if num_tokens < 1:
        raise ValueError(f"{num_tokens=} must be >= 1")
    words, _ = _filler_words(rng, num_tokens)
    return " ".join(words[:num_tokens])


# ----------------------------------------------------------------------------------- example
@dataclasses.dataclass(frozen=True)
class Fact:
    name: str
    code: str  # 5 digits, e.g. "40917"
    position: int  # token index of the fact's first token ("The") in <s> + prompt
    depth: float  # position / prompt length (with <s>): 0 = document start, 1 = the question


@dataclasses.dataclass(frozen=True)
class ExampleMeta:
    facts: tuple[Fact, ...]  # in document order
    asked: int  # index into facts of the fact the question asks about
    num_tokens: int  # tokens of <s> + prompt + answer


class Example(NamedTuple):
    prompt: str  # ends with "? The code for <name>"
    answer: str  # "4 0 9 1 7"
    meta: ExampleMeta


FACT_TOKENS = 5 + CODE_LEN  # The code for <name> d d d d d .
QUESTION_TOKENS = 13  # Question : what is the code for <name> ? The code for <name>


def question_words(name: str) -> list[str]:
    """The question about `name`'s code, as tokens; it ends with the fact's own prefix."""
    return ["Question", ":", "what", "is", "the", "code", "for", name, "?", *_prefix(name)]


def _prefix(name: str) -> list[str]:
    return ["The", "code", "for", name]


def min_tokens(num_facts: int) -> int:
    """The shortest `num_tokens` that fits `num_facts` facts, the question and the answer."""
    return 1 + num_facts * FACT_TOKENS + QUESTION_TOKENS + CODE_LEN


def make_example(rng: np.random.Generator, num_tokens: int, num_facts: int) -> Example:
    """One haystack document with `num_facts` facts and a question about one of them.

    Args:
      rng: the random source (the example is a function of its state).
      num_tokens: tokens of `<s> + prompt + answer` (the context a model holds when it has
        read the last answer digit); a training row adds `</s>`.
      num_facts: facts in the document, 1..8 (`MAX_FACTS`).

    Returns:
      Example(prompt, answer, meta); `meta.facts[meta.asked].code` spaced out is the answer.

    Raises:
      ValueError: `num_facts` out of range, or `num_tokens` < `min_tokens(num_facts)`.
    """
    if not 1 <= num_facts <= MAX_FACTS:
        raise ValueError(f"{num_facts=} must be in 1..{MAX_FACTS}")
    if num_tokens < min_tokens(num_facts):
        raise ValueError(
            f"{num_tokens=} is too short for {num_facts} facts; need >= {min_tokens(num_facts)}"
        )
    n_filler = num_tokens - min_tokens(num_facts)
    words, starts = _filler_words(rng, n_filler)
    # A window that ends at a sentence end: drop the excess from the front.
    cut = len(words) - n_filler
    words = words[cut:]
    bounds = [0] + [s - cut for s in starts if s - cut > 0] + ([n_filler] if n_filler else [])
    bounds = sorted(set(bounds))
    names = [NAMES[i] for i in rng.choice(len(NAMES), size=num_facts, replace=False)]
    codes = ["".join(str(d) for d in rng.integers(0, 10, size=CODE_LEN)) for _ in names]
    slots = sorted(int(bounds[int(rng.integers(len(bounds)))]) for _ in names)
    asked_name = names[int(rng.integers(num_facts))]

    out: list[str] = []
    facts: list[Fact] = []
    prev = 0
    for slot, name, code in zip(slots, names, codes, strict=True):
        out += words[prev:slot]
        prev = slot
        facts.append(Fact(name=name, code=code, position=1 + len(out), depth=0.0))
        out += [*_prefix(name), *code, "."]
    out += words[prev:]
    out += question_words(asked_name)
    prompt_len = 1 + len(out)
    facts = [dataclasses.replace(f, depth=f.position / prompt_len) for f in facts]
    asked = next(i for i, f in enumerate(facts) if f.name == asked_name)
    if prompt_len + CODE_LEN != num_tokens:  # a bug in the lengths above
        raise RuntimeError(f"made {prompt_len + CODE_LEN} tokens, not {num_tokens=}")
    answer = " ".join(facts[asked].code)
    meta = ExampleMeta(facts=tuple(facts), asked=asked, num_tokens=prompt_len + CODE_LEN)
    return Example(prompt=" ".join(out), answer=answer, meta=meta)


def split_examples(
    seed: int, n: int, num_tokens: int, num_facts: int
) -> list[tuple[str, str, str]]:
    """`n` held-out haystacks as (context, question, answer): each prompt cut at its last
    `Question :`, so the context can be compressed before the question is seen.

    Args:
      seed: seeds `numpy.random.default_rng`.
      n, num_tokens, num_facts: count, prompt length and facts of each `make_example`.
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ex = make_example(rng, num_tokens, num_facts)
        head, _, tail = ex.prompt.rpartition("Question :")
        out.append((head.strip(), "Question :" + tail, ex.answer))
    return out


# ------------------------------------------------------------------------------------- batch
class Batch(NamedTuple):
    tokens: np.ndarray  # [B, T + 1] int32: <s> document (</s>); inputs [:, :-1], targets [:, 1:]
    weights: np.ndarray  # [B, T] float32 loss weight of each target
    answer_mask: np.ndarray  # [B, T] bool: targets that are answer digits (5 per haystack row)


def make_batch(
    rng: np.random.Generator,
    batch_size: int,
    seq_len: int,
    *,
    min_facts: int = 1,
    max_facts: int = MAX_FACTS,
    filler_fraction: float = 0.0,
    recall_fraction: float = 0.0,
    answer_weight: float = 21.0,
) -> Batch:
    """A training batch: haystack rows (and plain filler rows) of `seq_len` input tokens.

    Every target gets weight 1 except the 5 answer digits and the `</s>` after them, which get
    `answer_weight` (they are a handful of tokens among hundreds, and the point of the task).

    Args:
      rng: the random source.
      batch_size: rows B.
      seq_len: input tokens T per row (a haystack row is `make_example(rng, T, n)` + `</s>`).
      min_facts, max_facts: each haystack row draws its number of facts uniformly from this range.
      filler_fraction: probability that a row is plain filler (`<s>` + T filler tokens).
      recall_fraction: probability that a haystack row ends, instead of the question, with
        filler and then the asked fact's prefix alone (`... The code for Alice` + the code):
        the bare induction copy, without the question's words. Same length and answer
        positions.
      answer_weight: loss weight of the answer digits and the `</s>` target.

    Returns:
      Batch(tokens [B, T+1] int32, weights [B, T] float32, answer_mask [B, T] bool).

    Raises:
      ValueError: a bad size, fact range or fraction.
    """
    if batch_size < 1:
        raise ValueError(f"{batch_size=} must be >= 1")
    if not 1 <= min_facts <= max_facts <= MAX_FACTS:
        raise ValueError(f"{min_facts=}, {max_facts=} must satisfy 1 <= min <= max <= {MAX_FACTS}")
    if seq_len < min_tokens(max_facts):
        raise ValueError(f"{seq_len=} is too short for {max_facts} facts")
    for name, value in (("filler_fraction", filler_fraction), ("recall_fraction", recall_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1]")
    tokens = np.empty((batch_size, seq_len + 1), np.int32)
    weights = np.ones((batch_size, seq_len), np.float32)
    answer_mask = np.zeros((batch_size, seq_len), bool)
    for row in range(batch_size):
        if rng.random() < filler_fraction:
            tokens[row] = [BOS_ID] + encode(make_filler(rng, seq_len))
            continue
        n = int(rng.integers(min_facts, max_facts + 1))
        ex = make_example(rng, seq_len, n)
        prompt = ex.prompt
        if recall_fraction and rng.random() < recall_fraction:
            name = ex.meta.facts[ex.meta.asked].name
            restated = _prefix(name)
            filler = make_filler(rng, QUESTION_TOKENS - len(restated)).split()
            prompt = " ".join(prompt.split()[:-QUESTION_TOKENS] + filler + restated)
        tokens[row] = [BOS_ID] + encode(prompt) + encode(ex.answer) + [EOS_ID]
        # Targets at t predict token t + 1: the answer digits are tokens T-5..T-1, `</s>` is T.
        answer_mask[row, seq_len - CODE_LEN - 1 : seq_len - 1] = True
        weights[row, seq_len - CODE_LEN - 1 :] = answer_weight
    return Batch(tokens=tokens, weights=weights, answer_mask=answer_mask)
