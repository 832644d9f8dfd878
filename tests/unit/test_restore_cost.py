"""Restore or prefill again (worker/restore_cost.py), and what saves may cost decoding
(worker/save_budget.py): the decisions, from measured figures, without a model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from shared.prefix_cache import PrefixCache, ReadOffer
from shared.prefix_cache.blobs import MemoryBlobStore
from worker.restore_cost import MEMORY_PRIOR, RestoreCosts, choice_timings
from worker.save_yield import SaveYield

MB = 10**6


def costs(prefill_tokens_per_s: float, disk_bytes_per_s: float | None) -> RestoreCosts:
    measured = RestoreCosts(None)
    measured.prefilled(256, 256 / prefill_tokens_per_s)
    measured.disk.per_s = disk_bytes_per_s
    return measured


def test_before_any_prefill_is_measured_a_restore_is_taken() -> None:
    choice = RestoreCosts(None).choose(ReadOffer(3000, 36 * MB, 0), kept=0)
    assert choice.restore and choice.prefill_s is None
    assert choice_timings(choice)["recompute_estimate_ms"] is None


def test_a_slow_disk_loses_to_prefill_and_the_page_cache_wins() -> None:
    # 3,000 tokens of 12 KB at 200 tokens/s: 15 s to prefill; 36 MB at 2 MB/s: 18 s to read.
    slow = costs(200, 2 * MB)
    cold = slow.choose(ReadOffer(3000, 36 * MB, 0), kept=0)
    assert not cold.restore
    assert cold.restore_s == pytest.approx(18) and cold.prefill_s == pytest.approx(15)
    assert choice_timings(cold) == {
        "restore_choice": "recompute",
        "restore_estimate_ms": pytest.approx(18_000),
        "recompute_estimate_ms": pytest.approx(15_000),
    }
    # The same state, all in the page cache, reads at memory's rate.
    assert slow.choose(ReadOffer(3000, 36 * MB, 36 * MB), kept=0).restore
    # What memory already gives is not the restore's to save.
    assert slow.choose(ReadOffer(3000, 36 * MB, 0), kept=0).prefill_s == pytest.approx(15)
    assert slow.choose(ReadOffer(3000, 36 * MB, 0), kept=2000).prefill_s == pytest.approx(5)


def test_an_unmeasured_disk_reads_as_memory_does() -> None:
    assert costs(200, None).choose(ReadOffer(3000, 36 * MB, 0), kept=0).restore


def test_restores_teach_the_rates_they_read_at() -> None:
    learned = costs(200, 100 * MB)
    learned.restored(ReadOffer(1000, 10 * MB, 0), 1.0)  # from the disk: 10 MB/s, not 100
    assert learned.disk.per_s is not None and learned.disk.per_s < 100 * MB
    before = learned.disk.per_s
    learned.restored(ReadOffer(1000, 10 * MB, 10 * MB), 0.01)  # from memory: 1 GB/s
    assert learned.disk.per_s == before
    assert learned.memory.per_s is not None and learned.memory.per_s < MEMORY_PRIOR


def test_the_prefill_rate_is_of_the_recent_chunks_by_their_tokens() -> None:
    measured = RestoreCosts(None)
    measured.prefilled(12, 12 / 64)  # a short piece, slow per token
    measured.prefilled(256, 256 / 190)
    assert measured.prefill_per_s() == pytest.approx(268 / (12 / 64 + 256 / 190))


def test_a_restarted_worker_starts_from_the_prefill_rate_it_kept(tmp_path: Path) -> None:
    record = (tmp_path / "prefill-rates.json", "model|threads=2")
    first = RestoreCosts(None, record)
    assert first.prefill_per_s() is None
    first.prefilled(256, 1.0)  # the first chunk is kept at once
    assert RestoreCosts(None, record).prefill_per_s() == pytest.approx(256)
    # Another model's rate is its own.
    assert RestoreCosts(None, (record[0], "other|threads=2")).prefill_per_s() is None


def accounts() -> PrefixCache:
    return PrefixCache(MemoryBlobStore(), "fp")


def slowed(
    counted: PrefixCache | None, limit: float, beside_s: float, **options: float
) -> SaveYield:
    """A model decoding 8-row passes of 80 ms, and a save during which one took `beside_s`."""
    yielding = SaveYield(limit, counted, **options)
    yielding.busy(True)
    for _ in range(5):
        yielding.passed(8, 0.080)  # the lone baseline
    assert not yielding.wait_turn()  # no save has slowed anything: it starts at once
    with yielding.saving():
        yielding.passed(8, beside_s)
    return yielding


def test_once_a_save_slowed_decoding_past_the_limit_saves_wait_for_the_model_to_wait() -> None:
    counted = accounts()
    yielding = slowed(counted, 0.15, 0.300)  # 3.75 times its baseline
    assert counted.counters()["saving_step_ms"] == 300
    assert counted.counters()["saving_step_baseline_ms"] == 80
    assert counted.counters()["decode_pass_ms"] == 5 * 80 + 300
    asked, done = threading.Event(), threading.Event()

    def save() -> None:
        asked.set()
        yielding.wait_turn()
        done.set()

    saver = threading.Thread(target=save)
    saver.start()
    asked.wait()
    for _ in range(5):  # the model goes on decoding: the save waits
        yielding.passed(8, 0.080)
    assert not done.is_set()
    yielding.busy(False)  # the model thread waits for work: the save goes
    saver.join(timeout=60)
    assert done.is_set() and counted.counters()["saves_deferred"] == 1


def test_a_save_within_the_limit_keeps_the_next_from_waiting() -> None:
    yielding = slowed(None, 0.15, 0.090)  # 1.125 times its baseline
    assert not yielding.wait_turn()


def test_saves_someone_waits_for_do_not_wait_for_the_model() -> None:
    yielding = slowed(None, 0.15, 0.300)
    with yielding.hurried():  # a warm job flushing its snapshot while others decode
        assert not yielding.wait_turn()


def test_a_deferred_save_tries_again_after_the_retry_time() -> None:
    yielding = slowed(None, 0.15, 0.300, retry_s=0.2)
    assert yielding.wait_turn()  # deferred while the model stays busy, then it tries
    with yielding.saving():
        yielding.passed(8, 0.085)  # saves no longer slow it (say, fewer streams now)
    assert not yielding.wait_turn()


def test_a_save_shorter_than_the_pass_it_slowed_still_counts() -> None:
    yielding = SaveYield(0.15, retry_s=0.2)
    yielding.busy(True)
    for _ in range(5):
        yielding.passed(8, 0.080)
    with yielding.saving():
        pass  # a save that ended before the pass it ran beside
    yielding.passed(8, 0.300)
    assert yielding.wait_turn()  # deferred: it slowed that pass past the limit
