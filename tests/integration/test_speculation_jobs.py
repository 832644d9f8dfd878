"""Speculative decoding through the job path: per-request mode, per-job report, metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.harness import Stack
from tests.integration.test_job_path import submit, wait_status
from tests.integration.test_metrics import scrape

TEXT = (
    "The quarterly report lists 42 crates of pears shipped from Lyon to Ghent, 17 crates of "
    "apples held in Antwerp, and 9 crates of plums returned to the farm in Valence."
)
COPY = {"prompt": f"Repeat this exactly:\n{TEXT}\nRepeat:\n", "max_tokens": 48, "temperature": 0}


def test_speculation_gives_plain_output_and_reports_drafts(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(worker={"speculation_exact": True, "max_active_jobs": 1})
    plain = wait_status(
        stack, submit(stack, COPY | {"speculation": "off"})["id"], {"finished"}, 120
    )
    assert plain["speculation"] is None
    auto = COPY | {"speculation": "auto"}
    fast = wait_status(stack, submit(stack, auto)["id"], {"finished"}, 120)
    assert fast["result"]["text"] == plain["result"]["text"]
    report = fast["speculation"]
    assert report["mode"] == "auto" and report["accepted"] > 0
    assert report["drafted"] >= report["accepted"]
    assert 0 < report["acceptance_rate"] <= 1
    metrics = scrape(stack)
    assert metrics["granary_speculation_drafted_tokens_total{}"] == report["drafted"]
    assert metrics["granary_speculation_accepted_tokens_total{}"] == report["accepted"]
    bad = httpx.post(f"{stack.url}/v1/jobs", json=COPY | {"speculation": "always"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "speculation"


def test_requests_do_not_speculate_unless_asked(stack: Stack) -> None:
    job = wait_status(stack, submit(stack, COPY)["id"], {"finished"}, 120)
    assert job["speculation"] is None  # `jobs.speculation`


def test_auto_leaves_sampled_requests_plain_and_seeded(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(worker={"max_active_jobs": 1})
    sampled = COPY | {"temperature": 0.8, "seed": 11, "speculation": "auto"}
    first = wait_status(stack, submit(stack, sampled)["id"], {"finished"}, 120)
    again = wait_status(stack, submit(stack, sampled)["id"], {"finished"}, 120)
    assert first["speculation"] is None
    assert first["result"]["text"] == again["result"]["text"]
    forced = wait_status(
        stack, submit(stack, sampled | {"speculation": "on"})["id"], {"finished"}, 120
    )
    assert forced["speculation"]["drafted"] > 0


def test_extraction_drafts_inside_its_questions(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(worker={"speculation_exact": True, "max_active_jobs": 1})
    body = {
        "document": TEXT,
        "questions": [{"id": "copy", "question": "Repeat the document exactly."}],
        "max_tokens": 40,
    }

    def run(extra: dict[str, str]) -> dict[str, Any]:
        job = httpx.post(f"{stack.url}/v1/extractions", json=body | extra).json()
        return wait_status(stack, job["id"], {"finished"}, 120)

    plain, fast = run({"speculation": "off"}), run({"speculation": "auto"})
    assert plain["speculation"] is None
    answer = fast["extraction"]["answers"]["copy"]["text"]
    assert answer == plain["extraction"]["answers"]["copy"]["text"]
    assert "42 crates of pears" in answer  # it did copy
    report = fast["speculation"]
    assert report["mode"] == "auto" and report["accepted"] > 0
    metrics = scrape(stack)
    assert metrics["granary_speculation_accepted_tokens_total{}"] == report["accepted"]
