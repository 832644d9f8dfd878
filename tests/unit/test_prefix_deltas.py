"""Deltas in the prefix cache, on states shaped as llama.cpp writes them (no model needed).

A fake cell's bytes depend on its tokens up to it and on how it was computed (`how`), as a real
KV cell depends on its prefix and on the shape of the chunk that computed it. The real model's
states are tested in tests/integration/test_prefix_cache_engine.py.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from shared.prefix_cache import PrefixCache, ReadOffer
from shared.prefix_cache.blobs import MemoryBlobStore
from shared.prefix_cache.format import (
    MAX_DEPTH,
    blob_key,
    blob_name,
    decode_blob,
    parse_head,
)
from shared.prefix_cache.keys import prefix_key
from shared.prefix_cache.state_layout import compose, leading_equal, parse

FP = "fp-deltas"
B = 16
LAYERS = 2
K_ROW = 64
V_EMBD = 16
V_EL = 2
CELL_BYTES = 12 + LAYERS * (K_ROW + V_EMBD * V_EL)


def cell_bytes(tokens: list[int], i: int, how: str, n: int) -> bytes:
    digest = hashlib.blake2b(repr((tokens[: i + 1], how)).encode(), digest_size=64).digest()
    return (digest * ((n // 64) + 1))[:n]


def fake_state(
    tokens: list[int],
    how: str = "canonical",
    *,
    v_trans: bool = True,
    seq: int = 0,
    n_stream: int = 1,
) -> bytes:
    """A llama_state_seq_get_data buffer: header, cell metadata, K rows, V rows or columns."""
    n = len(tokens)
    stream = seq if n_stream > 1 else 0
    out = [struct.pack("<IiI", 0xAF143CD8, seq, n_stream)]
    out += [struct.pack("<I", 0)] * stream
    out.append(struct.pack("<I", n))
    out += [struct.pack("<iIi", i, 1, seq) for i in range(n)]
    out.append(struct.pack("<II", int(v_trans), LAYERS))
    for layer in range(LAYERS):
        out.append(struct.pack("<iQ", 1, K_ROW))
        out += [cell_bytes(tokens, i, f"{how}k{layer}", K_ROW) for i in range(n)]
    for layer in range(LAYERS):
        cells = [cell_bytes(tokens, i, f"{how}v{layer}", V_EMBD * V_EL) for i in range(n)]
        if v_trans:
            out.append(struct.pack("<iII", 1, V_EL, V_EMBD))
            for j in range(V_EMBD):
                out += [c[j * V_EL : (j + 1) * V_EL] for c in cells]
        else:
            out.append(struct.pack("<iQ", 1, V_EMBD * V_EL))
            out += cells
    out += [struct.pack("<I", 0)] * (n_stream - stream - 1)
    return b"".join(out)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


SYSTEM = toks(1000, 40)


def make_cache(store: MemoryBlobStore | None = None, **options: object) -> PrefixCache:
    return PrefixCache(store or MemoryBlobStore(), FP, block_tokens=B, **options)  # type: ignore[arg-type]


def head(cache: PrefixCache, tokens: list[int]):  # type: ignore[no-untyped-def]
    data = cache._store.get(key_of(tokens))
    assert data is not None
    parsed = parse_head(data, FP)
    assert parsed is not None
    return parsed[0]


def key_of(tokens: list[int]) -> str:
    return blob_key(FP, blob_name(len(tokens), prefix_key(tokens, B, FP)))


def restored(cache: PrefixCache, prompt: list[int]) -> tuple[int, bytes] | None:
    hit = cache.lookup(prompt)
    return None if hit is None else (hit.n_tokens, bytes(hit.state))


# --- the layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("v_trans", [True, False])
def test_cells_split_and_join_back_into_the_same_state(v_trans: bool) -> None:
    tokens = toks(0, 30)
    state = fake_state(tokens, v_trans=v_trans)
    layout = parse(state)
    assert layout is not None and layout.n_cells == 30
    head_part = parse(compose(layout, [(layout, 0, 12)]).tobytes())
    tail_part = parse(compose(layout, [(layout, 12, 30)]).tobytes())
    assert head_part is not None and tail_part is not None
    assert head_part.n_cells == 12 and tail_part.n_cells == 18
    joined = compose(tail_part, [(head_part, 0, 12), (tail_part, 0, 18)])
    assert joined.tobytes() == state
    # The short state is the one computed for the first 12 tokens.
    assert compose(layout, [(layout, 0, 12)]).tobytes() == fake_state(tokens[:12], v_trans=v_trans)


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("differs_at", [0, 1, 16, 17, 29])
def test_leading_equal_finds_the_first_cell_that_differs(v_trans: bool, differs_at: int) -> None:
    a = parse(fake_state(toks(0, 30), v_trans=v_trans))
    b = parse(fake_state([*toks(0, differs_at), *toks(500, 30 - differs_at)], v_trans=v_trans))
    assert a is not None and b is not None
    assert leading_equal(b, [(a, 0, 30)], 30) == differs_at
    assert leading_equal(b, [(a, 0, 30)], 9) == min(9, differs_at)
    assert leading_equal(a, [(a, 0, 30)], 30) == 30
    # The same cells read from two segments: a base and the delta on it.
    head = parse(compose(a, [(a, 0, 12)]).tobytes())
    assert head is not None
    assert leading_equal(b, [(head, 0, 12), (a, 12, 30)], 30) == differs_at
    other = parse(fake_state(toks(0, 30), "another chunking", v_trans=v_trans))
    assert other is not None and leading_equal(other, [(a, 0, 30)], 30) == 0


def test_states_of_unknown_shape_do_not_parse() -> None:
    good = fake_state(toks(0, 8))
    assert parse(good) is not None
    assert parse(good + b"\0") is None  # trailing bytes (a second cache: sliding window)
    assert parse(good[:-1]) is None
    assert parse(b"\0" * len(good)) is None  # no magic
    assert parse(b"not a state at all") is None
    several = bytearray(good)
    struct.pack_into("<I", several, 12 + 4 + 4, 2)  # a cell of two sequences
    assert parse(bytes(several)) is None


# --- saving deltas ---------------------------------------------------------------------------


def test_prompts_sharing_a_start_store_it_once() -> None:
    """The issue's target: bytes on disk follow the unique tokens, not the saved ones."""
    cache = make_cache()
    prompts = [[*SYSTEM, *toks(10_000 + 100 * i, 50)] for i in range(10)]
    for prompt in prompts:
        assert cache.save(prompt, fake_state(prompt))
    unique = len(SYSTEM) + 50 * len(prompts)
    stats = cache.stats()
    assert stats.entries == 10
    assert stats.bytes < 1.3 * unique * CELL_BYTES  # headers and token lists on top
    assert stats.bytes < 0.7 * sum(len(p) for p in prompts) * CELL_BYTES  # 0.6 unique
    first = head(cache, prompts[0])
    assert first.base is None
    for prompt in prompts[1:]:
        # Every one stands on the first, not on the one before: chains stay one deep.
        ref = head(cache, prompt).base
        assert ref is not None and ref.name == key_of(prompts[0]).rsplit("/", 1)[1]
        assert ref.shared == len(SYSTEM) and ref.depth == 1
    for prompt in prompts:
        assert restored(cache, [*prompt, 7]) == (len(prompt), fake_state(prompt))


