"""The accuracy exam for `document_format`: does reading a document as `text` or `facts` keep
the answers a model gives from it as sent (`raw`)?

Six documents written for this project (`bench/exam_docs/`: an Italian shop's home page as
HTML, an English invoice as a PDF-to-text tool gives it, an English report of Markdown tables,
a German returns-and-warranty page as HTML, an Italian flooring services page copied out of a
browser as plain text and a German removals page as HTML, the last two with price lines under
product names, short FAQ answers, a cookie banner and a dense footer), each with its questions
in a TOML file beside it; `web_page` marks the pages `facts` has its targets on.
Every document is sent in every format, with all its questions in one `POST /v1/extractions`
job, to a real API and worker per model (the full job path), greedy. Recorded per run: the
document's tokens after normalisation (the job's `document` report; raw: its tokens_before),
time to first token at the client (POST to the first token event: normalising in the API,
queueing, prefill, first token), the score (answers the question's regexes accept), critical
facts answered right, and on questions the document does not answer, "not stated" against an
invented answer. The prefix cache is off: every run prefills its document cold.
"""

from __future__ import annotations

import os
import re
import time
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson
from httpx_sse import connect_sse

from shared.settings import Settings
from tests.harness import Stack

DOCS_DIR = Path(__file__).resolve().parent / "exam_docs"
MODELS = ("qwen2.5-coder-0.5b", "smollm2-135m", "qwen2.5-coder-1.5b")
FORMATS = ("raw", "text", "facts")
INSTRUCTIONS = (
    "Answer each question about the document using only the document. Reply in English with "
    "the value only, in a few words. If the document does not give the answer, reply: "
    "not stated."
)
MAX_TOKENS = 24
# The longest page sent raw (umzug.html, ~4,100 Qwen tokens, its markup included) with its
# instructions and a question.
N_CTX = 8192
# An answer that says the document does not give it.
NOT_STATED = re.compile(
    r"not (stated|mentioned|specified|given|provided|available|listed|indicated)|"
    r"does not (say|state|mention|specify|give|provide|indicate)|"
    r"doesn't (say|state|mention|specify|give)|no information|\bunknown\b|"
    r"cannot be determined|non (è )?(indicat|specificat)|nicht angegeben",
    re.IGNORECASE,
)

Grade = Literal["right", "wrong", "not_stated", "hallucinated"]
_DIGIT = re.compile(r"\d")
_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")


def _matches(pattern: str, answer: str) -> list[tuple[int, int]]:
    """Spans where `pattern` matches a whole value: "2" is not found in "2.2%" or "204.2"."""
    return [
        m.span()
        for m in re.finditer(pattern, answer, re.IGNORECASE)
        if not re.search(r"\d[.,]$", answer[: m.start()])
        and not re.match(r"[.,]\d", answer[m.end() :])
    ]


@dataclass(frozen=True, slots=True)
class Question:
    id: str
    question: str
    # Right: some `accept` pattern matches the answer and no `reject` pattern does.
    accept: tuple[str, ...] = ()
    reject: tuple[str, ...] = ()
    critical: bool = False
    # False: the document does not answer it; "not stated" is right, anything else invented.
    stated: bool = True
    # A reference answer the patterns grade right, and text every format must keep (tests).
    answer: str = ""
    evidence: tuple[str, ...] = ()
    # Formats known to lose the evidence: a weakness the exam shows (the test says when fixed).
    lost_in: tuple[str, ...] = ()
    trap: str = ""

    def grade(self, answer: str) -> Grade:
        says_not_stated = NOT_STATED.search(answer) is not None
        if not self.stated:
            return "not_stated" if says_not_stated else "hallucinated"
        if says_not_stated:
            return "wrong"
        if any(_matches(p, answer) for p in self.reject):
            return "wrong"
        found = {p: _matches(p, answer) for p in self.accept}
        if any(spans and not _DIGIT.search(p) for p, spans in found.items()):
            return "right"  # a worded answer ("no", "free", "standard") matched
        spans = [span for p in found.values() for span in p]
        if not spans:
            return "wrong"
        # A value answer is its first value not copied from the question: "25.1 MWh, down
        # from 26.8" answers 25.1; "The invoice number is 41857263" does not answer "2".
        asked = set(_NUMBER.findall(self.question))
        first = next((m for m in _NUMBER.finditer(answer) if m.group() not in asked), None)
        if first is None or any(a <= first.start() < b for a, b in spans):
            return "right"
        return "wrong"


@dataclass(frozen=True, slots=True)
class ExamDocument:
    name: str
    text: str
    language: str
    domain: str
    questions: tuple[Question, ...]
    # A web page (HTML, or copied out of a browser as text): where `facts` has its targets.
    web_page: bool = False


