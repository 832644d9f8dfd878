"""A fact sheet written by the model, measured as issue 34's fallback before it is built.

Deterministic `facts` cannot make a web page copied as plain text three times shorter without dropping
values (docs/BENCHMARKS.md, "Accuracy exam"). The issue's fallback is a sheet the worker's own
model writes, checked against the source and cached. Measured here, not served: for each exam
document, Qwen2.5-Coder-0.5B (greedy, one API and worker, prefix cache off) is asked through
`POST /v1/jobs` to rewrite the document (read as `facts`) as one "subject, label: value" line
per fact; the sheet is checked (every value in it — number, date, amount, phone, email, URL,
ID — must appear in the document's `text` reading: what it invented), then the exam's questions
are asked about the sheet (sent `raw`) beside `raw` and `facts`, as bench/exam.py asks them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bench import exam
from shared.normalize import normalize
from shared.normalize.entities import Values, entities
from shared.settings import Settings
from tests.harness import Stack

MODEL = "qwen2.5-coder-0.5b"
INSTRUCTIONS = (
    "Rewrite the document as a fact sheet: one fact per line, written as 'subject, label: "
    "value', in the document's language. Keep every price, date, duration, phone number, "
    "e-mail, address, number, name, condition and exclusion, each with what it belongs to. "
    "No sentences, no filler, nothing that is not in the document."
)
PROMPT = "Write the fact sheet."
MAX_SHEET_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Sheet:
    document: str
    text: str
    tokens: int
    seconds: float
    invented: tuple[str, ...]  # values in the sheet the document does not hold


def write_sheet(stack: Stack, doc: exam.ExamDocument) -> Sheet:
    body = {
        "document": doc.text,
        "document_format": "facts",
        "instructions": INSTRUCTIONS,
        "prompt": PROMPT,
        "max_tokens": MAX_SHEET_TOKENS,
        "temperature": 0,
    }
    started = time.perf_counter()
    _, view = exam.follow(stack, "/v1/jobs", body)
    seconds = time.perf_counter() - started
    text = view["result"]["text"].strip()
    source = Values(normalize(doc.text, "text").text)
    invented = tuple(dict.fromkeys(v for v in entities(text) if not source.contains(v)))
    return Sheet(doc.name, text, view["usage"]["completion_tokens"], seconds, invented)


def measure(settings: Settings, log_dir: Path) -> tuple[list[Sheet], list[exam.Run]]:
    docs = exam.load()
    stack = Stack(settings, log_dir)
    try:
        stack.start_api()
        stack.start_worker()
        runs = exam.run_model(stack, MODEL, docs, ("raw", "facts"))
        sheets = [write_sheet(stack, doc) for doc in docs]
        for doc, sheet in zip(docs, sheets, strict=True):
            as_sheet = exam.ExamDocument(
                doc.name, sheet.text, doc.language, doc.domain, doc.questions, doc.web_page
            )
            (run,) = exam.run_model(stack, MODEL, [as_sheet], ("raw",))
            run.format, run.tokens = "sheet", sheet.tokens
            runs.append(run)
    finally:
        stack.stop()
    return sheets, runs


def section(settings: Settings, log_dir: Path) -> str:
    sheets, runs = measure(settings, log_dir)
    rows = []
    for sheet in sheets:
        by = {r.format: r for r in runs if r.document == sheet.document}
        cells = []
        for fmt in ("raw", "facts", "sheet"):
            t = exam.totals([by[fmt]])
            cells.append(f"{by[fmt].tokens:,} tok, {t['score']}/{t['questions']}, {t['critical']}")
        ratio = by["raw"].tokens / max(sheet.tokens, 1)
        invented = ", ".join(sheet.invented[:6]) or "none"
        rows.append(
            f"| {sheet.document} | {' | '.join(cells)} | {ratio:.1f}× | {sheet.seconds:.0f} s "
            f"| {invented} |"
        )
    totals = {
        fmt: exam.totals([r for r in runs if r.format == fmt]) for fmt in ("raw", "facts", "sheet")
    }
    summary = ", ".join(
        f"{fmt} {t['score']}/{t['questions']} (critical {t['critical']}/{t['critical_total']})"
        for fmt, t in totals.items()
    )
    return "\n".join(
        [
            "## A fact sheet written by the model (measured, not served)",
            "",
            __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
            "",
            "| document | raw: tokens, score, critical | facts | sheet | sheet × fewer than raw "
            "| writing the sheet | values the sheet invented |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"All documents: {summary}.",
            "",
        ]
    )
