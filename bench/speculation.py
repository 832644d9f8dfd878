"""Speculative decoding off, on and auto: decode speed on copy-heavy answers and on free text.

Pending issue 33, item 2: the one-job engine that drafted was retired, and the Conclave does
not draft yet, so `make bench` writes `PENDING` in this section's place and measures nothing.
The workloads below stay for item 2, which measures drafting inside the Conclave's shared
steps; what follows describes the run as it was made on the retired engine.

One worker serves every job, greedy, the three modes interleaved question by question (off,
on, auto, off, ...), so machine drift hits all three alike; the worker's controller carries
what it learned from job to job, as in production. The whole run is made twice: with exact
greedy speculation (the default: near ties replayed alone) and without those replays.
Workloads:
- clause quotes: each answer quotes a clause of a contract, as extraction answers do;
- the same questions as one extraction job (drafting inside the multi-question decode);
- ledger quotes: answers are asked to quote ledger lines (the 0.5B model invents many of the
  numbers, so less of each answer is a copy);
- free-form generation: short essays, nothing to copy.
Decode speed of a document or free-form job is the worker's own figure (answer tokens from the
first to the last); of an extraction job, answer tokens over the job's time after the document
prefill (the questions' own prefill included).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.prefix_cache import document
from shared.settings import Settings
from tests.harness import Stack

PENDING = """## Speculative decoding: off, on, auto

