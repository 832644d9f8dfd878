"""When to speculate, and how far: decided by measured speed, not by acceptance alone.

A verified draft is only worth it if tokens come out faster than without drafting: a batch of
k + 1 tokens costs more than one, and on text the drafts never match that cost buys nothing.
The controller times every step and keeps, per mode, the time per emitted token as a ratio of
moving averages (seconds over tokens, so a step that emits 9 tokens weighs 9 times one that
emits 1). Speculation is on while its time per token beats plain decoding's. A step that
found nothing to draft is a plain decode and is measured as one.

Only the mode in use is measured continuously, so the other one is probed from time to time:
a few steps every `probe_every` steps. A probe that confirms the mode in use doubles the wait
for the next one (up to `max_probe_every`), so a worker whose text never matches its drafts
stops paying for probes; a probe that changes the mode resets the wait. Counting steps, not
tokens, bounds what probing costs: a speculative step that emits 17 tokens would otherwise
reach a probe in 4 steps and spend a third of the time probing plain decoding.

While decoding plainly the draft source still guesses the next token (a few dict lookups, no
model work), and the guesses are scored against what the model wrote: when they start coming
true (the workload turned copy-heavy) drafting is probed at once instead of after the wait.

The draft length adapts too: it grows after a step whose whole draft was accepted and shrinks
after one that was not, as in Hugging Face's assisted generation.

Per worker, `SpeculationController` keeps what was learned (both speeds, the draft length,
the mode) from job to job; per job, `JobSpeculation` adapts it and hands it back at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

Mode = Literal["auto", "on", "off"]
MODES: tuple[Mode, ...] = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class ControlConfig:
    min_draft: int = 1
    max_draft: int = 16
    initial_draft: int = 4
    # Draft length change after a fully accepted draft, and after a partly rejected one.
    grow: int = 2
    shrink: int = 1
    # Weight of the newest step in the moving averages.
    smoothing: float = 0.2
    # Steps between probes of the mode not in use, doubling while probes change nothing.
    probe_every: int = 40
    max_probe_every: int = 640
    probe_steps: int = 4
    # Share of plain steps whose token the draft source guessed (moving average) at which
    # drafting is probed at once, if it is also clearly above the share when the last probe
    # started: free text hovers around a half, and must not trigger probe after probe.
    guess_trigger: float = 0.5
    guess_gain: float = 0.25


@dataclass(frozen=True, slots=True)
class Rate:
    """Moving averages of a step's seconds and emitted tokens; their ratio is s/token."""

    seconds: float
    tokens: float

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens > 0 else float("inf")

    def update(self, seconds: float, tokens: int, weight: float) -> Rate:
        return Rate(
            self.seconds + weight * (seconds - self.seconds),
            self.tokens + weight * (tokens - self.tokens),
        )


@dataclass(frozen=True, slots=True)
class Learned:
    """What a worker carries from one job to the next."""

    speculating: bool
    draft: int
    plain: Rate | None = None
    spec: Rate | None = None
    probe_every: int = 0
    until_probe: int = 0
    # The share of right guesses when the last probe started.
    probed_guesses: float = 0.0

    @property
    def speedup(self) -> float | None:
        """Plain time per token over speculative time per token."""
        if self.plain is None or self.spec is None or self.spec.seconds <= 0:
            return None
        return self.plain.per_token / self.spec.per_token


