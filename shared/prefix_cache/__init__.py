"""The shared on-disk prefix KV cache: states keyed by token prefix, shared by every worker.

Inside: `keys` (chained block hashes of token prefixes), `blobs` (the narrow bytes-in/bytes-out
storage interface, directory and memory implementations), `format` (blob bytes and where files
live), `state_layout` (where each KV cell's bytes are in a llama.cpp state), `deltas` (states
stored as their own cells on a base), `eviction` (what the budget removes first), `maintenance`
(verifying every blob), `cache` (lookup, save, budget), `fingerprint` (which states a model may
read), `residency` (what the page cache holds, how fast the disk reads the rest) and `counters`
(hits and misses summed over workers in Redis). Other packages use what is
exported here.
"""

from __future__ import annotations

from shared.prefix_cache.cache import (
    COUNTERS,
    CacheHit,
    PrefixCache,
    ReadOffer,
    chunk_end,
    open_cache,
    restorable_tokens,
)
from shared.prefix_cache.counters import cache_report, read_counters
from shared.prefix_cache.fingerprint import configured_fingerprint
from shared.prefix_cache.keys import common_prefix_len
from shared.prefix_cache.state_layout import Layout as StateLayout
from shared.prefix_cache.state_layout import first_cells
from shared.prefix_cache.state_layout import parse as parse_state

__all__ = [
    "COUNTERS",
    "CacheHit",
    "PrefixCache",
    "ReadOffer",
    "StateLayout",
    "cache_report",
    "chunk_end",
    "common_prefix_len",
    "configured_fingerprint",
    "first_cells",
    "open_cache",
    "parse_state",
    "read_counters",
    "restorable_tokens",
]
