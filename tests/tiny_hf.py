"""Tiny randomly initialised Hugging Face checkpoints, written with `transformers` (never downloaded).

A test fixture module (tests import it as `tiny_hf`; `benchmarks/decode_cpu.py` and
`benchmarks/kv_memory.py` put `tests/` on `sys.path` for it): tests use the checkpoints as
reference models. Imports torch and transformers lazily: only callers that write checkpoints
need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORDS = 125  # vocab = 3 specials + WORDS words "w0".."w124"

KINDS: dict[str, dict[str, Any]] = {
    # GQA (4 query heads on 2 kv heads) and Llama-3 rope scaling
    "llama": dict(
        arch="LlamaForCausalLM",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_tied": dict(arch="LlamaForCausalLM", tie_word_embeddings=True),
    "mistral": dict(arch="MistralForCausalLM", sliding_window=16),
    "qwen2": dict(arch="Qwen2ForCausalLM", tie_word_embeddings=False),
}


def word_tokenizer(words: int = WORDS):
    """A word-level `tokenizers` tokenizer: <unk>=0, <s>=1, </s>=2, then "w0".."w{words-1}"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def write_tiny_checkpoint(
    folder: str | Path,
    kind: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    initializer_range: float = 0.1,
    vocab_size: int = WORDS + 3,
    eos: bool = False,
    **overrides,
) -> Path:
    """Writes `config.json`, `model.safetensors` (float32), `tokenizer.json` and
    `generation_config.json` of a random model of `kind` (see KINDS) into `folder`.

    `eos=False` leaves the eos id unset so greedy runs always reach max_new_tokens. A
    `vocab_size` above the tokenizer's (benchmarks: 32000) leaves the extra ids without text.
    """
    import torch
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is unknown; expected one of {sorted(KINDS)}")
    spec = dict(KINDS[kind])
    arch = spec.pop("arch")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, arch)
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2 if eos else None,
        pad_token_id=0,
        **{**spec, **overrides},
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    word_tokenizer().save(str(folder / "tokenizer.json"))
    return folder
