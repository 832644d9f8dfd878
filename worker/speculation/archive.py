"""The generation archive: what this model wrote before, as drafts for what it writes next.

Batch workloads repeat themselves: the same field names, boilerplate and phrasings come back
job after job. The archive maps each n-gram of past outputs to the tokens that followed it, per
model fingerprint (token ids mean nothing across tokenizers, and different models continue
differently).

Stored in one SQLite file in WAL mode: every worker process on the host opens it, readers never
block the writer, and a commit is atomic, so a killed worker loses at most the output it was
still writing, never what it archived before. SQLite locking needs a local file system, so the
archive is per host, not on NFS. The size is bounded: entries are evicted oldest-written first,
and freed pages are given back to the file system.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from shared.prefix_cache.keys import token_bytes, tokens_from_bytes

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS models (
        id INTEGER PRIMARY KEY,
        fingerprint TEXT NOT NULL UNIQUE
    )""",
    # Ids only grow (AUTOINCREMENT), so a rewritten n-gram moves to the young end and
    # eviction by id is oldest-written first.
    """CREATE TABLE IF NOT EXISTS ngrams (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        model INTEGER NOT NULL,
        ngram BLOB NOT NULL,
        continuation BLOB NOT NULL,
        UNIQUE (model, ngram)
    )""",
)
_BUSY_TIMEOUT_S = 10.0
# The write-ahead log is checkpointed (and truncated) once it holds a quarter of max_bytes,
# within these bounds (SQLite's default is 1000 pages).
_WAL_PAGES = (16, 1000)
# Evicting for bytes goes in steps of this fraction of the entries, so it is not done per add.
_EVICT_FRACTION = 0.1


class DraftArchive:
    """An n-gram -> continuation index over past outputs, on disk, shared by processes.

    `durable=True` makes every commit survive a power loss too (one fsync per `add`);
    without it a commit survives a killed process but not a crashed machine.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        max_entries: int = 200_000,
        max_bytes: int = 64 * 1024 * 1024,
        min_n: int = 2,
        max_n: int = 4,
        continuation: int = 16,
        durable: bool = True,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.path = Path(path)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_n = min_n
        self.max_n = max_n
        self.continuation = continuation
        self._lock = threading.Lock()
        self._model_ids: dict[str, int] = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = _connect(self.path, durable, max_bytes)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add(self, fingerprint: str, tokens: Sequence[int]) -> int:
        """Archive one output; returns how many n-grams were written (in one transaction)."""
        rows = list(self._rows(tokens))
        if not rows:
            return 0
        with self._lock:
            with _transaction(self._db):
                model = self._model_id(fingerprint, create=True)
                assert model is not None
                self._db.executemany(
                    "INSERT OR REPLACE INTO ngrams (model, ngram, continuation) VALUES (?, ?, ?)",
                    [(model, ngram, cont) for ngram, cont in rows],
                )
                self._evict()
            _release_free_pages(self._db)
        return len(rows)

    def propose(self, fingerprint: str, context: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest archived n-gram ending `context`."""
        if k <= 0:
            return []
        with self._lock:
            model = self._model_id(fingerprint, create=False)
            if model is None:
                return []
            for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
                row = self._db.execute(
                    "SELECT continuation FROM ngrams WHERE model = ? AND ngram = ?",
                    (model, token_bytes(context[-n:])),
                ).fetchone()
                if row is not None:
                    return tokens_from_bytes(row[0])[:k]
        return []

    def entries(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM ngrams").fetchone()[0])

    def size_bytes(self) -> int:
        """Bytes the database file holds (the write-ahead log is bounded separately)."""
        with self._lock:
            return _page_bytes(self._db, "page_count")

    def _rows(self, tokens: Sequence[int]) -> list[tuple[bytes, bytes]]:
        """(n-gram, what followed it) for every n-gram with a continuation; later ones win."""
        rows: dict[bytes, bytes] = {}
        for end in range(self.min_n, len(tokens)):
            cont = token_bytes(tokens[end : end + self.continuation])
            for n in range(self.min_n, min(self.max_n, end) + 1):
                rows[token_bytes(tokens[end - n : end])] = cont
        return list(rows.items())

    def _model_id(self, fingerprint: str, *, create: bool) -> int | None:
        known = self._model_ids.get(fingerprint)
        if known is not None:
            return known
        row = self._db.execute(
            "SELECT id FROM models WHERE fingerprint = ?", (fingerprint,)
        ).fetchone()
        if row is None and create:
            row = self._db.execute(
                "INSERT INTO models (fingerprint) VALUES (?) RETURNING id", (fingerprint,)
            ).fetchone()
        if row is None:
            return None
        self._model_ids[fingerprint] = int(row[0])
        return int(row[0])

    def _evict(self) -> None:
        """Keep at most max_entries ids and max_bytes of pages; oldest written go first."""
        db = self._db
        newest = db.execute("SELECT max(id) FROM ngrams").fetchone()[0]
        if newest is None:
            return
        db.execute("DELETE FROM ngrams WHERE id <= ?", (newest - self.max_entries,))
        while _used_bytes(db) > self.max_bytes:
            oldest, count = db.execute("SELECT min(id), count(*) FROM ngrams").fetchone()
            if not count:
                break
            step = max(1, int(count * _EVICT_FRACTION))
            db.execute("DELETE FROM ngrams WHERE id < ?", (oldest + step,))


def _connect(path: Path, durable: bool, max_bytes: int) -> sqlite3.Connection:
    # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE), so a writer takes the write
    # lock up front instead of failing to upgrade a read lock under contention.
    db = sqlite3.connect(
        path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )
    try:
        # Only takes effect on a new, empty file: it must precede the first table.
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute(f"PRAGMA synchronous = {'FULL' if durable else 'NORMAL'}")
        page_size = int(db.execute("PRAGMA page_size").fetchone()[0])
        wal_pages = max(_WAL_PAGES[0], min(_WAL_PAGES[1], max_bytes // 4 // page_size))
        db.execute(f"PRAGMA wal_autocheckpoint = {wal_pages}")
        db.execute(f"PRAGMA journal_size_limit = {wal_pages * page_size}")
        with _transaction(db):
            for statement in _SCHEMA:
                db.execute(statement)
    except BaseException:
        db.close()
        raise
    return db


def _release_free_pages(db: sqlite3.Connection) -> None:
    """Hand the pages freed by evictions back to the file system (its own transaction).

    The pragma frees one page per step, and execute() steps once; executescript() runs it to
    the end, but commits first, so it cannot run inside add()'s transaction.
    """
    if db.execute("PRAGMA freelist_count").fetchone()[0]:
        db.executescript("PRAGMA incremental_vacuum;")


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any error."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _page_bytes(db: sqlite3.Connection, pragma: str) -> int:
    pages = int(db.execute(f"PRAGMA {pragma}").fetchone()[0])
    return pages * int(db.execute("PRAGMA page_size").fetchone()[0])


def _used_bytes(db: sqlite3.Connection) -> int:
    return _page_bytes(db, "page_count") - _page_bytes(db, "freelist_count")


class ArchiveDrafts:
    """The archive as a draft source for one job: looks up the tail of the sequence so far."""

    def __init__(self, archive: DraftArchive, fingerprint: str) -> None:
        self.archive = archive
        self.fingerprint = fingerprint
        self._tail: deque[int] = deque(maxlen=archive.max_n)

    def extend(self, tokens: Sequence[int]) -> None:
        self._tail.extend(tokens)

    def propose(self, k: int) -> list[int]:
        return self.archive.propose(self.fingerprint, list(self._tail), k)
