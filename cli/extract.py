"""`granary extract DOC …` and `granary batch ITEMS.jsonl -o RESULTS.jsonl`, with progress bars."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from cli.client import GranaryClient
from shared.errors import InvalidRequest
from shared.job_metrics import LOW_AGREEMENT
from shared.settings import Settings

POLL_S = 1.0


def extract_from_cli(args: argparse.Namespace, settings: Settings) -> int:
    client = GranaryClient.from_settings(settings, args.url)
    body: dict[str, Any] = {"document": Path(args.document).read_text(encoding="utf-8")}
    if args.fields:
        body["fields"] = orjson.loads(Path(args.fields).read_bytes())
    elif args.question:
        body["questions"] = [{"id": str(i + 1), "question": q} for i, q in enumerate(args.question)]
    else:
        raise InvalidRequest("give --question (one or more) or --fields FILE")
    names = ("instructions", "max_tokens", "temperature", "samples", "seed")
    for name in (*names, "document_format", "document_type"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    job = client.extract(body)
    total = len(body.get("questions") or body["fields"])
    final = _follow_answers(client, job["id"], total)
    extraction = final.get("extraction") or {}
    out = extraction.get("object") or {
        k: a["text"] for k, a in extraction.get("answers", {}).items()
    }
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
    _print_agreement(extraction.get("answers", {}))
    return 0 if final.get("status") == "finished" else 1


def _print_agreement(answers: dict[str, Any]) -> None:
    """Voted answers: how many samples agreed, on standard error (standard output stays the
    answers alone); those below 0.6 are the ones worth checking."""
    votes = {k: a["vote"] for k, a in answers.items() if a.get("vote")}
    for key, vote in votes.items():
        check = "  <- check" if vote["agreement"] < LOW_AGREEMENT else ""
        agreeing = round(vote["agreement"] * vote["counted"])
        sys.stderr.write(
            f"agreement {key}: {vote['agreement']:.2f} ({agreeing} of {vote['counted']}){check}\n"
        )


def _follow_answers(client: GranaryClient, job_id: str, total: int) -> dict[str, Any]:
    started, tokens = time.perf_counter(), 0
    final: dict[str, Any] = {}
    with tqdm(total=total, unit="answer", desc="extracting", file=sys.stderr) as bar:
        for event, data in client.events(job_id):
            if event == "token":
                tokens += 1
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - started):.1f}")
            elif event == "answer":
                bar.update(1)
            else:
                final = data
        bar.set_postfix(cached=final.get("usage", {}).get("cached_tokens", 0))
    return final


def batch_from_cli(args: argparse.Namespace, settings: Settings) -> int:
    client = GranaryClient.from_settings(settings, args.url)
    lines = Path(args.items).read_bytes().splitlines()
    items = [orjson.loads(line) for line in lines if line.strip()]
    if args.document_format is not None:  # a default: an item's own format wins
        items = [{"document_format": args.document_format, **item} for item in items]
    batch = client.batch({"items": items})
    batch = _follow_batch(client, batch)
    with open(args.output, "wb") as out:
        for line in client.batch_results(batch["id"]):
            out.write(line + b"\n")
    counts = batch["counts"]
    print(
        f"{args.output}: {counts['succeeded']} succeeded, {counts['failed']} failed, "
        f"{counts['cancelled']} cancelled",
        file=sys.stderr,
    )
    return 0 if counts["succeeded"] == batch["total"] else 1


def _follow_batch(client: GranaryClient, batch: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    with tqdm(total=batch["total"], unit="item", desc="batch", file=sys.stderr) as bar:
        while True:
            ended = sum(batch["counts"][s] for s in ("succeeded", "failed", "cancelled"))
            bar.update(ended - bar.n)
            usage = batch["usage"]
            rate = usage["completion_tokens"] / max(time.perf_counter() - started, 1e-9)
            bar.set_postfix(tok_s=f"{rate:.1f}", cached=usage["cached_tokens"])
            if batch["finished_at"] is not None:
                return batch
            time.sleep(POLL_S)
            batch = client.batch_status(batch["id"])
