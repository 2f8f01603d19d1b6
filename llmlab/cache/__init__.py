"""KV cache: block pool, prefix index, eviction policies, and per-request accounting."""

from llmlab.cache.block_pool import BlockPool
from llmlab.cache.eviction import (
    EVICTION_POLICIES,
    ARCEviction,
    EvictionPolicy,
    FIFOEviction,
    LFUEviction,
    LRUEviction,
    RandomEviction,
    S3FIFOEviction,
)
from llmlab.cache.kv_cache_manager import BlockEvents, CacheSnapshot, KVCacheManager
from llmlab.cache.prefix_index import PrefixIndex, chain_hash

__all__ = [
    "EVICTION_POLICIES",
    "ARCEviction",
    "BlockEvents",
    "BlockPool",
    "CacheSnapshot",
    "EvictionPolicy",
    "FIFOEviction",
    "KVCacheManager",
    "LFUEviction",
    "LRUEviction",
    "PrefixIndex",
    "RandomEviction",
    "S3FIFOEviction",
    "chain_hash",
]
