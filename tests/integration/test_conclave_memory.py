"""The Conclave's memory: moving a sequence's buffer to close a gap keeps its cells exactly."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp
import numpy as np
import pytest
from llama_cpp import Llama

from shared.settings import Settings
from tests.conftest import DATA_DIR
from worker import kv_state
from worker.conclave.memory import Memory, Resident, Reuse
from worker.decode_batch import fill_batch, llama_batch
from worker.model import load_model

N_SEQ = 6
N_CTX = 256
PROMPTS = [
    "The lighthouse keeper counted the ships that passed",
    "A recipe for bread needs flour, water, salt and",
    "Three trains left the station at noon, and the first",
    "The museum opens at nine; on Mondays it",
]


@pytest.fixture(scope="module")
def llama() -> Iterator[Llama]:
    settings = Settings(model="smollm2-135m", data_dir=DATA_DIR, n_ctx=N_CTX)
    built = load_model(settings, N_SEQ)
    yield built
    built.close()


def decode(llama: Llama, rows: list[tuple[int, int, int]]) -> list[np.ndarray]:
    """One llama_decode of `rows` (token, position, sequence); a copy of every row's logits."""
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama.model))
    with llama_batch(max(len(rows), 1)) as batch:
        fill_batch(batch, rows, logits=True)
        assert llama_cpp.llama_decode(llama.ctx, batch) == 0
    return [
        np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama.ctx, i), (n_vocab,)).copy()
        for i in range(len(rows))
    ]


def fill(
    llama: Llama, memory: Memory, text: str, decodes: bool = True
) -> tuple[Resident, list[int]]:
    """A resident holding all of `text`'s tokens but the last, which is returned to decode."""
    tokens = llama.tokenize(text.encode())
    resident = memory.claim(None, None, decodes=decodes)
    decode(llama, [(t, p, resident.seq) for p, t in enumerate(tokens[:-1])])
    resident.tokens = tokens[:-1]
    resident.prefilled = len(tokens) - 1
    return resident, tokens


def next_logits(llama: Llama, resident: Resident, tokens: list[int]) -> np.ndarray:
    """The logits after the whole prompt, leaving the resident as it was."""
    position = len(tokens) - 1
    (logits,) = decode(llama, [(tokens[-1], position, resident.seq)])
    mem = llama_cpp.llama_get_memory(llama.ctx)
    llama_cpp.llama_memory_seq_rm(mem, resident.seq, position, -1)
    return logits


def assert_same(before: list[np.ndarray], after: list[np.ndarray]) -> None:
    """Bit for bit: a moved buffer is a copy, not a recomputation."""
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert np.array_equal(a, b), f"sequence {i}'s logits changed"


def test_compacting_moves_streams_into_one_run_and_keeps_their_cells(llama: Llama) -> None:
    mem = llama_cpp.llama_get_memory(llama.ctx)
    llama_cpp.llama_memory_clear(mem, True)
    memory = Memory(mem, N_SEQ, block_tokens=256, truncatable=True)
    # Sequences 0..3 taken in order; 1 then ends (idle, kept for reuse) and 2 is busy outside
    # the batch (prefilling, say). For the batch {0, 3}, the window {0, 1} costs two copies (3
    # moves in, the idle 1 aside) and {3, 4} one (0 moves to 4).
    filled = [fill(llama, memory, text) for text in PROMPTS]
    assert [r.seq for r, _ in filled] == [0, 1, 2, 3]
    before = [next_logits(llama, r, t) for r, t in filled]
    memory.release(filled[1][0])

    moved = memory.compact({0, 3})

    assert moved == {0: 4}, "the cheapest window holding no other busy sequence: {3, 4}"
    assert [r.seq for r, _ in filled] == [4, 1, 2, 3]
    assert_same(before, [next_logits(llama, r, t) for r, t in filled])
    # Decoded together, the moved pair is one run of increasing ids: one pass, same rows.
    (run_a, tokens_a), (run_b, tokens_b) = filled[3], filled[0]
    together = decode(
        llama,
        [
            (tokens_a[-1], len(tokens_a) - 1, run_a.seq),
            (tokens_b[-1], len(tokens_b) - 1, run_b.seq),
        ],
    )
    assert np.argmax(together[0]) == np.argmax(before[3])
    assert np.argmax(together[1]) == np.argmax(before[0])


