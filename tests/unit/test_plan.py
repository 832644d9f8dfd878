"""The Conclave's turn policy (worker/conclave/plan.py), without a model."""

from __future__ import annotations

import itertools

from worker.conclave.drafts import Offer
from worker.conclave.plan import (
    STARVE_AFTER,
    Decoding,
    Pass,
    Prefilling,
    Waiting,
    plan_admission,
    plan_decode,
    plan_prefill,
)

# Admission: eight questions about one 600-token document (streams 1-8, each may fork from
# another's prefill at the document's end), and a chat sharing nothing (stream 9).
DOCUMENT_END = 600


def shared_document(follower: int, leader: int) -> int:
    return DOCUMENT_END if follower <= 8 and leader <= 8 else 0


def nothing_kept(_key: int) -> int:
    return 0


def test_questions_arriving_with_their_document_wait_for_one_of_them_to_read_it() -> None:
    waiting = [Waiting(key, priority=0) for key in range(1, 10)]
    plan = plan_admission(waiting, {}, room=12, reach=shared_document, kept=nothing_kept)
    assert plan.start == (1, 9)  # the first question reads the document; the chat starts
    assert plan.follows == {key: (1, DOCUMENT_END) for key in range(2, 9)}
    assert plan.led_priority == {1: 0}


def test_a_follower_keeps_its_leader_until_the_leader_reaches_the_fork_or_ends() -> None:
    follower = Waiting(2, priority=0, leader=1, reach=DOCUMENT_END)
    waiting_on = plan_admission([follower], {1: 256}, 4, shared_document, nothing_kept)
    assert waiting_on.follows == {2: (1, DOCUMENT_END)} and waiting_on.start == ()
    # Its leader read the document (it decodes now) or ended: it starts, forking from memory.
    assert plan_admission([follower], {}, 4, shared_document, nothing_kept).start == (2,)


def test_a_stream_memory_already_serves_does_not_wait() -> None:
    plan = plan_admission(
        [Waiting(2, 0)], {1: 100}, 4, shared_document, kept=lambda _key: DOCUMENT_END
    )
    assert plan.start == (2,)


def test_a_leader_prefills_at_its_most_urgent_followers_priority() -> None:
    waiting = [Waiting(2, priority=1), Waiting(3, priority=0)]
    plan = plan_admission(waiting, {1: 0}, 4, shared_document, nothing_kept)
    assert plan.follows == {3: (1, DOCUMENT_END), 2: (1, DOCUMENT_END)}
    assert plan.led_priority == {1: 0}


def test_admission_goes_by_priority_then_arrival_while_sequences_are_free() -> None:
    waiting = [Waiting(key, priority=2 - key % 3) for key in range(10, 16)]
    plan = plan_admission(waiting, {}, room=4, reach=lambda _f, _l: 0, kept=nothing_kept)
    assert plan.start == (11, 14, 10, 13)


def run_prefills(arrivals: dict[int, tuple[int, int, int]], chunk: int) -> list[int]:
    """Whose chunk each turn reads, for streams {key: (arrival turn, priority, prompt tokens)}
    read `chunk` tokens at a time, as the loop applies the plan."""
    remaining: dict[int, int] = {}
    passed: dict[int, int] = {}
    order: list[int] = []
    for turn in range(1000):
        for key, (at, _priority, tokens) in arrivals.items():
            if at == turn:
                remaining[key], passed[key] = tokens, 0
        views = [
            Prefilling(key, arrivals[key][1], left, passed[key], min(chunk, left))
            for key, left in remaining.items()
            if left > 0
        ]
        plan = plan_prefill(views)
        if plan is None:
            return order
        passed.update(plan.passed_over)
        (key,) = plan.keys  # no `rows`: one chunk a turn
        remaining[key] -= chunk
        order.append(key)
    raise AssertionError("the prefills never ended")


def test_nothing_to_prefill_plans_nothing() -> None:
    assert plan_prefill([]) is None


def test_a_more_urgent_class_goes_first_then_the_shortest_then_the_earliest() -> None:
    plan = plan_prefill(
        [Prefilling(0, 1, 10, 0, 10), Prefilling(1, 0, 900, 0, 900), Prefilling(2, 0, 40, 0, 40)]
    )
    assert plan is not None and plan.keys == (2,)
    assert plan_prefill([Prefilling(3, 0, 40, 0, 40), Prefilling(2, 0, 40, 0, 40)]).keys == (2,)  # type: ignore[union-attr]


def test_a_long_prompt_is_read_while_short_ones_keep_arriving() -> None:
    # A 2,048-token document (8 chunks), and a short chat arriving every turn: more than one
    # chunk a turn can read, so a backlog of starved chats grows. Shortest first alone (or the
    # shortest starved first) would read the document after the last chat; it reads a chunk
    # every STARVE_AFTER + 1 turns until the backlog's older chats share its turns.
    arrivals = {0: (0, 0, 2048)} | {key: (key, 0, 16) for key in range(1, 60)}
    order = run_prefills(arrivals, chunk=256)
    turns_of_document = [turn for turn, key in enumerate(order) if key == 0]
    gaps = [b - a for a, b in itertools.pairwise(turns_of_document)]
    assert len(turns_of_document) == 8
    assert gaps[:4] == [STARVE_AFTER + 1] * 4
    assert turns_of_document[-1] < 59  # read whole while chats still arrive


