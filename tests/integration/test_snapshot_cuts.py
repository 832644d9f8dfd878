"""Snapshots cut from one capture after the first token: the same states, nothing before it.

The Conclave captures a stream's sequence once, after its first token, and the saver cuts the
state of each snapshot point from that capture (worker/conclave/loop.py `_save_snapshots`).
A cut must be the state a capture at that point gives, byte for byte, so a restore of it
gives cold output; and it must not cost the first token anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import llama_cpp
import pytest
from llama_cpp import Llama

from shared.llm import render_prompt, tokenize
from shared.prefix_cache import PrefixCache, first_cells, open_cache, parse_state
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.conftest import DATA_DIR
from worker import kv_state
from worker.chunk_ends import snapshot_points
from worker.conclave.loop import Conclave
from worker.conclave.row_check import KernelFacts
from worker.conclave.streams import Ended, Event, Started, StreamHandle, StreamRequest, Token
from worker.decode_batch import fill_batch, llama_batch
from worker.model import load_model, warm_up
from worker.prefix_saver import PrefixSaver
from worker.prompt_breaks import prompt_breaks

N_CTX = 2048
N_SEQ = 3
SYSTEM = (
    "You are the stock clerk of a fruit warehouse. Answer from the inventory the user gives, "
    "in one short sentence, and name the crate you read it from."
)
INVENTORY = "\n".join(f"Crate {i} on shelf {i % 7} holds {i * 3 + 1} plums." for i in range(24))


def settings(tmp_path: Path, flash_attn: bool = False) -> Settings:
    return Settings(
        model="smollm2-135m",
        data_dir=DATA_DIR,
        n_ctx=N_CTX,
        flash_attn=flash_attn,
        cache={"dir": tmp_path / "kv"},
    )


def load(tmp_path: Path, flash_attn: bool = False) -> Llama:
    """A context laid out as the Conclave's: a KV buffer per sequence."""
    config = settings(tmp_path, flash_attn)
    return load_model(config, N_SEQ)


def prefill(llama: Llama, tokens: list[int], start: int, seq: int = 0) -> None:
    with llama_batch(len(tokens)) as batch:
        fill_batch(batch, [(t, start + i, seq) for i, t in enumerate(tokens)], logits=False)
        assert llama_cpp.llama_decode(llama.ctx, batch) == 0


@pytest.mark.parametrize("flash_attn", [False, True], ids=["V transposed", "V rows"])
def test_a_state_cut_to_its_first_cells_is_the_state_captured_there(
    tmp_path: Path, flash_attn: bool
) -> None:
    llama = load(tmp_path, flash_attn)
    tokens = llama.tokenize(INVENTORY.encode(), add_bos=True)[:300]
    prefill(llama, tokens[:200], 0)
    there = bytes(kv_state.capture(llama)[0])
    prefill(llama, tokens[200:], 200)
    layout = parse_state(kv_state.capture(llama)[0])
    assert layout is not None and layout.n_cells == 300
    cut = first_cells(layout, 200)
    assert cut is not None and cut.tobytes() == there
    assert first_cells(layout, 301) is None
    llama.close()


def test_cells_that_do_not_start_at_position_0_are_not_cut(tmp_path: Path) -> None:
    llama = load(tmp_path)
    tokens = llama.tokenize(INVENTORY.encode(), add_bos=True)[:120]
    prefill(llama, tokens, 0)
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llama.ctx), 0, 0, 20)
    layout = parse_state(kv_state.capture(llama)[0])
    assert layout is not None and layout.n_cells == 100
    assert first_cells(layout, 50) is None
    llama.close()


