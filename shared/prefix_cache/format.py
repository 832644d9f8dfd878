"""How the prefix cache lays out its store: blob bytes, blob names and where files live.

A blob is a header, the model fingerprint, the token ids, the state's breaks (since version 2:
where its prefill ended chunks besides the block grid, which decides what it may be restored
for; see `restorable_tokens`) and the KV state. A delta (version 3) holds, after the breaks, a
reference to its base (the base's name, its payload digest, how many leading cells it takes
from it and how deep its chain is) and only its own cells (see shared.prefix_cache.deltas);
whole states are still written as version 2, which older workers read. Every byte is covered by
a check: header fields by size/digest consistency, the fingerprint by comparison, tokens, breaks
and base reference by SHA-256 and the state by XXH3-128 (version 1 blobs, still read: no breaks,
BLAKE2b-256). Blob names are ``{n_tokens}-{prefix key}``.
Paths inside the store (``sh`` = first two hex chars of ``bkey``, to keep the index fan-out
small)::

    {fp}/blobs/{n}-{id}               one blob per saved prefix (header+tokens+state)
    {fp}/hits/{n}-{id}                its size in bytes is the hit count (capped)
    {fp}/index/{sh}/{bkey}/{n}-{id}   empty marker: blob shares boundary bkey
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import xxhash

from shared.prefix_cache.keys import DIGEST_BYTES, KEY_HEX_CHARS, token_bytes, tokens_from_bytes

MAGIC = b"GRNYKV\r\n"  # \r\n: a text-mode copy that mangles newlines fails fast
FORMAT_VERSION = 2  # a whole state
DELTA_VERSION = 3  # a state's own cells on a base's
READABLE_VERSIONS = (1, FORMAT_VERSION, DELTA_VERSION)  # warmed caches survive an upgrade
# magic, version, fingerprint length, block_tokens, n_tokens, payload length,
# sha256(tokens [+ breaks]), payload digest (see _payload_digest). The same size in every
# version, so reading a head needs no version.
HEADER = struct.Struct("<8sHHIIQ32s32s")
# Version 2: after the tokens, a count and that many positions, each inside the state.
_COUNT = struct.Struct("<I")
# More would make a head read unbounded; a prompt with more is not saved.
MAX_BREAKS = 255
# Version 3, after the breaks: base n_tokens, base prefix key, base payload digest, cells
# taken from the base, depth (1: the base is a whole state).
_BASE = struct.Struct(f"<I{DIGEST_BYTES}s32sIH")
# A restore reads at most this many blobs beyond the one it found.
MAX_DEPTH = 8
# A fingerprint (or namespaced one) is a directory name: nothing that could climb out.
FINGERPRINT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_NAME = re.compile(rf"(\d+)-([0-9a-f]{{{KEY_HEX_CHARS}}})")


@dataclass(frozen=True, slots=True)
class BaseRef:
    """What a delta stands on: the first `shared` cells of blob `{n_tokens}-{blob_id}`, as it
    was when the delta was written (`payload_digest`: a base replaced since is detected)."""

    n_tokens: int
    blob_id: str
    payload_digest: bytes
    shared: int
    depth: int

    @property
    def name(self) -> str:
        return blob_name(self.n_tokens, self.blob_id)

    def pack(self) -> bytes:
        return _BASE.pack(
            self.n_tokens, bytes.fromhex(self.blob_id), self.payload_digest, self.shared, self.depth
        )


@dataclass(frozen=True, slots=True)
class Header:
    fingerprint: str
    block_tokens: int
    n_tokens: int
    payload_bytes: int
    tokens_sha256: bytes
    payload_digest: bytes
    version: int
    breaks: tuple[int, ...] = ()
    base: BaseRef | None = None

    @property
    def depth(self) -> int:
        """Blobs a restore reads beyond this one."""
        return 0 if self.base is None else self.base.depth

    @property
    def tokens_offset(self) -> int:
        return HEADER.size + len(self.fingerprint.encode("utf-8"))

    @property
    def payload_offset(self) -> int:
        breaks = 0 if self.version == 1 else _COUNT.size + 4 * len(self.breaks)
        base = _BASE.size if self.version == DELTA_VERSION else 0
        return self.tokens_offset + 4 * self.n_tokens + breaks + base


def head_bytes(fingerprint: str, n_tokens: int) -> int:
    """What a head read takes to hold every field `parse_head` checks, breaks included."""
    fixed = HEADER.size + len(fingerprint.encode("utf-8")) + 4 * n_tokens
    return fixed + _COUNT.size + 4 * MAX_BREAKS + _BASE.size


def _payload_digest(version: int, payload: bytes | memoryview) -> bytes:
    """The state's check. It guards against damage, not forgery (whoever can write the cache
    directory can write a matching digest of any kind), so version 2 uses XXH3-128: 3.8 ms
    over a 37 MB state where version 1's BLAKE2b-256 takes 49 ms. Zero-padded to the field."""
    if version == 1:
        return hashlib.blake2b(payload, digest_size=32).digest()
    return xxhash.xxh3_128_digest(payload).ljust(32, b"\0")


