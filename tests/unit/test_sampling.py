"""The one sampler: argmax when greedy, else a seeded draw from the top_p nucleus."""

from __future__ import annotations

import numpy as np

from worker.sampling import Sampling, sample


def test_sampling() -> None:
    logits = np.array([0.0, 3.0, 2.9, -1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, Sampling(), rng) == 1
    # A nucleus this small holds only the most likely token.
    assert {sample(logits, Sampling(1.0, 0.01), rng) for _ in range(50)} == {1}
    assert {sample(logits, Sampling(1.0, 0.9), rng) for _ in range(200)} == {1, 2}
    draws = [sample(logits, Sampling(5.0, 1.0), np.random.default_rng(7)) for _ in range(3)]
    assert len(set(draws)) == 1


def test_a_temperature_too_close_to_0_to_scale_by_is_greedy() -> None:
    logits = np.array([0.0, 3.0, 2.9], dtype=np.float32)
    assert sample(logits, Sampling(1e-310), np.random.default_rng(0)) == 1