def test_a_state_extending_a_stored_one_restores_through_the_chain() -> None:
    cache = make_cache()
    doc = [*SYSTEM, *toks(5000, 60)]
    turn = [*doc, *toks(7000, 20)]
    for tokens in (SYSTEM, doc, turn):
        assert cache.save(tokens, fake_state(tokens))
    assert head(cache, doc).depth == 1 and head(cache, turn).depth == 2
    assert head(cache, turn).base.shared == len(doc)  # type: ignore[union-attr]
    assert restored(cache, [*turn, 1]) == (len(turn), fake_state(turn))
    # A delta's own blob is about its own cells.
    size = cache._store.stat(key_of(turn))
    assert size is not None and size.size_bytes < 30 * CELL_BYTES + 2000


def test_cells_computed_differently_are_stored_whole() -> None:
    cache = make_cache()
    assert cache.save(SYSTEM, fake_state(SYSTEM))
    prompt = [*SYSTEM, *toks(9000, 30)]
    assert cache.save(prompt, fake_state(prompt, "chunks ending elsewhere"))
    assert head(cache, prompt).base is None
    assert restored(cache, [*prompt, 1]) == (
        len(prompt),
        fake_state(prompt, "chunks ending elsewhere"),
    )


def test_states_that_do_not_parse_are_stored_whole() -> None:
    cache = make_cache()
    assert cache.save(SYSTEM, b"opaque" * 100)
    prompt = [*SYSTEM, *toks(9000, 30)]
    assert cache.save(prompt, b"opaque" * 100 + b"more")
    assert head(cache, prompt).base is None