class SpeculationController:
    """Per worker: hands each job the state learned so far and takes back what it learned."""

    def __init__(
        self,
        config: ControlConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config or ControlConfig()
        self.clock = clock
        # Optimistic start: the first job's first probe measures plain decoding anyway.
        cfg = self.config
        self.learned = Learned(
            speculating=True,
            draft=cfg.initial_draft,
            probe_every=cfg.probe_every,
            until_probe=cfg.probe_every,
        )

    def job(self, mode: Mode = "auto") -> JobSpeculation:
        if mode not in MODES:
            raise ValueError(f"speculation must be one of {MODES}, got {mode!r}")
        return JobSpeculation(self, mode)


class JobSpeculation:
    """Per job: plans each step's draft length (0: decode plainly) and learns from its timing.

    Used as the SpeculativeDecoder's planner: `plan()` before a step, `record()` after it;
    the clock runs between the two, so drafting and verification are both timed. `guessed()`
    scores the source's guess on a plain step.
    """

    def __init__(self, controller: SpeculationController, mode: Mode) -> None:
        self._controller = controller
        self.config = controller.config
        self.mode = mode
        self.state = controller.learned
        self._clock = controller.clock
        self._probe_left = 0
        self._probed_mode = False
        self._guesses = 0.0
        self._probe = Rate(0.0, 0.0)
        self._step_speculates = False
        self._step_started = 0.0

    @property
    def speculating(self) -> bool:
        """Whether steps outside probes draft."""
        return self.mode == "on" or (self.mode == "auto" and self.state.speculating)

    @property
    def draft_length(self) -> int:
        return self.state.draft

    @property
    def speedup(self) -> float | None:
        return self.state.speedup

    def plan(self) -> int:
        if self.mode == "auto" and self._probe_left == 0 and self._probe_due():
            self._probe_left = self.config.probe_steps
            self._probe = Rate(0.0, 0.0)
            self._probed_mode = self.state.speculating
            self.state = replace(self.state, probed_guesses=self._guesses)
        probing = self._probe_left > 0
        self._step_speculates = self.speculating != probing
        self._step_started = self._clock()
        return self.state.draft if self._step_speculates else 0

    def record(self, drafted: int, accepted: int, emitted: int, replayed: bool = False) -> None:
        elapsed = self._clock() - self._step_started
        if drafted > 0:
            self._adapt_draft(drafted, accepted)
        # A step that found nothing to draft was a plain decode, whatever was planned: counted
        # as speculative, its noise alone would decide a comparison of two equal costs. A step
        # that replayed near-tie cells paid for earlier drafting: counted as plain, the cost
        # would make plain decoding look slow and drafting look cheap.
        speculative = drafted > 0 or replayed
        probed = False
        if self._probe_left > 0:
            probed = self._record_probe(speculative, elapsed, emitted)
        else:
            self.state = replace(self.state, until_probe=self.state.until_probe - 1)
            self._measure(speculative, elapsed, emitted)
        was = self.state.speculating
        self._decide()
        if probed:
            self._schedule_probe(changed=self.state.speculating != self._probed_mode)
        elif self.state.speculating != was:
            self._schedule_probe(changed=True)

    def guessed(self, right: bool) -> None:
        """A plain step's outcome for the source's guess of its token."""
        self._guesses += self.config.smoothing * (float(right) - self._guesses)

    def finish(self) -> None:
        """Hand what this job learned back to the worker, for its next job."""
        self._controller.learned = self.state

    def _probe_due(self) -> bool:
        if self.state.until_probe <= 0:
            return True
        # Guesses coming true that did not when drafting was last probed: the text changed.
        cfg = self.config
        needed = max(cfg.guess_trigger, self.state.probed_guesses + cfg.guess_gain)
        return not self.state.speculating and self._guesses >= needed

    def _adapt_draft(self, drafted: int, accepted: int) -> None:
        cfg = self.config
        change = cfg.grow if accepted == drafted else -cfg.shrink
        draft = max(cfg.min_draft, min(cfg.max_draft, self.state.draft + change))
        self.state = replace(self.state, draft=draft)

    def _record_probe(self, speculative: bool, elapsed: float, emitted: int) -> bool:
        """Count a probe step; True when it was the probe's last."""
        if speculative == self._step_speculates:
            self._probe = Rate(self._probe.seconds + elapsed, self._probe.tokens + emitted)
        else:
            self._measure(speculative, elapsed, emitted)
        self._probe_left -= 1
        if self._probe_left > 0:
            return False
        # The probe replaces the old figure: it measures the workload as it is now. A probe
        # that found nothing to draft measured nothing.
        if self._probe.tokens > 0:
            self._set_rate(self._step_speculates, self._probe)
        return True

    def _schedule_probe(self, changed: bool) -> None:
        """The next probe: soon after a change of mode, ever later while probes change nothing."""
        cfg = self.config
        wait = cfg.probe_every if changed else min(2 * self.state.probe_every, cfg.max_probe_every)
        self.state = replace(self.state, probe_every=wait, until_probe=wait)

    def _measure(self, speculative: bool, elapsed: float, emitted: int) -> None:
        old = self.state.spec if speculative else self.state.plain
        if old is None:
            new = Rate(elapsed, emitted)
        else:
            new = old.update(elapsed, emitted, self.config.smoothing)
        self._set_rate(speculative, new)

    def _set_rate(self, speculative: bool, rate: Rate) -> None:
        if speculative:
            self.state = replace(self.state, spec=rate)
        else:
            self.state = replace(self.state, plain=rate)

    def _decide(self) -> None:
        plain, spec = self.state.plain, self.state.spec
        if self.mode != "auto" or self._probe_left > 0 or plain is None or spec is None:
            return
        self.state = replace(self.state, speculating=spec.per_token < plain.per_token)
