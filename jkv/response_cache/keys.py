"""Canonical cache keys: what makes two requests "the same request".

Key format::

    llm:response:{<model_name>:<bucket>}:<generation>:<sha256 hex>

The braces are part of the key. In Redis Cluster a `{...}` substring is a hash tag: only the
text inside it is hashed to pick the slot. One tag per model would put all of a model's keys
on one primary, so the tag also holds a bucket, the digest's first byte modulo `BUCKETS`
(two hex digits, 00-3f): a model's responses spread over 64 slots, hence over every primary,
while an entry and what must change with it (its group set, its lease) share one slot and
may share a MULTI. The generation counter, `llm:gen:{<model_name>}`, is one key per model.
A single server keeps the same keys (one code path); the bucket costs it nothing.

`<generation>` is the model's invalidation counter (see `invalidation.py`): bumping it makes
every older key unreachable at once, before the old keys are deleted in the background.

The SHA-256 covers, in a versioned framing (`KEY_SCHEMA`):

1. a header, canonical JSON (sorted keys, no spaces, UTF-8) of
   `["jkv-key", KEY_SCHEMA, namespace, model_version, settings]`;
2. the prompt as the model reads it: a token-id sequence as little-endian int64, or a str's
   exact UTF-8 (whitespace included: a byte-level tokenizer reads "a\n\nb" and "a b" as
   different tokens, so their answers differ). Only a cache built with
   `normalize_whitespace=True` hashes a str whitespace-normalised (the seed's canonical hash:
   trim, newlines to spaces, every run of whitespace to one space; Python's `str.split`
   defines whitespace), for a caller whose model cannot see the difference. The three forms
   never equal each other. jkv's own callers (`jkv.generate`, `jkv.stream`, `jkv serve`) pass
   token ids: whitespace variants then share a key exactly when the tokenizer gives them the
   same ids (the demo's word-level tokenizer does; a byte-level BPE never does).

The header is length-prefixed, so no choice of prompt can imitate another header.

Settings rules (the caller passes fully resolved settings, as `jkv.generate` does):

- Every entry counts; nested dicts (e.g. KV policy parameters) are sorted too.
- `1` and `1.0` are DIFFERENT keys (JSON keeps the int/float distinction; a float is written
  as its shortest round-trip repr). Only a needless miss can come of it, never a wrong hit.
- `True` differs from `1`; a tuple equals the list with the same items.
- `None` is a value: `{"top_k": None}` differs from `{}` (absent). Pass resolved settings.
- Allowed values: None, bool, int, finite float, str, list/tuple of these, dict with str keys
  of these; numpy scalars are taken by `.item()`. Anything else raises ValueError.

Settings are best passed as a `Settings` object, built once per distinct settings: it is
validated and canonically encoded at construction, so a lookup only hashes the prompt. A plain
mapping works too; it is packed with msgpack to find its `Settings` in a memo.

Model names: 1-128 characters from `A-Z a-z 0-9 . _ - / + @`, starting with a letter or a
digit. Excluded are `{`, `}` (hash tag), `:` (field separator), glob characters `* ? [ ] \\`
(the invalidation SCAN uses the name in a MATCH pattern) and whitespace. `derive_model_name`
turns any text (a folder's name) into a valid name.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import threading
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

KEY_SCHEMA = 2  # 2: a str prompt is hashed exactly unless normalisation is asked for
PREFIX = "llm:response:"
MAX_NAME = 128
_MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+@-]{0,127}")
_NAME_BREAKERS = re.compile(r"[^A-Za-z0-9._/+@-]+")
_NAME_EDGES = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")
_NAMESPACE_RE = re.compile(r"[^\x00-\x1f]{1,256}")
_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_SCALARS = (type(None), bool, int, str)
_MEMO_MAX = 4096

Prompt = str | Sequence[int]


def normalize_prompt(prompt: str) -> str:
    """Whitespace normalisation for keys: trim, newlines to spaces, runs to one space.

    Args:
        prompt: the raw prompt text.

    Returns:
        The normalised text.
    """
    return " ".join(prompt.split())


def check_model_name(model_name: Any) -> str:
    """Validates a model name for use inside keys and SCAN patterns.

    Args:
        model_name: the name, e.g. "llama-demo" or "meta-llama/Llama-3.2-1B".

    Returns:
        The same name.

    Raises:
        ValueError: the name is not a str of allowed characters (see the module docstring).
    """
    if not isinstance(model_name, str) or not _MODEL_NAME_RE.fullmatch(model_name):
        hint = f", e.g. {derive_model_name(model_name)!r}" if isinstance(model_name, str) else ""
        raise ValueError(
            f"model_name={model_name!r} must be 1-128 characters from A-Z a-z 0-9 . _ - / + @, "
            "starting with a letter or digit (no braces, colons, glob characters or spaces)" + hint
        )
    return model_name


def derive_model_name(text: str) -> str:
    """A valid model name made from any text, e.g. a folder's name ("demo copy" -> "demo-copy").

    Every run of characters a name may not hold becomes one "-"; the result starts and ends with
    a letter or digit and is cut to 128 characters; "model" when nothing is left. Two texts may
    give one name: that only shares an invalidation scope, since keys also hash the model's
    identity.

    Args:
        text: any str.

    Returns:
        A name `check_model_name` accepts.
    """
    name = _NAME_EDGES.sub("", _NAME_BREAKERS.sub("-", text))
    return _NAME_EDGES.sub("", name[:MAX_NAME]) or "model"


def check_namespace(namespace: Any) -> str:
    """Validates a tenant namespace (any non-empty printable str up to 256 characters).

    Raises:
        ValueError: not a str, empty, too long, or containing control characters.
    """
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(f"namespace={namespace!r} must be a non-empty printable str (<= 256)")
    return namespace


def check_model_version(model_version: Any) -> str:
    """Validates a model version (weights fingerprint): any str, may be empty."""
    if not isinstance(model_version, str):
        raise ValueError(f"model_version={model_version!r} must be a str (a weights fingerprint)")
    return model_version


def is_cacheable(settings: Mapping[str, Any]) -> bool:
    """Whether a request is deterministic, so that its answer may be reused.

    Deterministic means greedy (`temperature` present and 0, or `top_k` 1) or an explicit
    integer `seed`. An absent temperature is NOT taken as greedy: pass resolved settings.

    Args:
        settings: the generation settings.

    Returns:
        True when the response may be cached.
    """
    seed = settings.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return True
    if settings.get("top_k") == 1:
        return True
    t = settings.get("temperature")
    return t is not None and not isinstance(t, bool) and t == 0


def _canonical(value: Any, where: str) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}={value!r} must be a finite number")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has key {k!r}; setting keys must be str")
            out[k] = _canonical(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and getattr(value, "shape", None) == ():
        return _canonical(item(), where)
    raise ValueError(
        f"{where}={value!r} has type {type(value).__name__}; expected None, bool, int, float, "
        "str, list, tuple or dict with str keys"
    )


def canonical_header(namespace: str, model_version: str, settings: Mapping[str, Any]) -> bytes:
    """The versioned, canonical encoding of everything but the prompt.

    Args:
        namespace: the tenant.
        model_version: the model's identity (weights, tokenizer, config).
        settings: every setting that changes the output (a mapping or a `Settings`).

    Returns:
        Canonical JSON bytes.

    Raises:
        ValueError: a setting of an unsupported type, a non-str key, or NaN/inf.
    """
    canonical = settings.canonical if type(settings) is Settings else Settings(settings).canonical
    head = _JSON.encode(["jkv-key", KEY_SCHEMA, namespace, model_version])
    return head[:-1].encode("utf-8") + b"," + canonical + b"]"


class Settings(Mapping):
    """Resolved generation settings, validated and canonically encoded once.

    Build one per distinct settings and reuse it: lookups then skip the validation and the
    encoding. Read-only; equal to the mapping it was made from.

    Args:
        settings: a mapping of str to None, bool, int, finite float, str, list/tuple or dict.

    Attributes:
        canonical: the settings' canonical JSON (sorted keys, no spaces, UTF-8).
        cacheable: `is_cacheable(settings)`.

    Raises:
        ValueError: not a mapping, a non-str key, NaN/inf, or a value of another type.
    """

    __slots__ = ("_items", "canonical", "cacheable")

    def __init__(self, settings: Mapping[str, Any]) -> None:
        if not isinstance(settings, Mapping):
            raise ValueError(f"settings={settings!r} must be a mapping of str to values")
        self._items = dict(settings)
        self.canonical = _JSON.encode(_canonical(self._items, "settings")).encode("utf-8")
        self.cacheable = is_cacheable(self._items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Settings({self._items!r})"


class KeyHasher:
    """Computes request digests: one SHA-256 pass over the prompt.

    Everything but the prompt (namespace, model version, settings) is hashed once into a base
    state that each digest copies; bases are memoised by `(namespace, model_version,
    settings.canonical)`. A plain-mapping `settings` is first turned into a `Settings`,
    memoised by its msgpack bytes (msgpack keeps int, float, bool and str apart, so equal bytes
    mean equal settings; another dict order only costs a memo miss). Both memos are bounded
    and cleared when full (rare: it takes thousands of distinct settings).
    """

    def __init__(self, normalize_whitespace: bool = False) -> None:
        if not isinstance(normalize_whitespace, bool):
            raise ValueError(f"normalize_whitespace={normalize_whitespace!r} must be True or False")
        self.normalize_whitespace = normalize_whitespace
        self._bases: dict[tuple[str, str, bytes], tuple[Any, Any]] = {}
        self._settings: dict[bytes, Settings] = {}
        self._local = threading.local()

    def settings(self, settings: Mapping[str, Any]) -> Settings:
        """The `Settings` of a mapping (memoised).

        Raises:
            ValueError: as `Settings`.
        """
        if type(settings) is Settings:
            return settings
        packer = getattr(self._local, "packer", None)
        if packer is None:  # a Packer per thread: reusing one saves a third of packb's cost
            packer = self._local.packer = msgpack.Packer(use_bin_type=True)
        try:
            packed = packer.pack(settings)
        except (TypeError, ValueError, OverflowError):
            return Settings(settings)  # exotic values: validated (and refused) there
        found = self._settings.get(packed)
        if found is None:
            found = Settings(settings)
            if len(self._settings) >= _MEMO_MAX:
                self._settings.clear()
            self._settings[packed] = found
        return found

    def _base(self, namespace: str, model_version: str, settings: Settings) -> tuple[Any, Any]:
        """The hash states of the header, followed by the text / token-ids tag (memoised)."""
        header = canonical_header(namespace, model_version, settings)
        base = hashlib.sha256(len(header).to_bytes(8, "little"))
        base.update(header)
        text, tokens = base.copy(), base
        text.update(b"w" if self.normalize_whitespace else b"s")  # normalised / exact text
        tokens.update(b"t")
        if len(self._bases) >= _MEMO_MAX:
            self._bases.clear()
        self._bases[(namespace, model_version, settings.canonical)] = (text, tokens)
        return text, tokens

    def digest(
        self, namespace: str, model_version: str, prompt: Prompt, settings: Mapping[str, Any]
    ) -> str:
        """The SHA-256 hex digest of one request (see the module docstring).

        Raises:
            ValueError: bad settings, or a prompt that is neither str nor a sequence of ints.
        """
        if type(settings) is not Settings:
            settings = self.settings(settings)
        bases = self._bases.get((namespace, model_version, settings.canonical))
        if bases is None:
            bases = self._base(namespace, model_version, settings)
        if isinstance(prompt, str):
            h = bases[0].copy()
            text = " ".join(prompt.split()) if self.normalize_whitespace else prompt
            h.update(text.encode("utf-8", "surrogatepass"))
        else:
            h = bases[1].copy()
            h.update(_token_bytes(prompt))
        return h.hexdigest()


def _token_bytes(tokens: Any) -> bytes:
    if isinstance(tokens, bytes | bytearray | Mapping) or not hasattr(tokens, "__iter__"):
        raise ValueError(f"prompt of type {type(tokens).__name__} must be a str or token ids")
    try:
        a = array("q", tokens)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"prompt token ids must be int64 integers ({e})") from None
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


_HASHERS = {False: KeyHasher(), True: KeyHasher(normalize_whitespace=True)}


def request_hash(
    namespace: str,
    model_version: str,
    prompt: Prompt,
    settings: Mapping[str, Any],
    *,
    normalize_whitespace: bool = False,
) -> str:
    """The SHA-256 hex digest of a request (module-level convenience over `KeyHasher`).

    Args:
        namespace: the tenant.
        model_version: the model's identity (jkv passes `params.identity`).
        prompt: a str (exact, or whitespace-normalised with `normalize_whitespace`) or a
            sequence of token ids.
        settings: every setting that changes the output.
        normalize_whitespace: hash a str prompt whitespace-normalised (see the module).

    Returns:
        64 lowercase hex characters.

    Raises:
        ValueError: bad settings or prompt.
    """
    return _HASHERS[normalize_whitespace is True].digest(namespace, model_version, prompt, settings)


BUCKETS = 64  # hash-tag buckets per model; changing it moves every key
RESPONSE_KEY = PREFIX + "{{{}:{:02x}}}:{}:{}"  # .format(model, bucket, generation, digest)


def bucket_of(digest: str) -> int:
    """The bucket of a request digest (64 hex characters): its first byte modulo BUCKETS."""
    return int(digest[:2], 16) % BUCKETS


def response_key(model_name: str, generation: int, digest: str) -> str:
    """`llm:response:{model_name:bucket}:generation:digest` (model name already validated)."""
    return RESPONSE_KEY.format(model_name, bucket_of(digest), generation, digest)


def response_pattern(model_name: str) -> str:
    """SCAN MATCH pattern for every bucket and generation of one model's responses (a model
    name holds no ':' or glob character, so no other model's keys match)."""
    return f"{PREFIX}{{{model_name}:*"


