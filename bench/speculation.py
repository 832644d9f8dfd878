"""Speculation off, on and auto on the default engine: decode speed, one stream and four.

Drafts are prompt lookup (worker/conclave/drafts.py) riding in the Conclave's decode passes.
One worker per model serves every job, greedy; the three modes take turns within each round
(their order rotating round by round), and the ratio to `off` is taken per round (median and
range). Workloads: clause quotes (document jobs asking for a clause word for word: copy-heavy),
the same four questions as one extraction job (its answers decoded together), and free text (a
new short essay each job: nothing to copy). Each is run with one job at a time and with four
jobs submitted together.

Decode speed: answer tokens after the first over the time from the first answer token to the
last, both from the worker's own timings (`started_at`, `ttft_ms`, `decode_tokens_per_s`); for
four jobs together, the sum over the group's span (the first job's first token to the last
job's last). An extraction job's questions are decoded together: its whole answer time after
the document's prefill counts. "Same text" compares every job's text with `off`'s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.paired import in_turn, ratio_summary
from tests.harness import Stack

MODES = ("off", "on", "auto")
CLAUSES_ASKED = (2, 5, 9, 11)
COPY_TOKENS = 96
FREE_TOKENS = 96
TOPICS = (
    "the compass",
    "glassmaking",
    "the telescope",
    "windmills",
    "the steam engine",
    "canals",
    "the telegraph",
    "porcelain",
    "the calendar",
    "bridges",
    "clocks",
    "the postal service",
    "maps",
    "soap",
    "the umbrella",
    "eyeglasses",
    "the piano",
    "chess",
    "libraries",
    "coffee",
    "tea",
    "sugar",
    "silk",
    "the plough",
    "vaccines",
    "the zipper",
    "railways",
    "the lightbulb",
    "cement",
    "ink",
    "paper",
    "the wheel",
    "sailing ships",
    "kites",
    "mirrors",
    "tunnels",
)
CONCURRENT = 4
# The targets, auto against off: (workload, streams) -> at least this ratio.
TARGETS = {
    ("clause quotes", 1): 1.5,
    ("free text", 1): 0.97,
    ("clause quotes", CONCURRENT): 0.97,
    ("free text", CONCURRENT): 0.97,
}


@dataclass
class Timed:
    """One mode's jobs in one round: answer tokens, decode seconds, texts, drafts."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    texts: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _submit(client: httpx.Client, path: str, body: dict[str, Any]) -> str:
    job_id: str = client.post(path, json=body).json()["id"]
    return job_id


def _wait(client: httpx.Client, job_id: str) -> dict[str, Any]:
    while (view := client.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "started"):
        time.sleep(0.02)
    assert view["status"] == "finished", view
    result: dict[str, Any] = view
    return result


def _span(view: dict[str, Any]) -> tuple[int, float, float]:
    """A generation job's answer tokens after the first, and when its first and last came."""
    tokens, rate = view["usage"]["completion_tokens"], view["timings"]["decode_tokens_per_s"]
    first = view["started_at"] + (view["timings"]["ttft_ms"] or 0) / 1000
    if not rate or tokens < 2:
        return 0, first, first
    return tokens - 1, first, first + (tokens - 1) / rate


def _text(view: dict[str, Any]) -> str:
    if view.get("extraction"):
        answers = view["extraction"]["answers"]
        return "\n".join(answers[k]["text"] for k in sorted(answers))
    text: str = view["result"]["text"]
    return text


