"""What a job hands back to the runtime (worker/tasks.py): its result, usage and timings."""

from __future__ import annotations

from dataclasses import dataclass

from shared.schemas import (
    ExtractionResult,
    ExtractOrder,
    JobResult,
    Speculation,
    SpeculationReport,
    Timings,
    Usage,
    WarmResult,
)
from worker.answers import Answering
from worker.resume import Streamed


@dataclass(frozen=True, slots=True)
class Generation:
    result: JobResult
    usage: Usage
    timings: Timings
    # Where the prompt's declared shared prefix (a document) ends, if it has one.
    prefix_tokens: int | None = None
    # False: the output may depend on what ran beside it (worker/conclave/streams.py Ended),
    # so it is not stored as the request's result.
    reproducible: bool = True
    # What drafting did, when the job asked for it.
    speculation: SpeculationReport | None = None


@dataclass(frozen=True, slots=True)
class Extracted:
    result: ExtractionResult
    usage: Usage
    timings: Timings
    prefix_tokens: int
    # False: an answer may depend on what ran beside it (worker/conclave/streams.py Ended).
    reproducible: bool = True
    speculation: SpeculationReport | None = None


def extraction_outcome(
    order: ExtractOrder,
    answering: Answering,
    prefix: list[int],
    tails: list[list[int]],
    cached: int,
    started: float,
    prefilled: float,
    streamed: Streamed,
) -> Extracted:
    """The job's result, usage and timings once every question is answered."""
    ids = [q.id for q in order.questions]
    answers = {i: answering.answers[i] for i in ids}
    result = ExtractionResult(
        answers=answers,
        object={i: a.text.strip() for i, a in answers.items()} if order.fields else None,
    )
    usage = Usage(
        prompt_tokens=len(prefix) + sum(len(t) for t in tails),
        cached_tokens=cached,
        completion_tokens=sum(a.usage.completion_tokens for a in answers.values()),
        resumed_tokens=streamed.resumed_tokens,
    )
    first = min((a.timings.ttft_ms for a in answers.values() if a.timings.ttft_ms), default=None)
    timings = Timings(prefill_ms=(prefilled - started) * 1000, ttft_ms=first)
    speculation = speculation_report(order.speculation, answering.drafted, answering.accepted)
    return Extracted(result, usage, timings, len(prefix), not answering.drifted, speculation)


def speculation_report(mode: Speculation, drafted: int, accepted: int) -> SpeculationReport | None:
    """What drafting did for a job's streams; None when the job did not ask for it."""
    if mode == "off":
        return None
    rate = accepted / drafted if drafted else None
    return SpeculationReport(mode=mode, drafted=drafted, accepted=accepted, acceptance_rate=rate)


def warm_result(target: int, cached: int, reached: int) -> WarmResult:
    """A warm job's outcome: `target` cells wanted, `cached` found, `reached` held at the end
    (fewer than `target` when it stopped early: it steps aside, resuming later)."""
    return WarmResult(
        prefix_tokens=target,
        cached_tokens=cached,
        warmed_tokens=max(reached - cached, 0),
        already_cached=cached >= target,
        yielded=int(reached < target),
    )