def test_no_deltas_when_switched_off_or_for_sliding_window_models() -> None:
    for cache in (make_cache(deltas=False), make_cache(truncatable=False)):
        prompt = [*SYSTEM, *toks(9000, 30)]
        assert cache.save(SYSTEM, fake_state(SYSTEM))
        assert cache.save(prompt, fake_state(prompt))
        assert head(cache, prompt).base is None


def test_a_base_from_another_sequence_serves_a_state_of_this_one() -> None:
    """The Conclave's sequences each have a stream: the cells are the same, the framing and
    seq ids (which a restore does not read) are not; the restore gets this state's framing."""
    cache = make_cache()
    assert cache.save(SYSTEM, fake_state(SYSTEM, seq=3, n_stream=4))
    prompt = [*SYSTEM, *toks(9000, 30)]
    state = fake_state(prompt, seq=1, n_stream=4)
    assert cache.save(prompt, state)
    assert head(cache, prompt).base is not None
    hit = restored(cache, [*prompt, 1])
    assert hit is not None
    got = parse(hit[1])
    want = parse(state)
    assert got is not None and want is not None
    assert hit[1][:16] == state[:16]  # this state's framing
    assert leading_equal(got, [(want, 0, want.n_cells)], want.n_cells) == want.n_cells
    seq_ids = np.frombuffer(hit[1], np.int32, count=3 * len(prompt), offset=32).reshape(-1, 3)
    assert set(seq_ids[:, 2]) == {1, 3}  # the base's cells keep their own


def test_chains_stay_within_max_depth() -> None:
    cache = make_cache()
    tokens = list(SYSTEM)
    assert cache.save(tokens, fake_state(tokens))
    for step in range(MAX_DEPTH + 2):
        tokens = [*tokens, *toks(20_000 + 100 * step, 40)]
        assert cache.save(tokens, fake_state(tokens))
        # Past the bound a delta stands on a shallower blob of the chain.
        assert head(cache, tokens).depth == min(step + 1, MAX_DEPTH)
        assert restored(cache, [*tokens, 1]) == (len(tokens), fake_state(tokens))


# --- what a restore does when a base is missing or bad -------------------------------------


def three_states() -> tuple[PrefixCache, list[int], list[int]]:
    cache = make_cache()
    doc = [*SYSTEM, *toks(5000, 60)]
    assert cache.save(SYSTEM, fake_state(SYSTEM))
    assert cache.save(doc, fake_state(doc))
    assert head(cache, doc).base is not None
    return cache, SYSTEM, doc


def test_a_delta_whose_base_is_gone_is_removed_and_the_lookup_falls_back() -> None:
    cache, system, doc = three_states()
    cache._store.delete(key_of(system))
    assert restored(cache, [*doc, 1]) is None  # nothing shorter left: the job prefills
    assert cache._store.stat(key_of(doc)) is None
    assert cache.stats().entries == 0


def test_a_damaged_base_is_removed_with_its_delta() -> None:
    cache, system, doc = three_states()
    other = [*SYSTEM[:20], *toks(88_000, 40)]  # shares 16 tokens: a shorter hit
    assert cache.save(other, fake_state(other))
    data = cache._store.get(key_of(system))
    assert data is not None
    damaged = bytearray(data)
    damaged[-1] ^= 0xFF
    cache._store.put(key_of(system), bytes(damaged))
    assert restored(cache, [*doc, 1]) == (B, fake_state(other))  # the next shorter hit
    assert cache._store.stat(key_of(system)) is None and cache._store.stat(key_of(doc)) is None


