"""jkv.output: incremental detokenisation and stop strings, against whole-text decoding.

References are independent: `tokenizer.decode` of the whole id list (what the text must equal)
and a brute-force stop search over every prefix of the ids (the fewest tokens whose text holds
a stop string). Three tokenizers: the demo's word-level one, a byte-level BPE (multi-byte
characters split across tokens) and a Metaspace BPE (sentencepiece-style leading spaces).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jkv.demo.tokenizer import build_tokenizer
from jkv.output import Detokenizer, RowOutput
from jkv.tokenizer import Tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, ça coûte 5 € — naïve café déjà vu",
    "日本語のテキストと emoji 🙂 mixed with ascii words",
    "stop here STOP now ### end of the line",
] * 20


def _bpe(kind: str) -> Tokenizer:
    tok = HFTokenizer(models.BPE(unk_token=None, byte_fallback=False))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = sorted(set("".join(CORPUS)) | {"▁"})
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return Tokenizer(tok)


TOKENIZERS = {
    "demo": lambda: Tokenizer(build_tokenizer()),
    "bytelevel": lambda: _bpe("bytelevel"),
    "metaspace": lambda: _bpe("metaspace"),
}
TEXTS = {
    "demo": "Question : what is the code for Alice ? The code for Alice is 4 0 9 1 7 .",
    "bytelevel": CORPUS[1] + " " + CORPUS[2],
    "metaspace": CORPUS[0] + " " + CORPUS[1],
}


class Counting:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.inner.decode(ids)


@pytest.fixture(params=sorted(TOKENIZERS))
def tok(request):
    return request.param, TOKENIZERS[request.param]()


def test_text_equals_decoding_the_whole_list_at_every_complete_step(tok):
    name, tokenizer = tok
    ids = tokenizer.encode(TEXTS[name], add_special_tokens=False)
    d = Detokenizer(tokenizer)
    pieces = [d.push(t) for t in ids]
    assert d.text == "".join(pieces) == tokenizer.decode(ids)
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n])
        if not full.endswith("\ufffd"):  # a partial character waits for the next token
            assert d.text[: d.ends[n - 1]] == full, n


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel alphabet spells bytes in."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def test_a_split_character_waits_for_its_last_byte():
    tokenizer = TOKENIZERS["bytelevel"]()
    chars = _byte_chars()
    ids = tokenizer.encode("ab ", add_special_tokens=False)
    n0 = len(ids)
    ids += [tokenizer.token_to_id(chars[b]) for b in "€".encode()]  # one token per byte
    ids += tokenizer.encode(" cd", add_special_tokens=False)
    d = Detokenizer(tokenizer)
    pieces = [d.push(t) for t in ids]
    assert d.text == tokenizer.decode(ids) == "ab € cd"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[n0] == pieces[n0 + 1] == "" and "€" in pieces[n0 + 2]  # whole, at its last byte


def test_each_token_decodes_a_short_window_not_the_whole_text():
    tokenizer = TOKENIZERS["demo"]()
    ids = tokenizer.encode(" ".join([TEXTS["demo"]] * 20), add_special_tokens=False)
    counting = Counting(tokenizer)
    d = Detokenizer(counting)
    for t in ids:
        d.push(t)
    assert d.text == tokenizer.decode(ids)
    # Whole-text decoding per token would decode n(n+1)/2 ids; the window decodes ~3 per token.
    assert counting.decoded <= 4 * len(ids), (counting.decoded, len(ids))


def _first_stop(tokenizer, ids, stop):
    """Brute force: the fewest tokens whose text holds a stop string, and where the first stop
    string starts in that text."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        found = [text.find(s) for s in stop if s in text]
        if found:
            return min(found), n
    return None


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_match_a_brute_force_search(tok, seed):
    name, tokenizer = tok
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXTS[name], add_special_tokens=False)
    text = tokenizer.decode(ids)
    stops = []
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(text) - 1)
        stops.append(text[i : i + rng.randint(1, 6)])
    if rng.random() < 0.3:
        stops.append("never in the text ~~~")
    stops = tuple(s for s in stops if s)
    want = _first_stop(tokenizer, ids, stops)
    row = RowOutput(tokenizer, stops)
    for t in ids:  # token by token, as a stream sees them
        row.push([t])
        if row.hit is not None:
            break
    assert row.hit == want, (stops, row.hit, want)
    if want is not None:
        assert row.text == tokenizer.decode(ids[: want[1]])[: want[0]]
        assert not any(s in row.text for s in stops)


def test_stop_found_across_pushes_of_several_tokens():
    tokenizer = TOKENIZERS["demo"]()
    ids = tokenizer.encode(TEXTS["demo"], add_special_tokens=False)
    stops = ("code for Alice is",)
    want = _first_stop(tokenizer, ids, stops)
    for chunk in (1, 2, 3, 5, 16):
        row = RowOutput(tokenizer, stops)
        for i in range(0, len(ids), chunk):
            row.push(ids[i : i + chunk])
            if row.hit:
                break
        assert row.hit == want, chunk


def test_settled_text_holds_back_what_a_stop_string_may_still_take():
    tokenizer = TOKENIZERS["demo"]()
    row = RowOutput(tokenizer, ("Alice ? The",))
    ids = tokenizer.encode("what is the code for Alice ? The", add_special_tokens=False)
    shown = []
    for t in ids:
        row.push([t])
        shown.append(row.settled())
    assert row.hit is not None and row.text == "what is the code for "
    assert all(row.text.startswith(s) or s.startswith(row.text) for s in shown)
    assert all("Alice ? The" not in s for s in shown)
