"""The request's `speculation` field: validated and accepted, not applied (issue 33, item 2).

No engine drafts today: a request asking for speculation is decoded plainly, so its output is
the plain one, and it reports no `speculation`.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.harness import Stack
from tests.integration.test_job_path import submit, wait_status

TEXT = (
    "The quarterly report lists 42 crates of pears shipped from Lyon to Ghent, 17 crates of "
    "apples held in Antwerp, and 9 crates of plums returned to the farm in Valence."
)
COPY = {"prompt": f"Repeat this exactly:\n{TEXT}\nRepeat:\n", "max_tokens": 24, "temperature": 0}


def _finished(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    # `cache: false`: each run decodes, none is answered from an earlier one's result.
    return wait_status(stack, submit(stack, body | {"cache": False})["id"], {"finished"}, 120)


def test_speculation_is_accepted_and_decodes_plainly(stack: Stack) -> None:
    plain = _finished(stack, COPY)
    assert plain["speculation"] is None  # `jobs.speculation`
    for mode in ("auto", "on"):
        asked = _finished(stack, COPY | {"speculation": mode})
        assert asked["result"]["text"] == plain["result"]["text"]
        assert asked["speculation"] is None
    bad = httpx.post(f"{stack.url}/v1/jobs", json=COPY | {"speculation": "always"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "speculation"


def test_a_seeded_request_asking_for_speculation_samples_as_without(stack: Stack) -> None:
    sampled = COPY | {"temperature": 0.8, "seed": 11}
    plain = _finished(stack, sampled)
    forced = _finished(stack, sampled | {"speculation": "on"})
    assert forced["result"]["text"] == plain["result"]["text"]
    assert forced["speculation"] is None


def test_an_extraction_asking_for_speculation_answers_plainly(stack: Stack) -> None:
    body = {
        "document": TEXT,
        "questions": [{"id": "copy", "question": "Repeat the document exactly."}],
        "max_tokens": 24,
        "cache": False,
    }

    def run(extra: dict[str, str]) -> dict[str, Any]:
        job = httpx.post(f"{stack.url}/v1/extractions", json=body | extra).json()
        return wait_status(stack, job["id"], {"finished"}, 120)

    plain, asked = run({"speculation": "off"}), run({"speculation": "auto"})
    answer = asked["extraction"]["answers"]["copy"]["text"]
    assert answer == plain["extraction"]["answers"]["copy"]["text"]
    assert asked["speculation"] is None
