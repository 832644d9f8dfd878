"""The sampling side of speculative decoding, on hand-made distributions (no model)."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from worker.speculation.decoder import (
    Distribution,
    Sampling,
    accept_or_resample,
    sample,
    target_distribution,
)

TRIALS = 20_000


def llama_cpp_chain(logits: np.ndarray, sampling: Sampling) -> dict[int, float]:
    """The candidates and probabilities llama.cpp's own chain (as Llama.generate builds it,
    minus the neutral repeat penalty) leaves for its final dist sampler."""
    n = logits.size
    data = (llama_cpp.llama_token_data * n)(
        *(llama_cpp.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits))
    )
    cur = llama_cpp.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for stage in (
        llama_cpp.llama_sampler_init_top_k(sampling.top_k),
        llama_cpp.llama_sampler_init_typical(1.0, 1),
        llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1),
        llama_cpp.llama_sampler_init_min_p(sampling.min_p, 1),
        llama_cpp.llama_sampler_init_temp(sampling.temperature),
        llama_cpp.llama_sampler_init_dist(1234),
    ):
        llama_cpp.llama_sampler_chain_add(chain, stage)
    try:
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(cur))
    finally:
        llama_cpp.llama_sampler_free(chain)
    return {int(data[i].id): float(data[i].p) for i in range(cur.size)}


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=0.8, top_p=0.95),
        Sampling(temperature=1.0, top_p=1.0),
        Sampling(temperature=0.3, top_p=0.5),
        Sampling(temperature=1.5, top_p=0.9, top_k=10, min_p=0.0),
        Sampling(temperature=0.7, top_p=1.0, top_k=0, min_p=0.1),
    ],
)
def test_target_distribution_is_the_one_llama_cpp_samples_from(sampling: Sampling) -> None:
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=500) * 3).astype(np.float32)
    ours = target_distribution(logits, sampling)
    theirs = llama_cpp_chain(logits, sampling)
    assert sorted(ours.ids.tolist()) == sorted(theirs)
    for token, p in zip(ours.ids.tolist(), ours.probs.tolist(), strict=True):
        assert p == pytest.approx(theirs[token], rel=1e-4, abs=1e-6)


def empirical(tokens: list[int], ids: np.ndarray) -> np.ndarray:
    counts = {int(t): 0 for t in ids}
    for token in tokens:
        counts[token] += 1
    return np.array([counts[int(t)] for t in ids]) / len(tokens)


DIST = Distribution(np.array([7, 3, 9, 1]), np.array([0.5, 0.3, 0.15, 0.05]))


@pytest.mark.parametrize("draft", [7, 3, 1, 42])  # likely, middling, unlikely, impossible
def test_accept_or_resample_emits_the_target_distribution(draft: int) -> None:
    rng = np.random.default_rng(draft)
    outcomes = [accept_or_resample(DIST, draft, rng) for _ in range(TRIALS)]
    tokens = [token for token, _ in outcomes]
    # Binomial standard error at 20k trials is <= 0.0036; allow four of them.
    assert empirical(tokens, DIST.ids) == pytest.approx(DIST.probs, abs=0.015)
    accepted = sum(ok for _, ok in outcomes) / TRIALS
    assert accepted == pytest.approx(DIST.prob(draft), abs=0.015)
    # A rejection never emits the rejected draft.
    assert all(token != draft for token, ok in outcomes if not ok)


def test_a_certain_draft_is_always_accepted() -> None:
    certain = Distribution(np.array([5]), np.array([1.0]))
    rng = np.random.default_rng(0)
    assert all(accept_or_resample(certain, 5, rng) == (5, True) for _ in range(100))
    assert all(accept_or_resample(certain, 6, rng) == (5, False) for _ in range(100))


def test_sample_follows_the_distribution() -> None:
    rng = np.random.default_rng(1)
    tokens = [sample(DIST, rng) for _ in range(TRIALS)]
    assert empirical(tokens, DIST.ids) == pytest.approx(DIST.probs, abs=0.015)


def test_a_chain_of_drafts_keeps_the_joint_distribution() -> None:
    """Two positions: draft (a, b) verified in order equals sampling each position directly.

    The second position's distribution depends on the first token, as a model's would.
    """
    first = Distribution(np.array([0, 1]), np.array([0.6, 0.4]))
    second = {
        0: Distribution(np.array([0, 1, 2]), np.array([0.2, 0.3, 0.5])),
        1: Distribution(np.array([0, 1, 2]), np.array([0.7, 0.2, 0.1])),
    }
    rng = np.random.default_rng(5)
    pairs = []
    for _ in range(TRIALS):
        a, ok = accept_or_resample(first, 1, rng)
        b = accept_or_resample(second[a], 2, rng)[0] if ok else sample(second[a], rng)
        pairs.append(3 * a + b)
    expected = np.array([first.probs[a] * second[a].probs[b] for a in (0, 1) for b in (0, 1, 2)])
    assert empirical(pairs, np.arange(6)) == pytest.approx(expected, abs=0.015)
