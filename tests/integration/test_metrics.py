"""`GET /metrics` reflects jobs, tokens, timings and the prefix cache of every worker."""

from __future__ import annotations

import re
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.harness import HTTP, REPO, Stack
from tests.integration.test_job_path import events, submit, wait_status

DASHBOARD = REPO / "deploy" / "grafana-dashboard.json"
DOC = " ".join(f"Invoice {i}: {i * 3 % 17} boxes of tea shipped to Lyon." for i in range(30))


def scrape(stack: Stack) -> dict[str, float]:
    response = HTTP.get(f"{stack.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_metrics_reflect_jobs_and_a_cache_hit(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(cache={"block_tokens": 64, "min_tokens": 16})
    before = scrape(stack)
    assert before["granary_workers{}"] == 1
    assert before["granary_queue_depth{queue=interactive}"] == 0
    assert before["granary_jobs_total{status=finished}"] == 0
    body = {"prompt": DOC + "\nTotal boxes:", "max_tokens": 4, "temperature": 0}
    first = events(stack, submit(stack, body)["id"])[-1][2]
    stack.stop_process("worker-1")  # a fresh worker: the second job can only hit the disk cache
    stack.start_worker("worker-2")
    second = events(stack, submit(stack, body)["id"])[-1][2]
    after = scrape(stack)
    assert after["granary_jobs_submitted_total{}"] == 2
    assert after["granary_jobs_total{status=finished}"] == 2
    prompt = first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    assert after["granary_prompt_tokens_total{}"] == prompt
    assert after["granary_cached_tokens_total{}"] == second["usage"]["cached_tokens"] > 0
    assert after["granary_completion_tokens_total{}"] == 8
    # The model's work: every prompt token not reused, and every token written but the last
    # (a disk restore may add a row of its own before it, a prompt's last token may be read
    # as a decode row).
    assert before["granary_model_rows_total{work=prompt}"] == 0
    read = after["granary_model_rows_total{work=prompt}"]
    written = after["granary_model_rows_total{work=decode}"]
    computed = prompt - second["usage"]["cached_tokens"]
    assert computed - 2 <= read <= computed
    assert computed + 8 - 2 <= read + written <= computed + 8 - 2 + 1
    assert after["granary_model_seconds_total{work=prompt}"] > 0
    assert after["granary_model_seconds_total{work=decode}"] > 0
    assert after["granary_time_to_first_token_seconds_count{}"] == 2
    assert after["granary_queue_wait_seconds_count{}"] == 2
    assert after["granary_time_to_first_token_seconds_bucket{le=+Inf}"] == 2
    assert after["granary_cache_hits_total{}"] >= 1
    assert after["granary_cache_hit_tokens_total{}"] >= second["usage"]["cached_tokens"]
    assert after["granary_cache_bytes_written_total{}"] > 0
    assert after["granary_cache_entries{}"] >= 1
    # What the workers counted: two prompts, the second restored from disk, with the prefill
    # time it saved at the rate the first worker measured and kept for the next one.
    assert after["granary_cache_prompts_total{}"] == 2
    assert after["granary_cache_memory_hits_total{}"] == 0
    assert after["granary_cache_restores_skipped_total{}"] == 0
    assert after["granary_cache_prefill_saved_seconds_total{}"] > 0
    assert second["timings"]["restore_choice"] == "restore"
    assert second["timings"]["recompute_estimate_ms"] > 0
    # The Grafana dashboard charts only what is exported.
    charted = set(re.findall(r"granary_\w+", DASHBOARD.read_text()))
    assert charted and charted <= {name.split("{")[0] for name in after}


def test_cancelled_queued_job_is_counted(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(workers=0)
    job = submit(stack, {"prompt": "Hello", "max_tokens": 2})
    assert scrape(stack)["granary_queue_depth{queue=interactive}"] == 1
    HTTP.delete(f"{stack.url}/v1/jobs/{job['id']}")
    after = scrape(stack)
    assert after["granary_jobs_total{status=cancelled}"] == 1


def test_metrics_reflect_a_warm_run(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(cache={"block_tokens": 64, "min_tokens": 16})
    assert scrape(stack)["granary_warm_runs_total{trigger=manual}"] == 0
    run = HTTP.post(f"{stack.url}/v1/warm", json={"document": DOC}).json()
    job = wait_status(stack, run["jobs"][0]["id"], {"finished"})
    after = scrape(stack)
    assert after["granary_warm_runs_total{trigger=manual}"] == 1
    assert after["granary_warm_runs_total{trigger=schedule}"] == 0
    assert after["granary_warm_tokens_total{}"] == job["warm"]["warmed_tokens"] > 0
    assert after["granary_cache_bytes_written_total{}"] > 0
