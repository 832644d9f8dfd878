"""Speculative decoding through the job path: per-request mode, per-job report, metrics."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.harness import Stack
from tests.integration.test_job_path import submit, wait_status
from tests.integration.test_metrics import scrape

TEXT = (
    "The quarterly report lists 42 crates of pears shipped from Lyon to Ghent, 17 crates of "
    "apples held in Antwerp, and 9 crates of plums returned to the farm in Valence."
)
COPY = {"prompt": f"Repeat this exactly:\n{TEXT}\nRepeat:\n", "max_tokens": 48, "temperature": 0}


def test_speculation_on_gives_plain_output_and_reports_drafts(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    plain = wait_status(stack, submit(stack, COPY)["id"], {"finished"}, 120)
    assert plain["speculation"] is None  # off unless asked (`jobs.speculation`)
    fast = wait_status(stack, submit(stack, COPY | {"speculation": "on"})["id"], {"finished"}, 120)
    assert fast["result"]["text"] == plain["result"]["text"]  # copying: no near-ties to flip
    report = fast["speculation"]
    assert report["mode"] == "on" and report["accepted"] > 0
    assert report["drafted"] >= report["accepted"]
    assert 0 < report["acceptance_rate"] <= 1
    metrics = scrape(stack)
    assert metrics["granary_speculation_drafted_tokens_total{}"] == report["drafted"]
    assert metrics["granary_speculation_accepted_tokens_total{}"] == report["accepted"]
    bad = httpx.post(f"{stack.url}/v1/jobs", json=COPY | {"speculation": "always"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "speculation"
