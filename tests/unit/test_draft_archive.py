from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

from worker.speculation.archive import ArchiveDrafts, DraftArchive

REPO = Path(__file__).resolve().parents[2]
OUTPUT = [5, 6, 7, 8, 9, 10, 11, 12]


def test_proposes_what_followed_an_archived_ngram(tmp_path: Path) -> None:
    archive = DraftArchive(tmp_path / "a.db", continuation=4)
    assert archive.add("fp", OUTPUT) > 0
    assert archive.propose("fp", [1, 2, 6, 7], 3) == [8, 9, 10]
    assert archive.propose("fp", [6, 7], 10) == [8, 9, 10, 11]
    assert archive.propose("fp", [7], 3) == []  # shorter than min_n
    assert archive.propose("fp", [99, 98], 3) == []


def test_the_longest_ngram_wins(tmp_path: Path) -> None:
    archive = DraftArchive(tmp_path / "a.db", min_n=2, max_n=3)
    archive.add("fp", [1, 2, 3, 40])
    archive.add("fp", [0, 2, 3, 50])  # a newer (2, 3)
    assert archive.propose("fp", [1, 2, 3], 1) == [40]
    assert archive.propose("fp", [9, 2, 3], 1) == [50]


def test_models_never_mix(tmp_path: Path) -> None:
    archive = DraftArchive(tmp_path / "a.db")
    archive.add("model-a", OUTPUT)
    assert archive.propose("model-b", [6, 7], 3) == []
    assert archive.propose("model-a", [6, 7], 3) == [8, 9, 10]


def test_shared_between_processes(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    reader = DraftArchive(path)
    code = "import sys; from worker.speculation.archive import DraftArchive;"
    code += f"DraftArchive(sys.argv[1]).add('fp', {OUTPUT})"
    subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, check=True)
    assert reader.propose("fp", [6, 7], 2) == [8, 9]


_BATCH_WRITER = """
import sys
from worker.speculation.archive import DraftArchive
archive = DraftArchive(sys.argv[1], durable=False)
base = int(sys.argv[2])
for i in range(base, base + 40):
    archive.add("fp", [1_000_000 + i, 2_000_000 + i, i])
"""


def test_processes_write_at_the_same_time(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    writers = [
        subprocess.Popen([sys.executable, "-c", _BATCH_WRITER, str(path), str(base)], cwd=REPO)
        for base in (0, 1000)
    ]
    assert [w.wait() for w in writers] == [0, 0]
    archive = DraftArchive(path)
    for i in [*range(40), *range(1000, 1040)]:
        assert archive.propose("fp", [1_000_000 + i, 2_000_000 + i], 1) == [i]


def test_oldest_entries_are_evicted_beyond_max_entries(tmp_path: Path) -> None:
    archive = DraftArchive(tmp_path / "a.db", max_entries=50, min_n=2, max_n=2)
    for start in range(0, 1000, 10):
        archive.add("fp", list(range(start, start + 10)))
    assert archive.entries() <= 50
    assert archive.propose("fp", [991, 992], 1) == [993]
    assert archive.propose("fp", [1, 2], 1) == []


def test_files_stay_within_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    max_bytes = 256 * 1024
    archive = DraftArchive(path, max_bytes=max_bytes, durable=False)
    rng = random.Random(1)
    for _ in range(30):
        archive.add("fp", [rng.randrange(50_000) for _ in range(200)])
        assert archive.size_bytes() <= max_bytes
        # Plus the log (checkpointed at a quarter of max_bytes, plus the add that crossed it),
        # the shared-memory index, and pages freed since the last checkpoint.
        on_disk = sum(os.path.getsize(p) for p in tmp_path.glob("a.db*"))
        assert on_disk <= 2.5 * max_bytes
    assert archive.entries() > 0


_WRITER = """
    import sys
    from worker.speculation.archive import DraftArchive
    archive = DraftArchive(sys.argv[1], continuation=4)
    i = 0
    while True:
        archive.add("fp", [1_000_000 + i, 2_000_000 + i, i])
        print(i, flush=True)
        i += 1
"""


def test_what_was_archived_survives_a_kill(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_WRITER), str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    acknowledged = [int(writer.stdout.readline()) for _ in range(30)]
    # Killed mid-loop, most likely inside a transaction.
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    archive = DraftArchive(path, continuation=4)
    for i in acknowledged:
        assert archive.propose("fp", [1_000_000 + i, 2_000_000 + i], 1) == [i]
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    archive.add("fp", OUTPUT)  # still writable
    assert archive.propose("fp", [6, 7], 1) == [8]


def test_as_a_draft_source_it_looks_up_the_tail(tmp_path: Path) -> None:
    archive = DraftArchive(tmp_path / "a.db")
    archive.add("fp", OUTPUT)
    drafts = ArchiveDrafts(archive, "fp")
    drafts.extend([1, 2, 3, 6])
    assert drafts.propose(2) == []
    drafts.extend([7])
    assert drafts.propose(2) == [8, 9]
