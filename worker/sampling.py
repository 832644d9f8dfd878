"""How a token is chosen from a row's logits: one `Sampling` per request, one sampler.

Greedy (temperature 0) is the argmax; otherwise a draw from the top_p nucleus of
softmax(logits / temperature), with the stream's own generator seeded by the request, so a
seeded request writes the same text wherever it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Logits = npt.NDArray[np.float32]
Ints = npt.NDArray[np.intp]
Floats = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def sample(logits: Logits, sampling: Sampling, rng: np.random.Generator) -> int:
    """Argmax when greedy, else a draw from the top_p nucleus of softmax(logits / T)."""
    if sampling.greedy:
        return int(np.argmax(logits))
    with np.errstate(over="ignore"):
        scaled = logits.astype(np.float64) / sampling.temperature
    if not np.isfinite(scaled).all():  # a temperature this close to 0 is greedy
        return int(np.argmax(logits))
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if sampling.top_p >= 1:
        return int(rng.choice(len(probs), p=probs))
    order, cumulative = _ranking_head(probs, sampling.top_p)
    # The smallest head of the ranking whose mass reaches top_p, never empty.
    keep = min(int(np.searchsorted(cumulative, sampling.top_p)) + 1, len(probs))
    head = probs[order[:keep]]
    return int(order[rng.choice(keep, p=head / head.sum())])


def _ranking_head(probs: npt.NDArray[np.float64], top_p: float) -> tuple[Ints, Floats]:
    """The tokens by probability, highest first (ties by id), with their cumulative mass, at
    least until that mass reaches `top_p`: the head of what a full stable sort gives, with
    the same sums, from a partial one. A full sort of a vocabulary of 151,936 took most of a
    sampled token's time on the model thread, where every decoding stream waits for it."""
    n = len(probs)
    count = 64
    while count < n:
        threshold = np.partition(probs, n - count)[n - count]  # the count-th highest
        head = np.flatnonzero(probs >= threshold)  # ties with it too, in id order
        order = head[np.argsort(-probs[head], kind="stable")]
        cumulative = np.cumsum(probs[order])  # summed in order: the full sort's first sums
        if cumulative[-1] >= top_p:
            return order, cumulative
        count *= 16
    order = np.argsort(-probs, kind="stable")
    return order, np.cumsum(probs[order])
