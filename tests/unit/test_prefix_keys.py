from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from shared.prefix_cache.keys import (
    block_hashes,
    boundaries,
    common_prefix_len,
    head_key,
    head_lengths,
    prefix_key,
    seed_key,
    token_bytes,
    tokens_from_bytes,
)

TOKENS = list(range(10))
# Frozen: changing these silently orphans every cache on disk.
EXPECTED_SEED = "46b1b233ca47b8594e45da709e0538ec"
EXPECTED_BLOCKS = ["d8aa170093e85cd528f9861cf6c68c86", "f40b3d3a76bad5c18ff349f4f2b828b8"]
EXPECTED_PREFIX = "be3019ca7c9dd6afcbdb0f3c1e53fefd"
REPO = Path(__file__).resolve().parents[2]


def test_token_bytes_are_little_endian_int32() -> None:
    assert token_bytes([1, -2, 2**31 - 1]) == struct.pack("<3i", 1, -2, 2**31 - 1)
    assert tokens_from_bytes(token_bytes([5, 0, 70000])) == [5, 0, 70000]
    with pytest.raises(ValueError):
        token_bytes([2**31])


def test_fixed_expected_hex() -> None:
    assert seed_key("fp0", 4) == EXPECTED_SEED
    assert block_hashes(TOKENS, 4, "fp0") == EXPECTED_BLOCKS
    assert prefix_key(TOKENS, 4, "fp0") == EXPECTED_PREFIX


def test_chain_is_h_prev_concat_block() -> None:
    prev = bytes.fromhex(EXPECTED_SEED)
    h1 = hashlib.blake2b(
        prev + struct.pack("<4i", 0, 1, 2, 3), digest_size=16, person=b"granary-block"
    )
    assert block_hashes(TOKENS, 4, "fp0")[0] == h1.hexdigest()


def test_same_keys_in_another_process_with_other_hash_seed() -> None:
    code = (
        "from shared.prefix_cache.keys import block_hashes;"
        "print(block_hashes(list(range(10)), 4, 'fp0'))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == repr(EXPECTED_BLOCKS)


def test_different_fingerprint_or_block_size_gives_different_keys() -> None:
    assert set(block_hashes(TOKENS, 4, "fp1")).isdisjoint(EXPECTED_BLOCKS)
    assert prefix_key(TOKENS, 4, "fp1") != EXPECTED_PREFIX
    assert block_hashes(TOKENS[:8], 2, "fp0")[3] != EXPECTED_BLOCKS[1]


def test_chain_depends_on_every_earlier_block() -> None:
    changed = [99, *TOKENS[1:]]
    assert block_hashes(changed, 4, "fp0")[1] != EXPECTED_BLOCKS[1]


def test_prefix_of_tokens_has_prefix_of_chain() -> None:
    long = list(range(100))
    assert block_hashes(long[:37], 4, "fp0") == block_hashes(long, 4, "fp0")[:9]


def test_prefix_key_with_chain_and_n_tokens_matches_sliced() -> None:
    long = list(range(50))
    chain = block_hashes(long, 4, "fp0")
    for n in range(51):
        expected = prefix_key(long[:n], 4, "fp0")
        assert prefix_key(long, 4, "fp0", n_tokens=n, chain=chain) == expected


def test_prefix_key_distinguishes_lengths_and_kinds() -> None:
    keys = {prefix_key(TOKENS, 4, "fp0", n_tokens=n) for n in range(11)}
    assert len(keys) == 11
    assert keys.isdisjoint(EXPECTED_BLOCKS)
    assert head_key(TOKENS, 2, 4, "fp0") not in keys


def test_boundaries_cover_heads_then_blocks() -> None:
    assert head_lengths(256) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert head_lengths(1) == []
    bounds = boundaries(TOKENS, 4, "fp0")
    assert [b.n_tokens for b in bounds] == [1, 2, 4, 8]
    assert [b.key for b in bounds[2:]] == EXPECTED_BLOCKS
    assert [b.n_tokens for b in boundaries(TOKENS[:3], 4, "fp0")] == [1, 2]
    # A head key of length L depends on exactly the first L tokens.
    assert bounds[1].key == head_key([0, 1, 77], 2, 4, "fp0")


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
