"""One question's vote over its sampled answers: who leads, and when the rest cannot matter.

Sample 0 is the greedy answer, the others are sampled. Answers count as one vote when their
`answer_key` is equal. Samples are counted in index order, whatever order they end in: sample
s counts once samples 0..s-1 have, so what a vote counted, and its agreement, depend on the
samples' texts alone, never on which decoded faster, and a seeded vote reproduces whole. The vote
is decided as soon as the leading answer has more votes than any other could still reach
with every sample not yet counted, so stopping the rest then never changes the winner. A tie
in a complete count goes to the answer of the lowest sample (the greedy one when among them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.schemas import Variant, Vote
from worker.answer_key import answer_key


@dataclass
class Ballot:
    samples: int  # how many were asked for
    # Samples that ended: index -> (key, text).
    ended: dict[int, tuple[str, str]] = field(default_factory=dict)
    # Samples 0..counted-1 are counted.
    counted: int = 0

    def end(self, sample: int, text: str) -> None:
        """A sample ended with `text`; it counts once every lower sample has."""
        if not 0 <= sample < self.samples or sample in self.ended:
            raise ValueError(f"sample {sample} cannot end again or does not exist")
        self.ended[sample] = (answer_key(text), text)
        while not self.decided and self.counted in self.ended:
            self.counted += 1

    @property
    def complete(self) -> bool:
        """Nothing more will be counted: the vote is decided or every sample counted."""
        return self.decided or self.counted == self.samples

    @property
    def decided(self) -> bool:
        """No answer but the leader can win, whatever the uncounted samples say."""
        groups = self.groups()
        if not groups:
            return False
        runner_up = len(groups[1]) if len(groups) > 1 else 0
        return len(groups[0]) > runner_up + self.samples - self.counted

    def needed(self) -> int:
        """The fewest more samples that could decide the vote: as many as make the leader win
        if they all agree with it (every sample, before any is counted, is a majority)."""
        groups = self.groups()
        lead = len(groups[0]) if groups else 0
        runner_up = len(groups[1]) if len(groups) > 1 else 0
        remaining = self.samples - self.counted
        return min(remaining, (runner_up + remaining - lead) // 2 + 1)

    def groups(self) -> list[list[int]]:
        """Counted samples by answer, most votes first, ties by their lowest sample."""
        by_key: dict[str, list[int]] = {}
        for sample in range(self.counted):
            by_key.setdefault(self.ended[sample][0], []).append(sample)
        return sorted(by_key.values(), key=lambda group: (-len(group), group[0]))

    def winner(self) -> int:
        """The sample whose text answers: the first of the group with the most votes."""
        return self.groups()[0][0]

    def text(self, sample: int) -> str:
        return self.ended[sample][1]

    def outcome(self) -> Vote:
        groups = self.groups()
        return Vote(
            agreement=len(groups[0]) / self.counted,
            counted=self.counted,
            samples=self.samples,
            variants=[Variant(text=self.text(g[0]), votes=len(g)) for g in groups],
        )