class RecordingSaver(PrefixSaver):
    """A real saver that also notes, in `seen`, each capture among the stream's events."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def snapshots(
        self,
        cache: PrefixCache,
        llama: Llama,
        seq: int,
        prompt: tuple[list[int], tuple[int, ...]],
        points: Iterable[int],
    ) -> bool:
        self.seen.append("capture")
        return super().snapshots(cache, llama, seq, prompt, points)


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[Callable[[bool, PrefixSaver | None], Conclave]]:
    """Conclaves, one at a time, on one context: each starts with empty memory."""
    llama = load(tmp_path)
    cache = open_cache(settings(tmp_path))
    running: list[Conclave] = []

    def startup() -> KernelFacts:
        warm_up(llama)
        return KernelFacts(rows_invariant=True)

    def start(with_cache: bool, saver: PrefixSaver | None) -> Conclave:
        for earlier in running:
            earlier.close()
        running.clear()
        conclave = Conclave(
            llama,
            lambda _: cache if with_cache else None,
            saver,
            block_tokens=256,
            min_snapshot_tokens=32,
            n_seq=N_SEQ,
            truncatable=True,
            startup=startup,
        )
        running.append(conclave)
        return conclave

    yield start
    for conclave in running:
        conclave.close()
    llama.close()


def request(llama: Llama, question: str, copies: int = 1, max_new: int = 6) -> StreamRequest:
    text = "\n".join([INVENTORY] * copies) + f"\n\n{question}"
    job = JobRequest(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    )
    tokens = tokenize(llama, render_prompt(llama, job))
    breaks = prompt_breaks(llama, tokens, None, limit=len(tokens) - 1)
    return StreamRequest(tokens, breaks, None, 0, max_new=max_new, declared=False)


def points(stream: StreamRequest) -> list[int]:
    return sorted(
        snapshot_points(
            stream.breaks,
            0,
            stream.prefill_end,
            declared=False,
            truncatable=True,
            block_tokens=256,
            min_tokens=32,
        )
    )


def run(
    conclave: Conclave, stream: StreamRequest, seen: list[str] | None = None
) -> tuple[list[int], int]:
    """The stream's tokens and how many prompt tokens it reused."""
    tokens: list[int] = []

    def keep(token: Token) -> bool:
        tokens.append(token.token)
        if seen is not None:
            seen.append("token")
        return False

    handle = conclave.submit(conclave.handle(stream, keep))
    started = next_event(handle)
    assert isinstance(started, Started)
    assert isinstance(next_event(handle), Ended)
    return tokens, started.cached_tokens


def next_event(handle: StreamHandle) -> Event:
    event = handle.next(timeout=120)
    assert event is not None, "the stream went silent"
    return event


def test_the_conclave_captures_after_the_first_token_and_restores_give_cold_output(
    serving: Callable[[bool, PrefixSaver | None], Conclave],
) -> None:
    seen: list[str] = []
    saver = RecordingSaver(seen)
    conclave = serving(True, saver)
    first = request(conclave.llama, "Which crate holds 31 plums?")
    second = request(conclave.llama, "How many plums are on shelf 3?")
    stored = points(first)
    assert len(stored) >= 2 and stored[-2] in first.breaks  # the question's start, the end
    assert second.tokens[: stored[-2]] == first.tokens[: stored[-2]]

    cold_first, reused = run(conclave, first, seen)
    saver.flush()
    assert reused == 0
    assert seen[0] == "token" and seen.count("capture") == 1, seen

    cold_second, _ = run(serving(False, None), second)
    warm = serving(True, saver)
    # The second question restores the state cut at the question's start, from disk (memory
    # is empty); the first its own prompt's end, also cut from the one capture.
    assert run(warm, second) == (cold_second, stored[-2])
    # Memory now holds all but the first's last few tokens: prefilling those may well cost
    # less than reading the whole state (worker/restore_cost.py), so it is dropped first.
    warm.forget()
    assert run(warm, first) == (cold_first, first.prefill_end)
    saver.close()


def test_a_prefill_cancelled_midway_saves_the_points_it_passed(
    serving: Callable[[bool, PrefixSaver | None], Conclave], tmp_path: Path
) -> None:
    saver = PrefixSaver()
    conclave = serving(True, saver)
    long = request(conclave.llama, "Which crate holds 31 plums?", copies=5)
    handle = conclave.submit(conclave.handle(long))
    assert isinstance(next_event(handle), Started)
    handle.cancel()
    ended = next_event(handle)
    assert isinstance(ended, Ended) and ended.reason == "cancelled"
    assert ended.position < long.prefill_end, "the prefill ended before the cancel reached it"
    saver.flush()
    cache = open_cache(settings(tmp_path))
    passed = [p for p in points(long) if p <= ended.position]
    assert passed, "no snapshot point was passed"
    for point in passed:
        hit = cache.lookup(long.tokens[: point + 1], breaks=[b for b in long.breaks if b <= point])
        assert hit is not None and hit.n_tokens == point
    saver.close()