def encode_blob(
    fingerprint: str,
    block_tokens: int,
    tokens: Sequence[int],
    state: bytes,
    breaks: Sequence[int] = (),
    base: BaseRef | None = None,
) -> bytes:
    """A whole state (version 2), or with `base` a delta: `state` then holds only the cells
    after the base's `shared` ones (version 3)."""
    if len(breaks) > MAX_BREAKS or any(not 0 < b < len(tokens) for b in breaks):
        raise ValueError(f"a state's breaks are at most {MAX_BREAKS} positions inside it")
    if base is not None and not _base_fits(base, len(tokens)):
        raise ValueError("a delta takes fewer cells from its base than it holds")
    version = FORMAT_VERSION if base is None else DELTA_VERSION
    fp = fingerprint.encode("utf-8")
    listed = token_bytes(tokens) + _COUNT.pack(len(breaks)) + token_bytes(sorted(breaks))
    if base is not None:
        listed += base.pack()
    header = HEADER.pack(
        MAGIC,
        version,
        len(fp),
        block_tokens,
        len(tokens),
        len(state),
        hashlib.sha256(listed).digest(),
        _payload_digest(version, state),
    )
    return b"".join((header, fp, listed, state))


def _base_fits(base: BaseRef, n_tokens: int) -> bool:
    return (
        0 < base.shared < n_tokens and base.shared <= base.n_tokens and 1 <= base.depth <= MAX_DEPTH
    )


def parse_head(data: bytes | memoryview, expected_fp: str) -> tuple[Header, list[int]] | None:
    """Header and verified tokens, or None if anything is inconsistent. `data` may run on
    past the head (see head_bytes)."""
    if len(data) < HEADER.size:
        return None
    magic, version, fp_len, block_tokens, n, payload_bytes, tok_sha, pay_dig = HEADER.unpack_from(
        data
    )
    if magic != MAGIC or version not in READABLE_VERSIONS or block_tokens < 1:
        return None
    fp = data[HEADER.size : HEADER.size + fp_len]
    if fp != expected_fp.encode("utf-8"):
        return None
    header = Header(expected_fp, block_tokens, n, payload_bytes, tok_sha, pay_dig, version)
    start = header.tokens_offset
    end = start + 4 * n
    breaks: list[int] = []
    if version > 1:
        if len(data) < end + _COUNT.size:
            return None
        (count,) = _COUNT.unpack_from(data, end)
        if count > MAX_BREAKS:
            return None
        breaks = tokens_from_bytes(data[end + _COUNT.size : end + _COUNT.size + 4 * count])
        end += _COUNT.size + 4 * count
        if len(breaks) != count or any(not 0 < b < n for b in breaks):
            return None
    base = None
    if version == DELTA_VERSION:
        base = _unpack_base(data, end, n)
        if base is None:
            return None
        end += _BASE.size
    listed = data[start:end]
    if len(listed) != end - start or hashlib.sha256(listed).digest() != tok_sha:
        return None
    header = replace(header, breaks=tuple(breaks), base=base)
    return header, tokens_from_bytes(data[start : start + 4 * n])


def _unpack_base(data: bytes | memoryview, offset: int, n_tokens: int) -> BaseRef | None:
    if len(data) < offset + _BASE.size:
        return None
    base_n, base_id, digest, shared, depth = _BASE.unpack_from(data, offset)
    base = BaseRef(base_n, base_id.hex(), digest, shared, depth)
    return base if _base_fits(base, n_tokens) else None


def decode_blob(
    data: bytes | memoryview, expected_fp: str
) -> tuple[Header, list[int], memoryview] | None:
    """Fully verified (header, tokens, state) or None; the state is a view into `data`."""
    parsed = parse_head(data, expected_fp)
    if parsed is None:
        return None
    header, tokens = parsed
    if len(data) != header.payload_offset + header.payload_bytes:
        return None  # truncated or trailing garbage
    payload = memoryview(data)[header.payload_offset :]
    if _payload_digest(header.version, payload) != header.payload_digest:
        return None
    return header, tokens, payload


def name_tokens(name: str) -> int:
    """Token count from a blob name without full validation (-1 if none): cheap filter."""
    n_text = name.partition("-")[0]
    return int(n_text) if n_text.isdigit() else -1


def parse_name(name: str) -> tuple[int, str] | None:
    m = _NAME.fullmatch(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def blob_name(n_tokens: int, blob_id: str) -> str:
    return f"{n_tokens}-{blob_id}"


def blob_key(fp: str, name: str) -> str:
    return f"{fp}/blobs/{name}"


def index_dir(fp: str, boundary_key: str) -> str:
    return f"{fp}/index/{boundary_key[:2]}/{boundary_key}/"


def hits_key(fp: str, name: str) -> str:
    return f"{fp}/hits/{name}"