def test_a_short_prompt_arriving_behind_a_long_one_goes_before_its_next_chunk() -> None:
    order = run_prefills({0: (0, 0, 1024), 1: (1, 0, 30), 2: (2, 1, 30)}, chunk=256)
    # The urgent class's short prompt is read next; the batch class's waits for the document.
    assert order == [0, 1, 0, 0, 0, 2]


def test_every_prefilling_stream_is_counted_passed_over_but_the_chosen() -> None:
    plan = plan_prefill([Prefilling(0, 0, 10, 2, 10), Prefilling(1, 0, 500, 3, 500)])
    assert plan is not None
    assert plan.passed_over == {0: 0, 1: 4}


def test_short_chunks_of_one_class_share_a_turn_up_to_one_chunks_rows() -> None:
    # An extraction's question tails (12-14 tokens) beside a document still to read (its next
    # chunk 256 tokens) and a batch-class chat: the tails are read in one turn, shortest first;
    # the document's chunk would take the turn past 256 rows, the chat is of another class.
    tails = [Prefilling(key, 0, 12 + key % 3, 0, 12 + key % 3) for key in range(1, 9)]
    document = Prefilling(20, 0, 500, 0, 256)
    chat = Prefilling(21, 1, 30, 0, 30)
    plan = plan_prefill([document, chat, *tails], rows=256)
    assert plan is not None
    assert plan.keys == (3, 6, 1, 4, 7, 2, 5, 8)
    assert plan.passed_over == {20: 1, 21: 1} | {key: 0 for key in range(1, 9)}


def test_a_turn_adds_chunks_only_while_they_fit_in_its_rows() -> None:
    plan = plan_prefill(
        [Prefilling(0, 0, 900, STARVE_AFTER, 256), Prefilling(1, 0, 10, 0, 10)],
        rows=256,
    )
    assert plan is not None and plan.keys == (0,)  # the starved document's chunk fills it
    plan = plan_prefill(
        [
            Prefilling(0, 0, 100, 0, 100),
            Prefilling(1, 0, 150, 0, 150),
            Prefilling(2, 0, 160, 0, 160),
        ],
        rows=256,
    )
    assert plan is not None and plan.keys == (0, 1)  # 100 + 150; 160 more would not fit


def no_cost(_rows: int) -> float | None:
    return None


def test_streams_share_passes_in_sequence_order_within_the_row_budget() -> None:
    decoding = [Decoding(key, seq=40 - key) for key in range(40)]
    plan = plan_decode(decoding, no_cost, max_rows=31)
    assert [len(p.keys) for p in plan.passes] == [31, 9]
    seqs = [40 - key for p in plan.passes for key in p.keys]
    assert seqs == sorted(seqs)
    assert plan.alone == ()


def test_without_row_invariant_kernels_one_pass_takes_every_stream() -> None:
    plan = plan_decode([Decoding(key, seq=key) for key in range(40)], no_cost, max_rows=None)
    assert [len(p.keys) for p in plan.passes] == [40]


def test_a_lone_plain_stream_and_streams_past_a_near_tie_decode_alone() -> None:
    assert plan_decode([Decoding(7, seq=0)], no_cost, 31).alone == (7,)
    plan = plan_decode(
        [Decoding(1, seq=0), Decoding(2, seq=1, alone=True), Decoding(3, seq=2)], no_cost, 31
    )
    assert plan.passes == (Pass((1, 3)),)
    assert plan.alone == (2,)


def test_every_stream_past_a_near_tie_decodes_alone_on_any_kernels() -> None:
    # Stock kernels (no row budget) once every stream met a near tie: no batched pass at all.
    decoding = [Decoding(key, seq=key, alone=True) for key in range(5)]
    for max_rows in (None, 31):
        plan = plan_decode(decoding, no_cost, max_rows)
        assert plan.passes == ()
        assert plan.alone == (0, 1, 2, 3, 4)


def linear(rows: int) -> float:
    return 0.05 * rows  # no row cheaper than alone: a draft never pays for itself


def cheap(rows: int) -> float:
    return 0.05 + 0.005 * (rows - 1)


def test_a_drafting_stream_takes_the_batched_path_alone_and_drafts_where_rows_are_cheap() -> None:
    offer = Offer(5, "auto", 0.9, 0.9, 4)
    cheap_plan = plan_decode([Decoding(5, seq=0, drafting=True, offer=offer)], cheap, 31)
    assert cheap_plan.passes == (Pass((5,), {5: 4}),)
    dear_plan = plan_decode([Decoding(5, seq=0, drafting=True, offer=offer)], linear, 31)
    assert dear_plan.passes == (Pass((5,)),)


def test_drafts_never_take_a_pass_past_the_row_budget() -> None:
    decoding = [
        Decoding(key, seq=key, drafting=True, offer=Offer(key, "on", 0.9, 0.9, 8))
        for key in range(6)
    ]
    plan = plan_decode(decoding, cheap, max_rows=31)
    (only,) = plan.passes
    assert len(only.keys) + sum(only.drafts.values()) == 31
