"""The one sampler: argmax when greedy, else a seeded draw from the top_p nucleus."""

from __future__ import annotations

import numpy as np
import pytest

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


def full_sort_draw(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The nucleus drawn from a full stable sort of every probability, as it was written first:
    the ranking's partial sort must draw the same token with the same generator."""
    scaled = logits.astype(np.float64) / sampling.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = min(int(np.searchsorted(cumulative, sampling.top_p)) + 1, len(order))
    head = probs[order[:keep]]
    return int(order[rng.choice(keep, p=head / head.sum())])


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])
def test_a_partial_sort_draws_what_a_full_sort_draws(spread: float) -> None:
    """Flat and peaked rows, ties included (rounded logits), every nucleus size."""
    make = np.random.default_rng(int(spread * 10))
    for case in range(40):
        logits = (make.standard_normal(5000) * spread).round(1).astype(np.float32)
        sampling = Sampling(float(make.uniform(0.2, 1.5)), float(make.uniform(0.05, 0.999)))
        ours, theirs = np.random.default_rng(case), np.random.default_rng(case)
        for _ in range(5):
            assert sample(logits, sampling, ours) == full_sort_draw(logits, sampling, theirs)