def _run_group(client: httpx.Client, jobs: list[tuple[str, dict[str, Any]]], mode: str) -> Timed:
    """Submit `jobs` together (one of them: one at a time, by the caller) and time them."""
    ids = [_submit(client, path, body | {"speculation": mode}) for path, body in jobs]
    views = [_wait(client, job_id) for job_id in ids]
    timed = Timed(texts=[_text(v) for v in views])
    for view in views:
        report = view.get("speculation") or {}
        timed.drafted += report.get("drafted", 0)
        timed.accepted += report.get("accepted", 0)
    if views[0].get("extraction"):  # its questions decode together: the time after the prefill
        for view in views:
            timed.tokens += view["usage"]["completion_tokens"]
            answer_s = (
                view["finished_at"] - view["started_at"] - view["timings"]["prefill_ms"] / 1000
            )
            timed.seconds += answer_s
        return timed
    spans = [_span(v) for v in views]
    timed.tokens = sum(tokens for tokens, _, _ in spans)
    timed.seconds = max(last for _, _, last in spans) - min(first for _, first, _ in spans)
    return timed


Jobs = Callable[[int], list[tuple[str, dict[str, Any]]]]  # a round's index -> its jobs


def _workloads() -> dict[str, Jobs]:
    contract = {"document": CONTRACT, "document_format": "raw", "temperature": 0}
    clauses = [f"Quote clause {n} word for word." for n in CLAUSES_ASKED]
    quotes = [("/v1/jobs", contract | {"prompt": q, "max_tokens": COPY_TOKENS}) for q in clauses]
    questions = [{"id": str(i), "question": q} for i, q in enumerate(clauses)]
    extraction = ("/v1/extractions", contract | {"questions": questions, "max_tokens": COPY_TOKENS})
    topics = iter(TOPICS * 100)

    def essays(_round: int) -> list[tuple[str, dict[str, Any]]]:
        def essay(topic: str) -> dict[str, Any]:
            content = f"Write a paragraph on the history of {topic}."
            messages = [{"role": "user", "content": content}]
            return {"messages": messages, "temperature": 0, "max_tokens": FREE_TOKENS}

        # The same topics for every mode of a round, new ones each round.
        return [("/v1/jobs", essay(next(topics))) for _ in range(CONCURRENT)]

    return {
        "clause quotes": lambda _round: quotes,
        "clause quotes, one extraction job": lambda _round: [extraction],
        "free text": essays,
    }


Results = dict[tuple[str, int, str], list[Timed]]  # (workload, streams, mode) -> per round


def measure(stack: Stack, rounds: int) -> Results:
    results: Results = {}
    with httpx.Client(base_url=stack.url, timeout=900) as client:
        for name, jobs_of in _workloads().items():
            _run_group(client, jobs_of(-1)[:1], "off")  # the document's prefill, then cached
            for k in range(rounds):
                jobs = jobs_of(k)
                order = in_turn(MODES, k)
                for streams in (1, CONCURRENT):
                    for mode in order:
                        if streams == 1:
                            parts = [_run_group(client, [job], mode) for job in jobs]
                            timed = _merge(parts)
                        elif len(jobs) == 1:
                            continue  # an extraction job decodes its questions together anyway
                        else:
                            timed = _run_group(client, jobs[:CONCURRENT], mode)
                        results.setdefault((name, streams, mode), []).append(timed)
    return results


def _merge(parts: list[Timed]) -> Timed:
    merged = Timed()
    for part in parts:
        merged.tokens += part.tokens
        merged.seconds += part.seconds
        merged.drafted += part.drafted
        merged.accepted += part.accepted
        merged.texts += part.texts
    return merged


def section(threads: int, results: dict[str, Results], rounds: int) -> str:
    rows, missed = [], []
    for model, by_key in results.items():
        keys = sorted({(name, streams) for name, streams, _ in by_key}, key=lambda k: (k[1], k[0]))
        for name, streams in keys:
            row, met = _row(model, name, streams, {m: by_key[(name, streams, m)] for m in MODES})
            rows.append(row)
            if not met:
                missed.append(f"{model}, {name}, {streams} stream(s)")
    summary = "every target met" if not missed else "missed: " + "; ".join(missed)
    return f"""## Speculative decoding: off, on, auto

{__doc__.split(chr(10) + chr(10), 1)[1].replace(chr(10), " ").strip()} {threads} threads,
{rounds} rounds. Ratios: the mode's decode tokens per second over `off`'s in the same round
(median and range). Acceptance: drafted tokens written, with `on`. Result: {summary}.

| model | workload | streams | off tok/s (median) | on vs off | auto vs off | acceptance (on) \
| same text as off | auto target (issue 33) |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}
"""


