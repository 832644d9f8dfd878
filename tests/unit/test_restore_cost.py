"""Restore or prefill again (worker/restore_cost.py), and what saves may cost decoding
(worker/save_budget.py): the decisions, from measured figures, without a model."""

from __future__ import annotations

import threading

import pytest

from shared.prefix_cache import PrefixCache, ReadOffer
from shared.prefix_cache.blobs import MemoryBlobStore
from worker.restore_cost import MEMORY_PRIOR, RestoreCosts, choice_timings
from worker.save_budget import IDLE_S, SaveBudget

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


def accounts() -> PrefixCache:
    return PrefixCache(MemoryBlobStore(), "fp")


def test_saves_wait_while_they_have_cost_decoding_more_than_their_share() -> None:
    counted = accounts()
    budget = SaveBudget(0.15, counted)
    for _ in range(5):
        budget.passed(8, 0.080)  # the lone baseline of an 8-row pass
    assert not budget.wait_turn()  # nothing owed: a save starts at once
    # Five passes earned 60 ms; a save made one pass take 300 ms: 220 ms owed, 45 ms earned.
    with budget.saving():
        budget.passed(8, 0.300)
    assert counted.counters()["saving_step_ms"] == 300
    assert counted.counters()["saving_step_baseline_ms"] == 80
    waited = threading.Event()
    done = threading.Event()

    def save() -> None:
        waited.set()
        budget.wait_turn()
        done.set()

    saver = threading.Thread(target=save)
    saver.start()
    waited.wait()
    passes = 0
    while not done.is_set():
        assert passes < 50, "the saver never got its turn"
        budget.passed(8, 0.080)  # each pass earns 12 ms of the 115 ms still owed
        passes += 1
        done.wait(0.01)
    saver.join()
    assert passes >= 10  # not before the debt was paid
    assert counted.counters()["saves_deferred"] == 1


def test_with_no_stream_decoding_a_save_waits_for_no_budget() -> None:
    budget = SaveBudget(0.0)
    budget.passed(1, 0.02)
    with budget.saving():
        budget.passed(1, 0.5)  # deep in debt, and nothing will earn it back
    started = threading.Event()
    done = threading.Event()

    def save() -> None:
        started.set()
        budget.wait_turn()
        done.set()

    threading.Thread(target=save).start()
    started.wait()
    # No pass for IDLE_S: the model is not decoding, so the save goes.
    assert done.wait(IDLE_S * 20)