Pending issue 33, item 2 (drafting inside the Conclave's shared steps). The request's
`speculation` field is accepted and validated, and not applied: every job is decoded plainly
and reports no `speculation`. The figures this section held were measured on the one-job
engine (`worker.max_active_jobs = 1`), which has been retired with its speculative decoder; no
code in the tree produces them now, so they are not shown. `bench/speculation.py` keeps the
workloads (clause quotes as document jobs and as one extraction, ledger quotes, free text new
and asked before) for item 2 to measure on the default engine.
"""

MODES = ("off", "on", "auto")
VARIANTS = ("exact", "no tie replays")
CLAUSES_ASKED = (2, 5, 9, 11)
LINES = (4, 11, 19)
TOPICS = ("the bicycle", "paper money", "the printing press", "lighthouses")
# One per free-form job of the new-prompts workload: nothing in the archive answers them.
NEW_TOPICS = (
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
)
COPY_TOKENS = 96
FREE_TOKENS = 96


@dataclass
class Tally:
    """Answer tokens and decode seconds of one mode on one workload, and what it drafted."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    texts: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    def add(self, tokens: int, seconds: float, view: dict[str, Any], text: str) -> None:
        self.tokens += tokens
        self.seconds += seconds
        report = view.get("speculation") or {}
        self.drafted += report.get("drafted", 0)
        self.accepted += report.get("accepted", 0)
        self.texts.append(text)


Measure = Callable[[httpx.Client, str], tuple[int, float, dict[str, Any], str]]


def _finished(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    job_id = client.post(path, json=body).json()["id"]
    while (view := client.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "started"):
        time.sleep(0.05)
    assert view["status"] == "finished", view
    result: dict[str, Any] = view
    return result


def _generation(path_body: dict[str, Any]) -> Measure:
    def measure(client: httpx.Client, mode: str) -> tuple[int, float, dict[str, Any], str]:
        view = _finished(client, "/v1/jobs", path_body | {"speculation": mode})
        tokens, rate = view["usage"]["completion_tokens"], view["timings"]["decode_tokens_per_s"]
        if not rate:  # a one-token answer has no decode rate
            return 0, 0.0, view, view["result"]["text"]
        # The worker's rate runs from the first token to the last: tokens - 1 intervals.
        return tokens - 1, (tokens - 1) / rate, view, view["result"]["text"]

    return measure


def _extraction(body: dict[str, Any]) -> Measure:
    def measure(client: httpx.Client, mode: str) -> tuple[int, float, dict[str, Any], str]:
        view = _finished(client, "/v1/extractions", body | {"speculation": mode})
        seconds = view["finished_at"] - view["started_at"] - view["timings"]["prefill_ms"] / 1000
        answers = view["extraction"]["answers"]
        text = "\n".join(answers[k]["text"] for k in sorted(answers))
        return view["usage"]["completion_tokens"], seconds, view, text

    return measure


CLAUSE_JOBS = "clause quotes (document jobs)"
CLAUSE_EXTRACTION = "clause quotes (one extraction job, 4 questions decoded together)"
FREE = "free-form generation, a new prompt every job"
FREE_AGAIN = "free-form generation, prompts asked before (the archive holds their answers)"


def _essay(topic: str) -> dict[str, Any]:
    content = f"Write a paragraph on the history of {topic}."
    messages = [{"role": "user", "content": content}]
    return {"messages": messages, "temperature": 0, "max_tokens": FREE_TOKENS}


def _new_essays() -> Measure:
    topics = iter(NEW_TOPICS)

    def measure(client: httpx.Client, mode: str) -> tuple[int, float, dict[str, Any], str]:
        return _generation(_essay(next(topics)))(client, mode)

    return measure


def _workloads() -> dict[str, list[Measure]]:
    clauses = [f"Quote clause {n} word for word." for n in CLAUSES_ASKED]
    # As sent: the answers quote the document word for word.
    contract = {
        "document": CONTRACT,
        "document_format": "raw",
        "temperature": 0,
        "max_tokens": COPY_TOKENS,
    }
    lines = [f"Quote lines {n} to {n + 2} of the ledger exactly as written." for n in LINES]
    ledger = contract | {"document": document(40, seed=77).rsplit("\n", 1)[0]}
    return {
        CLAUSE_JOBS: [_generation(contract | {"prompt": q}) for q in clauses],
        CLAUSE_EXTRACTION: [
            _extraction(
                contract
                | {"questions": [{"id": str(i), "question": q} for i, q in enumerate(clauses)]}
            )
        ],
        "ledger quotes (document jobs)": [_generation(ledger | {"prompt": q}) for q in lines],
        FREE: [_new_essays()] * len(TOPICS),
        FREE_AGAIN: [_generation(_essay(t)) for t in TOPICS],
    }


def measure(stack: Stack, rounds: int) -> dict[str, dict[str, Tally]]:
    """Every workload's tallies per mode, from the worker `stack` runs."""
    workloads = _workloads()
    tallies = {name: {mode: Tally() for mode in MODES} for name in workloads}
    with httpx.Client(base_url=stack.url, timeout=900) as client:
        for name, jobs in workloads.items():
            jobs[0](client, "off")  # the document's prefill, cached for everyone after
            for _ in range(rounds):
                for job in jobs:
                    for mode in MODES:
                        tallies[name][mode].add(*job(client, mode))
    return tallies


Run = dict[str, dict[str, Tally]]  # workload -> mode -> tally


def section(settings: Settings, runs: dict[str, Run], rounds: int) -> str:
    """The table for both variants (`VARIANTS`, each measured by `measure` on its own worker)."""
    rows = [
        _row(name, variant, modes) for variant, run in runs.items() for name, modes in run.items()
    ]
    verdicts = "; ".join(_verdict(variant, run) for variant, run in runs.items())
    differences = "\n".join(
        line for variant, run in runs.items() for line in _differences(variant, run)
    )
    return f"""## Speculative decoding: off, on, auto

{settings.model}, {settings.threads} threads, greedy, one worker; the three modes interleaved
job by job, {rounds} round(s) of every question, the whole run made once with exact greedy
speculation (the default, `worker.speculation_exact`: a batched row whose top two logits
nearly tie is decided again one token at a time) and once without those replays. Drafts come
from n-grams of the prompt (the document), of the job's own output and of the worker's archive
of past outputs; `auto` is the controller deciding by measured speed. Answer tokens per second
of decoding (see `bench/speculation.py` for how each is timed); "same text" compares with
`off`. Targets: auto ≥ 1.5× off on copy-heavy extraction, ≥ 0.97× on free text. Result:
{verdicts}.

| workload | variant | off tok/s | on tok/s | auto tok/s | acceptance (on) | same text as off (on / auto) |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Texts that differ from `off` (where they part): {differences or "none"}
"""


# The targets: auto against off, on copy-heavy answers and on free text.
TARGETS = (
    (CLAUSE_JOBS, "clause-quote jobs", 1.5),
    (CLAUSE_EXTRACTION, "the clause-quote extraction", 1.5),
    (FREE, "free text (new prompts)", 0.97),
)


def _verdict(variant: str, run: Run) -> str:
    parts = []
    for name, label, target in TARGETS:
        ratio = run[name]["auto"].rate / run[name]["off"].rate
        met = "met" if ratio >= target else "MISSED"
        parts.append(f"**{ratio:.2f}×** on {label} (target ≥ {target}×: {met})")
    return f"{variant}: auto is " + ", ".join(parts)


def _differences(variant: str, tallies: Run) -> list[str]:
    found = []
    for name, modes in tallies.items():
        if name == FREE:
            continue  # every job had its own prompt
        for mode in ("on", "auto"):
            for i, (a, b) in enumerate(zip(modes["off"].texts, modes[mode].texts, strict=True)):
                if a != b:
                    at = _common_prefix(a, b)
                    found.append(
                        f"\n- {name}, {variant}, {mode}, job {i}: off {a[at - 20 : at + 30]!r}, "
                        f"{mode} {b[at - 20 : at + 30]!r}"
                    )
    return found


def _common_prefix(a: str, b: str) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _row(name: str, variant: str, modes: dict[str, Tally]) -> str:
    off, on, auto = (modes[m] for m in MODES)
    acceptance = f"{on.accepted / on.drafted:.0%}" if on.drafted else "—"

    def same(tally: Tally) -> str:
        if name == FREE:
            return "— (other prompts)"
        equal = sum(a == b for a, b in zip(tally.texts, off.texts, strict=True))
        return f"{equal}/{len(off.texts)}"

    return (
        f"| {name} | {variant} | {off.rate:.1f} | {on.rate:.1f} ({on.rate / off.rate:.2f}×) | "
        f"{auto.rate:.1f} ({auto.rate / off.rate:.2f}×) | {acceptance} | "
        f"{same(on)} / {same(auto)} |"
    )


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
