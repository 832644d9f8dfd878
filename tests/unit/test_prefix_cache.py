from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import json
import logging
import multiprocessing
import os
import random
import struct
import subprocess
from collections import Counter
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest

from shared.prefix_cache import CacheHit, PrefixCache, restorable_tokens
from shared.prefix_cache.blobs import (
    BlobEntry,
    BlobStat,
    BlobStore,
    DirectoryBlobStore,
    MemoryBlobStore,
    file_system,
)
from shared.prefix_cache.format import FORMAT_VERSION, HEADER, MAGIC, encode_blob
from shared.prefix_cache.keys import prefix_key, token_bytes
from shared.prefix_cache.residency import uncached_read_rate

FP = "f00dfeed"
B = 8  # block_tokens: head boundaries at 1, 2, 4; full blocks at 8, 16, ...


class FakeClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class CountingStore:
    """Wraps a store and counts calls per method (the lookup cost unit)."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        self.calls["put"] += 1
        self.inner.put(key, data, durable=durable)

    def get(self, key: str) -> memoryview | None:
        self.calls["get"] += 1
        return self.inner.get(key)

    def get_head(self, key: str, n_bytes: int) -> bytes | None:
        self.calls["get_head"] += 1
        return self.inner.get_head(key, n_bytes)

    def stat(self, key: str) -> BlobStat | None:
        self.calls["stat"] += 1
        return self.inner.stat(key)

    def resident_bytes(self, key: str) -> int | None:
        self.calls["resident_bytes"] += 1
        return self.inner.resident_bytes(key)

    def touch(self, key: str, mtime_s: float) -> bool:
        self.calls["touch"] += 1
        return self.inner.touch(key, mtime_s)

    def delete(self, key: str) -> bool:
        self.calls["delete"] += 1
        return self.inner.delete(key)

    def list(self, prefix: str) -> builtins.list[str]:
        self.calls["list"] += 1
        return self.inner.list(prefix)

    def scan(self, prefix: str) -> builtins.list[BlobEntry]:
        self.calls["scan"] += 1
        return self.inner.scan(prefix)


class FailingStore(MemoryBlobStore):
    """Every write fails like a read-only or full disk."""

    def __init__(self, err: int) -> None:
        super().__init__()
        self.err = err

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        raise OSError(self.err, os.strerror(self.err))

    def touch(self, key: str, mtime_s: float) -> bool:
        raise OSError(self.err, os.strerror(self.err))


def make_cache(store: BlobStore | None = None, **kwargs: object) -> PrefixCache:
    options: dict[str, object] = {"block_tokens": B, "max_bytes": 10**9, "truncatable": True}
    options.update(kwargs)
    return PrefixCache(store or MemoryBlobStore(), FP, **options)  # type: ignore[arg-type]


def state_for(tokens: list[int]) -> bytes:
    return repr(tokens).encode() * 3


P = [11, 12, 13, 14, 15, 16, 17, 18, 21, 22, 23, 24, 25, 26, 27, 28, 31, 32, 33, 34]  # 20


def saved(truncatable: bool, *prefixes: list[int], store: BlobStore | None = None) -> PrefixCache:
    cache = make_cache(store, truncatable=truncatable)
    for tokens in prefixes:
        assert cache.save(tokens, state_for(tokens))
    return cache


def blob_files(root: Path) -> list[Path]:
    return sorted((root / FP / "blobs").glob("*"))


def markers(store: BlobStore) -> list[str]:
    return [e.key for e in store.scan(f"{FP}/index/")]


# ---- lookup semantics ----------------------------------------------------------------
#
# A restore may end only where the prompt's own cold prefill ends a chunk: at a multiple of
# B, or at limit = len(prompt) - 1 when the blob is exactly that prefix. Workers save
# prompt[:-1] after each job (plus, when not truncatable, the last block boundary below it).


@pytest.mark.parametrize("truncatable", [True, False])
def test_exact_repeat_hits_all_but_last_token(truncatable: bool) -> None:
    snapshot = P[:-1]  # what the worker saved after running P (19 tokens: mid-block)
    hit = saved(truncatable, snapshot).lookup(P)
    assert hit == CacheHit(19, state_for(snapshot), 19, prefix_key(snapshot, B, FP))


def test_blob_of_whole_prompt_is_cut_to_block_when_truncatable() -> None:
    hit = saved(True, P).lookup(P)  # 20 tokens held, limit 19: cells 16..19 had another shape
    assert hit == CacheHit(16, state_for(P), 20, prefix_key(P, B, FP))


def test_blob_of_whole_prompt_misses_when_not_truncatable() -> None:
    assert saved(False, P).lookup(P) is None


@pytest.mark.parametrize("truncatable", [True, False])
def test_longer_prompt_uses_whole_mid_block_blob_only_at_limit(truncatable: bool) -> None:
    cache = saved(truncatable, P)  # 20 tokens, ends mid-block
    hit = cache.lookup([*P, 7])  # limit 20 == blob: the cold run also ends a chunk at 20
    assert hit is not None and hit.n_tokens == 20 and hit.blob_tokens == 20
    assert hit.state == state_for(P)
    hit = cache.lookup([*P, 7, 7, 7])  # limit 22: cold run computes 16..21 in one chunk
    if truncatable:
        assert hit is not None and (hit.n_tokens, hit.blob_tokens) == (16, 20)
        assert hit.state == state_for(P)
    else:
        assert hit is None


@pytest.mark.parametrize("truncatable", [True, False])
def test_longer_prompt_uses_whole_block_aligned_blob(truncatable: bool) -> None:
    hit = saved(truncatable, P[:16]).lookup([*P, 7, 7, 7])
    assert hit is not None and (hit.n_tokens, hit.blob_tokens) == (16, 16)
    assert hit.state == state_for(P[:16])


def test_prompt_diverging_mid_block_truncatable() -> None:
    prompt = [*P[:18], 99, 99, 99, 99, 99]
    hit = saved(True, P).lookup(prompt)
    assert hit is not None and (hit.n_tokens, hit.blob_tokens) == (16, 20)
    hit = saved(True, P).lookup([*P[:15], 99, 99, 99])  # diverges inside block 2
    assert hit is not None and (hit.n_tokens, hit.blob_tokens) == (8, 20)


def test_prompt_diverging_mid_block_not_truncatable() -> None:
    prompt = [*P[:18], 99, 99, 99]
    assert saved(False, P).lookup(prompt) is None
    assert saved(False, P, P[:12]).lookup(prompt) is None  # exact but ends mid-block
    boundary = P[:16]
    hit = saved(False, P, P[:12], boundary).lookup(prompt)
    assert hit is not None and hit.n_tokens == 16 and hit.state == state_for(boundary)


def test_not_truncatable_prefers_block_boundary_blob_for_longer_prompt() -> None:
    # The worker's pair after running P: P[:19] (limit) and P[:16] (last block boundary).
    cache = saved(False, P[:19], P[:16])
    hit = cache.lookup([*P, 5, 6, 7])
    assert hit is not None and (hit.n_tokens, hit.blob_tokens) == (16, 16)
    assert hit.state == state_for(P[:16])
    hit = cache.lookup(P)  # the exact repeat still restores everything
    assert hit is not None and (hit.n_tokens, hit.blob_tokens) == (19, 19)
    hit = cache.lookup([*P[:19], 99])  # same limit, different last token
    assert hit is not None and hit.n_tokens == 19


def test_shorter_prompt_truncatable() -> None:
    hit = saved(True, P).lookup(P[:13])
    assert hit is not None and (hit.n_tokens, hit.blob_tokens) == (8, 20)
    hit = saved(True, P).lookup(P[:17])  # limit 16 is a block boundary
    assert hit is not None and (hit.n_tokens, hit.blob_tokens) == (16, 20)


def test_shorter_prompt_not_truncatable() -> None:
    assert saved(False, P).lookup(P[:13]) is None
    assert saved(False, P).lookup(P[:17]) is None


@pytest.mark.parametrize("truncatable", [True, False])
def test_prompts_shorter_than_one_block(truncatable: bool) -> None:
    short = [5, 6, 7]
    cache = saved(truncatable, short)
    assert (hit := cache.lookup([5, 6, 7, 8])) is not None and hit.n_tokens == 3
    assert cache.lookup(short) is None  # limit 2: no block boundary below it
    assert cache.lookup([5, 6]) is None
    assert cache.lookup([5, 6, 7, 8, 9]) is None  # limit 4 > 3, and 3 is mid-block


def test_short_prompt_uses_exact_blob_in_head_boundary() -> None:
    prompt = [11, 12, 13, 14, 15, 16, 40]  # diverges from P at 6 < B
    assert saved(True, P).lookup(prompt) is None  # only block 0 lies below the divergence
    cache = saved(True, P, P[:6])  # P[:6]: a worker's snapshot after running prompt
    hit = cache.lookup(prompt)
    assert hit is not None and (hit.n_tokens, hit.blob_tokens) == (6, 6)
    assert hit.state == state_for(P[:6])


def test_single_token_prompt_never_hits() -> None:
    cache = saved(True, [5], [5, 6])
    assert cache.lookup([5]) is None
    assert cache.lookup([]) is None


def test_foreign_fingerprint_never_reads_blobs() -> None:
    store = MemoryBlobStore()
    saved(True, P, store=store)
    other = PrefixCache(store, "0ther", block_tokens=B)
    assert other.lookup([*P, 1]) is None
    assert other.entries() == []


@pytest.mark.parametrize(
    ("common", "blob_tokens", "limit", "truncatable", "expected"),
    [
        (19, 19, 19, True, 19),  # exact repeat
        (19, 19, 19, False, 19),
        (16, 16, 22, True, 16),  # exact, ends on a block boundary
        (16, 16, 22, False, 16),
        (20, 20, 22, True, 16),  # exact but mid-block and short of limit
        (20, 20, 22, False, 0),
        (20, 20, 19, True, 16),  # longer than the prompt allows
        (20, 20, 19, False, 0),
        (18, 20, 22, True, 16),  # diverges mid-block
        (18, 20, 22, False, 0),
        (16, 20, 22, True, 16),  # diverges on a block boundary
        (16, 20, 22, False, 0),
        (16, 24, 16, True, 16),  # limit on a block boundary inside a longer blob
        (16, 24, 16, False, 0),
        (3, 3, 3, True, 3),  # shorter than one block
        (3, 3, 3, False, 3),
        (3, 3, 5, True, 0),
        (6, 20, 6, True, 0),
        (0, 20, 22, True, 0),
    ],
)
def test_usable_table(
    common: int, blob_tokens: int, limit: int, truncatable: bool, expected: int
) -> None:
    assert make_cache(truncatable=truncatable).usable(common, blob_tokens, limit) == expected


@pytest.mark.parametrize(
    ("common", "stored", "limit", "breaks", "stored_breaks", "truncatable", "expected"),
    [
        (20, 20, 25, (20,), (), True, 20),  # a document's state, ending mid-block at its end
        (20, 20, 25, (20,), (), False, 20),
        (20, 20, 25, (), (), True, 16),  # the same state, a prompt without that break
        (22, 24, 25, (20,), (20,), True, 20),  # memory: cut back to a shared break
        (22, 24, 25, (20,), (20,), False, 0),
        (22, 24, 25, (), (20,), True, 16),  # memory past a break this prompt lacks
        (22, 24, 25, (12,), (20,), True, 8),  # the prompt breaks where the state did not
        (22, 24, 25, (21,), (20,), True, 16),
        (18, 24, 25, (20,), (20,), True, 16),  # diverges before the break
    ],
)
def test_usable_with_breaks(
    common: int,
    stored: int,
    limit: int,
    breaks: tuple[int, ...],
    stored_breaks: tuple[int, ...],
    truncatable: bool,
    expected: int,
) -> None:
    got = restorable_tokens(common, stored, limit, B, truncatable, breaks, stored_breaks)
    assert got == expected


# (common, stored, breaks, stored_breaks, truncatable, expected) against a limit of 299 tokens
# in 128-token chunks. Granule 4: a restore may end inside a chunk at a multiple of 4.
GRANULE_4 = [
    (203, 230, (), (), True, 200),  # a multiple of 4 inside the block from 128
    (240, 250, (), (), True, 224),  # 32 tokens left to read in the chunk, at least
    (203, 230, (150,), (150,), True, 202),  # ... from the shared break at 150, a chunk start
    (159, 230, (), (), True, 128),  # fewer than 32 tokens of the chunk read before it
    (240, 250, (200,), (), True, 168),  # the state ended no chunk at 200, this prompt does
    (203, 230, (), (), False, 0),  # memory that cannot be cut back keeps the old rule
    (256, 256, (), (), False, 256),
    (290, 300, (), (), True, 264),  # the last chunk ends at the limit, 299: 32 before it
]
# Shape-free rows (granule 1, prompt pieces that share passes): at any shared token.
SHAPE_FREE = [
    (150, 200, (100,), (120,), True, 150),  # cut back to the last shared token
    (250, 200, (), (), True, 200),  # a whole state, ending inside a chunk
    (400, 400, (), (), True, 299),  # never past the token read fresh
    (150, 200, (), (), False, 0),  # a memory that cannot be cut: not inside the state
    (250, 200, (100,), (), False, 200),  # but the whole of one, wherever it ends
]


@pytest.mark.parametrize(
    ("granule", "shape_free", "case"),
    [(4, False, case) for case in GRANULE_4] + [(1, True, case) for case in SHAPE_FREE],
)
def test_a_restore_ends_inside_a_chunk_by_the_granule_or_at_any_token_where_shape_free(
    granule: int,
    shape_free: bool,
    case: tuple[int, int, tuple[int, ...], tuple[int, ...], bool, int],
) -> None:
    """Each rule reaches at least as far as the one before it (no granule; granule 1 alone)."""
    common, stored, breaks, stored_breaks, truncatable, expected = case
    args = (common, stored, 299, 128, truncatable, breaks, stored_breaks)
    got = restorable_tokens(*args, granule, shape_free)
    assert got == expected
    assert restorable_tokens(*args, granule if shape_free else None) <= got


def test_lookup_restores_a_document_prefix_ending_mid_block() -> None:
    cache = saved(False, P)  # 20 tokens: a document prefix, block size 8
    prompt = [*P, 7, 8, 9]
    assert cache.lookup(prompt) is None  # without the break: the cold run chunks differently
    hit = cache.lookup(prompt, breaks=(20,))
    assert hit is not None and hit.n_tokens == 20


def test_a_state_restores_whole_only_for_prompts_with_its_breaks() -> None:
    """A state is saved with where its prefill ended chunks (here also at 12, a message's
    start): only a prompt whose cold prefill ends chunks there too may restore past it."""
    cache = make_cache()
    assert cache.save(P, state_for(P), breaks=(12,))
    prompt = [*P, 7, 8, 9]
    hit = cache.lookup(prompt, breaks=(12, 20))
    assert hit is not None and hit.n_tokens == 20
    # Without the break at 12 a cold run computes [8, 16) in one chunk: only block 0 matches.
    hit = cache.lookup(prompt, breaks=(20,))
    assert hit is not None and hit.n_tokens == 8


def test_a_state_with_a_break_before_the_first_block_boundary_is_found() -> None:
    """Ranked by name alone, such a state (a system prompt's end before the first boundary,
    then a document) seemed restorable to no token, and was never read."""
    cache = make_cache()
    assert cache.save(P, state_for(P), breaks=(3,))
    hit = cache.lookup([*P, 7, 8, 9], breaks=(3, 20))
    assert hit is not None and hit.n_tokens == 20
    # A prompt parting from it mid-block: found by reading its head, cut back to block 16.
    hit = cache.lookup([*P[:18], 99, 98, 97], breaks=(3, 18))
    assert hit is not None and hit.n_tokens == 16
    assert cache.lookup([*P, 7, 8, 9], breaks=(20,)) is None  # without the break at 3


def test_a_longer_state_with_breaks_leaves_a_shorter_one_without() -> None:
    cache = saved(True, P[:16])
    assert cache.save(P, state_for(P), breaks=(12,))
    hit = cache.lookup([*P[:16], 5])  # a prompt chunked on the grid alone, to block 16
    assert hit is not None and hit.n_tokens == 16


@pytest.mark.parametrize("truncatable", [True, False])
def test_random_lookups_match_brute_force(truncatable: bool) -> None:
    rng = random.Random(1234 + truncatable)
    block = 4
    cache = make_cache(truncatable=truncatable, block_tokens=block, max_probes=10**6)
    saved_seqs = [[rng.randint(1, 3) for _ in range(rng.randint(1, 14))] for _ in range(40)]
    for seq in saved_seqs:
        assert cache.save(seq, state_for(seq))
    stored_ids = {e.key for e in cache.entries()}
    stored = [s for s in saved_seqs if prefix_key(s, block, FP) in stored_ids]
    kinds: Counter[str] = Counter()
    for _ in range(400):
        prompt = [rng.randint(1, 3) for _ in range(rng.randint(1, 18))]
        hit = cache.lookup(prompt)
        best = _brute_force_best(stored, prompt, truncatable, block)
        assert (0 if hit is None else hit.n_tokens) == best, prompt
        if hit is None:
            kinds["miss"] += 1
            continue
        blob = next(s for s in stored if prefix_key(s, block, FP) == hit.key)
        assert hit.state == state_for(blob) and hit.blob_tokens == len(blob)
        assert blob[: hit.n_tokens] == prompt[: hit.n_tokens]
        assert hit.n_tokens <= len(prompt) - 1
        if hit.n_tokens % block:
            assert hit.n_tokens == len(prompt) - 1 == len(blob)
            kinds["at_limit"] += 1
        else:
            kinds["cut" if hit.n_tokens < len(blob) else "at_block"] += 1
    # Every branch of the rule was exercised (cutting needs a truncatable cache).
    assert kinds["miss"] and kinds["at_limit"] and kinds["at_block"]
    assert bool(kinds["cut"]) == truncatable


def _brute_force_best(
    stored: list[list[int]], prompt: list[int], truncatable: bool, block: int
) -> int:
    """Try every point where a cold prefill of `prompt` ends a chunk, against every blob."""
    limit = len(prompt) - 1
    chunk_ends = {*range(block, limit + 1, block), limit}
    best = 0
    for s in stored:
        for end in chunk_ends:
            if end < 1 or end > len(s) or s[:end] != prompt[:end]:
                continue
            exact = end == len(s)  # the blob's own last chunk ended here too
            if exact or (truncatable and end % block == 0):
                best = max(best, end)
    return best


def _cells(tokens: list[int], start: int, end: int, block: int) -> list[list[int]]:
    """Cold-prefill model: a cell's value is its token plus the shape of its chunk."""
    out: list[list[int]] = []
    position = start
    while position < end:
        chunk_end = min(position - position % block + block, end)
        out += [[t, position, chunk_end] for t in tokens[position:chunk_end]]
        position = chunk_end
    return out