def test_an_idle_resident_in_the_window_moves_aside_with_its_cells(llama: Llama) -> None:
    mem = llama_cpp.llama_get_memory(llama.ctx)
    llama_cpp.llama_memory_clear(mem, True)
    memory = Memory(mem, N_SEQ, block_tokens=256, truncatable=True)
    filled = [fill(llama, memory, text) for text in PROMPTS[:3]]
    before = [next_logits(llama, r, t) for r, t in filled]
    memory.release(filled[1][0])  # idle at 1, between the busy 0 and 2

    moved = memory.compact({0, 2})

    # Either 2 moves to 1 (the idle one giving way) or 0 does; the idle cells survive.
    assert len(moved) == 1
    seqs = sorted(r.seq for i, (r, _) in enumerate(filled) if i != 1)
    assert seqs[1] - seqs[0] == 1
    idle = filled[1][0]
    assert idle.idle and idle.seq not in seqs
    assert_same(before, [next_logits(llama, r, t) for r, t in filled])


def test_a_held_prefix_between_the_streams_moves_aside_with_its_cells(llama: Llama) -> None:
    mem = llama_cpp.llama_get_memory(llama.ctx)
    llama_cpp.llama_memory_clear(mem, True)
    memory = Memory(mem, 5, block_tokens=256, truncatable=True)
    # 0 and 2 decode, 1 holds a prefix for later forks, 3 is busy otherwise (prefilling).
    filled = [fill(llama, memory, text) for text in PROMPTS]
    before = [next_logits(llama, r, t) for r, t in filled]
    held = frozenset({1})
    assert memory.compact({0, 2}) == {}, "a busy sequence in every window"
    spare = memory.claim(None, None)
    assert memory.compact({0, 2}, held) == {}, "no sequence outside a window to move it to"
    memory.forget(spare)

    moved = memory.compact({0, 2}, held)

    assert moved in ({0: 1}, {2: 1}), "one of the pair moves into the held prefix's sequence"
    assert filled[1][0].seq == 4 and not filled[1][0].idle, "the held prefix took the spare"
    assert_same(before, [next_logits(llama, r, t) for r, t in filled])


def test_a_decoding_stream_takes_a_held_prefix_s_place_below_its_own(llama: Llama) -> None:
    mem = llama_cpp.llama_get_memory(llama.ctx)
    llama_cpp.llama_memory_clear(mem, True)
    memory = Memory(mem, 3, block_tokens=256, truncatable=True)
    first, _, last = (fill(llama, memory, text)[0] for text in PROMPTS[:3])
    memory.forget(first)
    held, tokens = fill(llama, memory, PROMPTS[3], decodes=False)  # the only free sequence
    expected = next_logits(llama, held, tokens)
    assert held.seq == 0
    memory.forget(last)

    taken = memory.claim(None, None, held=frozenset({held.seq}))

    assert (taken.seq, held.seq) == (0, 2), "the held prefix moved up, out of the way"
    decode(llama, [(0, 0, taken.seq)])  # llama.cpp makes queued copies before a decode
    memory.copies_made()
    assert_same([expected], [next_logits(llama, held, tokens)])


def test_a_state_loaded_over_a_copy_source_does_not_reach_the_copy(llama: Llama) -> None:
    """llama.cpp makes a queued copy at the next decode, reading the source then."""
    mem = llama_cpp.llama_get_memory(llama.ctx)
    llama_cpp.llama_memory_clear(mem, True)
    memory = Memory(mem, 2, block_tokens=256, truncatable=True)
    other, _ = fill(llama, memory, PROMPTS[1])
    other_state, _ = kv_state.capture(llama, other.seq)
    memory.forget(other)
    source, tokens = fill(llama, memory, PROMPTS[0])
    expected = next_logits(llama, source, tokens)
    # A new stream shares the busy source's prefix: it gets a queued copy of its buffer.
    copy = memory.claim(None, Reuse(source, len(tokens) - 1))
    assert copy.seq != source.seq
    memory.release(source)
    # The source, now the only idle sequence, goes to a stream restoring another state from
    # disk before anything decodes: what the loop's `_restore` does.
    taken = memory.claim(None, None)
    assert taken.seq == source.seq and memory.copies_pending()
    decode(llama, [(0, 0, taken.seq)])  # the loop's throwaway cell (without it, this fails)
    memory.copies_made()
    assert not memory.copies_pending()
    assert kv_state.restore_into(llama, taken.seq, other_state, len(other.tokens))

    assert_same([expected], [next_logits(llama, copy, tokens)])
