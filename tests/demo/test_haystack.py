"""The demo task's generator and tokenizer: facts present, exact lengths, determinism, masks."""

from __future__ import annotations

import numpy as np
import pytest

from jkv.demo import haystack
from jkv.demo import tokenizer as demo_tokenizer

CASES = [(64, 1), (64, 2), (128, 4), (128, 8), (256, 8), (512, 3), (1024, 8)]


def _spaced(code: str) -> str:
    return " ".join(code)


@pytest.mark.parametrize("num_tokens,num_facts", CASES, ids=[f"T={t}_facts={n}" for t, n in CASES])
def test_example_has_every_fact_and_exact_length(num_tokens, num_facts):
    rng = np.random.default_rng(num_tokens * 10 + num_facts)
    for _ in range(20):
        ex = haystack.make_example(rng, num_tokens, num_facts)
        words = ex.prompt.split()
        assert 1 + len(words) + len(ex.answer.split()) == num_tokens == ex.meta.num_tokens
        assert len(ex.meta.facts) == num_facts
        assert len({f.name for f in ex.meta.facts}) == num_facts
        for fact in ex.meta.facts:
            sentence = f"The code for {fact.name} {_spaced(fact.code)} ."
            assert ex.prompt.count(sentence) == 1
            # position counts <s>: words[position - 1] is the fact's first word.
            assert words[fact.position - 1 : fact.position - 1 + haystack.FACT_TOKENS] == (
                sentence.split()
            )
            assert 0.0 < fact.depth < 1.0
        asked = ex.meta.facts[ex.meta.asked]
        assert ex.answer == _spaced(asked.code)
        assert ex.prompt.endswith(
            f"Question : what is the code for {asked.name} ? The code for {asked.name}"
        )
        assert [f.position for f in ex.meta.facts] == sorted(f.position for f in ex.meta.facts)


@pytest.mark.parametrize("num_facts", range(1, haystack.MAX_FACTS + 1))
def test_the_asked_fact_is_in_the_document(num_facts):
    """The document before the question holds the asked fact, whole and once (a generator that
    cut facts off made training plateau), and names it nowhere else; at every length."""
    rng = np.random.default_rng(100 + num_facts)
    for num_tokens in (haystack.min_tokens(num_facts), 64, 128, 256, 512):
        if num_tokens < haystack.min_tokens(num_facts):
            continue
        for _ in range(10):
            ex = haystack.make_example(rng, num_tokens, num_facts)
            document, _, question = ex.prompt.rpartition(" Question : ")
            asked = ex.meta.facts[ex.meta.asked]
            fact = f"The code for {asked.name} {ex.answer} ."
            assert document.count(fact) == 1 and document.split().count(asked.name) == 1
            assert question.split().count(asked.name) == 2 and "Question" not in document
            # the question ends with the fact's first 4 words, and the answer follows both
            assert question.split()[-4:] == fact.split()[:4]
            assert len(document.split()) == (
                num_tokens - 1 - haystack.QUESTION_TOKENS - haystack.CODE_LEN
            )


def test_batch_rows_ask_about_a_fact_of_their_document():
    for seq_len, lo, hi in ((64, 1, 2), (128, 1, 8), (512, 4, 8)):
        batch = haystack.make_batch(
            np.random.default_rng(seq_len), 8, seq_len, min_facts=lo, max_facts=hi
        )
        for row, mask in zip(batch.tokens, batch.answer_mask, strict=True):
            prompt = haystack.decode(row[: -haystack.CODE_LEN - 1])  # without answer and </s>
            answer = haystack.decode(row[1:][mask])
            document, _, question = prompt.rpartition(" Question : ")
            name = question.split()[-1]
            assert f"The code for {name} {answer} ." in document


def test_facts_spread_over_depths():
    rng = np.random.default_rng(0)
    depths = [f.depth for _ in range(200) for f in haystack.make_example(rng, 512, 2).meta.facts]
    assert min(depths) < 0.1 and max(depths) > 0.85
    asked = [haystack.make_example(rng, 256, 4).meta.asked for _ in range(200)]
    assert set(asked) == {0, 1, 2, 3}


def test_determinism_for_a_seed():
    a = haystack.make_example(np.random.default_rng(7), 256, 5)
    b = haystack.make_example(np.random.default_rng(7), 256, 5)
    c = haystack.make_example(np.random.default_rng(8), 256, 5)
    assert a == b and a != c
    ba = haystack.make_batch(np.random.default_rng(3), 4, 128, filler_fraction=0.5)
    bb = haystack.make_batch(np.random.default_rng(3), 4, 128, filler_fraction=0.5)
    for x, y in zip(ba, bb, strict=True):
        np.testing.assert_array_equal(x, y)


def test_filler_length_and_words():
    rng = np.random.default_rng(1)
    for n in (1, 7, 100, 600):
        text = haystack.make_filler(rng, n)
        assert len(text.split()) == n
        assert haystack.UNK_ID not in haystack.encode(text)
        assert "code" not in text.split() and "Question" not in text.split()


