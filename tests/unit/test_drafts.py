"""Drafting's decisions without a model (worker/conclave/drafts.py): the prompt lookup, the
pass cost it learns, and how many drafts a pass carries."""

from __future__ import annotations

import pytest

from worker.conclave.drafts import (
    MAX_DRAFT,
    PRIOR_ACCEPTANCE,
    Acceptance,
    Offer,
    PassCost,
    PromptLookup,
    StreamDrafts,
    plan_drafts,
    ubatch_rows,
)

QUOTE = [11, 12, 13, 14, 15, 16, 17, 18]


def test_the_lookup_continues_the_span_its_last_tokens_copy() -> None:
    lookup = PromptLookup([1, 2, *QUOTE, 3, 4, 11, 12])
    assert lookup.propose(4) == [13, 14, 15, 16]
    lookup.extend([13, 14])  # followed: the same span goes on
    assert lookup.propose(3) == [15, 16, 17]
    lookup.extend([99])  # left the span: no n-gram ending in 99 was ever followed
    assert lookup.propose(3) == []


def test_the_lookup_never_matches_its_own_tail() -> None:
    assert PromptLookup([5, 6, 7, 8]).propose(2) == []


def test_a_pass_cost_never_measured_is_extrapolated_from_below() -> None:
    cost = PassCost()
    assert cost.estimate(1) is None
    cost.record(1, 0.040)
    assert cost.estimate(1) == pytest.approx(0.040)
    four = cost.estimate(4)
    assert four is not None and 0.040 < four < 4 * 0.040
    cost.record(4, 0.200)  # measured dearer than the prior: the measurement wins
    assert cost.estimate(4) == pytest.approx(0.200)
    assert cost.estimate(5) > 0.200  # type: ignore[operator]


def test_a_longer_pass_is_priced_at_the_cost_per_row_measured_last() -> None:
    cost = PassCost()
    for rows, seconds in ((1, 0.010), (2, 0.016), (4, 0.020)):  # a second row dear, then cheap
        cost.record(rows, seconds)
    assert cost.estimate(8) == pytest.approx(0.020 + 4 * 0.002)
    assert cost.estimate(3) == pytest.approx(0.016 + 0.006)  # between 1 and 2 rows' slope
    cost.record(5, 0.019)  # cheaper than 4 (noise): a row more never costs less than nothing
    assert cost.estimate(6) == pytest.approx(0.019)


def linear(one_row: float, per_row: float) -> PassCost:
    cost = PassCost()
    for rows in range(1, 32):
        cost.record(rows, one_row + per_row * (rows - 1))
    return cost


def test_a_lone_stream_drafts_when_its_guesses_come_true_and_not_when_they_do_not() -> None:
    cost = linear(0.040, 0.026)  # a row more costs 0.65 of one row
    copying = plan_drafts([0], [Offer(0, "auto", 0.9, 0.9, MAX_DRAFT)], cost.estimate, 31)
    assert copying[0] >= 2
    free_text = plan_drafts([0], [Offer(0, "auto", 0.3, 0.3, MAX_DRAFT)], cost.estimate, 31)
    assert free_text[0] == 0


def test_under_load_drafting_turns_itself_down() -> None:
    cost = linear(0.040, 0.026)
    offers = [Offer(key, "auto", 0.8, 0.8, MAX_DRAFT) for key in range(8)]
    assert sum(plan_drafts(range(8), offers, cost.estimate, 31).values()) == 0
    # Rows that cost little beside the others (a pass bound by reading the weights): it pays.
    cheap = linear(0.040, 0.004)
    assert sum(plan_drafts(range(8), offers, cheap.estimate, 31).values()) > 0


def test_llama_cpp_splits_a_pass_where_its_streams_bring_different_rows() -> None:
    assert ubatch_rows([1, 1, 1, 1]) == [4]
    assert ubatch_rows([3, 1, 1, 1]) == [4, 2]
    assert ubatch_rows([2, 2, 1]) == [3, 2]
    assert ubatch_rows([1, 3, 1, 2]) == [4, 2, 1]  # a gap in the rows left splits again


