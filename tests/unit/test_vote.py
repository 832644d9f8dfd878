"""Votes over sampled answers (worker/vote.py) and the spellings they unify (answer_key.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.answer_key import answer_key
from worker.vote import Ballot


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("After 24 hours.", "after  24 hours"),
        ('"Rice"', "rice"),
        ("€ 1,200.00", "1200 €"),
        ("1.200,50 €", "€1200.5"),
        ("12 500 boxes", "12500 boxes"),
        ("5 March 2024", "2024-03-05"),
        ("March 5th, 2024", "05.03.2024"),
        ("5. März 2024", "2024-03-05"),
        ("15/3/2024", "3/15/2024"),
        ("0.50 kg", "0.5 kg"),
        ("1,5 kg", "1.5 kg"),
    ],
)
def test_spellings_of_one_answer_share_a_key(one: str, other: str) -> None:
    assert answer_key(one) == answer_key(other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("12 boxes", "21 boxes"),
        ("1.5 kg", "15 kg"),
        ("2024-03-05", "2024-05-03"),
        ("3/4/2024", "4/3/2024"),  # day and month cannot be told apart: kept as written
        ("31.02.2024", "2024-03-02"),  # not a date: kept as written
        ("rice", "salt"),
        ("v2.5.1", "v2.51"),
    ],
)
def test_different_answers_keep_different_keys(one: str, other: str) -> None:
    assert answer_key(one) != answer_key(other)


def full_count_winner(answers: list[str]) -> str:
    """The vote's rule written plainly: most votes, ties to the lowest sample index."""
    keys = [answer_key(a) for a in answers]
    votes = Counter(keys)
    best = max(votes.values())
    return next(k for k in keys if votes[k] == best)


def in_order(answers: list[str]) -> Ballot:
    """The samples ending one after another, up to the vote's end."""
    ballot = Ballot(len(answers))
    for sample, answer in enumerate(answers):
        ballot.end(sample, answer)
        if ballot.complete:
            break
    return ballot


answers_and_order = st.lists(
    st.sampled_from(["rice", "Rice.", "salt", "tea", "12", "12.0"]), min_size=1, max_size=9
).flatmap(lambda answers: st.tuples(st.just(answers), st.permutations(range(len(answers)))))


@given(answers_and_order)
def test_stopping_once_decided_never_changes_the_winner(case: tuple[list[str], list[int]]) -> None:
    """Samples end in any order; once the ballot is complete the rest cannot matter, and what
    it counted does not depend on the order they ended in."""
    answers, order = case
    ballot = Ballot(len(answers))
    for sample in order:
        ballot.end(sample, answers[sample])
        if ballot.complete:
            break
    assert ballot.complete
    assert answer_key(ballot.text(ballot.winner())) == full_count_winner(answers)
    assert ballot.outcome() == in_order(answers).outcome()
    outcome = ballot.outcome()
    assert outcome.variants[0].text == answers[ballot.winner()]
    assert outcome.agreement == outcome.variants[0].votes / outcome.counted
    assert sum(v.votes for v in outcome.variants) == outcome.counted == ballot.counted


def test_a_vote_is_decided_only_when_the_rest_cannot_overturn_it() -> None:
    ballot = Ballot(5)
    ballot.end(3, "rice")
    assert ballot.counted == 0  # sample 3 waits for 0, 1 and 2
    ballot.end(0, "rice")
    ballot.end(2, "salt")
    assert ballot.counted == 1 and not ballot.decided  # 1 against 0 with 4 to come
    ballot.end(1, "Rice")  # 0..3 count: 3 against 1 with 1 to come
    assert ballot.counted == 4 and ballot.decided and ballot.winner() == 0
    vote = ballot.outcome()
    assert (vote.agreement, vote.counted, vote.samples) == (0.75, 4, 5)
    assert [(v.text, v.votes) for v in vote.variants] == [("rice", 3), ("salt", 1)]


def test_samples_after_the_decision_are_not_counted() -> None:
    ballot = Ballot(5)
    for sample in (0, 1, 2):
        ballot.end(sample, "12 boxes")
    assert ballot.decided and ballot.counted == 3
    ballot.end(3, "13 boxes")
    assert ballot.outcome().counted == 3 and ballot.outcome().agreement == 1.0


def test_a_tie_goes_to_the_lowest_sample_whatever_ended_first() -> None:
    ballot = Ballot(4)
    for sample, answer in [(3, "salt"), (2, "salt"), (1, "rice"), (0, "rice")]:
        ballot.end(sample, answer)
    assert not ballot.decided and ballot.complete  # a tie is settled by the full count
    assert ballot.winner() == 0 and ballot.outcome().agreement == 0.5


def test_a_sample_ends_once() -> None:
    ballot = Ballot(3)
    ballot.end(1, "rice")
    with pytest.raises(ValueError, match="sample 1"):
        ballot.end(1, "rice")
    with pytest.raises(ValueError, match="sample 3"):
        ballot.end(3, "rice")


@given(st.lists(st.sampled_from(["rice", "salt", "tea"]), min_size=1, max_size=9))
def test_drawing_the_fewest_that_could_decide_ends_where_drawing_all_does(
    answers: list[str],
) -> None:
    """Samples drawn in waves of `needed()` (as a voted question draws them) reach the
    outcome of counting them all in order, and no smaller wave could have decided it."""
    waves = Ballot(len(answers))
    while not waves.complete:
        wave = waves.needed()
        assert 1 <= wave <= len(answers) - waves.counted
        if wave > 1:  # one fewer, all agreeing with the leader, would leave it open
            probe = Ballot(len(answers))
            for sample in range(waves.counted):
                probe.end(sample, waves.text(sample))
            leader = probe.text(probe.winner()) if probe.counted else "rice"
            for sample in range(waves.counted, waves.counted + wave - 1):
                probe.end(sample, leader)
            assert not probe.complete
        for sample in range(waves.counted, waves.counted + wave):
            waves.end(sample, answers[sample])
    assert waves.outcome() == in_order(answers).outcome()


def test_a_fresh_vote_needs_a_majority_first() -> None:
    assert [Ballot(n).needed() for n in (1, 2, 3, 5, 9)] == [1, 2, 2, 3, 5]
