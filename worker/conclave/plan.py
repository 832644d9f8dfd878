"""The Conclave's decisions, apart from the passes that carry them out.

Each turn the model thread (loop.py) admits waiting streams, then asks `plan_prefill` whose
prompt chunk it reads and, once that chunk is read, `plan_decode` which decoding streams share
which pass and with how many drafts. Both are pure functions of the streams' state as the
loop sees it, so the policy is tested without a model (tests/unit/test_plan.py): priority
classes, shortest remaining first, a bounded wait for a long prompt, the row budget, drafting
turned down under load.

Why the row budget: on the row-invariant kernels a pass computes each row as a lone decode
does only below `granary_exact_rows` rows (worker/kernels.py); a wider pass takes the batched
kernels and its rows' logits depend on what shares it. More decoding streams than that (an
extraction's many questions, `max_active_jobs` up to 48) are split into several passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from worker.conclave.drafts import Offer, plan_drafts

# A stream passed over this many times for a shorter one prefills next, however long it is.
STARVE_AFTER = 4


@dataclass(frozen=True, slots=True)
class Prefilling:
    """A stream still reading its prompt."""

    key: int  # in arrival order
    priority: int  # the most urgent of its own and its waiting followers' (loop.py `_leader`)
    remaining: int  # prompt tokens still to read
    passed_over: int  # turns another stream's chunk went first since its last one


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    key: int  # whose next chunk is read
    passed_over: dict[int, int]  # every prefilling stream's count after this turn


def plan_prefill(prefilling: Sequence[Prefilling]) -> PrefillPlan | None:
    """The stream whose chunk this turn reads: the most urgent priority class first, the
    fewest remaining tokens within it (a short prompt's first token should not wait for a long
    document's read), arrival order last. But a stream passed over STARVE_AFTER times goes
    next, and among such the one passed over most: under a backlog of short prompts the
    shortest starved one would win every turn, and the long one wait for the backlog to end."""
    if not prefilling:
        return None
    starved = [s for s in prefilling if s.passed_over >= STARVE_AFTER]
    if starved:
        chosen = min(starved, key=lambda s: (-s.passed_over, s.priority, s.remaining, s.key))
    else:
        chosen = min(prefilling, key=lambda s: (s.priority, s.remaining, s.key))
    counts = {s.key: 0 if s is chosen else s.passed_over + 1 for s in prefilling}
    return PrefillPlan(chosen.key, counts)


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
    if len(batched) == 1 and not batched[0].drafting:
        return DecodePlan((), (*alone, batched[0].key))
    width = len(batched) if max_rows is None else max(1, max_rows)
    passes = []
    for start in range(0, len(batched), width):
        group = batched[start : start + width]
        offers = [d.offer for d in group if d.offer is not None]
        drafts: dict[int, int] = {}
        if offers and max_rows is not None:
            planned = plan_drafts(len(group), offers, cost, max_rows)
            drafts = {key: k for key, k in planned.items() if k > 0}
        passes.append(Pass(tuple(d.key for d in group), drafts))
    return DecodePlan(tuple(passes), tuple(alone))
