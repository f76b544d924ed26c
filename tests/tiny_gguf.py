"""Tiny GGUF files written with the `gguf` package's own writer from tiny random Hugging Face
checkpoints (tests/tiny_hf.py): the tensors renamed by gguf's own name map, Q and K permuted as
llama.cpp's convert_hf_to_gguf.py does, each tensor in the type asked, and a byte-level BPE
tokenizer trained here on English text that ships with Python (pydoc's topics,
`jkv.demo.real_text`).

Test fixture module (imported as `tiny_gguf`); imports gguf, torch and tokenizers lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

from jkv.demo.real_text import english_text

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_VOCAB = 384  # 256 bytes + 3 specials + 125 merges
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# tiny_hf kind -> general.architecture (llama.cpp writes Mistral models as "llama")
GGUF_ARCH = {"llama": "llama", "llama_tied": "llama", "mistral": "llama", "qwen2": "qwen2"}


def bpe_tokenizer(vocab_size: int = BPE_VOCAB):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `english_text`, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([english_text(60_000)], trainer)
    return tok


def permute(w, n_head: int):
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), HF layout -> GGUF layout."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(
    path: str | Path,
    hf_folder: str | Path,
    kind: str = "llama",
    *,
    qtypes: dict[str, str] | None = None,
    default_qtype: str = "F32",
    skip: tuple[str, ...] = (),
    architecture: str | None = None,
    pre: str = "gpt2",
    tokenizer=None,
    tokenizer_model: str = "gpt2",
    extra: tuple[str, ...] = (),
) -> Path:
    """Writes the HF checkpoint in `hf_folder` (a tiny_hf one with a BPE_VOCAB vocabulary) as
    the GGUF file `path`.

    qtypes: GGUF tensor name suffix (e.g. "attn_q.weight", "token_embd.weight") -> GGML type
    name ("F32", "F16", "Q8_0", "Q4_1", ...); other tensors get `default_qtype` (norms stay F32,
    as llama.cpp keeps 1-D tensors). `skip`: GGUF names left out; `architecture`: written as
    general.architecture instead of the kind's; `tokenizer_model`: tokenizer.ggml.model;
    `extra`: names of extra F32 tensors written (e.g. "rope_freqs.weight", [head_dim / 2] ones).
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hf_folder, path = Path(hf_folder), Path(path)
    cfg = json.loads((hf_folder / "config.json").read_text())
    arch = GGUF_ARCH[kind]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tok = tokenizer or bpe_tokenizer(cfg["vocab_size"])
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    writer.add_name(f"tiny-{kind}")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    table = gguf.MODEL_ARCH.QWEN2 if arch == "qwen2" else gguf.MODEL_ARCH.LLAMA
    names = gguf.get_tensor_name_map(table, cfg["num_hidden_layers"])
    for hf_name, w in load_file(str(hf_folder / "model.safetensors")).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        if name in skip:
            continue
        w = w.astype(np.float32)
        if arch == "llama" and ("attn_q." in name or "attn_k." in name):
            w = permute(w, n_head if "attn_q." in name else n_kv)
        qtype = default_qtype if w.ndim > 1 else "F32"
        for suffix, q in (qtypes or {}).items():
            if name.endswith(suffix):
                qtype = q
        if qtype == "I32":  # a type no float weight is stored in: for the loader's error
            writer.add_tensor(name, w.astype(np.int32))
            continue
        q = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, gguf.quants.quantize(w, q), raw_dtype=q)
    for name in extra:
        writer.add_tensor(name, np.ones(cfg["hidden_size"] // n_head // 2, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_chat_case(tmp_path: Path):
    """A tiny GGUF chat model (ChatML) loaded by jkv, the same weights in transformers, and a
    chat prompt: (params, HF model, the chat's prefix ids, the prompt's ids: the prefix and
    two sentences with a magic number)."""
    import quality_kvpress as qk
    from tiny_hf import write_tiny_checkpoint

    import jkv
    from jkv.replay import chat_frame

    src = write_tiny_checkpoint(tmp_path / "src", "llama", vocab_size=BPE_VOCAB)
    params = jkv.load(write_tiny_gguf(tmp_path / "m.gguf", src, "llama"))
    model, _ = qk.load_hf(jkv.export_hf(params, tmp_path / "hf"), attn_implementation="sdpa")
    prefix, _ = chat_frame(params)
    body = params.tokenizer.encode(" Magic numbers hide in text, 41729 among them." * 2,
                                   add_special_tokens=False)  # fmt: skip
    return params, model, prefix, prefix + body