def test_one_stream_s_drafts_beside_plain_rows_are_priced_as_a_pass_of_their_own() -> None:
    cheap = linear(0.040, 0.004)  # a row more is cheap, a pass more is not
    offer = Offer(3, "auto", 0.9, 0.9, MAX_DRAFT)
    assert plan_drafts([3], [offer], cheap.estimate, 31)[3] >= 2
    assert plan_drafts([0, 1, 2, 3], [offer], cheap.estimate, 31) == {3: 0}
    # Every stream drafting the same: one pass of equal rows, which pays.
    offers = [Offer(key, "auto", 0.9, 0.9, MAX_DRAFT) for key in range(4)]
    planned = plan_drafts(range(4), offers, cheap.estimate, 31)
    assert len(set(planned.values())) == 1 and planned[0] > 0


def test_the_likeliest_drafts_go_first_and_the_row_budget_holds() -> None:
    cheap = linear(0.040, 0.001)
    offers = [Offer(0, "auto", 0.95, 0.95, MAX_DRAFT), Offer(1, "auto", 0.5, 0.5, MAX_DRAFT)]
    planned = plan_drafts([0, 1], offers, cheap.estimate, 31)
    assert planned[0] >= planned[1]
    many = [Offer(key, "auto", 0.99, 0.99, MAX_DRAFT) for key in range(6)]
    assert 6 + sum(plan_drafts(range(6), many, cheap.estimate, 31).values()) <= 31


def test_on_drafts_all_it_has_within_the_budget_and_nothing_drafts_unmeasured() -> None:
    unmeasured = PassCost()
    offers = [Offer(0, "on", 0.1, 0.1, 5), Offer(1, "auto", 0.99, 0.99, 5)]
    assert plan_drafts([0, 1], offers, unmeasured.estimate, 31) == {0: 5, 1: 0}
    assert plan_drafts([0, 1], [Offer(0, "on", 0.1, 0.1, 5)], unmeasured.estimate, 4) == {0: 2}


def test_a_copied_span_is_priced_as_one_that_goes_on_once_begun() -> None:
    cost = linear(0.040, 0.014)  # a row more costs 0.35 of one (a small model's weights)
    flat = plan_drafts([0], [Offer(0, "auto", 0.6, 0.6, MAX_DRAFT)], cost.estimate, 31)
    span = plan_drafts([0], [Offer(0, "auto", 0.6, 0.95, MAX_DRAFT)], cost.estimate, 31)
    assert span[0] > flat[0]
    assert Offer(0, "auto", 0.6, 0.95, MAX_DRAFT).expected(3) == pytest.approx(0.6 * 0.95**2)


def test_a_stream_learns_from_plain_passes_and_from_its_drafts() -> None:
    worker = Acceptance()
    drafts = StreamDrafts("auto", [1, 2, *QUOTE, 3, 11, 12], worker)
    offer = drafts.offer(0, 4)
    assert offer is not None and offer.available == 4
    assert offer.first == offer.then == PRIOR_ACCEPTANCE
    drafts.scored([], 0, 13)  # a plain pass wrote the guessed token: a span starts
    assert drafts.acceptance.start > PRIOR_ACCEPTANCE and worker.start > PRIOR_ACCEPTANCE
    assert drafts.acceptance.then == PRIOR_ACCEPTANCE
    offer = drafts.offer(0, 4)  # after a right guess, the next is priced as going on
    assert offer is not None and offer.first == drafts.acceptance.then
    drafts.scored(drafts.take(3), 3, 16)  # all three right, and the offer's fourth too
    assert drafts.drafted == 3
    then = drafts.acceptance.then
    assert then > PRIOR_ACCEPTANCE
    drafts.offer(0, 4)
    drafts.scored(drafts.take(3), 0, 77)  # the first wrong: the span ended
    assert drafts.acceptance.then < then
    offer = drafts.offer(0, 4)
    assert offer is not None and offer.first == drafts.acceptance.start
    # A new stream starts from the worker's rates, never above the prior: those before it may
    # have copied where it writes free text.
    assert worker.then > PRIOR_ACCEPTANCE
    fresh = StreamDrafts("on", [1, 2, 3], worker).acceptance
    assert fresh.start == fresh.then == PRIOR_ACCEPTANCE
    low = StreamDrafts("on", [1, 2, 3], Acceptance(0.1, 0.2)).acceptance
    assert (low.start, low.then) == (0.1, 0.2)