def load(directory: Path = DOCS_DIR) -> list[ExamDocument]:
    """Every document with its questions, in file name order."""
    docs = []
    for spec_path in sorted(directory.glob("*.toml")):
        spec = tomllib.loads(spec_path.read_text(encoding="utf-8"))
        questions = tuple(_question(spec_path.name, q) for q in spec["questions"])
        text = (directory / spec["document"]).read_text(encoding="utf-8")
        docs.append(
            ExamDocument(
                spec["document"],
                text,
                spec["language"],
                spec["domain"],
                questions,
                web_page=spec.get("web_page", False),
            )
        )
    return docs


def _question(source: str, fields: dict[str, Any]) -> Question:
    unknown = set(fields) - set(Question.__dataclass_fields__)
    if unknown:  # a misspelt key would silently grade nothing
        raise ValueError(f"{source}: unknown question fields {sorted(unknown)}")
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return Question(**values)


@dataclass(slots=True)
class Run:
    model: str
    document: str
    format: str
    used: str
    tokens: int
    tokens_before: int | None
    ttft_ms: float
    prefill_ms: float
    # The 1-minute load average after the job: the worker alone keeps it near its threads;
    # more means another process shared the cores and the TTFT is longer than alone.
    load: float | None
    grades: dict[str, Grade]
    answers: dict[str, str]
    critical: set[str] = field(default_factory=set)

    def count(self, grade: Grade, only: Iterable[str] | None = None) -> int:
        ids = set(only) if only is not None else set(self.grades)
        return sum(1 for i, g in self.grades.items() if g == grade and i in ids)


def body(doc: ExamDocument, fmt: str) -> dict[str, Any]:
    return {
        "document": doc.text,
        "document_format": fmt,
        "instructions": INSTRUCTIONS,
        "questions": [{"id": q.id, "question": q.question} for q in doc.questions],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stop": ["\n"],
    }


