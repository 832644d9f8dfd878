"""The `granary` command: one entry point for every process and the client commands."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import get_args

import httpx
from pydantic import ValidationError

from cli.model import add_model_parser
from shared.errors import GranaryError
from shared.schemas import DocumentFormat, DocumentType
from shared.settings import Settings, load_settings

FORMATS = get_args(DocumentFormat)
TYPES = get_args(DocumentType)


def _document_options(parser: argparse.ArgumentParser, *, with_type: bool = True) -> None:
    parser.add_argument(
        "--document-format",
        choices=FORMATS,
        default=None,
        help="send the document as is (raw), as clean text, or as one fact per line",
    )
    if with_type:
        parser.add_argument("--document-type", choices=TYPES, default=None, help="else detected")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="granary", description=__doc__)
    parser.add_argument("--config", type=Path, help="TOML settings file (default: granary.toml)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Redis (if needed), the API, workers and the warmer")
    up.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    sub.add_parser("api", help="run the HTTP API")
    sub.add_parser("worker", help="run one worker with the model resident")
    warmer = sub.add_parser("warmer", help="run the warm-up scheduler")
    warmer.add_argument("--run-now", action="store_true", help="run once at start (no catch-up)")
    extract = sub.add_parser("extract", help="ask many questions about one document")
    extract.add_argument("document", help="the document file (UTF-8 text)")
    extract.add_argument("--question", action="append", help="a question (repeatable)")
    extract.add_argument("--fields", help='JSON file {"name": "description", ...}')
    extract.add_argument("--instructions", help="system instructions")
    extract.add_argument("--max-tokens", type=int, default=None, help="per answer")
    extract.add_argument("--temperature", type=float, default=None)
    extract.add_argument(
        "--samples",
        type=int,
        default=None,
        help="vote over N answers per question (needs a --temperature)",
    )
    extract.add_argument("--seed", type=int, default=None, help="makes a vote reproducible")
    extract.add_argument("--url", default=None, help="API base URL (default: from settings)")
    _document_options(extract)
    batch = sub.add_parser("batch", help="run a JSON Lines file of extraction requests")
    batch.add_argument("items", help='JSONL: {"custom_id", "document", "questions"|"fields"…}')
    batch.add_argument("-o", "--output", required=True, help="results, JSON Lines")
    batch.add_argument("--url", default=None, help="API base URL (default: from settings)")
    _document_options(batch, with_type=False)
    warm = sub.add_parser("warm", help="warm documents now (through the API)")
    warm.add_argument("files", nargs="+", help="document files (UTF-8 text)")
    warm.add_argument("--instructions", help="the instructions requests send with them")
    warm.add_argument("--template", help="the template requests send with them ({document})")
    warm.add_argument("--no-wait", action="store_true", help="print the run id and return")
    warm.add_argument("--url", default=None, help="API base URL (default: from settings)")
    _document_options(warm)
    normalize = sub.add_parser(
        "normalize", help="print a document as a document_format reads it, with token counts"
    )
    normalize.add_argument("file", help="the document (UTF-8), or - for standard input")
    normalize.add_argument("--format", choices=FORMATS[1:], default="facts")
    normalize.add_argument("--type", choices=TYPES, default=None, help="else detected")
    sub.add_parser("prepare", help="provision the configured model and print its path")
    add_model_parser(sub)
    cache = sub.add_parser("cache", help="inspect or manage the shared prefix cache")
    cache.add_argument("action", choices=["stats", "ls", "verify", "prune", "clear", "forget"])

    submit = sub.add_parser("submit", help="submit a prompt and stream the answer")
    submit.add_argument("prompt", help="the prompt, or @FILE to read it from a file")
    submit.add_argument("--wait", action="store_true", help="print the final job JSON instead")
    submit.add_argument("--max-tokens", type=int, default=None)
    submit.add_argument("--temperature", type=float, default=None)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--url", default=None, help="API base URL (default: from settings)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = load_settings(args.config)
    except (ValidationError, FileNotFoundError) as exc:
        print(f"granary: invalid settings: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return _run(args, settings)
    except GranaryError as exc:
        print(f"granary: {exc.message}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"granary: cannot reach the API: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace, settings: Settings) -> int:
    # Imports are per command: the API never loads worker code, the client never loads llama.
    if args.command == "up":
        from cli.up import run_stack

        return run_stack(settings, args.config, args.workers)
    if args.command == "api":
        from api.app import serve

        serve(settings)
    elif args.command == "worker":
        from worker.main import run_worker

        run_worker(settings)
    elif args.command == "warmer":
        from warmer.main import run_warmer

        run_warmer(settings, run_now=args.run_now)
    elif args.command == "prepare":
        from shared.models import resolve_model

        print(resolve_model(settings.model, settings.data_dir))
    elif args.command == "model":
        from cli.model import trim_from_cli

        return trim_from_cli(args, settings)
    elif args.command == "cache":
        from cli.cache import run_cache_command

        return run_cache_command(args.action, settings)
    elif args.command == "extract":
        from cli.extract import extract_from_cli

        return extract_from_cli(args, settings)
    elif args.command == "batch":
        from cli.extract import batch_from_cli

        return batch_from_cli(args, settings)
    elif args.command == "warm":
        from cli.warm import warm_from_cli

        return warm_from_cli(args, settings)
    elif args.command == "normalize":
        from cli.normalize import normalize_from_cli

        return normalize_from_cli(args, settings)
    elif args.command == "submit":
        from cli.client import submit_from_cli

        return submit_from_cli(args, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