@pytest.mark.parametrize("truncatable", [True, False])
def test_warm_runs_compute_the_same_cells_as_cold_runs(truncatable: bool) -> None:
    """Simulate the worker: restore, prefill the rest in canonical chunks, save snapshots."""
    rng = random.Random(99 + truncatable)
    block = 4
    cache = make_cache(truncatable=truncatable, block_tokens=block, max_probes=10**6)
    stems = [[rng.randint(1, 50) for _ in range(rng.randint(0, 12))] for _ in range(6)]
    reused = 0
    for _ in range(300):
        prompt = [*rng.choice(stems), *(rng.randint(1, 3) for _ in range(rng.randint(0, 9)))]
        if len(prompt) < 2:
            continue
        limit = len(prompt) - 1
        hit = cache.lookup(prompt)
        cells: list[list[int]] = []
        if hit is not None:
            if not truncatable:
                assert hit.n_tokens == hit.blob_tokens
            cells = json.loads(bytes(hit.state))[: hit.n_tokens]
        restored = len(cells)
        cells += _cells(prompt, restored, limit, block)
        assert cells == _cells(prompt, 0, limit, block), (prompt, restored)
        reused += restored
        points = {limit} if truncatable else {limit, limit - limit % block}
        for point in sorted(p for p in points if p > restored):
            cache.save(prompt[:point], json.dumps(cells[:point]).encode())
    assert reused > 300  # the cache was actually used


