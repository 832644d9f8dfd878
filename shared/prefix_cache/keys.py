"""Stable, namespaced keys for token-id prefixes.

Tokens are split into blocks of ``block_tokens``; block hashes are chained,
h_k = H(h_{k-1} || block_k), starting from a seed derived from the model
fingerprint and the block size. Equal keys therefore mean equal prefixes for
the same model in every process and on every host (blake2b-128; Python's
``hash()`` is salted per process and must never be used here).

Three kinds of key share one seed but use distinct blake2b ``person`` tags so
they can never collide with each other:

* block hash   -- prefix ending on a block boundary (``block_hashes``)
* head key     -- short prefix of a power-of-two length below one block, so
                  prompts shorter than a block still have index boundaries
* prefix key   -- identity of an arbitrary-length prefix (names a blob)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

DIGEST_BYTES = 16
KEY_HEX_CHARS = 2 * DIGEST_BYTES
_SCHEME = b"granary.prefix.v1"
_TOKEN = struct.Struct("<i")
_U32 = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class Boundary:
    """An index point: the first ``n_tokens`` tokens hash to ``key``."""

    n_tokens: int
    key: str


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian int32 encoding of token ids (the hashed and stored form)."""
    try:
        return struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must fit in int32: {exc}") from exc


def tokens_from_bytes(data: bytes | memoryview) -> list[int]:
    """Inverse of :func:`token_bytes`; ``len(data)`` must be a multiple of 4."""
    return [t for (t,) in _TOKEN.iter_unpack(data)]


def _digest(person: bytes, *parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=person)
    for part in parts:
        h.update(part)
    return h.digest()


def seed_key(root: str, block_tokens: int) -> str:
    """Chain seed; block size is mixed in because it changes every boundary."""
    _check_block_tokens(block_tokens)
    return _digest(b"granary-seed", _SCHEME, _U32.pack(block_tokens), root.encode("utf-8")).hex()


def block_hashes(tokens: Sequence[int], block_tokens: int, root: str) -> list[str]:
    """Chain hashes h_1..h_K of the K = len(tokens) // block_tokens full blocks."""
    data = token_bytes(tokens)
    step = 4 * block_tokens
    prev = bytes.fromhex(seed_key(root, block_tokens))
    out: list[str] = []
    for k in range(len(tokens) // block_tokens):
        prev = _digest(b"granary-block", prev, data[k * step : (k + 1) * step])
        out.append(prev.hex())
    return out


def head_lengths(block_tokens: int) -> list[int]:
    """Sub-block boundary lengths: powers of two strictly below one block."""
    _check_block_tokens(block_tokens)
    out: list[int] = []
    n = 1
    while n < block_tokens:
        out.append(n)
        n *= 2
    return out


def head_key(tokens: Sequence[int], n_tokens: int, block_tokens: int, root: str) -> str:
    """Key of the short prefix ``tokens[:n_tokens]`` (n_tokens < block_tokens)."""
    if not 0 < n_tokens < block_tokens or n_tokens > len(tokens):
        raise ValueError(f"head length {n_tokens} out of range")
    seed = bytes.fromhex(seed_key(root, block_tokens))
    return _digest(b"granary-head", seed, token_bytes(tokens[:n_tokens])).hex()


def boundaries(
    tokens: Sequence[int],
    block_tokens: int,
    root: str,
    *,
    chain: Sequence[str] | None = None,
) -> list[Boundary]:
    """Every index boundary of ``tokens`` (length <= len(tokens)), shortest first.

    ``chain`` may be the block hashes of ``tokens`` or of any extension of it.
    """
    n = len(tokens)
    if chain is None:
        chain = block_hashes(tokens, block_tokens, root)
    heads = [
        Boundary(length, head_key(tokens, length, block_tokens, root))
        for length in head_lengths(block_tokens)
        if length <= n
    ]
    blocks = [Boundary((k + 1) * block_tokens, chain[k]) for k in range(n // block_tokens)]
    return heads + blocks


def prefix_key(
    tokens: Sequence[int],
    block_tokens: int,
    root: str,
    *,
    n_tokens: int | None = None,
    chain: Sequence[str] | None = None,
) -> str:
    """Identity of ``tokens[:n_tokens]`` (default: all of ``tokens``).

    Cost is O(block_tokens) when ``chain`` (block hashes of ``tokens``) is given,
    which lets a lookup test "is this blob exactly a prefix of the prompt"
    from a file name alone.
    """
    n = len(tokens) if n_tokens is None else n_tokens
    if not 0 <= n <= len(tokens):
        raise ValueError(f"n_tokens {n} out of range")
    full_blocks = n // block_tokens
    if full_blocks == 0:
        base = seed_key(root, block_tokens)
    else:
        if chain is None:
            chain = block_hashes(tokens[: full_blocks * block_tokens], block_tokens, root)
        base = chain[full_blocks - 1]
    tail = token_bytes(tokens[full_blocks * block_tokens : n])
    return _digest(b"granary-prefix", bytes.fromhex(base), _U32.pack(n), tail).hex()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _check_block_tokens(block_tokens: int) -> None:
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
