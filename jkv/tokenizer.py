"""Text <-> token ids through a Hugging Face `tokenizer.json` (the `tokenizers` library), and the
model's chat template (a Jinja string, rendered by `jkv.chat`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids generation needs.

    Hashed by identity, so it can ride as static data in the params pytree. `chat_template` is
    the model's Jinja chat template (None: the model has none; `jkv.chat` then uses its default).
    """

    def __init__(
        self,
        inner,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        source: str = "<memory>",
        chat_template: str | None = None,
    ):
        self.inner = inner
        self.source = source
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template

    @classmethod
    def from_file(cls, path: str | Path, **kwargs) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: no such file; expected a tokenizers tokenizer.json")
        try:
            inner = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust error says little; name the file
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
        return cls(inner, source=str(path), **kwargs)

    @classmethod
    def from_folder(cls, folder: str | Path, **kwargs) -> Tokenizer | None:
        """The folder's `tokenizer.json` with its chat template (`read_chat_template`); None
        when the folder has no tokenizer.json."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            return None
        template = read_chat_template(folder)
        return cls.from_file(folder / "tokenizer.json", chat_template=template, **kwargs)

    def to_str(self) -> str:
        return self.inner.to_str()

    def save(self, path: str | Path) -> None:
        """Writes tokenizer.json at `path`, and the chat template beside it as
        `chat_template.jinja` (where transformers 5 keeps it) when there is one."""
        path = Path(path)
        path.write_text(self.inner.to_str())
        if self.chat_template is not None:
            (path.parent / CHAT_TEMPLATE_FILE).write_text(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(int(token_id))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text={text!r} must be a str")
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self.inner.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Turns a growing list of token ids into new text pieces.

    Decodes the whole list each time and emits the new suffix, holding back text that ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD) until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        piece, self.emitted = text[len(self.emitted) :], text
        return piece


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def read_chat_template(folder: Path) -> str | None:
    """A model folder's chat template: `tokenizer_config.json`'s `chat_template` (a string, or
    the one named "default" of a list), else `chat_template.jinja`; None when neither has one."""
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text()).get("chat_template")
        except json.JSONDecodeError as e:
            raise ValueError(f"{config}: not valid JSON ({e})") from None
        if isinstance(template, list):  # named templates: the default one
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        if isinstance(template, str):
            return template
    jinja = folder / CHAT_TEMPLATE_FILE
    return jinja.read_text() if jinja.is_file() else None


def read_special_ids(folder: Path) -> tuple[int | None, tuple[int, ...]]:
    """bos and eos ids from `generation_config.json`, else `config.json` (either may be absent)."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if "eos_token_id" in data or "bos_token_id" in data:
            eos = data.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            return data.get("bos_token_id"), tuple(int(e) for e in eos_ids)
    return None, ()
