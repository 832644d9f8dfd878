"""Guessing the next tokens for free: n-gram lookup in the prompt and the output so far.

Extraction answers copy spans of their document and long outputs repeat themselves, so the
tokens that followed the last occurrence of the current n-gram are a good guess for what comes
next. The guess is only a draft: the model verifies it (worker/speculative.py).

The index is updated as tokens arrive (one dict write per n-gram length and token), so a
proposal costs a few dict lookups however long the sequence is, instead of a rescan per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class DraftSource(Protocol):
    """Something that proposes the tokens following the sequence it has been shown."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the sequence: the prompt first, then each accepted output token."""
        ...

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens guessed to follow the sequence; [] when there is no guess."""
        ...


class NgramLookup:
    """Prompt lookup: continue the most recent earlier occurrence of the last n tokens.

    n runs from `max_n` down to `min_n`: a longer match is stronger evidence of a copied span.
    Only n-grams that something followed are indexed, so the sequence's own tail never matches
    itself.
    """

    def __init__(self, tokens: Iterable[int] = (), *, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # One dict per n: n-gram -> position of the token that followed its latest occurrence.
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.ngram_sizes}
        self.extend(list(tokens))

    @property
    def ngram_sizes(self) -> range:
        return range(self.max_n, self.min_n - 1, -1)

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self.tokens
        for token in tokens:
            end = len(seq)
            # The n-grams ending just before `token` now have a continuation.
            for n in self.ngram_sizes:
                if end >= n:
                    self._next[n][tuple(seq[end - n : end])] = end
            seq.append(token)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        seq = self.tokens
        for n in self.ngram_sizes:
            if len(seq) < n:
                continue
            start = self._next[n].get(tuple(seq[-n:]))
            if start is not None:
                return continue_from(seq, start, k)
        return []


def continue_from(seq: Sequence[int], start: int, k: int) -> list[int]:
    """`k` tokens copied from `seq[start:]`, running on into the draft itself.

    A match close to the end means the text is looping with period len(seq) - start; copying
    past the end then repeats the loop instead of cutting the draft short.
    """
    draft: list[int] = []
    end = len(seq)
    for i in range(start, start + k):
        draft.append(seq[i] if i < end else draft[i - end])
    return draft


class FirstOf:
    """Several sources in order of trust: the first one with a guess wins.

    Every source sees every token, so a later source is ready when an earlier one has nothing.
    """

    def __init__(self, *sources: DraftSource) -> None:
        self.sources = sources

    def extend(self, tokens: Sequence[int]) -> None:
        for source in self.sources:
            source.extend(tokens)

    def propose(self, k: int) -> list[int]:
        for source in self.sources:
            draft = source.propose(k)
            if draft:
                return draft
        return []
