"""`granary warm FILE…`: warm documents now, with a progress bar, and report what each cost."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cli.client import GranaryClient
from shared.settings import Settings

POLL_S = 0.5


def warm_from_cli(args: argparse.Namespace, settings: Settings) -> int:
    client = GranaryClient.from_settings(settings, args.url)
    paths = [Path(p) for p in args.files]
    body: dict[str, Any] = {"documents": [p.read_text(encoding="utf-8") for p in paths]}
    for name in ("instructions", "template", "document_format", "document_type"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    run = client.warm(body)
    if args.no_wait:
        print(run["id"])
        return 0
    run = _follow(client, run)
    return _report(run, paths)


def _follow(client: GranaryClient, run: dict[str, Any]) -> dict[str, Any]:
    total = len(run["jobs"])
    with tqdm(total=total, unit="doc", desc="warming", file=sys.stderr) as bar:
        while True:
            ended = sum(run["counts"][s] for s in ("finished", "failed", "cancelled"))
            bar.update(ended - bar.n)
            bar.set_postfix(tokens=run["warmed_tokens"], cached=run["already_cached"])
            if run["finished_at"] is not None:
                return run
            time.sleep(POLL_S)
            run = client.warm_run(run["id"])


def _report(run: dict[str, Any], paths: list[Path]) -> int:
    failed = 0
    for path, job in zip(paths, run["jobs"], strict=False):
        warm = job.get("warm")
        if job["status"] != "finished" or warm is None:
            failed += 1
            print(f"{path}: {job['status']} {job.get('error') or ''}".rstrip())
        elif warm["already_cached"]:
            print(f"{path}: {warm['prefix_tokens']} tokens, already cached")
        else:
            print(
                f"{path}: {warm['prefix_tokens']} tokens, {warm['warmed_tokens']} computed "
                f"({warm['cached_tokens']} were cached)"
            )
    return 1 if failed else 0
