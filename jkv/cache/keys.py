"""Canonical cache keys: what makes two requests "the same request".

Key format::

    llm:response:{<model_name>}:<generation>:<sha256 hex>

The braces are part of the key. In Redis Cluster a `{...}` substring is a hash tag: only the
text inside it is hashed to pick the slot, so all of one model's keys (responses, group sets,
leases, its generation counter) live in one slot and may share a MULTI or a pipeline.

`<generation>` is the model's invalidation counter (see `invalidation.py`): bumping it makes
every older key unreachable at once, before the old keys are deleted in the background.

The SHA-256 covers, in a versioned framing (`KEY_SCHEMA`):

1. a header, canonical JSON (sorted keys, no spaces, UTF-8) of
   `["jkv-key", KEY_SCHEMA, namespace, model_version, settings]`;
2. the prompt: a str is whitespace-normalised (the seed's rule: trim, newlines to spaces,
   every run of whitespace to one space; Python's `str.split` defines whitespace, so Unicode
   spaces count too) and UTF-8 encoded; a token-id sequence is hashed as little-endian int64
   and is never equal to a str prompt.

The header is length-prefixed, so no choice of prompt can imitate another header.

Settings rules (the caller passes fully resolved settings, as `jkv.generate` does):

- Every entry counts; nested dicts (e.g. KV policy parameters) are sorted too.
- `1` and `1.0` are DIFFERENT keys (JSON keeps the int/float distinction; a float is written
  as its shortest round-trip repr). Only a needless miss can come of it, never a wrong hit.
- `True` differs from `1`; a tuple equals the list with the same items.
- `None` is a value: `{"top_k": None}` differs from `{}` (absent). Pass resolved settings.
- Allowed values: None, bool, int, finite float, str, list/tuple of these, dict with str keys
  of these; numpy scalars are taken by `.item()`. Anything else raises ValueError.

Model names: 1-128 characters from `A-Z a-z 0-9 . _ - / + @`, starting with a letter or a
digit. Excluded are `{`, `}` (hash tag), `:` (field separator), glob characters `* ? [ ] \\`
(the invalidation SCAN uses the name in a MATCH pattern) and whitespace.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

KEY_SCHEMA = 1
PREFIX = "llm:response:"
_MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+@-]{0,127}")
_NAMESPACE_RE = re.compile(r"[^\x00-\x1f]{1,256}")
_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_SCALARS = (type(None), bool, int, str)
_HEADER_MEMO_MAX = 4096

Prompt = str | Sequence[int]


def normalize_prompt(prompt: str) -> str:
    """The seed's whitespace normalisation: trim, newlines to spaces, runs to one space.

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
        raise ValueError(
            f"model_name={model_name!r} must be 1-128 characters from A-Z a-z 0-9 . _ - / + @, "
            "starting with a letter or digit (no braces, colons, glob characters or spaces)"
        )
    return model_name


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
        model_version: the weights fingerprint.
        settings: every setting that changes the output.

    Returns:
        Canonical JSON bytes.

    Raises:
        ValueError: a setting of an unsupported type, a non-str key, or NaN/inf.
    """
    if not isinstance(settings, Mapping):
        raise ValueError(f"settings={settings!r} must be a mapping of str to values")
    doc = ["jkv-key", KEY_SCHEMA, namespace, model_version, _canonical(settings, "settings")]
    return _JSON.encode(doc).encode("utf-8")


class KeyHasher:
    """Computes request digests, memoising the pure function (prompt, settings) -> digest.

    Memo keys are the msgpack bytes of `(namespace, model_version, settings)` in the caller's
    order, plus the raw prompt str. msgpack keeps int, float, bool and str apart, so equal
    memo keys mean equal inputs (a different dict order only costs a memo miss); the digest
    itself always comes from the canonical encoding. A repeated prompt then skips
    normalisation and SHA-256, which keeps an L1 hit near a dict lookup. The memo is FIFO
    (reads take no lock), bounded by entries and by prompt characters; token-id prompts are
    not memoised.

    Args:
        max_entries: most memoised digests.
        max_chars: most prompt characters held by the memo (the prompts stay referenced).
    """

    def __init__(self, max_entries: int = 4096, max_chars: int = 8 << 20) -> None:
        self._bases: dict[bytes, Any] = {}
        self._digests: OrderedDict[tuple[bytes, str], str] = OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._chars = 0

    def _base(self, settings_id: bytes | None, namespace, model_version, settings):
        base = self._bases.get(settings_id) if settings_id is not None else None
        if base is None:
            header = canonical_header(namespace, model_version, settings)
            base = hashlib.sha256(len(header).to_bytes(8, "little"))
            base.update(header)
            if settings_id is not None:
                if len(self._bases) >= _HEADER_MEMO_MAX:
                    self._bases.clear()  # rare: many distinct settings; rebuilding is cheap
                self._bases[settings_id] = base
        return base

    def digest(
        self, namespace: str, model_version: str, prompt: Prompt, settings: Mapping[str, Any]
    ) -> str:
        """The SHA-256 hex digest of one request (see the module docstring).

        Raises:
            ValueError: bad settings, or a prompt that is neither str nor a sequence of ints.
        """
        packer = getattr(self._local, "packer", None)
        if packer is None:  # a Packer per thread: reusing one saves a third of packb's cost
            packer = self._local.packer = msgpack.Packer(use_bin_type=True)
        try:
            settings_id = packer.pack((namespace, model_version, settings))
        except (TypeError, ValueError, OverflowError):
            settings_id = None  # exotic values: always take the canonical path
        memo = None
        if settings_id is not None and type(prompt) is str:
            memo = (settings_id, prompt)
            found = self._digests.get(memo)  # one C call: safe without the lock
            if found is not None:
                return found
        h = self._base(settings_id, namespace, model_version, settings).copy()
        if isinstance(prompt, str):
            h.update(b"s")
            h.update(" ".join(prompt.split()).encode("utf-8", "surrogatepass"))
        else:
            h.update(b"t")
            h.update(_token_bytes(prompt))
        found = h.hexdigest()
        if memo is not None and len(prompt) <= self._max_chars:
            self._remember(memo, found)
        return found

    def _remember(self, memo: tuple[bytes, str], digest: str) -> None:
        with self._lock:
            if memo in self._digests:
                return
            self._digests[memo] = digest
            self._chars += len(memo[1])
            while len(self._digests) > self._max_entries or self._chars > self._max_chars:
                (_, old_prompt), _ = self._digests.popitem(last=False)
                self._chars -= len(old_prompt)


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


_DEFAULT_HASHER = KeyHasher()


def request_hash(
    namespace: str, model_version: str, prompt: Prompt, settings: Mapping[str, Any]
) -> str:
    """The SHA-256 hex digest of a request (module-level convenience over `KeyHasher`).

    Args:
        namespace: the tenant.
        model_version: the weights fingerprint.
        prompt: a str (whitespace-normalised) or a sequence of token ids.
        settings: every setting that changes the output.

    Returns:
        64 lowercase hex characters.

    Raises:
        ValueError: bad settings or prompt.
    """
    return _DEFAULT_HASHER.digest(namespace, model_version, prompt, settings)


def response_key(model_name: str, generation: int, digest: str) -> str:
    """`llm:response:{model_name}:generation:digest` (model name already validated)."""
    return f"{PREFIX}{{{model_name}}}:{generation}:{digest}"


def response_pattern(model_name: str) -> str:
    """SCAN MATCH pattern for every generation of one model's responses."""
    return f"{PREFIX}{{{model_name}}}:*"


def group_key(model_name: str, generation: int, group_id: int) -> str:
    """The Redis set that lists one embedding cluster's response keys."""
    return f"llm:group:{{{model_name}}}:{generation}:{group_id}"


def group_pattern(model_name: str) -> str:
    """SCAN MATCH pattern for every group set of one model."""
    return f"llm:group:{{{model_name}}}:*"


def generation_key(model_name: str) -> str:
    """The INCR counter holding the model's current generation."""
    return f"llm:gen:{{{model_name}}}"


def lease_key(response: str) -> str:
    """The cross-node single-flight lease of one response key (same hash slot)."""
    return "llm:lease:" + response[len(PREFIX) :]


def generation_of(key: str, pattern_prefix_len: int) -> int | None:
    """Parses the generation field of a response or group key, None when malformed."""
    field = key[pattern_prefix_len:].split(":", 1)[0]
    return int(field) if field.isdigit() else None