def group_key(model_name: str, generation: int, group_id: int, bucket: int) -> str:
    """The Redis set that lists one embedding cluster's response keys in one bucket."""
    return f"llm:group:{{{model_name}:{bucket:02x}}}:{generation}:{group_id}"


def group_keys(model_name: str, generation: int, group_id: int) -> list[str]:
    """One embedding cluster's sets, every bucket."""
    return [group_key(model_name, generation, group_id, b) for b in range(BUCKETS)]


def group_pattern(model_name: str, group_id: int | None = None) -> str:
    """SCAN MATCH pattern for every group set of one model (of one group id, if given)."""
    pattern = f"llm:group:{{{model_name}:*"
    return pattern if group_id is None else f"{pattern}:{group_id}"


def generation_key(model_name: str) -> str:
    """The INCR counter holding the model's current generation."""
    return f"llm:gen:{{{model_name}}}"


def lease_key(response: str) -> str:
    """The cross-node single-flight lease of one response key (same hash slot)."""
    return "llm:lease:" + response[len(PREFIX) :]


def generation_of(key: str) -> int | None:
    """Parses the generation field of a response or group key (after the hash tag), None
    when malformed."""
    _, sep, rest = key.partition("}:")
    return parse_generation(rest.split(":", 1)[0]) if sep else None


def parse_generation(value: str | bytes | None) -> int | None:
    """A generation counter's value: absent is 0; None when it is not a decimal int64 >= 0.

    Anyone with access to Redis can write any bytes there, so nothing else is trusted (`int()`
    alone would take "+1", " 1", "1_000" or Unicode digits).
    """
    if value is None:
        return 0
    if isinstance(value, str):
        value = value.encode("utf-8", "replace")
    if not value.isdigit() or len(value) > 19:  # bytes.isdigit: ASCII 0-9 only
        return None
    n = int(value)
    return n if n < 2**63 else None