# ---- save: dedupe, redundancy ---------------------------------------------------------


def test_saving_same_prefix_twice_is_cheap_noop() -> None:
    store = CountingStore(MemoryBlobStore())
    cache = make_cache(store)
    assert cache.save(P, state_for(P))
    store.calls.clear()
    assert cache.save(P, b"different state")
    assert store.calls["put"] == 0 and store.calls["scan"] == 0
    assert (hit := cache.lookup([*P, 1])) is not None and hit.state == state_for(P)


def test_extension_replaces_shorter_blob_when_truncatable() -> None:
    store = MemoryBlobStore()
    cache = saved(True, P[:8], P, store=store)
    assert [e.n_tokens for e in cache.entries()] == [20]
    assert all(k.endswith(f"20-{prefix_key(P, B, FP)}") for k in markers(store))
    assert (hit := cache.lookup([*P[:8], 1])) is not None and hit.n_tokens == 8


def test_extension_keeps_serving_mid_block_prefix_fully() -> None:
    # The longer blob could serve it only cut back to 8 tokens, so the 10-token one stays.
    cache = saved(True, P[:10], P)
    assert (hit := cache.lookup([*P[:10], 1])) is not None and hit.n_tokens == 10


def test_extension_keeps_shorter_blob_when_not_truncatable() -> None:
    cache = saved(False, P[:10], P)
    assert sorted(e.n_tokens for e in cache.entries()) == [10, 20]


