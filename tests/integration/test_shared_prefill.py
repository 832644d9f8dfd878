"""Questions about one document arriving together: the document is read once, and every answer
is the one its lone run gives (the Conclave's model thread in process, SmolLM2)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from shared.llm import render_prompt, tokenize
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.conftest import DATA_DIR
from worker.conclave.engine import ConclaveEngine
from worker.conclave.streams import Ended, Started, StreamHandle, StreamRequest, Token
from worker.main import build_conclave
from worker.prompt_breaks import prompt_breaks

QUESTIONS = [
    "Which shelf holds the most crates?",
    "Which clerk checked shelf 7?",
    "How many crates of pears are on shelf 3?",
    "On which day was shelf 12 checked?",
    "Which shelves hold plums?",
    "Who checked the apples?",
    "How many shelves are there?",
    "Which clerk checked the last shelf?",
]
FRUITS = ("apples", "pears", "plums", "figs")
DOCUMENT = "\n".join(
    f"Shelf {n} holds {3 + n * 7 % 11} crates of {FRUITS[n % 4]}, checked by clerk {n * 5 % 9} "
    f"on day {n % 6 + 1}."
    for n in range(1, 21)
)
SETTINGS = Settings(
    model="smollm2-135m",
    data_dir=DATA_DIR,
    n_ctx=1024,
    cache={"enabled": False, "block_tokens": 64},
    worker={"max_active_jobs": len(QUESTIONS)},
)
# Memory is reused within a namespace only: each run gets its own, so a "lone" run is cold.
_namespaces = (f"run-{n}" for n in itertools.count())


@pytest.fixture(scope="module")
def engine() -> Iterator[ConclaveEngine]:
    built = build_conclave(SETTINGS)
    yield built
    built.close()


def request(engine: ConclaveEngine, question: str, namespace: str) -> StreamRequest:
    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}]
    llama = engine.llama
    tokens = tokenize(llama, render_prompt(llama, JobRequest(messages=messages)))
    breaks = prompt_breaks(llama, tokens, None, limit=len(tokens) - 1)
    return StreamRequest(tokens, breaks, namespace, 0, max_new=12)


class Run:
    """A submitted stream: its tokens as they come, its start and end."""

    def __init__(self, engine: ConclaveEngine, req: StreamRequest) -> None:
        self.request = req
        self.tokens: list[int] = []
        self.handle: StreamHandle = engine.conclave.submit(engine.conclave.handle(req, self._keep))

    def _keep(self, token: Token) -> bool:
        self.tokens.append(token.token)
        return False

    def started(self) -> Started:
        event = self.handle.next(timeout=120)
        assert isinstance(event, Started), event
        return event

    def ended(self) -> Ended:
        while not isinstance(event := self.handle.next(timeout=120), Ended):
            assert event is not None, "the stream did not end"
        self.handle.close()
        return event

    @property
    def computed(self) -> int:
        """Cells this stream's prefill computed (the rest came from memory)."""
        return self.request.prefill_end - self.cached

    def finish(self) -> list[int]:
        self.cached = self.started().cached_tokens
        self.ended()
        return self.tokens


_lone_runs: dict[str, list[int]] = {}
# The lone runs share a namespace: the first reads the document cold, the others restore it
# from memory (warm == cold, tests/integration/test_prefix_cache_engine.py), so the document
# is read once for all of them instead of eight times.
_LONE = next(_namespaces)


def lone(engine: ConclaveEngine, question: str) -> list[int]:
    """A question's tokens run alone (once per module: the same run gives the same)."""
    if question not in _lone_runs:
        _lone_runs[question] = Run(engine, request(engine, question, _LONE)).finish()
    return _lone_runs[question]


def test_questions_arriving_together_read_their_document_once(engine: ConclaveEngine) -> None:
    namespace = next(_namespaces)
    runs = [Run(engine, request(engine, q, namespace)) for q in QUESTIONS]
    together = [run.finish() for run in runs]
    document = max(runs[0].request.breaks)  # the system message's end
    tails = [run.request.prefill_end - document for run in runs]
    assert document > 300, "the document should be several chunks long"
    # Before: each question prefilled most of the document beside the others.
    assert sum(run.computed for run in runs) <= document + sum(tails)
    assert together == [lone(engine, q) for q in QUESTIONS]


def test_followers_of_a_cancelled_leader_take_over_and_answer_as_alone(
    engine: ConclaveEngine,
) -> None:
    namespace = next(_namespaces)
    leader = Run(engine, request(engine, "Cancelled before it is read.", namespace))
    leader.started()  # it prefills from now on: the questions below wait for it
    followers = [Run(engine, request(engine, q, namespace)) for q in QUESTIONS[:4]]
    leader.handle.cancel()
    assert leader.ended().reason == "cancelled"
    answers = [run.finish() for run in followers]
    document = max(followers[0].request.breaks)
    # One of them took over and read the rest of the document once for all.
    assert sum(run.computed for run in followers) < 2 * document
    assert answers == [lone(engine, q) for q in QUESTIONS[:4]]