def _row(model: str, name: str, streams: int, modes: dict[str, list[Timed]]) -> tuple[str, bool]:
    """A table row, and whether auto met its target (True where it has none)."""
    off = modes["off"]
    ratios = {
        m: [t.rate / o.rate for t, o in zip(modes[m], off, strict=True)] for m in ("on", "auto")
    }
    drafted = sum(t.drafted for t in modes["on"])
    acceptance = f"{sum(t.accepted for t in modes['on']) / drafted:.0%}" if drafted else "–"
    same = all(
        t.texts == o.texts for m in ("on", "auto") for t, o in zip(modes[m], off, strict=True)
    )
    target = TARGETS.get((name, streams))
    met = target is None or statistics.median(ratios["auto"]) >= target
    verdict = "–" if target is None else f"≥ {target}×: {'met' if met else 'MISSED'}"
    row = (
        f"| {model} | {name} | {streams} | {statistics.median(t.rate for t in off):.1f} | "
        f"{ratio_summary(ratios['on'])} | {ratio_summary(ratios['auto'])} | {acceptance} | "
        f"{'yes' if same else '**NO**'} | {verdict} |"
    )
    return row, met


# A contract whose clauses the clause-quote workloads ask for, word for word.
_CLAUSES = (
    "Definitions. In this agreement the Supplier means Northwind Millers Ltd, the Buyer means "
    "Harbour Bakeries plc, and Goods means the flour, grain and packaging listed in the order "
    "schedule attached to each purchase order.",
    "Orders. The Buyer shall place each order in writing at least five working days before "
    "the requested delivery date, stating the quantity, the grade of flour and the delivery "
    "address for every consignment.",
    "Delivery. The Supplier shall deliver the Goods to the address named in the order between "
    "seven in the morning and two in the afternoon, and the Buyer shall provide a clear "
    "unloading bay for the delivery vehicle.",
    "Inspection. The Buyer may inspect the Goods within forty-eight hours of delivery and "
    "shall notify the Supplier in writing of any damaged sacks, short weight or contamination "
    "found during that inspection.",
    "Price. The price of the Goods is the price in the Supplier's list on the date the order "
    "is accepted, exclusive of value added tax, which the Buyer shall pay in addition at the "
    "prevailing rate.",
    "Payment. The Buyer shall pay each invoice within thirty days of its date by bank "
    "transfer to the account named on the invoice, and interest accrues on late payments at "
    "four percent above the base rate.",
    "Quality. The Supplier warrants that the Goods conform to the grade stated in the order, "
    "are fit for baking bread and pastry, and have been milled and stored in accordance with "
    "food safety law.",
    "Liability. Neither party is liable for loss of profit or indirect loss, and the "
    "Supplier's total liability for any consignment shall not exceed twice the price paid for "
    "that consignment.",
    "Force majeure. Neither party is in breach if a failure to perform is caused by flood, "
    "fire, strike, crop failure or any other event beyond its reasonable control, provided it "
    "notifies the other party promptly.",
    "Termination. Either party may end this agreement by giving three months' written notice, "
    "and either party may end it at once if the other becomes insolvent or commits a serious "
    "breach that is not remedied within fourteen days.",
    "Confidentiality. Each party shall keep the other's prices, recipes and customer lists "
    "confidential and shall use them only to perform this agreement, during its term and for "
    "two years after it ends.",
    "Governing law. This agreement is governed by the law of England and Wales, and the "
    "courts of England shall have exclusive jurisdiction over any dispute arising out of or in "
    "connection with it.",
)
CONTRACT = "Supply agreement\n\n" + "\n\n".join(
    f"Clause {i}. {text}" for i, text in enumerate(_CLAUSES, 1)
)
