"""A GGUF file's tokenizer metadata -> a `tokenizers.Tokenizer` (byte-level BPE).

GGUF keeps a byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2": GPT-2, SmolLM, Llama 3,
Qwen2) as its vocabulary (`tokens`, id = index), `merges` ("a b", by rank), each token's type
(`token_type`: 3 control and 4 user-defined tokens are matched whole in the text, as llama.cpp
does; control tokens are special, so decoding skips them) and the name of its pre-tokenizer
(`tokenizer.ggml.pre`), whose splitting rules llama.cpp keeps in code: `PRE_TOKENIZERS` holds
those of the tokenizers jkv reads, as `tokenizers` pre-tokenizers.
"""

from __future__ import annotations

# llama.cpp's llama-vocab.cpp regexes (LLAMA_VOCAB_PRE_TYPE_LLAMA3, _QWEN2)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (a regex split before the byte-level step or None, digits one by one)
PRE_TOKENIZERS = {
    "default": (None, False),  # GPT-2's own regex, inside ByteLevel
    "gpt2": (None, False),
    "smollm": (None, True),  # SmolLM / SmolLM2: each digit alone, then GPT-2's regex
    "llama-bpe": (_LLAMA3, False),
    "llama3": (_LLAMA3, False),
    "qwen2": (_QWEN2, False),
}
CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType


def _pre_tokenizer(meta: dict, source: str):
    from tokenizers import Regex, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{source}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer jkv knows; expected "
            f"one of {sorted(PRE_TOKENIZERS)}"
        )
    regex, digits = PRE_TOKENIZERS[pre]
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if regex is not None:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=regex is None))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def build_tokenizer(meta: dict, source: str):
    """The `tokenizers.Tokenizer` a GGUF file's metadata describes.

    Raises:
      ValueError: naming the file and the field: a tokenizer model other than byte-level BPE,
        an unknown pre-tokenizer, a malformed merge, or token types that do not match the
        vocabulary.
    """
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported; expected 'gpt2' "
            "(byte-level BPE)"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = []
    for i, merge in enumerate(meta.get("tokenizer.ggml.merges", [])):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{source}: tokenizer.ggml.merges[{i}]={merge!r} is not 'a b'")
        merges.append((parts[0], parts[1]))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta, source)
    tok.decoder = decoders.ByteLevel()
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], int(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = {int(meta[k]) for k in meta if k.startswith("tokenizer.ggml.") and
                k.endswith("_token_id")}  # fmt: skip
    added = [
        AddedToken(tokens[i], special=t == CONTROL or i in specials, normalized=False)
        for i, t in enumerate(types)
        if t in (CONTROL, USER_DEFINED) or i in specials
    ]
    tok.add_tokens(added)
    return tok
