"""jkv's response cache: canonical keys, L1 LRU + L2 Redis, invalidation, single-flight.

Plain Python around bytes and strings: no JAX here, and `redis` is imported only when a
cache is given a Redis URL. See `response_cache.ResponseCache` for the entry point and
`keys.py` for what makes two requests the same.
"""

from jkv.cache.codec import CodecError, Record
from jkv.cache.config import CacheConfig
from jkv.cache.embed import ClusterIdFn, KMeansClusterer
from jkv.cache.invalidation import CleanupJob
from jkv.cache.keys import (
    Settings,
    derive_model_name,
    is_cacheable,
    normalize_prompt,
    request_hash,
)
from jkv.cache.l2 import CacheUnavailableError
from jkv.cache.response_cache import Lookup, ResponseCache

__all__ = [
    "CacheConfig",
    "CacheUnavailableError",
    "CleanupJob",
    "ClusterIdFn",
    "CodecError",
    "KMeansClusterer",
    "Lookup",
    "Record",
    "ResponseCache",
    "Settings",
    "derive_model_name",
    "is_cacheable",
    "normalize_prompt",
    "request_hash",
]
