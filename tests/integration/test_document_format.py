"""document_format through the real API, workers, warmer CLI and SmolLM2."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from shared import keys
from shared.normalize import normalize
from shared.settings import Settings
from tests.harness import HTTP, Stack, settings_env
from tests.integration.test_bad_input import assert_error
from tests.integration.test_job_path import wait_status

FIXTURES = Path(__file__).parent.parent / "fixtures" / "normalize"
HOTEL = (FIXTURES / "hotel.html").read_text(encoding="utf-8")
INSTRUCTIONS = "Answer from the page only, in a few words."
CACHE = {"block_tokens": 64, "min_tokens": 16}


@pytest.fixture(scope="module")
def api(module_stack_factory: Callable[..., Stack]) -> Stack:
    # No worker: bad input must be refused by the API itself.
    return module_stack_factory(workers=0)


def extraction(document: str, **extra: Any) -> dict[str, Any]:
    return {
        "document": document,
        "instructions": INSTRUCTIONS,
        "questions": [{"id": "suite", "question": "How much is the Suite in high season?"}],
        "max_tokens": 8,
        **extra,
    }


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/extractions", extraction("\x00\x01PK binary", document_format="facts"), "document"),
        ("/v1/extractions", extraction("x" * 40 + "\x02\x03", document_format="text"), "document"),
        (
            "/v1/extractions",
            extraction("<div><script>var a = 1;</script></div>", document_format="facts"),
            "document",
        ),
        (
            "/v1/extractions",
            extraction("Plain words. More words.", document_format="facts", document_type="csv"),
            "document_type",
        ),
        ("/v1/jobs", {"document": "Totals: 12", "prompt": "?", "document_type": "pdf"}, None),
        ("/v1/jobs", {"prompt": "hi", "document_format": "facts"}, None),
        ("/v1/jobs", {"document": HOTEL, "prompt": "?", "document_format": "html"}, None),
        (
            "/v1/warm",
            {"document": "no tags here", "document_format": "text", "document_type": "html"},
            "document_type",
        ),
    ],
)
def test_bad_documents_are_refused_naming_the_field(
    api: Stack, path: str, body: dict[str, Any], field: str | None
) -> None:
    response = HTTP.post(f"{api.url}{path}", json=body)
    if field is None:  # a schema error: pydantic names the field in its location
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["field"] in ("document_type", "document_format", None), error
        assert "document_" in error["message"], error
    else:
        assert_error(response, 400, field)


def test_a_facts_document_is_warmed_then_restored_whole_by_an_extraction(
    stack_factory: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = stack_factory(cache=CACHE)
    page = tmp_path / "hotel.html"
    page.write_text(HOTEL, encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "cli.main",
        "warm",
        str(page),
        "--instructions",
        INSTRUCTIONS,
        "--document-format",
        "facts",
    ]
    env = settings_env(stack.settings)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    prefix = int(done.stdout.split(": ", 1)[1].split(" tokens")[0])
    assert f"{prefix} tokens, {prefix} computed" in done.stdout

    stack.stop_process("worker-1")  # only the disk holds the warmed prefix now
    stack.start_worker("worker-2")
    body = extraction(HOTEL, document_format="facts")
    job = HTTP.post(f"{stack.url}/v1/extractions", json=body).json()
    final = wait_status(stack, job["id"], {"finished", "failed"}, 180)
    assert final["status"] == "finished", final
    assert final["usage"]["cached_tokens"] == prefix  # the API normalised to the same bytes
    report = final["document"]
    assert (report["format"], report["used"], report["type"]) == ("facts", "facts", "html")
    assert report["tokens_after"] * 2 < report["tokens_before"], report
    assert report["missing"] == [] and report["kept"]["facts_checked"] > 0

    # The order a worker read holds the normalised text and the format used.
    order = stack_order(stack, job["id"])
    assert order["document"]["document"] == normalize(HOTEL, "facts").text
    assert order["document"]["document_format"] == "facts"


def stack_order(stack: Stack, job_id: str) -> dict[str, Any]:
    client = redis.Redis.from_url(stack.settings.redis_url)
    raw = client.hget(keys.job(job_id), "order")
    assert raw is not None
    order: dict[str, Any] = orjson.loads(raw)
    return order


def test_facts_is_the_default_and_raw_is_sent_as_is(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(workers=0)
    body = {"document": HOTEL, "prompt": "Price?", "max_tokens": 2}
    job = HTTP.post(f"{stack.url}/v1/jobs", json=body).json()
    assert (job["document"]["format"], job["document"]["used"]) == ("facts", "facts")
    assert stack_order(stack, job["id"])["document"]["document"] != HOTEL
    raw = HTTP.post(f"{stack.url}/v1/jobs", json={**body, "document_format": "raw"}).json()
    assert raw["document"] is None
    assert stack_order(stack, raw["id"])["document"]["document"] == HOTEL


def test_granary_normalize_prints_the_text_and_token_counts(
    settings_factory: Callable[..., Settings],
) -> None:
    command = [sys.executable, "-m", "cli.main", "normalize", str(FIXTURES / "guide.md")]
    env = settings_env(settings_factory())
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (FIXTURES / "guide.md.facts.txt").read_text(encoding="utf-8")
    assert "markdown as facts:" in done.stderr and "x fewer" in done.stderr
    bad = subprocess.run(
        [*command[:-1], str(FIXTURES / "guide.md"), "--type", "csv"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "document_type is 'csv'" in bad.stderr


def test_a_bad_batch_item_fails_alone(api: Stack) -> None:
    good = {"custom_id": "good", **extraction(HOTEL, document_format="facts")}
    bad = {"custom_id": "bad", **extraction("\x00binary", document_format="facts")}
    response = HTTP.post(f"{api.url}/v1/batches", json={"items": [good, bad]})
    assert response.status_code == 202, response.text
    lines = HTTP.get(f"{api.url}/v1/batches/{response.json()['id']}/results").text.splitlines()
    results = {r["custom_id"]: r for r in map(orjson.loads, lines)}
    assert results["good"]["status"] == "queued"
    assert results["bad"]["status"] == "failed" and "binary" in results["bad"]["error"]
    order = stack_order(api, results["good"]["job_id"])
    assert order["document"]["document"] == normalize(HOTEL, "facts").text
