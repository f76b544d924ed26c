"""The demo model's tokenizer: a word-level `tokenizers` model over the haystack vocabulary.

Ids are `jkv.demo.haystack.VOCAB` indices (`<unk>`=0, `<s>`=1, `</s>`=2), so the training data,
encoded without the tokenizers library, and `tokenizer.json` agree by construction (a test checks).
Splitting: on whitespace and punctuation (`Question:` -> `Question`, `:`), and every digit apart
(`40917` -> `4 0 9 1 7`). Decoding joins tokens with single spaces (the haystack's canonical
text); encoding adds `<s>` in front.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel

from jkv.demo import haystack


def build_tokenizer():
    """The demo tokenizer as a `tokenizers.Tokenizer`.

    Returns:
      a tokenizers.Tokenizer (word-level, vocab `haystack.VOCAB`).
    """
    vocab = {word: i for i, word in enumerate(haystack.VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    # WordPiece without cleanup joins words with single spaces (no token starts with "##").
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", haystack.BOS_ID)]
    )
    tok.add_special_tokens(list(haystack.SPECIALS))
    return tok


def save_tokenizer(path: str | Path) -> Path:
    """Writes the demo `tokenizer.json` to `path` (a file path).

    Returns:
      the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(build_tokenizer().to_str())
    return path