def test_a_replaced_base_removes_the_delta_and_the_base_still_serves() -> None:
    cache, system, doc = three_states()
    # The same tokens stored again with other bytes (a racing writer, say): a valid blob whose
    # payload the delta was not written against.
    cache._store.delete(key_of(system))
    assert cache.save(system, fake_state(system, "recomputed"))
    # Cut back to the block boundary: the prompt goes on past it.
    assert restored(cache, [*doc, 1]) == (32, fake_state(system, "recomputed"))
    assert cache._store.stat(key_of(doc)) is None


def test_a_damaged_delta_is_removed_and_its_base_serves() -> None:
    cache, system, doc = three_states()
    data = cache._store.get(key_of(doc))
    assert data is not None
    cache._store.put(key_of(doc), bytes(data)[:-3])
    assert restored(cache, [*doc, 1]) == (32, fake_state(system))
    assert cache._store.stat(key_of(doc)) is None


def test_verify_removes_deltas_whose_base_is_gone() -> None:
    cache, system, doc = three_states()
    turn = [*doc, *toks(7000, 20)]
    assert cache.save(turn, fake_state(turn))
    cache._store.delete(key_of(system))
    report = cache.verify()
    assert report.checked == 2 and report.removed == 2
    assert cache.stats().entries == 0


def test_verify_keeps_sound_chains() -> None:
    cache, _, doc = three_states()
    turn = [*doc, *toks(7000, 20)]
    assert cache.save(turn, fake_state(turn))
    report = cache.verify()
    assert report.checked == 3 and report.removed == 0


# --- the budget ------------------------------------------------------------------------------


def test_eviction_takes_dependents_before_their_base() -> None:
    clock = [1000.0]
    store = MemoryBlobStore(clock=lambda: clock[0])
    cache = make_cache(store, clock=lambda: clock[0])
    assert cache.save(SYSTEM, fake_state(SYSTEM))
    prompts = [[*SYSTEM, *toks(30_000 + 100 * i, 40)] for i in range(6)]
    for prompt in prompts:
        clock[0] += 10
        assert cache.save(prompt, fake_state(prompt))
        assert head(cache, prompt).base is not None
    system_bytes = store.stat(key_of(SYSTEM))
    delta_bytes = store.stat(key_of(prompts[0]))
    assert system_bytes is not None and delta_bytes is not None
    # A smaller budget over the same files: the system prompt, saved first, was used by every
    # save since, so the oldest deltas go and it stays.
    budget = system_bytes.size_bytes + 3 * delta_bytes.size_bytes
    make_cache(store, clock=lambda: clock[0], max_bytes=budget).prune()
    assert store.stat(key_of(SYSTEM)) is not None
    assert [store.stat(key_of(p)) is not None for p in prompts] == [False] * 3 + [True] * 3
    assert restored(cache, [*prompts[-1], 1]) == (len(prompts[-1]), fake_state(prompts[-1]))


def test_a_save_never_evicts_the_base_it_stands_on() -> None:
    clock = [1000.0]
    store = MemoryBlobStore(clock=lambda: clock[0])
    probe = make_cache()
    assert probe.save(SYSTEM, fake_state(SYSTEM))
    budget = probe.stats().bytes + 45 * CELL_BYTES  # the base and about one delta
    cache = make_cache(store, clock=lambda: clock[0], max_bytes=budget)
    assert cache.save(SYSTEM, fake_state(SYSTEM))
    store.touch(key_of(SYSTEM), 0.0)  # the least recently used blob of all
    for i in range(3):
        clock[0] += 10
        prompt = [*SYSTEM, *toks(30_000 + 100 * i, 40)]
        assert cache.save(prompt, fake_state(prompt))
        assert head(cache, prompt).base is not None
        assert store.stat(key_of(SYSTEM)) is not None
        assert restored(cache, [*prompt, 1]) == (len(prompt), fake_state(prompt))


