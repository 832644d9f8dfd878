"""The Conclave's model thread in process: which rows share a decode step (exact batching)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from shared.llm import render_prompt, tokenize
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.conftest import DATA_DIR
from worker.conclave.engine import ConclaveEngine
from worker.conclave.loop import Conclave
from worker.conclave.row_check import KernelFacts
from worker.conclave.streams import Ended, StreamHandle, StreamRequest, Token, wait_started
from worker.main import build_conclave
from worker.model import load_model, warm_up
from worker.sampling import Sampling

# Free text on the smallest model: near ties come every few tokens, so batches meet them.
CHATS = [
    "Write two sentences about the sea.",
    "Describe a busy market in the morning.",
    "Tell a short story about a lost key.",
    "Explain why leaves change colour in autumn.",
    "Describe the smell of fresh bread.",
    "Write a short note to a neighbour about a parcel.",
]


SETTINGS = Settings(
    model="smollm2-135m",
    data_dir=DATA_DIR,
    n_ctx=512,
    cache={"enabled": False},
    worker={"max_active_jobs": len(CHATS)},
)


@pytest.fixture(scope="module")
def engine() -> Iterator[ConclaveEngine]:
    """As a worker builds it: the row check decides whether near ties are replayed."""
    built = build_conclave(SETTINGS)
    yield built
    built.close()


@pytest.fixture(scope="module")
def replaying_engine() -> Iterator[ConclaveEngine]:
    """As a worker on stock kernels runs: batched rows are taken as differing from lone ones."""
    built = build_conclave(SETTINGS, rows_invariant=False)
    yield built
    built.close()


@pytest.fixture(scope="module")
def lone_outputs(engine: ConclaveEngine) -> list[list[int]]:
    """Each chat decoded alone: one row per pass, the same arithmetic whichever way an engine
    takes batched rows, so both tests compare with these."""
    return [run(engine, [p])[0][0] for p in chat_prompts(engine)]


def chat_prompts(engine: ConclaveEngine) -> list[list[int]]:
    llama = engine.llama
    return [
        tokenize(llama, render_prompt(llama, JobRequest(messages=[{"role": "user", "content": c}])))
        for c in CHATS
    ]


def run(engine: ConclaveEngine, prompts: list[list[int]]) -> list[tuple[list[int], Ended]]:
    """Submit every prompt at once, greedy; each stream's tokens and its end."""
    return run_requests(engine, [StreamRequest(t, (), None, 0, max_new=48) for t in prompts])


def run_requests(
    engine: ConclaveEngine, requests: list[StreamRequest]
) -> list[tuple[list[int], Ended]]:
    """Submit every request at once; each stream's tokens and its end."""
    submitted = [submit(engine, request) for request in requests]
    return [(out, ended(handle)) for handle, out in submitted]


def submit(engine: ConclaveEngine, request: StreamRequest) -> tuple[StreamHandle, list[int]]:
    """The stream's handle and the list its tokens go to."""
    out: list[int] = []

    def keep(token: Token) -> bool:
        out.append(token.token)
        return False

    return engine.conclave.submit(engine.conclave.handle(request, keep)), out


def ended(handle: StreamHandle) -> Ended:
    """The stream's end, once every event before it is taken."""
    while not isinstance(event := handle.next(timeout=120), Ended):
        assert event is not None, "the stream did not end"
    return event


def test_the_wheel_make_install_builds_decodes_rows_together_as_alone_without_replays(
    engine: ConclaveEngine, lone_outputs: list[list[int]]
) -> None:
    assert engine.conclave.rows_invariant, "the row check found batched rows differing"
    engine.forget()  # the lone runs' cells: the prompts are read again, together
    shared = engine.conclave.shared_prompt_passes
    together = run(engine, chat_prompts(engine))
    assert [out for out, _ in together] == lone_outputs
    assert all(ended.replays == 0 and not ended.drifted for _, ended in together)
    # The chats' prompts, arriving together, were read in passes they shared.
    assert engine.conclave.shared_prompt_passes > shared


def test_a_prompts_last_token_is_read_in_its_last_chunk_warm_or_cold(
    engine: ConclaveEngine,
) -> None:
    """On these kernels a prompt row reads alike in any pass, so a prompt is read in block-long
    chunks through its last token (no short pieces at its breaks, no pass of its own for that
    token), whose row gives the first token: read cold, and again with memory holding all but
    that token (read then as a chunk of one row), the same tokens."""
    prompt = chat_prompts(engine)[0]
    engine.forget()
    before = engine.conclave.first_tokens_in_chunks
    outputs, restored = [], []
    for _ in range(2):
        handle, out = submit(engine, StreamRequest(prompt, (), None, 0, max_new=16))
        restored.append(wait_started(handle).cached_tokens)
        ended(handle)
        outputs.append(out)
    assert restored == [0, len(prompt) - 1]
    assert outputs[1] == outputs[0]
    assert engine.conclave.first_tokens_in_chunks == before + 2


