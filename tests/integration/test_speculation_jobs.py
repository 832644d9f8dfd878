"""The request's `speculation` field through the job path: drafts ride in the Conclave's
decode passes (worker/conclave/drafts.py), the output is plain decoding's, and the job reports
what drafting did (its record, /metrics' counters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import HTTP, Stack
from tests.integration.test_job_path import submit, wait_status

TEXT = (
    "The quarterly report lists 42 crates of pears shipped from Lyon to Ghent, 17 crates of "
    "apples held in Antwerp, and 9 crates of plums returned to the farm in Valence."
)


@pytest.fixture(scope="module")
def stack(module_stack_factory: Callable[..., Stack]) -> Stack:
    """One stack for the module's tests that take `stack`: each reads only its own jobs
    (counters as differences), so they can share it."""
    return module_stack_factory()


COPY = {"prompt": f"Repeat this exactly:\n{TEXT}\nRepeat:\n", "max_tokens": 24, "temperature": 0}


def _finished(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    # `cache: false`: each run decodes, none is answered from an earlier one's result.
    return wait_status(stack, submit(stack, body | {"cache": False})["id"], {"finished"}, 120)


def _drafted(stack: Stack) -> tuple[int, int]:
    metrics = HTTP.get(f"{stack.url}/metrics").text
    counts = {
        line.split()[0]: int(float(line.split()[1]))
        for line in metrics.splitlines()
        if line.startswith("granary_speculation_")
    }
    return counts["granary_speculation_drafted_tokens_total"], counts[
        "granary_speculation_accepted_tokens_total"
    ]


def test_a_request_asking_for_speculation_drafts_and_writes_the_plain_text(stack: Stack) -> None:
    plain = _finished(stack, COPY)
    assert plain["speculation"] is None  # `jobs.speculation`: off
    before = _drafted(stack)
    forced = _finished(stack, COPY | {"speculation": "on"})
    assert forced["result"]["text"] == plain["result"]["text"]
    report = forced["speculation"]
    assert report["mode"] == "on" and report["accepted"] > 0
    assert report["acceptance_rate"] == report["accepted"] / report["drafted"]
    after = _drafted(stack)
    assert after[0] - before[0] >= report["drafted"] and after[1] - before[1] >= report["accepted"]
    auto = _finished(stack, COPY | {"speculation": "auto"})
    assert auto["result"]["text"] == plain["result"]["text"]
    assert auto["speculation"]["mode"] == "auto"
    bad = HTTP.post(f"{stack.url}/v1/jobs", json=COPY | {"speculation": "always"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "speculation"


def test_a_seeded_request_drafting_samples_as_without(stack: Stack) -> None:
    sampled = COPY | {"temperature": 0.8, "seed": 11}
    plain = _finished(stack, sampled | {"speculation": "off"})
    forced = _finished(stack, sampled | {"speculation": "on"})
    assert forced["result"]["text"] == plain["result"]["text"]
    assert forced["speculation"]["drafted"] > 0


def test_an_extraction_drafting_answers_as_without(stack: Stack) -> None:
    body = {
        "document": TEXT,
        "questions": [{"id": "copy", "question": "Repeat the document exactly."}],
        "max_tokens": 24,
        "cache": False,
    }

    def run(extra: dict[str, str]) -> dict[str, Any]:
        job = HTTP.post(f"{stack.url}/v1/extractions", json=body | extra).json()
        return wait_status(stack, job["id"], {"finished"}, 120)

    plain, asked = run({"speculation": "off"}), run({"speculation": "on"})
    answer = asked["extraction"]["answers"]["copy"]["text"]
    assert answer == plain["extraction"]["answers"]["copy"]["text"]
    assert plain["speculation"] is None
    assert asked["speculation"]["mode"] == "on" and asked["speculation"]["drafted"] > 0
