"""The prefix cache: prompts' KV kept after their requests end, found again by later prompts.

    cache.py  the KV store's blocks indexed by the hash of their block chain; LRU; the
              memory guard's evictions
    disk.py   the disk tier: evicted blocks written to a directory, read back on a hit
    keys.py   a block's key: the digest of its chain, shared by both

`docs/kv-store.md` ("Prefix cache") explains the design.
"""

from engine.prefix.cache import CAUSES, PrefixCache, PrefixCacheStats, PrefixHit
from engine.prefix.keys import ROOT, ChainKey, chain_digest

__all__ = ["CAUSES", "ROOT", "ChainKey", "PrefixCache", "PrefixCacheStats", "PrefixHit", "chain_digest"]