def test_near_ties_replay_at_most_once_where_rows_differ(
    replaying_engine: ConclaveEngine, lone_outputs: list[list[int]]
) -> None:
    together = run(replaying_engine, chat_prompts(replaying_engine))
    assert [out for out, _ in together] == lone_outputs
    replays = [ended.replays for _, ended in together]
    # A stream that met a near tie is decoded alone from then on: it never replays again.
    assert max(replays) <= 1
    assert sum(replays) >= 2, "no near tie met: the rule went untested"
    assert not any(ended.drifted for _, ended in together)


def test_streams_writing_the_same_tokens_share_rows_and_each_writes_its_own_run(
    engine: ConclaveEngine,
) -> None:
    """One prompt, greedy twice and sampled at several temperatures (votes, `n` choices):
    while streams agree they share rows, and each writes what it writes alone, also when the
    cells a twin left behind are reused."""
    prompt = chat_prompts(engine)[0]
    samplings = [Sampling(), Sampling(), Sampling(1.0, 0.95, 7)]
    samplings += [Sampling(0.3, 0.95, seed) for seed in range(1, 4)]
    requests = [StreamRequest(prompt, (), None, 0, max_new=32, sampling=s) for s in samplings]
    alone = [run_requests(engine, [request])[0][0] for request in requests]
    shared = engine.conclave.twin_rows
    together = run_requests(engine, requests)
    assert [out for out, _ in together] == alone
    # The greedy pair is one run: all but its first row or two are shared.
    assert engine.conclave.twin_rows - shared >= len(alone[0]) - 2
    assert not any(ended.drifted for _, ended in together)
    assert [out for out, _ in run_requests(engine, requests)] == alone


def test_held_prefixes_taken_between_chats_leave_the_chats_one_pass(
    engine: ConclaveEngine, lone_outputs: list[list[int]]
) -> None:
    """Extraction documents held while chats decode: had each taken the next sequence, the
    chats' sequences would have gaps no move can close (every sequence busy), and llama.cpp
    would run each of their steps as several passes."""
    engine.forget()
    llama = engine.llama
    documents = [
        llama.tokenize(f"Ledger {i}: {'crates of pears, shelf by shelf. ' * 20}".encode())
        for i in range(3)
    ]
    chats = iter(chat_prompts(engine))
    split_before = engine.conclave.split_passes
    holds, together = [], []
    for document in documents:  # in arrival order: a held document, then two chats
        hold = StreamRequest(document, (), None, 0, max_new=0, end=len(document), hold=True)
        holds.append(submit(engine, hold)[0])
        for prompt in (next(chats), next(chats)):
            together.append(submit(engine, StreamRequest(prompt, (), None, 0, max_new=48)))
    assert [out for handle, out in together if ended(handle)] == lone_outputs
    assert engine.conclave.split_passes == split_before
    for held in holds:
        ended(held)
        held.close()


def test_the_start_up_decodes_on_the_thread_that_serves_and_its_failure_is_raised() -> None:
    """One thread decodes, the warm-up and row check included: a decode on another thread
    leaves llama.cpp an OpenMP team there that slowed every later decode (~1.4x on 2 cores)."""
    llama = load_model(SETTINGS, 2)
    seen: list[threading.Thread] = []

    def conclave(startup: Callable[[], KernelFacts]) -> Conclave:
        return Conclave(
            llama,
            lambda _: None,
            None,
            block_tokens=256,
            min_snapshot_tokens=64,
            n_seq=2,
            truncatable=True,
            startup=startup,
        )

    def startup() -> KernelFacts:
        warm_up(llama)
        seen.append(threading.current_thread())
        return KernelFacts(rows_invariant=True)

    serving = conclave(startup)
    tokens = llama.tokenize(b"The harvest was", add_bos=True)
    request = StreamRequest(tokens, (), None, 0, max_new=2, sampling=Sampling())

    def on_token(_: Token) -> bool:
        seen.append(threading.current_thread())
        return False

    ended(serving.submit(serving.handle(request, on_token)))
    serving.close()
    assert len(seen) == 3 and seen[0] is not threading.main_thread()
    assert seen[1] is seen[0] and seen[2] is seen[0]

    def failing() -> KernelFacts:
        raise RuntimeError("the warm-up decode failed")

    with pytest.raises(RuntimeError, match="warm-up decode failed"):
        conclave(failing)
    llama.close()