def _extract(stack: Stack, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """One extraction job followed over SSE: (client TTFT in ms, the final job view)."""
    return follow(stack, "/v1/extractions", body)


def follow(stack: Stack, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """A job POSTed to `path`, followed over SSE to its end: (client TTFT in ms, the final
    job view)."""
    with httpx.Client(base_url=stack.url, timeout=1800) as client:
        started = time.perf_counter()
        reply = client.post(path, json=body)
        reply.raise_for_status()
        job_id = reply.json()["id"]
        first: float | None = None
        with connect_sse(client, "GET", f"/v1/jobs/{job_id}/events") as source:
            for sse in source.iter_sse():
                if sse.event == "token" and first is None:
                    first = time.perf_counter()
                if sse.event in ("done", "error"):
                    break
        view: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "finished", view
    ttft = ((first or time.perf_counter()) - started) * 1000
    return ttft, view


def run_model(
    stack: Stack, model: str, docs: list[ExamDocument], formats: Sequence[str] = FORMATS
) -> list[Run]:
    """Every document in every format on one model's stack."""
    # One unrecorded job first, on a document of its own (the worker keeps a prefix in memory:
    # an exam document here would give its first run a head start): first-request costs.
    warm_up = {"document": "Warm-up note: the office opens at 9:00.", "document_format": "text"}
    _extract(
        stack, {**body(docs[0], "raw"), **warm_up, "questions": [{"id": "w", "question": "Hi?"}]}
    )
    runs: list[Run] = []
    for doc in docs:
        for fmt in formats:
            ttft, view = _extract(stack, body(doc, fmt))
            answers = {q: a["text"].strip() for q, a in view["extraction"]["answers"].items()}
            report = view.get("document") or {}
            runs.append(
                Run(
                    model=model,
                    document=doc.name,
                    format=fmt,
                    used=report.get("used", "raw"),
                    tokens=report.get("tokens_after", 0),
                    tokens_before=report.get("tokens_before"),
                    ttft_ms=ttft,
                    prefill_ms=view["timings"].get("prefill_ms") or 0.0,
                    load=os.getloadavg()[0],
                    grades={q.id: q.grade(answers[q.id]) for q in doc.questions},
                    answers=answers,
                    critical={q.id for q in doc.questions if q.critical},
                )
            )
        # Raw documents are not normalised, so their job has no report: the other formats'
        # tokens_before (same document, same tokenizer) is the raw document's count.
        before = {r.tokens_before for r in runs[-len(formats) :] if r.tokens_before}
        for r in runs[-len(formats) :]:
            if r.format == "raw" and len(before) == 1:
                r.tokens = before.pop()
    return runs


def measure(
    settings: Settings, log_dir: Path, docs: list[ExamDocument], formats: Sequence[str] = FORMATS
) -> list[Run]:
    stack = Stack(settings, log_dir)
    try:
        stack.start_api()
        stack.start_worker()
        return run_model(stack, settings.model, docs, formats)
    finally:
        stack.stop()


def section(runs: list[Run], docs: list[ExamDocument], settings: Settings) -> str:
    questions = sum(len(d.questions) for d in docs)
    unanswerable = sum(1 for d in docs for q in d.questions if not q.stated)
    critical = sum(1 for d in docs for q in d.questions if q.critical)
    languages = sorted({d.language for d in docs})
    rows = []
    verdicts = []
    for model in dict.fromkeys(r.model for r in runs):
        by_format = {
            fmt: totals([r for r in runs if r.model == model and r.format == fmt])
            for fmt in FORMATS
        }
        for fmt in FORMATS:
            t = by_format[fmt]
            raw = by_format["raw"]
            rows.append(
                f"| {model} | {fmt} | {t['tokens']} | {raw['tokens'] / max(t['tokens'], 1):.1f}× | "
                f"{t['ttft']:.0f} | {t['right']}/{t['stated']} + {t['not_stated']}/{t['unanswerable']} "
                f"= **{t['score']}/{t['questions']}** | {t['critical']}/{t['critical_total']} | "
                f"{t['not_stated']} / {t['hallucinated']} |"
            )
        for fmt in ("text", "facts"):
            t, raw = by_format[fmt], by_format["raw"]
            ok = t["score"] >= raw["score"] and t["critical"] >= raw["critical"]
            verdicts.append(
                f"- {model}, `{fmt}` against `raw`: score {t['score']} vs {raw['score']}, "
                f"critical {t['critical']} vs {raw['critical']} — "
                f"{'meets' if ok else 'MISSES'} the target (score ≥ raw's, critical never fewer)"
            )
    per_doc = _per_document(runs, docs)
    pages = _page_targets(runs, docs)
    labelled = _labelled_targets(runs, docs)
    return f"""## Accuracy exam: raw, text and facts documents

`bench/exam.py`: {len(docs)} documents written for this project (`bench/exam_docs/`; languages
{", ".join(languages)}; {", ".join(d.domain for d in docs)}) with {questions} questions
({critical} on critical facts, {unanswerable} that the document does not answer), graded by
accept/reject regexes on the answer. Traps: four similar prices in a table, near-duplicate
durations, a 10-year vs 5-year warranty in one sentence, negations, facts only in a footer,
conditions that change an answer. Each document in each `document_format` is one
`POST /v1/extractions` job with all its questions, through a real API and worker
({settings.threads} threads, n_ctx {settings.n_ctx}, prefix cache off: every run prefills cold),
greedy, at most {MAX_TOKENS} tokens per answer, stopping at a newline. Tokens: the documents'
tokens summed (the job's `document` report). TTFT: POST to the first token at the client, summed
over the documents (normalising in the API, queueing, prefill of the document and all
questions). Score: stated questions answered right, plus unanswerable ones answered "not stated".
Not stated / hallucinated: on the {unanswerable} unanswerable questions. Bad results are kept.
{_load(runs, settings)}

| model | format | document tokens | × fewer than raw | TTFT ms (sum) | score | critical right | not stated / hallucinated |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{chr(10).join(verdicts)}

Web pages ({", ".join(d.name for d in docs if d.web_page)}) against the token targets (`facts` ≥ 3×
fewer than `raw`, `text` ≥ 1.5×):

{pages}

`facts` against `raw` on the web pages' questions (target: ≥ raw's score + 10% of those questions)
and critical facts per document (target: never fewer than raw's on any document):

{labelled}

Per document (score / critical right / tokens / TTFT ms):

{per_doc}
"""


def _load(runs: list[Run], settings: Settings) -> str:
    loads = [r.load for r in runs if r.load is not None]
    if not loads:
        return "The load average was not recorded in this run."
    return (
        f"The 1-minute load average after each job was {min(loads):.1f}–{max(loads):.1f} (the "
        f"worker alone keeps it near {settings.threads}; more means other processes shared the "
        "cores, which lengthens TTFT but does not change greedy answers)."
    )


def totals(runs: list[Run]) -> dict[str, Any]:
    right = sum(r.count("right") for r in runs)
    not_stated = sum(r.count("not_stated") for r in runs)
    hallucinated = sum(r.count("hallucinated") for r in runs)
    return {
        "tokens": sum(r.tokens for r in runs),
        "ttft": sum(r.ttft_ms for r in runs),
        "right": right,
        "stated": sum(r.count("right") + r.count("wrong") for r in runs),
        "not_stated": not_stated,
        "hallucinated": hallucinated,
        "unanswerable": not_stated + hallucinated,
        "score": right + not_stated,
        "questions": sum(len(r.grades) for r in runs),
        "critical": sum(r.count("right", r.critical) for r in runs),
        "critical_total": sum(len(r.critical) for r in runs),
    }


def _page_targets(runs: list[Run], docs: list[ExamDocument]) -> str:
    pages = {d.name for d in docs if d.web_page}
    lines = []
    for r in runs:
        if r.document not in pages or r.format == "raw":
            continue
        raw = _run(runs, r.model, r.document, "raw")
        times, ttft = raw.tokens / max(r.tokens, 1), raw.ttft_ms / max(r.ttft_ms, 1)
        goal = 3.0 if r.format == "facts" else 1.5
        lines.append(
            f"- {r.model}, {r.document}, `{r.format}`: {times:.1f}× fewer tokens "
            f"({'met' if times >= goal else 'MISSED'}), TTFT {ttft:.1f}× shorter"
        )
    return "\n".join(lines)


def _run(runs: list[Run], model: str, document: str, fmt: str) -> Run:
    return next(r for r in runs if (r.model, r.document, r.format) == (model, document, fmt))


def _labelled_targets(runs: list[Run], docs: list[ExamDocument]) -> str:
    pages = [d.name for d in docs if d.web_page]
    lines = []
    for model in dict.fromkeys(r.model for r in runs):
        mine = [r for r in runs if r.model == model and r.document in pages]
        raw = totals([r for r in mine if r.format == "raw"])
        facts = totals([r for r in mine if r.format == "facts"])
        needed = raw["score"] + 0.1 * raw["questions"]
        fewer = []
        for doc in docs:
            if not any((r.model, r.document) == (model, doc.name) for r in runs):
                continue
            raw_doc = totals([_run(runs, model, doc.name, "raw")])["critical"]
            facts_doc = totals([_run(runs, model, doc.name, "facts")])["critical"]
            if facts_doc < raw_doc:
                fewer.append(f"{doc.name} {facts_doc} vs {raw_doc}")
        lines.append(
            f"- {model}: web pages' score {facts['score']} vs raw {raw['score']} of "
            f"{raw['questions']} (needs ≥ {needed:.1f}: "
            f"{'met' if facts['score'] >= needed else 'MISSED'}); critical facts fewer than "
            f"raw on {', '.join(fewer) if fewer else 'no document (met)'}"
            + (" (MISSED)" if fewer else "")
        )
    return "\n".join(lines)


def _per_document(runs: list[Run], docs: list[ExamDocument]) -> str:
    header = "| model | document | " + " | ".join(FORMATS) + " |"
    lines = [header, "|---|---|" + "---|" * len(FORMATS)]
    for model in dict.fromkeys(r.model for r in runs):
        for doc in docs:
            cells = []
            for fmt in FORMATS:
                found = [
                    r for r in runs if (r.model, r.document, r.format) == (model, doc.name, fmt)
                ]
                if not found:
                    cells.append("—")
                    continue
                r = found[0]
                t = totals([r])
                used = "" if r.used == fmt else f" (sent as {r.used})"
                cells.append(
                    f"{t['score']}/{t['questions']}, {t['critical']}/{t['critical_total']}, "
                    f"{r.tokens} tok, {r.ttft_ms:.0f} ms{used}"
                )
            lines.append(f"| {model} | {doc.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def runs_json(runs: list[Run]) -> bytes:
    """Everything measured, so the section can be rendered again (`regraded`) without a model."""
    return orjson.dumps(
        [{**asdict(r), "critical": sorted(r.critical)} for r in runs], option=orjson.OPT_INDENT_2
    )


def regraded(path: Path, docs: list[ExamDocument]) -> list[Run]:
    """The runs saved by `runs_json`, their answers graded again by the current questions."""
    questions = {(d.name, q.id): q for d in docs for q in d.questions}
    runs = []
    for saved in orjson.loads(path.read_bytes()):
        run = Run(**{**saved, "critical": set(saved["critical"])})
        run.grades = {i: questions[(run.document, i)].grade(a) for i, a in run.answers.items()}
        run.critical = {i for i in run.answers if questions[(run.document, i)].critical}
        runs.append(run)
    return runs


def answers_json(runs: list[Run], docs: list[ExamDocument]) -> bytes:
    """Every answer with its grade, for reading what went wrong."""
    questions = {(d.name, q.id): q for d in docs for q in d.questions}
    out = [
        {
            "model": r.model,
            "document": r.document,
            "format": r.format,
            "used": r.used,
            "question": questions[(r.document, i)].question,
            "id": i,
            "answer": r.answers[i],
            "grade": r.grades[i],
            "critical": i in r.critical,
        }
        for r in runs
        for i in r.grades
    ]
    return orjson.dumps(out, option=orjson.OPT_INDENT_2)
