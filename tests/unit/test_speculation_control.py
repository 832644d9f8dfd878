"""The controller against a simulated model: a step costs a fixed time plus a cost per draft."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from worker.speculation.control import ControlConfig, JobSpeculation, SpeculationController

PLAIN_S = 0.010
# A CPU verifies a few extra tokens for a fraction of a one-token step.
CHEAP_DRAFT_S = 0.0008

LOOKUP_S = 0.0001

# drafted -> accepted
Workload = Callable[[int], int]


def never_matches(drafted: int) -> int:
    return 0


def copies(drafted: int) -> int:
    return drafted


def runs_of_three(drafted: int) -> int:
    return min(drafted, 3)


@dataclass(frozen=True)
class Step:
    drafted: bool
    emitted: int


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def run(
    job: JobSpeculation,
    clock: Clock,
    workload: Workload,
    tokens: int,
    per_draft_s: float = CHEAP_DRAFT_S,
    found: int = 100,
) -> list[Step]:
    """Decode `tokens` tokens; the draft source finds at most `found` tokens to propose."""
    steps: list[Step] = []
    emitted_total = 0
    while emitted_total < tokens:
        planned = job.plan()
        drafted = min(planned, found)
        accepted = workload(drafted)
        # Looking for a draft costs a little even when nothing is found.
        clock.now += PLAIN_S + per_draft_s * drafted + (LOOKUP_S if planned else 0.0)
        job.record(drafted, accepted, accepted + 1)
        if drafted == 0 and found > 0:
            job.guessed(workload(1) == 1)  # the source's guess of a plain step's token
        steps.append(Step(drafted > 0, accepted + 1))
        emitted_total += accepted + 1
    return steps


def drafting_share(steps: list[Step]) -> float:
    return sum(s.drafted for s in steps) / len(steps)


def drafted_token_share(steps: list[Step]) -> float:
    return sum(s.emitted for s in steps if s.drafted) / sum(s.emitted for s in steps)


def controller() -> tuple[SpeculationController, Clock]:
    clock = Clock()
    return SpeculationController(ControlConfig(), clock=clock), clock


def test_turns_itself_off_where_drafts_never_match() -> None:
    ctl, clock = controller()
    job = ctl.job("auto")
    run(job, clock, never_matches, 100)
    assert not job.speculating
    assert job.draft_length == ctl.config.min_draft
    later = run(job, clock, never_matches, 3000)
    # Only probes draft now, ever more rarely: each one that changed nothing doubled the wait.
    assert 0 < drafting_share(later) < 0.02
    assert job.state.probe_every == ctl.config.max_probe_every
    assert job.speedup is not None and job.speedup < 1


def test_right_guesses_that_do_not_pay_are_not_probed_again_and_again() -> None:
    ctl, clock = controller()
    job = ctl.job("auto")
    steps = run(job, clock, runs_of_three, 3000, per_draft_s=1.5 * PLAIN_S)
    assert not job.speculating
    assert drafting_share(steps[100:]) < 0.02


def test_stays_on_for_copy_heavy_text() -> None:
    ctl, clock = controller()
    job = ctl.job("auto")
    steps = run(job, clock, copies, 1000)
    assert job.speculating
    assert job.draft_length == ctl.config.max_draft
    assert drafted_token_share(steps) > 0.95
    assert job.speedup is not None and job.speedup > 3


def test_finding_nothing_to_draft_never_turns_it_off() -> None:
    """Such steps are plain decodes plus a lookup: slower by a hair, but no evidence either way."""
    ctl, clock = controller()
    job = ctl.job("auto")
    run(job, clock, copies, 300, found=0)
    assert job.speculating
    steps = run(job, clock, copies, 100)
    # Drafting starts as soon as there is something to draft (or right after a probe).
    assert any(s.drafted for s in steps[: ctl.config.probe_steps + 1])


def test_speed_decides_not_acceptance() -> None:
    """Most drafted tokens are accepted either way; only the verification cost differs."""
    ctl, clock = controller()
    cheap = ctl.job("auto")
    run(cheap, clock, runs_of_three, 300)
    assert cheap.speculating
    ctl, clock = controller()
    costly = ctl.job("auto")
    run(costly, clock, runs_of_three, 300, per_draft_s=1.5 * PLAIN_S)
    assert not costly.speculating


def test_reprobes_and_switches_back_on_when_the_workload_changes() -> None:
    ctl, clock = controller()
    job = ctl.job("auto")
    run(job, clock, never_matches, 2000)
    assert not job.speculating
    steps = run(job, clock, copies, 300)
    assert job.speculating
    # The source's guesses came true on plain steps: drafting was probed at once, not after
    # the long wait the failed probes had built up.
    first_on = next(i for i in range(len(steps) - 1) if steps[i].drafted and steps[i + 1].drafted)
    assert first_on <= 4 + ctl.config.probe_steps
    run(job, clock, never_matches, 200)
    assert not job.speculating


def test_worker_remembers_across_jobs() -> None:
    ctl, clock = controller()
    first = ctl.job("auto")
    run(first, clock, never_matches, 200)
    first.finish()
    second = ctl.job("auto")
    assert not second.speculating
    assert second.plan() == 0  # starts where the worker left off
    second.record(0, 0, 1)
    assert second.state.probe_every > ctl.config.probe_every  # and so does the probe wait
    steps = run(second, clock, copies, 100)
    assert second.speculating
    assert any(s.drafted for s in steps[: 4 + ctl.config.probe_steps])


def test_forced_modes() -> None:
    ctl, clock = controller()
    off = ctl.job("off")
    assert drafting_share(run(off, clock, copies, 200)) == 0
    on = ctl.job("on")
    assert drafting_share(run(on, clock, never_matches, 200)) == 1
    with pytest.raises(ValueError):
        ctl.job("sometimes")  # type: ignore[arg-type]


def test_draft_length_grows_on_full_acceptance_and_shrinks_on_rejection() -> None:
    ctl, _ = controller()
    job = ctl.job("on")
    start = job.draft_length
    job.plan()
    job.record(start, start, start + 1)
    assert job.draft_length == start + ctl.config.grow
    job.plan()
    job.record(job.draft_length, 1, 2)
    assert job.draft_length == start + ctl.config.grow - ctl.config.shrink
    job.plan()
    job.record(0, 0, 1)  # nothing drafted: nothing learned about the length
    assert job.draft_length == start + ctl.config.grow - ctl.config.shrink


def test_a_replay_is_charged_to_drafting_not_to_plain_decoding() -> None:
    """A near-tie replay in a plain step pays for cells drafting wrote earlier."""
    ctl, clock = controller()
    job = ctl.job("on")
    job.plan()
    clock.now += PLAIN_S
    job.record(0, 0, 1)
    assert job.state.plain is not None and job.state.spec is None
    plain = job.state.plain
    job.plan()
    clock.now += 10 * PLAIN_S
    job.record(0, 0, 1, replayed=True)
    assert job.state.plain == plain
    assert job.state.spec is not None and job.state.spec.per_token == 10 * PLAIN_S
