from __future__ import annotations

import random

import pytest

from worker.speculation.sources import FirstOf, NgramLookup, continue_from


def rescan(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The slow reference: search backwards for the latest earlier match, longest n first."""
    for n in range(max_n, min_n - 1, -1):
        if len(seq) < n:
            continue
        tail = seq[-n:]
        for end in range(len(seq) - 1, n - 1, -1):
            if seq[end - n : end] == tail:
                return continue_from(seq, end, k)
    return []


def test_continues_a_span_copied_from_the_prompt() -> None:
    prompt = [10, 11, 12, 13, 14, 15, 16, 99, 12, 13]
    assert NgramLookup(prompt).propose(3) == [14, 15, 16]


def test_longest_match_wins_over_more_recent_shorter_one() -> None:
    # (2, 3) last occurred before 7, but (1, 2, 3) only before 4.
    seq = [1, 2, 3, 4, 0, 2, 3, 7, 1, 2, 3]
    assert NgramLookup(seq, min_n=2, max_n=3).propose(1) == [4]
    assert NgramLookup(seq, min_n=2, max_n=2).propose(1) == [7]


def test_latest_occurrence_of_the_same_ngram_wins() -> None:
    assert NgramLookup([5, 6, 1, 0, 5, 6, 2, 0, 5, 6]).propose(1) == [2]


def test_no_match_and_the_tail_never_matches_itself() -> None:
    assert NgramLookup([1, 2, 3, 4]).propose(4) == []
    assert NgramLookup([7, 8]).propose(4) == []
    assert NgramLookup([1, 2, 1, 2]).propose(0) == []


def test_output_is_indexed_as_it_arrives() -> None:
    lookup = NgramLookup([1, 2, 3])
    assert lookup.propose(2) == []
    lookup.extend([9, 1, 2])
    assert lookup.propose(2) == [3, 9]


def test_a_loop_is_continued_past_the_end_of_the_sequence() -> None:
    assert NgramLookup([1, 2, 3, 1, 2, 3, 1, 2]).propose(5) == [3, 1, 2, 3, 1]
    assert NgramLookup([4, 4, 4]).propose(3) == [4, 4, 4]


def test_incremental_index_equals_a_full_rescan() -> None:
    rng = random.Random(7)
    for _ in range(300):
        min_n, max_n = sorted(rng.sample(range(1, 5), 2))
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 120))]
        lookup = NgramLookup(min_n=min_n, max_n=max_n)
        for token in seq:
            lookup.extend([token])
        assert lookup.propose(5) == rescan(seq, 5, min_n, max_n)


def test_a_followed_proposal_keeps_copying_its_span() -> None:
    # Two lines share "7 8 9"; the latest occurrence is line B's, but we are quoting line A.
    line_a, line_b = [1, 2, 7, 8, 9, 3, 4], [5, 6, 7, 8, 9, 0, 0]
    lookup = NgramLookup([*line_a, *line_b, 99], min_n=2, max_n=2)
    lookup.extend([1, 2])
    assert lookup.propose(3) == [7, 8, 9]
    lookup.extend([7, 8, 9])
    assert lookup.propose(2) == [3, 4]  # a fresh match of (8, 9) would say [0, 0]
    lookup.extend([3, 5])  # the text leaves the span: match again
    assert lookup.propose(2) == []
    lookup.extend([6])
    assert lookup.propose(2) == [7, 8]


def test_first_of_asks_in_order_and_feeds_every_source() -> None:
    prompt = [1, 2, 3, 4, 5, 3, 6]
    strict = NgramLookup(prompt, min_n=3, max_n=3)
    loose = NgramLookup(prompt, min_n=1, max_n=1)
    both = FirstOf(strict, loose)
    both.extend([9, 3])
    assert both.propose(2) == [6, 9]  # only the unigram source knows a (3,)
    both.extend([1, 2, 3])
    assert loose.propose(2) == [1, 2]
    assert both.propose(2) == [4, 5]  # the trigram (1, 2, 3) comes first
    assert strict.tokens == loose.tokens == [*prompt, 9, 3, 1, 2, 3]


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        NgramLookup(min_n=0)
    with pytest.raises(ValueError):
        NgramLookup(min_n=3, max_n=2)
