"""Drafting for an extraction's questions, which are decoded together in one batch per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.speculation.decoder import StepPlanner
from worker.speculation.near_tie import TIE_MARGIN
from worker.speculation.sources import DraftSource


@dataclass
class Drafting:
    """Speculative decoding for questions decoded together.

    One draft source per question (the prompt's and its own answer's n-grams) and one planner
    for every step: a step's cost is the whole batch's, so its length and whether drafting pays
    are decided for all questions at once.
    """

    sources: Sequence[DraftSource]
    planner: StepPlanner
    max_draft: int = 8
    tie_margin: float = TIE_MARGIN
    drafted: int = 0
    accepted: int = 0
    # Question -> the source's guess of its next token, on a step that drafts nothing.
    guesses: dict[int, int] = field(default_factory=dict)

    def plan(self) -> int:
        return min(self.planner.plan(), self.max_draft)

    def propose(self, question: int, limit: int) -> list[int]:
        return self.sources[question].propose(limit)[:limit] if limit > 0 else []

    def guess(self, question: int) -> None:
        """Note what the source expects next, for the planner to score (no model work)."""
        draft = self.sources[question].propose(1)
        if draft:
            self.guesses[question] = draft[0]

    def extend(self, question: int, token: int) -> None:
        guess = self.guesses.pop(question, None)
        if guess is not None:
            self.planner.guessed(guess == token)
        self.sources[question].extend([token])

    def record(
        self, drafts: Sequence[Sequence[int]], accepted: int, emitted: int, replayed: bool
    ) -> None:
        drafted = sum(len(d) for d in drafts)
        self.drafted += drafted
        self.accepted += accepted
        self.planner.record(drafted, accepted, emitted, replayed)
