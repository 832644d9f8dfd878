"""Voted extraction answers against greedy ones: what `samples` costs, what it buys, and
whether its agreement tells right answers from wrong ones.

Each exam document (bench/exam.py: its questions, instructions, answer length and grading),
read as `facts`, through `POST /v1/extractions` on one API and one worker (2 threads, disk
cache off): greedy, then `samples` 5 and 9 (temperature 0.7, seed 1), in an order that rotates
from document to document. Before each job the worker forgets what its memory holds, so every
job reads its document cold, as a first request does. Time: from the POST to the job's end.
A voted answer is graded as its winning text. Targets (issue 38): `samples` 5 within 1.6 times
greedy's time; its score at least greedy's; answers every sample agreed on right at least twice
as often as answers with agreement below 0.6.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import exam
from bench.paired import in_turn, per_round, ratio_summary
from shared.settings import Settings
from tests.harness import Stack

SAMPLES = (1, 5, 9)
TEMPERATURE = 0.7
FORMAT = "facts"
TIME_TARGET = 1.6
LOW, FULL = 0.6, 1.0


@dataclass(frozen=True, slots=True)
class Voted:
    model: str
    document: str
    samples: int
    seconds: float
    grades: dict[str, exam.Grade]
    agreement: dict[str, float]  # voted answers only
    counted: int  # samples decoded to their end, over every question
    completion_tokens: int

    @property
    def score(self) -> int:
        return sum(map(_right, self.grades.values()))


def _right(grade: exam.Grade) -> bool:
    """As the exam scores: a right value, or "not stated" where the document does not say."""
    return grade in ("right", "not_stated")


def run(stack: Stack, model: str, doc: exam.ExamDocument, samples: int) -> Voted:
    body: dict[str, Any] = exam.body(doc, FORMAT)
    if samples > 1:
        body |= {"samples": samples, "temperature": TEMPERATURE, "seed": 1}
    stack.forget()
    started = time.perf_counter()
    _, view = exam.follow(stack, "/v1/extractions", body)
    seconds = time.perf_counter() - started
    answers = view["extraction"]["answers"]
    votes = {q: a["vote"] for q, a in answers.items() if a.get("vote")}
    return Voted(
        model,
        doc.name,
        samples,
        seconds,
        {q.id: q.grade(answers[q.id]["text"].strip()) for q in doc.questions},
        {q: v["agreement"] for q, v in votes.items()},
        sum(v["counted"] for v in votes.values()) or len(answers),
        view["usage"]["completion_tokens"],
    )


def measure(settings: Settings, log_dir: Path) -> list[Voted]:
    docs = exam.load()
    stack = Stack(settings, log_dir)
    results: list[Voted] = []
    try:
        stack.start_api()
        stack.start_worker()
        warm_up = exam.body(docs[0], "raw") | {
            "document": "Warm-up note: the office opens at 9:00.",
            "questions": [{"id": "w", "question": "When does it open?"}],
            "samples": 3,
            "temperature": TEMPERATURE,
        }
        exam.follow(stack, "/v1/extractions", warm_up)  # first-request costs
        for d, doc in enumerate(docs):
            order = in_turn(SAMPLES, d)
            by = {n: run(stack, settings.model, doc, n) for n in order}
            results += [by[n] for n in SAMPLES]
    finally:
        stack.stop()
    return results


BANDS = (
    (f"agreement {FULL:g}", lambda a: a >= FULL),
    (f"{LOW:g} to below {FULL:g}", lambda a: LOW <= a < FULL),
    (f"below {LOW:g}", lambda a: a < LOW),
)


def _graded(results: list[Voted], samples: int, band: Callable[[float], bool]) -> list[bool]:
    """Whether each voted answer in the agreement band was right."""
    return [
        _right(r.grades[q])
        for r in results
        if r.samples == samples
        for q, agreement in r.agreement.items()
        if band(agreement)
    ]


def _rate(graded: list[bool]) -> float | None:
    return sum(graded) / len(graded) if graded else None


def calibration(results: list[Voted]) -> list[str]:
    """Voted answers by agreement: how many, and how many of them were right."""
    rows = []
    for samples in SAMPLES[1:]:
        cells = []
        for _, band in BANDS:
            graded = _graded(results, samples, band)
            cells.append(f"{sum(graded)} of {len(graded)} ({_share(_rate(graded))})")
        rows.append(f"| {samples} | {' | '.join(cells)} |")
    return rows


def section(settings: Settings, log_dir: Path) -> str:
    results = measure(settings, log_dir)
    by = {(r.document, r.samples): r for r in results}
    docs = list(dict.fromkeys(r.document for r in results))
    rows = []
    for doc in docs:
        greedy = by[doc, 1]
        cells = [f"{greedy.seconds:.1f} s, {greedy.score}/{len(greedy.grades)}"]
        for n in SAMPLES[1:]:
            voted = by[doc, n]
            cells.append(
                f"{voted.seconds:.1f} s ({voted.seconds / greedy.seconds:.2f}×), "
                f"{voted.score}/{len(voted.grades)}, {voted.counted} of "
                f"{n * len(voted.grades)} samples"
            )
        rows.append(f"| {doc} | {' | '.join(cells)} |")
    ratios = {
        n: per_round([by[d, n].seconds for d in docs], [by[d, 1].seconds for d in docs])
        for n in SAMPLES[1:]
    }
    scores = {n: sum(by[d, n].score for d in docs) for n in SAMPLES}
    questions = sum(len(by[d, 1].grades) for d in docs)
    full, low = (_rate(_graded(results, 5, BANDS[i][1])) for i in (0, 2))
    verdicts = [
        f"`samples` 5 over greedy's time {ratio_summary(ratios[5])}: "
        + ("met" if statistics.median(ratios[5]) <= TIME_TARGET else "MISSED")
        + f" (target ≤ {TIME_TARGET}×)",
        f"score {scores[5]} against greedy's {scores[1]}: "
        + ("met" if scores[5] >= scores[1] else "MISSED"),
        f"answers with full agreement right {_share(full)}, below {LOW:g} {_share(low)}: "
        + ("met" if full is not None and low is not None and full >= 2 * low else "MISSED")
        + " (target: at least twice as often)",
    ]
    return "\n".join(
        [
            f"## Voted extraction answers ({settings.model})",
            "",
            __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
            "",
            "| document | greedy: time, score | `samples` 5: time (× greedy), score, samples "
            "decoded to their end | `samples` 9 |",
            "|---|---|---|---|",
            *rows,
            "",
            f"All {questions} questions: greedy {scores[1]}, `samples` 5 {scores[5]}, `samples` 9 "
            f"{scores[9]}; `samples` 9 over greedy's time {ratio_summary(ratios[9])}.",
            "",
            "Voted answers by agreement, right (of answers):",
            "",
            "| samples | " + " | ".join(name for name, _ in BANDS) + " |",
            "|---|---|---|---|",
            *calibration(results),
            "",
            "Targets (`samples` 5): " + "; ".join(verdicts) + ".",
            "",
        ]
    )


def _share(rate: float | None) -> str:
    return "–" if rate is None else f"{rate:.0%}"
