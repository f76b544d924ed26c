"""jkv's response cache: canonical keys, L1 LRU + L2 Redis, invalidation, single-flight.

Plain Python around bytes and strings: no JAX here, and `redis` is imported only when a
cache is given a Redis URL. See `response_cache.ResponseCache` for the entry point and
`keys.py` for what makes two requests the same.
"""

from jkv.response_cache.clusters import ClusterIdFn, KMeansClusterer
from jkv.response_cache.codec import CodecError, Record
from jkv.response_cache.config import CacheConfig
from jkv.response_cache.invalidation import CleanupJob
from jkv.response_cache.keys import (
    Settings,
    derive_model_name,
    is_cacheable,
    normalize_prompt,
    request_hash,
)
from jkv.response_cache.l2 import CacheUnavailableError
from jkv.response_cache.response_cache import Lookup, ResponseCache

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