def test_a_hit_on_a_delta_keeps_its_base_recent() -> None:
    clock = [1000.0]
    store = MemoryBlobStore(clock=lambda: clock[0])
    cache = make_cache(store, clock=lambda: clock[0])
    prompt = [*SYSTEM, *toks(30_000, 40)]
    assert cache.save(SYSTEM, fake_state(SYSTEM))
    assert cache.save(prompt, fake_state(prompt))
    clock[0] = 5000.0
    assert restored(cache, [*prompt, 1]) is not None
    base, delta = store.stat(key_of(SYSTEM)), store.stat(key_of(prompt))
    assert base is not None and delta is not None
    assert base.mtime_s > delta.mtime_s >= 5000.0


def test_whole_blobs_written_by_deltas_aware_code_are_format_2() -> None:
    """Older workers read every whole state; only deltas are a version they do not know."""
    cache = make_cache()
    assert cache.save(SYSTEM, fake_state(SYSTEM))
    data = cache._store.get(key_of(SYSTEM))
    assert data is not None
    decoded = decode_blob(data, FP)
    assert decoded is not None and decoded[0].version == 2
    prompt = [*SYSTEM, *toks(9000, 30)]
    assert cache.save(prompt, fake_state(prompt))
    assert head(cache, prompt).version == 3


def test_a_damaged_blob_does_not_hide_a_shorter_diverging_one() -> None:
    """The shorter one is found only by reading its tokens; the damaged one, named as a prefix
    of the prompt, had ranked first at every boundary until all its markers went with it."""
    cache = make_cache()
    diverging = [*SYSTEM, *toks(60_000, 40)]
    doc = [*SYSTEM, *toks(5000, 60)]
    assert cache.save(diverging, fake_state(diverging))
    assert cache.save(doc, fake_state(doc))
    data = cache._store.get(key_of(doc))
    assert data is not None
    cache._store.put(key_of(doc), bytes(data)[:-3])
    assert restored(cache, [*doc, 1]) == (32, fake_state(diverging))


def test_a_save_looks_at_shallower_boundaries_when_deeper_cells_differ() -> None:
    """The blob sharing the most tokens was computed in other chunks; the system prompt's,
    listed only at shallower boundaries, still serves as the base."""
    cache = make_cache()
    assert cache.save(SYSTEM, fake_state(SYSTEM))
    doc = [*SYSTEM, *toks(5000, 60)]
    assert cache.save(doc, fake_state(doc, "other chunks"))
    assert head(cache, doc).base is None
    longer = [*doc[:80], *toks(70_000, 30)]
    assert cache.save(longer, fake_state(longer))
    ref = head(cache, longer).base
    assert ref is not None and ref.name == key_of(SYSTEM).rsplit("/", 1)[1]
    assert ref.shared == len(SYSTEM)
    assert restored(cache, [*longer, 1]) == (len(longer), fake_state(longer))


# --- what a restore would read ----------------------------------------------------------------


def test_a_restore_is_offered_with_every_file_of_its_chain_before_any_is_read() -> None:
    store = MemoryBlobStore()
    cache = make_cache(store)
    doc = [*SYSTEM, *toks(5000, 60)]
    turn = [*doc, *toks(7000, 20)]
    for tokens in (SYSTEM, doc, turn):
        assert cache.save(tokens, fake_state(tokens))
    files = [store.stat(key_of(t)) for t in (SYSTEM, doc, turn)]
    chain_bytes = sum(f.size_bytes for f in files if f is not None)
    top = files[-1].size_bytes if files[-1] is not None else 0
    offers: list[ReadOffer] = []

    def decline_the_chain(offer: ReadOffer) -> bool:
        offers.append(offer)
        return offer.bytes < chain_bytes

    assert cache.lookup([*turn, 1], pays=decline_the_chain) is None
    # Asked of the delta alone (from its size) before its head is read, again once the head
    # gave what it restores, then of its chain; a memory store holds every byte in memory.
    alone = ReadOffer(len(turn), top, top)
    assert offers == [alone, alone, ReadOffer(len(turn), chain_bytes, chain_bytes)]
    assert cache.counters()["restores_skipped"] == 1
    assert cache.counters()["hits"] == cache.counters()["misses"] == 0
    # Told yes, the same lookup restores the same state as one never asked.
    hit = cache.lookup([*turn, 1], pays=lambda offer: True)
    assert hit is not None and bytes(hit.state) == fake_state(turn)