def test_extension_keeps_hot_shorter_blob() -> None:
    cache = saved(True, P[:10])
    for _ in range(2):
        assert cache.lookup([*P[:10], 1]) is not None
    assert cache.save(P, state_for(P))
    assert sorted(e.n_tokens for e in cache.entries()) == [10, 20]


def test_save_ignores_empty_input() -> None:
    cache = make_cache()
    assert cache.save([], b"x") is False
    assert cache.save([1, 2], b"") is False


# ---- corruption -------------------------------------------------------------------


def _corrupt_then_lookup(
    tmp_path: Path, damage: str, map_reads: bool
) -> tuple[CacheHit | None, PrefixCache]:
    store = DirectoryBlobStore(tmp_path, map_reads=map_reads)
    cache = saved(True, P, store=store)
    (path,) = blob_files(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "payload":
        data[-5] ^= 0x01
    elif damage == "header":
        data[10] ^= 0x40
    elif damage == "tokens":
        data[len(data) - len(state_for(P)) - 3] ^= 0x01
    elif damage == "digest_padding":  # the zero bytes after the 16-byte XXH3 digest
        data[HEADER.size - 1] ^= 0x01
    elif damage == "unknown_version":
        struct.pack_into("<H", data, len(MAGIC), FORMAT_VERSION + 1)
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "foreign":
        data = bytearray(encode_blob("0ther", B, P, state_for(P)))
    elif damage == "breaks":  # a break moved from 12 to 13: covered by the tokens' digest
        data = bytearray(encode_blob(FP, B, P, state_for(P), breaks=(12,)))
        data[len(data) - len(state_for(P)) - 4] ^= 0x01
    elif damage == "wrong_tokens":
        other = [*P[:-1], 77]
        data = bytearray(encode_blob(FP, B, other, state_for(other)))
    path.write_bytes(bytes(data))
    return cache.lookup([*P, 1]), cache


@pytest.mark.parametrize(
    "damage",
    [
        "payload",
        "header",
        "tokens",
        "breaks",
        "digest_padding",
        "unknown_version",
        "truncated",
        "foreign",
        "wrong_tokens",
    ],
)
@pytest.mark.parametrize("map_reads", [True, False])
def test_damaged_blob_is_a_miss_and_removed(
    tmp_path: Path, damage: str, map_reads: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        hit, cache = _corrupt_then_lookup(tmp_path, damage, map_reads)
    assert hit is None
    assert blob_files(tmp_path) == []
    assert "corrupt" in caplog.text
    assert cache.lookup([*P, 1]) is None
    assert cache.verify().orphans_removed >= 0
    assert not list((tmp_path / FP).rglob("*-*"))  # no markers left behind


def test_corrupt_long_blob_falls_back_to_shorter(tmp_path: Path) -> None:
    store = DirectoryBlobStore(tmp_path)
    cache = saved(False, P[:16], P, store=store)  # the worker's pair after running [*P, 1]
    long_path = next(p for p in blob_files(tmp_path) if p.name.startswith("20-"))
    long_path.write_bytes(long_path.read_bytes()[:-1])
    hit = cache.lookup([*P, 1])
    assert hit is not None and hit.n_tokens == 16 and hit.state == state_for(P[:16])
    assert not long_path.exists()


def version_1_blob(tokens: list[int], state: bytes) -> bytes:
    """A blob as granary wrote it before format 2: the state checked by BLAKE2b-256."""
    fp = FP.encode()
    digest = hashlib.blake2b(state, digest_size=32).digest()
    header = HEADER.pack(
        MAGIC,
        1,
        len(fp),
        B,
        len(tokens),
        len(state),
        hashlib.sha256(token_bytes(tokens)).digest(),
        digest,
    )
    return header + fp + token_bytes(tokens) + state


def _stored_as_version_1(tmp_path: Path) -> tuple[PrefixCache, Path]:
    cache = saved(True, P, store=DirectoryBlobStore(tmp_path))
    (path,) = blob_files(tmp_path)
    assert HEADER.unpack_from(path.read_bytes())[1] == FORMAT_VERSION == 2
    path.write_bytes(version_1_blob(P, state_for(P)))  # same name and markers: an older cache
    return cache, path


def test_version_1_blob_still_restores(tmp_path: Path) -> None:
    cache, _ = _stored_as_version_1(tmp_path)
    hit = cache.lookup([*P, 1])
    assert hit is not None and hit.n_tokens == 20 and hit.state == state_for(P)
    assert cache.verify().removed == 0


def test_damaged_version_1_payload_is_a_miss_and_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache, path = _stored_as_version_1(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert cache.lookup([*P, 1]) is None
    assert not path.exists() and "corrupt" in caplog.text


def test_blob_deleted_behind_markers_is_lazily_unindexed() -> None:
    store = MemoryBlobStore()
    cache = saved(True, P, store=store)
    store.delete(f"{FP}/blobs/20-{prefix_key(P, B, FP)}")
    assert cache.lookup(P[:3]) is None  # walks boundaries 2 and 1 only
    assert len(markers(store)) == 3
    assert cache.lookup([*P, 1]) is None  # walks 16, 8, 4
    assert markers(store) == []


def test_verify_reports_and_removes_bad_blobs(tmp_path: Path) -> None:
    store = DirectoryBlobStore(tmp_path)
    cache = saved(False, P[:10], P, [1, 2, 3], store=store)
    bad = next(p for p in blob_files(tmp_path) if p.name.startswith("10-"))
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    report = cache.verify()
    assert (report.checked, report.ok, report.removed) == (3, 2, 1)
    assert report.bytes_removed == len(data)
    assert sorted(e.n_tokens for e in cache.entries()) == [3, 20]
    assert cache.verify().removed == 0


# ---- concurrency across processes ------------------------------------------------------


RACE_PREFIXES = [[100 + i, *P] for i in range(30)]


def _race_saver(root: str, fill: int, size: int, start: Event) -> None:
    cache = PrefixCache(DirectoryBlobStore(root), FP, block_tokens=B)
    store = DirectoryBlobStore(root)
    start.wait()
    for tokens in RACE_PREFIXES:
        cache.save(tokens, bytes([fill]) * size)
    # Then overwrite one blob repeatedly, as a dedupe-free worst case.
    key = f"{FP}/blobs/{len(P) + 1}-{prefix_key(RACE_PREFIXES[0], B, FP)}"
    for _ in range(40):
        store.put(key, encode_blob(FP, B, RACE_PREFIXES[0], bytes([fill]) * size))


def test_processes_racing_to_save_same_prefixes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    payloads = {b"A" * 3000, b"B" * 70000}
    procs = [
        ctx.Process(target=_race_saver, args=(str(tmp_path), fill, size, start))
        for fill, size in ((ord("A"), 3000), (ord("B"), 70000))
    ]
    for p in procs:
        p.start()
    start.set()
    reader = make_cache(DirectoryBlobStore(tmp_path))
    while any(p.is_alive() for p in procs):  # concurrent readers never see torn blobs
        hit = reader.lookup([*RACE_PREFIXES[0], 5])
        assert hit is None or hit.state in payloads
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(blob_files(tmp_path)) == len(RACE_PREFIXES)
    for tokens in RACE_PREFIXES:
        hit = reader.lookup([*tokens, 5])
        assert hit is not None and hit.state in payloads and hit.n_tokens == len(tokens)
    assert reader.verify().removed == 0
    assert "corrupt" not in caplog.text  # no reader ever saw a torn or mixed blob
    assert not list(tmp_path.rglob(".*"))  # no temp files left


# ---- budget and eviction --------------------------------------------------------------


def _fill_cold(cache: PrefixCache, clock: FakeClock, count: int) -> list[list[int]]:
    colds = [[500 + i, *range(30)] for i in range(count)]
    for tokens in colds:
        clock.now_s += 10
        assert cache.save(tokens, bytes(1000))
    return colds


def _budget_cache(store: BlobStore, clock: FakeClock) -> PrefixCache:
    blob_bytes = len(encode_blob(FP, B, [0] * 31, bytes(1000)))
    return make_cache(store, max_bytes=5 * blob_bytes, clock=clock)


@pytest.fixture(params=["memory", "directory"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    return MemoryBlobStore() if request.param == "memory" else DirectoryBlobStore(tmp_path)


def test_hot_short_prefix_survives_cold_flood(any_store: BlobStore) -> None:
    clock = FakeClock()
    cache = _budget_cache(any_store, clock)
    hot = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert cache.save(hot, bytes(800))
    for _ in range(2):
        clock.now_s += 1
        assert cache.lookup([*hot, 42]) is not None
    colds = _fill_cold(cache, clock, 20)
    assert (hit := cache.lookup([*hot, 42])) is not None and hit.n_tokens == 10
    stats = cache.stats()
    assert stats.store_bytes <= stats.max_bytes and stats.evictions >= 15
    assert cache.lookup([*colds[0], 1]) is None
    assert cache.lookup([*colds[-1], 1]) is not None


def test_unhit_prefix_is_evicted_lru(any_store: BlobStore) -> None:
    clock = FakeClock()
    cache = _budget_cache(any_store, clock)
    once = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert cache.save(once, bytes(800))
    assert cache.lookup([*once, 42]) is not None  # a single hit does not protect
    colds = _fill_cold(cache, clock, 20)
    assert cache.lookup([*once, 42]) is None
    kept = sorted(e.last_used_s for e in cache.entries())
    assert kept == [clock.now_s - 10 * i for i in reversed(range(len(kept)))]
    assert cache.lookup([*colds[-len(kept)], 1]) is not None


def test_eviction_removes_markers_and_hits(any_store: BlobStore) -> None:
    clock = FakeClock()
    store = any_store
    cache = _budget_cache(store, clock)
    _fill_cold(cache, clock, 12)
    names = {e.key.rsplit("/", 1)[-1] for e in store.scan(f"{FP}/blobs/")}
    assert len(names) == 5
    assert {k.rsplit("/", 1)[-1] for k in markers(store)} == names
    assert cache.verify().orphans_removed == 0


def test_budget_is_shared_between_caches_and_fingerprints() -> None:
    clock = FakeClock()
    store = MemoryBlobStore()
    first = _budget_cache(store, clock)
    _fill_cold(first, clock, 5)
    other = PrefixCache(
        store, "0ther", block_tokens=B, max_bytes=first.stats().max_bytes, clock=clock
    )
    for i in range(3):
        clock.now_s += 10
        assert other.save([900 + i, *range(30)], bytes(1000))
    assert other.stats().store_bytes <= other.stats().max_bytes
    assert len(first.entries()) == 2 and len(other.entries()) == 3
    assert first.verify().orphans_removed == 0  # evicted foreign blobs lost their markers


def test_prune_enforces_smaller_budget_and_clear_empties() -> None:
    clock = FakeClock()
    store = MemoryBlobStore()
    big = make_cache(store, clock=clock)
    _fill_cold(big, clock, 6)
    small = _budget_cache(store, clock)
    assert small.prune() > 0
    assert len(small.entries()) == 5 and small.prune() == 0
    assert small.clear() == 5
    assert store.scan(f"{FP}/") == []


def test_stats_and_entries() -> None:
    clock = FakeClock(5000.0)
    cache = make_cache(clock=clock)
    cache.save(P, state_for(P))
    clock.now_s = 6000.0
    cache.lookup([*P, 1])
    cache.lookup([9, 9, 9])
    stats = cache.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.hit_tokens) == (1, 1, 1, 20)
    assert stats.bytes == stats.bytes_written == len(encode_blob(FP, B, P, state_for(P)))
    assert stats.bytes_read == len(state_for(P))
    (entry,) = cache.entries()
    assert (entry.n_tokens, entry.last_used, entry.hits) == (20, 6000.0, 1)


# ---- failures never reach the caller ------------------------------------------------


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_write_failures_make_save_return_false(err: int, caplog: pytest.LogCaptureFixture) -> None:
    cache = make_cache(FailingStore(err))
    with caplog.at_level(logging.WARNING, logger="shared.prefix_cache"):
        assert cache.save(P, state_for(P)) is False
    assert "save skipped" in caplog.text


@contextlib.contextmanager
def read_only_directory(path: Path) -> Iterator[Path]:
    """A directory no write reaches: by its mode for a user, and for root (whom modes do not
    stop) a read-only tmpfs mounted there, as a read-only cache mount would be."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_read_only_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with read_only_directory(tmp_path / "ro") as root:
        cache = make_cache(DirectoryBlobStore(root))
        with caplog.at_level(logging.WARNING):
            assert cache.save(P, state_for(P)) is False
        assert "save skipped" in caplog.text
        assert cache.lookup([*P, 1]) is None


class FreezableStore(MemoryBlobStore):
    """Writable until frozen; then every write fails as on a read-only mount."""

    frozen = False

    def _check(self) -> None:
        if self.frozen:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        self._check()
        super().put(key, data, durable=durable)

    def touch(self, key: str, mtime_s: float) -> bool:
        self._check()
        return super().touch(key, mtime_s)

    def delete(self, key: str) -> bool:
        self._check()
        return super().delete(key)


def test_hits_survive_a_cache_that_cannot_be_written(caplog: pytest.LogCaptureFixture) -> None:
    store = FreezableStore()
    cache = saved(True, P, store=store)
    store.frozen = True
    with caplog.at_level(logging.WARNING, logger="shared.prefix_cache"):
        hits = [cache.lookup([*P, 1]) for _ in range(3)]
    assert all(hit is not None and hit.n_tokens == 20 for hit in hits)
    assert cache.stats().hits == 3
    # Reported once, not at every hit.
    assert caplog.text.count("cannot write to the cache") == 1


def _chattr(flag: str, root: Path) -> bool:
    paths = [root, *root.rglob("*")]
    return subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True).returncode == 0


def test_hits_survive_an_immutable_cache_directory(tmp_path: Path) -> None:
    """A real directory whose files and folders are immutable (chattr +i: even root cannot
    write, touch or delete them), as when an operator freezes a warmed cache."""
    cache = saved(True, P, store=DirectoryBlobStore(tmp_path / "kv"))
    if not _chattr("+i", tmp_path / "kv"):
        if os.environ.get("CI"):
            pytest.fail("chattr +i failed: CI must run this test (root, ext4/xfs/tmpfs)")
        pytest.skip("chattr +i needs root and a file system that supports it")
    try:
        hit = cache.lookup([*P, 1])
        assert hit is not None and hit.n_tokens == 20 and hit.state == state_for(P)
        assert cache.save([*P, 41], state_for([*P, 41])) is False
    finally:
        _chattr("-i", tmp_path / "kv")


def test_unwritable_path_on_real_file_system(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    cache = make_cache(DirectoryBlobStore(blocker / "cache"))
    assert cache.save(P, state_for(P)) is False
    assert cache.lookup([*P, 1]) is None
    assert cache.stats().entries == 0


class BrokenReadStore(MemoryBlobStore):
    def get(self, key: str) -> bytes | None:
        raise OSError(errno.EIO, "I/O error")


def test_read_errors_make_lookup_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    cache = saved(True, P, store=BrokenReadStore())
    with caplog.at_level(logging.WARNING):
        assert cache.lookup([*P, 1]) is None
    assert "treating as miss" in caplog.text
    assert cache.stats().misses == 1


def test_foreign_files_in_shared_root_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "README.txt").write_text("not a cache")
    cache = make_cache(DirectoryBlobStore(tmp_path), max_bytes=1)
    assert cache.prune() == 0
    assert cache.save([1, 2], b"x") is False  # over budget, but no crash
    assert (tmp_path / "README.txt").exists()


def test_verify_keeps_blobs_of_a_different_block_size() -> None:
    store = MemoryBlobStore()
    other = make_cache(store, block_tokens=4)
    assert other.save(P, state_for(P))
    assert saved(True, P[:5], store=store).verify().removed == 0
    assert (hit := other.lookup([*P, 1])) is not None and hit.n_tokens == 20


def test_state_larger_than_budget_is_skipped() -> None:
    cache = make_cache(max_bytes=100)
    assert cache.save(P, bytes(1000)) is False
    assert cache.entries() == []


# ---- lookup cost ------------------------------------------------------------------


SYSTEM = [7, 7, 7, 7, 7, 7, 7, 7]  # one full block shared by every entry


def _lookup_costs(n_entries: int) -> list[Counter[str]]:
    store = CountingStore(MemoryBlobStore())
    cache = make_cache(store)
    for i in range(n_entries):
        tokens = [*SYSTEM, 1000 + i, *range(15)]
        assert cache.save(tokens, b"s")
    prompts = [
        [*SYSTEM, 1005, *range(15), 1, 2],  # hit on a stored entry
        [*SYSTEM, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5],  # only the shared block matches
        [3] * 40,  # nothing matches
    ]
    costs = []
    for prompt, expected in zip(prompts, (24, 8, 0), strict=True):
        store.calls.clear()
        hit = cache.lookup(prompt)
        costs.append(Counter(store.calls))
        assert (0 if hit is None else hit.n_tokens) == expected
    return costs


def test_lookup_cost_independent_of_entry_count() -> None:
    small, large = _lookup_costs(10), _lookup_costs(1000)
    assert small == large
    boundaries_in_longest_prompt = 3 + 40 // B
    for cost in large:
        assert sum(cost.values()) <= boundaries_in_longest_prompt + 2 * 4 + 3


def test_lookup_below_min_tokens_reads_nothing_and_counts_no_hit() -> None:
    cache = saved(False, P[:16])
    assert cache.lookup([*P, 1], min_tokens=17) is None
    assert cache.counters()["hits"] == 0
    assert cache.entries()[0].hits == 0


def test_a_directory_store_tells_what_the_page_cache_holds(tmp_path: Path) -> None:
    store = DirectoryBlobStore(tmp_path)
    store.put("a/b", b"x" * 70_000)
    assert store.resident_bytes("a/b") == 70_000  # just written: every page is in memory
    assert store.resident_bytes("a/missing") is None
    path = tmp_path / "a" / "b"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    dropped = store.resident_bytes("a/b")
    # A disk file system drops its clean pages; tmpfs keeps them (it has nowhere else).
    assert dropped == 0 or file_system(tmp_path, Path("/proc/self/mounts").read_text()) == "tmpfs"
    with open(path, "rb") as f:
        f.read()
    assert store.resident_bytes("a/b") == 70_000


def test_a_directory_reads_at_a_measured_rate_and_keeps_no_probe(tmp_path: Path) -> None:
    rate = uncached_read_rate(tmp_path, 256 * 1024)
    in_memory = file_system(tmp_path, Path("/proc/self/mounts").read_text()) == "tmpfs"
    assert (rate is None) if in_memory else (rate is not None and rate > 0)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_bytes(b"")
    assert uncached_read_rate(tmp_path / "file" / "under-it") is None


def test_a_restore_that_could_not_pay_reads_not_even_a_head() -> None:
    store = CountingStore(MemoryBlobStore())
    cache = make_cache(store)
    assert cache.save(P[:16], state_for(P[:16]), (12,))
    store.calls.clear()
    # The prompt shares the stored state's break: what it may restore depends on the state's
    # breaks, which only its head says; a no from its size alone reads nothing.
    assert cache.lookup([*P, 7], breaks=(12,), pays=lambda offer: False) is None
    assert store.calls["get_head"] == store.calls["get"] == 0
    hit = cache.lookup([*P, 7], breaks=(12,), pays=lambda offer: True)
    assert hit is not None and hit.n_tokens == 16
