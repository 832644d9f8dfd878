"""A prefix read from slow storage never stops the streams already decoding.

The cache's files are real; the store in front of them holds a read until the test lets it go
(a disk that takes as long as the test needs), so what the model thread does meanwhile is seen.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.llm import render_prompt, tokenize
from shared.prefix_cache.blobs import DirectoryBlobStore
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.conftest import DATA_DIR
from worker.conclave.engine import ConclaveEngine
from worker.conclave.streams import Ended, Started, StreamHandle, StreamRequest, Token
from worker.main import build_conclave

DOC = " ".join(f"Shelf {i} holds {i * 5 % 11} jars of plum jam." for i in range(20))


class HeldReads(DirectoryBlobStore):
    """Whole-blob reads wait until `release` is set; `waiting` says one has begun."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.waiting = threading.Event()
        self.release = threading.Event()

    def get(self, key: str) -> memoryview | None:
        self.waiting.set()
        assert self.release.wait(120), "the test never let the read go"
        return super().get(key)


@pytest.fixture()
def engine(tmp_path: Path) -> Iterator[ConclaveEngine]:
    settings = Settings(
        model="smollm2-135m",
        data_dir=DATA_DIR,
        n_ctx=1024,
        cache={"dir": tmp_path, "block_tokens": 64, "min_tokens": 16},
        worker={"max_active_jobs": 2},
    )
    built = build_conclave(settings)
    yield built
    built.close()


class Written:
    """A stream's tokens as the model thread hands them on; `wait_for` blocks until n came."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._grew = threading.Condition()

    def keep(self, token: Token) -> bool:
        with self._grew:
            self.tokens.append(token.token)
            self._grew.notify_all()
        return False

    def wait_for(self, n: int) -> bool:
        with self._grew:
            return self._grew.wait_for(lambda: len(self.tokens) >= n, timeout=120)


def submit(engine: ConclaveEngine, tokens: list[int], max_new: int) -> tuple[StreamHandle, Written]:
    written = Written()
    request = StreamRequest(tokens, (), None, 0, max_new=max_new)
    return engine.conclave.submit(engine.conclave.handle(request, written.keep)), written


def plain(engine: ConclaveEngine, text: str) -> list[int]:
    return tokenize(engine.llama, render_prompt(engine.llama, JobRequest(prompt=text)))


def events(handle: StreamHandle) -> tuple[Started, Ended]:
    started = None
    while not isinstance(event := handle.next(timeout=120), Ended):
        assert event is not None, "the stream did not end"
        if isinstance(event, Started):
            started = event
    assert started is not None
    return started, event


def test_a_stream_decodes_on_while_another_reads_its_prefix_from_disk(
    engine: ConclaveEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.cache is not None and engine.saver is not None
    document = plain(engine, DOC + "\nWhich shelf holds the most jars?")
    chat = plain(engine, "Write a long list of fruit names, one per line:\n")
    cold_handle, cold = submit(engine, document, 8)
    events(cold_handle)
    engine.saver.flush()  # the document's state is on disk
    engine.forget()  # and no longer in memory

    store = HeldReads(engine.cache._store.root)  # type: ignore[attr-defined]
    monkeypatch.setattr(engine.cache, "_store", store)
    decoding, chat_written = submit(engine, chat, 200)
    assert chat_written.wait_for(1)  # the chat decodes before the document's read begins
    reading, restored = submit(engine, document, 8)
    assert store.waiting.wait(120)
    # The read is held: the chat still gets tokens, unless the model thread waits for the disk.
    assert chat_written.wait_for(len(chat_written.tokens) + 5), "the chat stopped for the read"
    store.release.set()
    started, _ = events(reading)
    assert started.cached_tokens >= 64 and started.restore_ms is not None
    assert restored.tokens == cold.tokens
    events(decoding)
