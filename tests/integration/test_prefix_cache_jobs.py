"""The prefix cache through the whole job path: separate worker processes sharing one directory."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.llm import load_llama, render_prompt, tokenize
from shared.prefix_cache import common_prefix_len
from shared.schemas import JobRequest
from tests.harness import HTTP, Stack
from tests.integration.test_job_path import events, submit

DOC = " ".join(f"Invoice {i}: {i * 3 % 17} boxes of tea shipped to Lyon." for i in range(20))
PROMPT = {"prompt": DOC + "\nTotal boxes:", "max_tokens": 16, "temperature": 0}
CACHE = {"block_tokens": 64, "min_tokens": 16}


def run(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    final = events(stack, submit(stack, body)["id"])[-1][2]
    assert final["status"] == "finished", final
    return final


def cache_report(stack: Stack) -> dict[str, Any]:
    report: dict[str, Any] = HTTP.get(f"{stack.url}/v1/cache").json()
    return report


def blobs(stack: Stack) -> list[Path]:
    return sorted(stack.settings.cache_dir.glob("*/blobs/*"))


def test_restarted_worker_restores_from_disk(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(cache=CACHE)
    cold = run(stack, PROMPT)
    assert cold["usage"]["cached_tokens"] == 0
    # A fresh process: nothing in memory, only the shared directory. A stopping worker
    # writes its pending snapshots. (Elsewhere `forget` stands in for a restart.)
    stack.stop_process("worker-1")
    stack.start_worker("worker-2")
    assert blobs(stack)
    warm = run(stack, PROMPT)
    assert warm["usage"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1
    assert warm["result"]["text"] == cold["result"]["text"]
    assert warm["timings"]["restore_ms"] is not None
    assert warm["timings"]["ttft_ms"] < cold["timings"]["ttft_ms"]
    report = cache_report(stack)
    assert report["entries"] >= 1 and report["bytes"] > 0
    assert report["hits"] >= 1 and report["hit_tokens"] >= warm["usage"]["cached_tokens"]
    assert report["bytes_written"] > 0 and report["bytes_read"] > 0


def test_damaged_blobs_fall_back_to_prefill(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(cache=CACHE)
    cold = run(stack, PROMPT)
    for damage in (_flip_a_byte, _truncate):
        stack.forget()
        found = blobs(stack)
        assert len(found) == 1, found
        damage(found[0])
        job = run(stack, PROMPT)
        assert job["usage"]["cached_tokens"] == 0, damage.__name__
        assert job["result"]["text"] == cold["result"]["text"], damage.__name__


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def test_two_workers_racing_on_one_prefix_leave_one_good_blob(
    stack_factory: Callable[..., Stack],
) -> None:
    # One thread each: two llama.cpp workers spinning on the same two cores crawl.
    stack = stack_factory(workers=2, cache=CACHE, n_threads=1)
    results: list[dict[str, Any]] = []
    threads = [
        threading.Thread(target=lambda: results.append(run(stack, PROMPT))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0]["result"]["text"] == results[1]["result"]["text"]
    stack.forget()
    assert len(blobs(stack)) == 1
    warm = run(stack, PROMPT)
    assert warm["usage"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1
    assert warm["result"]["text"] == results[0]["result"]["text"]


def test_budget_evicts_and_holds(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(cache=CACHE)
    run(stack, PROMPT)
    stack.stop_process("worker-1")  # a stopping worker writes pending snapshots
    one_blob = blobs(stack)[0].stat().st_size
    budget = int(one_blob * 2.5)
    stack.settings = stack.settings.model_copy(
        update={"cache": stack.settings.cache.model_copy(update={"max_bytes": budget})}
    )
    stack.start_worker("worker-2")
    for i in range(4):
        run(stack, {**PROMPT, "prompt": f"Copy {i}. {PROMPT['prompt']}"})
    stack.stop_process("worker-2")  # its last snapshots written, its counters published
    on_disk = sum(p.stat().st_size for p in blobs(stack))
    assert on_disk <= budget
    assert 1 <= len(blobs(stack)) <= 2
    assert cache_report(stack)["evictions"] >= 2


PAGE = "\n\n".join(
    " ".join(f"Invoice {i}: {i * 3 % 17} boxes of tea shipped to Lyon." for i in range(k, k + 9))
    for k in (0, 9, 18)
)


def _chat(stack: Stack, question: str) -> dict[str, Any]:
    body = {
        "model": "x",
        "messages": _chat_body(question),
        "max_tokens": 16,
        "temperature": 0,
    }
    response = HTTP.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _shared_tokens(stack: Stack, *questions: str) -> int:
    llama = load_llama(stack.settings, vocab_only=True)
    try:
        prompts = [
            tokenize(llama, render_prompt(llama, JobRequest(messages=_chat_body(q))))
            for q in questions
        ]
    finally:
        llama.close()
    return common_prefix_len(*prompts)


def _chat_body(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{PAGE}\n\n{question}"}]


def test_a_document_in_a_chat_message_is_restored_whole_for_the_next_question(
    stack_factory: Callable[..., Stack],
) -> None:
    """No `document` field: the message's last paragraph start is where the question parts."""
    stack = stack_factory(cache=CACHE)
    first, second = "Which invoices shipped 5 boxes?", "How many boxes did invoice 7 ship?"
    cold = _chat(stack, second)
    for blob in blobs(stack):  # the next run must not find this question's own states
        blob.unlink()
    stack.forget()
    _chat(stack, first)
    stack.forget()  # memory gone: only the disk can help
    warm = _chat(stack, second)
    shared = _shared_tokens(stack, first, second)
    assert shared % CACHE["block_tokens"] > 4  # whole blocks alone would leave more out
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert shared - 4 <= cached <= shared
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
