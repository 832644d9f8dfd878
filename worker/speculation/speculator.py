"""Speculative decoding in the worker: draft sources, the controller and the archive, per job.

One `Speculator` per worker process holds the controller (what drafting has been worth on
this worker lately) and the generation archive (past outputs of this model). For each job it
builds a `SpeculativeDecoder` drafting from the prompt, the job's own output and the archive,
and afterwards archives the output and reports what drafting did.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from llama_cpp import Llama

from shared.schemas import Speculation, SpeculationReport, WorkOrder
from worker.speculation.archive import ArchiveDrafts, DraftArchive
from worker.speculation.control import SpeculationController
from worker.speculation.decoder import Sampling, SpeculativeDecoder
from worker.speculation.drafting import Drafting
from worker.speculation.near_tie import TIE_MARGIN
from worker.speculation.sources import FirstOf, NgramLookup


@dataclass
class SpeculativeRun:
    decoder: SpeculativeDecoder
    mode: Speculation
    output: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[int]:
        for token in self.decoder:
            self.output.append(token)
            yield token

    def report(self) -> SpeculationReport:
        stats = self.decoder.stats
        return SpeculationReport(
            mode=self.mode,
            drafted=stats.drafted,
            accepted=stats.accepted,
            acceptance_rate=stats.acceptance_rate,
            speedup=stats.speedup,
            tie_replays=stats.tie_replays,
        )


def drafts(mode: Speculation, temperature: float) -> bool:
    """Whether a request drafts at all.

    `auto` drafts for greedy requests only: greedy output is the same either way
    (worker/speculation/near_tie.py), while a sampled request's tokens depend on which steps
    drafted, and under `auto` that depends on timing: a seed would no longer reproduce its
    text. `on` drafts anyway.
    """
    return mode == "on" or (mode == "auto" and temperature <= 0)


class Speculator:
    def __init__(
        self, archive: DraftArchive | None, fingerprint: str, *, exact: bool = True
    ) -> None:
        self.controller = SpeculationController()
        # Extraction steps decode many questions at once: their timings are another workload.
        self.extraction_controller = SpeculationController()
        self._archive = archive
        self._fingerprint = fingerprint
        # Margin under which a greedy row decided in a batch is decided again alone.
        self.tie_margin = TIE_MARGIN if exact else 0.0
        # False: drafting's output depends on when it drafted (not stored as a result).
        self.exact = exact

    @contextmanager
    def drafting(self, prompts: list[list[int]], mode: Speculation) -> Iterator[Drafting]:
        """Drafting for questions decoded together, one prompt per question."""
        planner = self.extraction_controller.job(mode)
        try:
            yield Drafting([NgramLookup(p) for p in prompts], planner, tie_margin=self.tie_margin)
        finally:
            planner.finish()

    @contextmanager
    def decode(
        self, llama: Llama, prompt: list[int], order: WorkOrder, max_tokens: int
    ) -> Iterator[SpeculativeRun]:
        """Tokens after `prompt` (memory holds all of it but its last token)."""
        sources: list[NgramLookup | ArchiveDrafts] = [NgramLookup(prompt)]
        if self._archive is not None:
            archived = ArchiveDrafts(self._archive, self._fingerprint)
            archived.extend(prompt)
            sources.append(archived)
        planner = self.controller.job(order.speculation)
        decoder = SpeculativeDecoder(
            llama,
            prompt[-1],
            sampling=Sampling(temperature=order.temperature, top_p=order.top_p),
            source=FirstOf(*sources),
            planner=planner,
            seed=order.seed,
            max_tokens=max_tokens,
            tie_margin=self.tie_margin,
        )
        run = SpeculativeRun(decoder, order.speculation)
        try:
            with decoder:
                yield run
        finally:
            planner.finish()
            if self._archive is not None and run.output:
                self._archive.add(self._fingerprint, run.output)


def drafting_report(mode: Speculation, drafting: Drafting) -> SpeculationReport:
    return SpeculationReport(
        mode=mode,
        drafted=drafting.drafted,
        accepted=drafting.accepted,
        acceptance_rate=drafting.accepted / drafting.drafted if drafting.drafted else None,
        speedup=drafting.planner.speedup,
    )
