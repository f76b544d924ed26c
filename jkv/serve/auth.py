"""API keys and the tenants they name: who may call the server, and whose caches a request uses.

A key maps to a tenant name decided by the server (`--api-keys-file`: one `KEY TENANT` per
line; `--api-key KEY` and `JKV_API_KEY`: a tenant of its own each). A request without a valid
`Authorization: Bearer KEY` gets 401 in OpenAI's error JSON. The tenant then keys the response
cache and the engine's prefix cache: `cache_salt` derives one salt from (tenant, the client's
`cache_salt`), so a client's salt can only narrow its tenant's caches, never reach another's.

With no key configured every request is one tenant (no tenant name): the server is for
trusted clients only (`jkv serve` warns at start).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from jkv.serve.openai import APIError

ENV = "JKV_API_KEY"
_TENANT = re.compile(r"[A-Za-z0-9._@:/+-]{1,64}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def default_tenant(key: str) -> str:
    """The tenant of a key given alone (not in a keys file): named by its hash, never by it."""
    return "key-" + _digest(key).hex()[:12]


class Keys:
    """Valid API keys and their tenants (kept as SHA-256 digests only).

    Args:
        keys: key -> tenant name (1-64 characters from `A-Z a-z 0-9 . _ @ : / + -`).

    Raises:
        ValueError: an empty key, a key with whitespace, or a bad tenant name.
    """

    def __init__(self, keys: Mapping[str, str]):
        self._tenants: dict[bytes, str] = {}
        for key, tenant in keys.items():
            check_key(key)
            if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
                raise ValueError(
                    f"tenant={tenant!r}: expected 1-64 characters from A-Z a-z 0-9 . _ @ : / + -"
                )
            self._tenants[_digest(key)] = tenant

    def __len__(self) -> int:
        return len(self._tenants)

    @property
    def tenants(self) -> set[str]:
        return set(self._tenants.values())

    def tenant(self, authorization: str | None) -> str:
        """The tenant of an `Authorization` header's bearer key, or APIError(401)."""
        if not authorization:
            raise unauthorized(
                "You didn't provide an API key. Send it in an Authorization header using "
                "Bearer auth (Authorization: Bearer YOUR_KEY)"
            )
        scheme, _, key = authorization.strip().partition(" ")
        found = self._tenants.get(_digest(key.strip())) if scheme.lower() == "bearer" else None
        if found is None:
            raise unauthorized("Incorrect API key provided")
        return found


def unauthorized(message: str) -> APIError:
    return APIError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="jkv"'}
    )


def check_key(key) -> str:
    if not isinstance(key, str) or not key or any(c.isspace() for c in key):
        raise ValueError("an API key must be a non-empty string without whitespace")
    return key


def load(keys: Iterable[str] = (), keys_file: str | Path | None = None, env=None) -> Keys | None:
    """The keys of `jkv serve`: `--api-key` values, `JKV_API_KEY` from `env` (each its own
    tenant), and a keys file's `KEY TENANT` lines (`#` comments and blank lines skipped).
    None when there are none.

    Raises:
        ValueError: naming the file and line of a malformed entry, or a key given twice with
            two tenants.
    """
    table: dict[str, str] = {}

    def add(key: str, tenant: str, where: str) -> None:
        check_key(key)
        if table.get(key, tenant) != tenant:
            raise ValueError(f"{where}: this key is already the key of tenant {table[key]!r}")
        table[key] = tenant

    for key in keys:
        add(key, default_tenant(key), "--api-key")
    if env is not None and env.get(ENV):
        add(env[ENV], default_tenant(env[ENV]), ENV)
    if keys_file is not None:
        path = Path(keys_file)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read the API keys file ({e})") from None
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) != 2 or not _TENANT.fullmatch(fields[1]):
                raise ValueError(
                    f"{path}:{n}: expected 'KEY TENANT' (a tenant of 1-64 characters from "
                    "A-Z a-z 0-9 . _ @ : / + -)"
                )
            add(fields[0], fields[1], f"{path}:{n}")
    return Keys(table) if table else None


def cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The salt of a request's caches (response cache and prefix cache): one per (tenant,
    client salt); None, the shared caches, when neither is set."""
    if tenant is None and client_salt is None:
        return None
    return hashlib.sha256(json.dumps([tenant, client_salt]).encode()).hexdigest()