def test_tokenizer_round_trips_generated_text():
    tok = demo_tokenizer.build_tokenizer()
    assert tok.get_vocab_size() == len(haystack.VOCAB)
    assert [tok.token_to_id(s) for s in haystack.SPECIALS] == [0, 1, 2]
    rng = np.random.default_rng(2)
    for n in (1, 4, 8):
        ex = haystack.make_example(rng, 256, n)
        text = f"{ex.prompt} {ex.answer}"
        ids = tok.encode(text).ids
        assert ids == [haystack.BOS_ID] + haystack.encode(text)
        assert haystack.UNK_ID not in ids
        assert tok.decode(ids) == text
    filler = haystack.make_filler(rng, 300)
    assert tok.decode(tok.encode(filler).ids) == filler


def test_tokenizer_splits_typed_text_like_the_canonical_form():
    tok = demo_tokenizer.build_tokenizer()
    typed = "The code for Alice 40917. Question: what is the code for Alice? The code for Alice"
    canonical = (
        "The code for Alice 4 0 9 1 7 . Question : what is the code for Alice ? The code for Alice"
    )
    assert tok.encode(typed).ids == tok.encode(canonical).ids
    assert " ".join(typed.split()) != canonical  # only the canonical form round-trips exactly
    assert tok.decode(tok.encode(typed).ids) == canonical


def test_saved_tokenizer_loads(tmp_path):
    from tokenizers import Tokenizer

    path = demo_tokenizer.save_tokenizer(tmp_path / "tokenizer.json")
    loaded = Tokenizer.from_file(str(path))
    assert (
        loaded.encode("A dog slept .").ids
        == demo_tokenizer.build_tokenizer().encode("A dog slept .").ids
    )


def test_batch_loss_mask_marks_the_answer_digits():
    rng = np.random.default_rng(4)
    t, weight = 128, 21.0
    batch = haystack.make_batch(rng, 16, t, filler_fraction=0.3, answer_weight=weight)
    assert batch.tokens.shape == (16, t + 1) and batch.tokens.dtype == np.int32
    assert batch.weights.shape == batch.answer_mask.shape == (16, t)
    targets = batch.tokens[:, 1:]
    digit_ids = {haystack.encode(d)[0] for d in haystack.DIGITS}
    haystack_rows = batch.answer_mask.any(axis=1)
    assert 0 < haystack_rows.sum() < 16  # both kinds of row at this fraction and seed
    for row in range(16):
        if not haystack_rows[row]:
            np.testing.assert_array_equal(batch.weights[row], 1.0)
            continue
        mask = batch.answer_mask[row]
        assert mask.sum() == haystack.CODE_LEN
        assert all(int(x) in digit_ids for x in targets[row][mask])
        # the masked targets are the answer, i.e. the code of the fact the question names
        text = haystack.decode(batch.tokens[row])
        name = text.split(" Question : what is the code for ")[1].split()[0]
        code = text.split(f"The code for {name} ")[1].split(" .")[0]
        assert haystack.decode(targets[row][mask]) == code
        assert targets[row, -1] == haystack.EOS_ID
        np.testing.assert_array_equal(batch.weights[row][mask], weight)
        assert batch.weights[row, -1] == weight  # </s> after the digits
        assert batch.weights[row, : -haystack.CODE_LEN - 1].max() == 1.0


@pytest.mark.parametrize(
    "call",
    [
        lambda rng: haystack.make_example(rng, 64, 0),
        lambda rng: haystack.make_example(rng, 64, 9),
        lambda rng: haystack.make_example(rng, haystack.min_tokens(3) - 1, 3),
        lambda rng: haystack.make_filler(rng, 0),
        lambda rng: haystack.make_batch(rng, 0, 64, max_facts=2),
        lambda rng: haystack.make_batch(rng, 2, 64, max_facts=8),
        lambda rng: haystack.make_batch(rng, 2, 128, filler_fraction=1.5),
    ],
    ids=["facts=0", "facts=9", "too_short", "filler=0", "batch=0", "T_too_short", "fraction"],
)
def test_bad_arguments_raise(call):
    with pytest.raises(ValueError, match="="):
        call(np.random.default_rng(0))


def test_shortest_example_fits():
    ex = haystack.make_example(np.random.default_rng(0), haystack.min_tokens(8), 8)
    assert ex.prompt.startswith("The code for ")


def test_recall_rows_restate_the_asked_fact():
    rng = np.random.default_rng(5)
    batch = haystack.make_batch(rng, 32, 96, min_facts=2, max_facts=4, recall_fraction=0.5)
    recalls = 0
    for row, mask in zip(batch.tokens, batch.answer_mask, strict=True):
        words = haystack.decode(row[1:-1]).split()
        answer = words[-5:]
        assert mask.sum() == haystack.CODE_LEN and row[-1] == haystack.EOS_ID
        if "Question" in words:
            continue
        recalls += 1
        name = words[-6]
        assert words[-9:-5] == ["The", "code", "for", name]
        # the restated fact is the document's fact about that name, with the same code
        first = words.index(name)
        assert words[first + 1 : first + 6] == answer
    assert 0 < recalls < 32
    with pytest.raises(ValueError, match="recall_fraction"):
        haystack.make_batch(rng, 2, 96, max_facts=2, recall_fraction=1.5)
