"""Speculation inside shared steps (worker/conclave/drafts.py), on the Conclave as a worker
builds it: drafts ride in the decode pass, and output with them equals output without, alone
and beside seven other streams, greedy and seeded."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

import pytest

from shared.llm import render_prompt, tokenize
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.conftest import DATA_DIR
from worker.conclave.drafts import Mode
from worker.conclave.engine import ConclaveEngine
from worker.conclave.streams import Ended, StreamRequest, Token
from worker.main import build_conclave
from worker.sampling import Sampling

LEDGER = "\n".join(
    f"Crate {n}: {n * 7 % 40 + 10} pears from farm {n * 3 % 11}, shipped on day {n % 9 + 1}."
    for n in range(1, 13)
)
COPY = f"{LEDGER}\n\nCopy the lines for crates 5 to 9 exactly, one per line."
FREE = "Write a short story about a lighthouse keeper who finds a cat."
TOKENS = 32
GREEDY = Sampling()
# Memory is reused within a namespace only: each run gets its own, so every run is cold (its
# streams that share the ledger read it once).
_namespaces = (f"ns-{n}" for n in itertools.count())


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def engine(request: pytest.FixtureRequest) -> Iterator[ConclaveEngine]:
    built = build_conclave(
        Settings(
            model=request.param,
            data_dir=DATA_DIR,
            n_ctx=1024,
            cache={"enabled": False},
            worker={"max_active_jobs": 8},
        )
    )
    assert built.conclave.rows_invariant, "drafts are verified on row-invariant kernels only"
    yield built
    built.close()


def stream(
    engine: ConclaveEngine, text: str, mode: Mode, sampling: Sampling = GREEDY
) -> StreamRequest:
    llama = engine.llama
    messages = [{"role": "user", "content": text}]
    tokens = tokenize(llama, render_prompt(llama, JobRequest(messages=messages)))
    return StreamRequest(tokens, (), None, 0, TOKENS, sampling=sampling, speculation=mode)


def decode(
    engine: ConclaveEngine, requests: list[StreamRequest]
) -> tuple[list[list[int]], list[Ended]]:
    """Submit all at once, in a namespace of their own: each stream's tokens and its end, in
    the requests' order."""
    conclave = engine.conclave
    namespace = next(_namespaces)
    requests = [replace(request, namespace=namespace) for request in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    handles = []
    for request, tokens in zip(requests, outputs, strict=True):

        def keep(token: Token, into: list[int] = tokens) -> bool:
            into.append(token.token)
            return False

        handles.append(conclave.submit(conclave.handle(request, keep)))
    ended = []
    for handle in handles:
        while not isinstance(event := handle.next(timeout=300), Ended):
            assert event is not None, "the stream did not end"
        handle.close()
        ended.append(event)
    return outputs, ended


def test_a_copying_stream_drafts_and_writes_what_plain_decoding_writes(
    engine: ConclaveEngine,
) -> None:
    (plain,), _ = decode(engine, [stream(engine, COPY, "off")])
    (drafted,), (ended,) = decode(engine, [stream(engine, COPY, "on")])
    assert drafted == plain
    assert ended.drafted > 0 and ended.accepted > 0, "a copy should accept drafts"
    assert ended.accepted <= ended.drafted


def test_drafts_beside_seven_other_streams_change_no_output(engine: ConclaveEngine) -> None:
    texts = [COPY, FREE] * 4
    seeded = Sampling(temperature=0.8, top_p=0.95, seed=5)
    samplings = [GREEDY] * 4 + [seeded] * 4  # greedy and seeded, copying and free
    modes: list[Mode] = ["on", "auto", "on", "off"] * 2
    plain, _ = decode(
        engine, [stream(engine, t, "off", s) for t, s in zip(texts, samplings, strict=True)]
    )
    asked = zip(texts, modes, samplings, strict=True)
    mixed, ended = decode(engine, [stream(engine, t, m, s) for t, m, s in asked])
    assert mixed == plain
    assert sum(e.drafted for e in ended) > 0
