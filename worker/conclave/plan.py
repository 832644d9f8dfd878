"""The Conclave's decisions, apart from the passes that carry them out.

Each turn the model thread (loop.py) asks `plan_admission` which waiting streams start and which
wait for another's prefill, `plan_prefill` whose prompt chunks it reads and, once they are
read, `plan_decode` which decoding streams share which pass and with how many drafts. Each is a
pure function of the streams' state as the loop sees it (what memory and prompts hold comes in
as values or read-only functions), so the policy is tested without a model
(tests/unit/test_plan.py): priority classes, a document read once for the questions that
arrive with it, shortest remaining first, a bounded wait for a long prompt, the row budget,
drafting turned down under load.

Why the row budget: on the row-invariant kernels a pass computes each row as a lone decode
does only below `granary_exact_rows` rows (worker/kernels.py); a wider pass takes the batched
kernels and its rows' logits depend on what shares it. More decoding streams than that (an
extraction's many questions, `max_active_jobs` up to 48) are split into several passes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from worker.conclave.drafts import Offer, plan_drafts

# A stream passed over this many times for a shorter one prefills next, however long it is.
STARVE_AFTER = 4


@dataclass(frozen=True, slots=True)
class Waiting:
    """A stream without a sequence yet."""

    key: int  # in arrival order
    priority: int
    leader: int | None = None  # the prefilling stream it waited for last turn
    reach: int = 0  # the cells of that leader's prefill it may fork from


@dataclass(frozen=True, slots=True)
class Admission:
    start: tuple[int, ...]  # streams given a sequence this turn, in this order
    follows: dict[int, tuple[int, int]]  # a waiting stream's leader and reach
    led_priority: dict[int, int]  # a leader's most urgent follower's priority


def plan_admission(
    waiting: Sequence[Waiting],
    prefilling: Mapping[int, int],
    room: int,
    reach: Callable[[int, int], int],
    kept: Callable[[int], int],
) -> Admission:
    """Who starts, in priority then arrival order, while sequences are free or idle (`room`).

    A stream whose prompt shares a prefix with one still prefilling it waits for that
    *leader* instead of reading the prefix a second time beside it, while the leader has not
    reached the cells the follower may fork from (`reach(follower, leader)`) and they are more
    than memory would let it keep now (`kept`). It keeps its leader while that one prefills;
    one that ended (cancelled, failed) frees its followers, and the first of them to start
    leads the others. `prefilling`: each prefilling stream's prefilled cells; a stream started
    here leads from the cells memory lets it keep.
    """
    positions = dict(prefilling)
    start: list[int] = []
    follows: dict[int, tuple[int, int]] = {}
    led: dict[int, int] = {}
    for stream in sorted(waiting, key=lambda w: (w.priority, w.key)):
        if room <= 0:
            break
        followed = _leader(stream, positions, reach, kept)
        if followed is None:
            start.append(stream.key)
            positions[stream.key] = kept(stream.key)
            room -= 1
            continue
        follows[stream.key] = followed
        leader = followed[0]
        led[leader] = min(led.get(leader, stream.priority), stream.priority)
    return Admission(tuple(start), follows, led)


def _leader(
    stream: Waiting,
    positions: Mapping[int, int],
    reach: Callable[[int, int], int],
    kept: Callable[[int], int],
) -> tuple[int, int] | None:
    """The leader `stream` waits for and the cells it may fork from, if it should wait."""
    kept_leader = stream.leader
    if kept_leader is not None and positions.get(kept_leader, stream.reach) < stream.reach:
        return kept_leader, stream.reach
    if not positions:
        return None
    # The most it may fork from; of equals, the earliest leader.
    best, leader = max(((reach(stream.key, key), key) for key in positions), key=_most_then_first)
    if best <= positions[leader] or best <= kept(stream.key):
        return None
    return leader, best


def _most_then_first(reach_and_key: tuple[int, int]) -> tuple[int, int]:
    reach, key = reach_and_key
    return reach, -key


@dataclass(frozen=True, slots=True)
class Prefilling:
    """A stream still reading its prompt."""

    key: int  # in arrival order
    priority: int  # the most urgent of its own and its waiting followers' (`plan_admission`)
    remaining: int  # prompt tokens still to read
    passed_over: int  # turns another stream's chunk went first since its last one
    chunk: int  # tokens its next chunk reads


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    keys: tuple[int, ...]  # whose next chunks are read this turn, in this order
    passed_over: dict[int, int]  # every prefilling stream's count after this turn


def plan_prefill(prefilling: Sequence[Prefilling], rows: int = 0) -> PrefillPlan | None:
    """The streams whose chunks this turn reads. First: the most urgent priority class, the
    fewest remaining tokens within it (a short prompt's first token should not wait for a long
    document's read), arrival order last. But a stream passed over STARVE_AFTER times goes
    first, and among such the one passed over most: under a backlog of short prompts the
    shortest starved one would win every turn, and the long one wait for the backlog to end.

    Then, in the same order, the next chunks of other streams of that class while the turn reads
    at most `rows` tokens (one canonical chunk's): a turn of short chunks (an extraction's
    question tails, short chats) costs no more than one long chunk, and the decode passes of
    few rows that each short chunk would otherwise wait behind, the costliest per token, come
    less often."""
    if not prefilling:
        return None
    starved = [s for s in prefilling if s.passed_over >= STARVE_AFTER]
    if starved:
        first = min(starved, key=lambda s: (-s.passed_over, s.priority, s.remaining, s.key))
    else:
        first = min(prefilling, key=lambda s: (s.priority, s.remaining, s.key))
    chosen, read = [first.key], first.chunk
    for s in sorted(prefilling, key=lambda s: (s.remaining, s.key)):
        if s is not first and s.priority == first.priority and read + s.chunk <= rows:
            chosen.append(s.key)
            read += s.chunk
    counts = {s.key: 0 if s.key in chosen else s.passed_over + 1 for s in prefilling}
    return PrefillPlan(tuple(chosen), counts)


@dataclass(frozen=True, slots=True)
class Decoding:
    """A stream with a token to decode this turn."""

    key: int
    seq: int  # its sequence: a pass's rows run in increasing sequence order
    alone: bool = False  # decided alone from its first near tie on (stock kernels, loop.py)
    drafting: bool = False  # speculation on or auto (on row-invariant kernels only)
    offer: Offer | None = None  # the drafts it could add to its pass now


@dataclass(frozen=True, slots=True)
class Pass:
    keys: tuple[int, ...]  # one row each, in sequence order
    drafts: dict[int, int] = field(default_factory=dict)  # draft rows per key, where any


@dataclass(frozen=True, slots=True)
class DecodePlan:
    passes: tuple[Pass, ...]  # batched passes
    alone: tuple[int, ...]  # each decoded in a pass of its own, the lone-run shape


def plan_decode(
    decoding: Sequence[Decoding], cost: Callable[[int], float | None], max_rows: int | None
) -> DecodePlan:
    """Which streams share which pass, and the drafts each carries.

    `max_rows`: the most rows a pass may have and still compute each row as alone (the
    row-invariant kernels); None where batched rows are not exact anyway (stock kernels: a
    greedy near tie is decided again alone), so any number shares a pass.
    """
    alone = [d.key for d in decoding if d.alone]
    batched = sorted((d for d in decoding if not d.alone), key=lambda d: d.seq)
    # A lone plain row gains nothing from the batched path; a drafting stream takes it, where
    # its guesses are scored and its passes timed (a pass of one row is a lone step then).
    if not batched or (len(batched) == 1 and not batched[0].drafting):
        return DecodePlan((), (*alone, *(d.key for d in batched)))
    width = len(batched) if max_rows is None else max(1, max_rows)
    passes = []
    for start in range(0, len(batched), width):
        group = batched[start : start + width]
        offers = [d.offer for d in group if d.offer is not None]
        drafts: dict[int, int] = {}
        if offers and max_rows is not None:
            planned = plan_drafts([d.key for d in group], offers, cost, max_rows)
            drafts = {key: k for key, k in planned.items() if k > 0}
        passes.append(Pass(tuple(d.key for d in group), drafts))
    return DecodePlan(tuple(passes), tuple(alone))
