"""`granary normalize FILE`: a document as `document_format` text or facts reads it, and what
that saves, counted with the configured model's tokenizer (vocabulary only, no weights)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.documents import normalized, report
from shared.errors import InvalidRequest
from shared.llm import load_llama
from shared.schemas import DocumentFields
from shared.settings import Settings


def normalize_from_cli(args: argparse.Namespace, settings: Settings) -> int:
    source = "standard input" if args.file == "-" else args.file
    try:
        raw = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"{source} is not UTF-8 text") from None
    fields = DocumentFields(document=raw, document_format=args.format, document_type=args.type)
    changed, result = normalized(fields)
    assert result is not None  # text and facts always normalise
    done = report(load_llama(settings, vocab_only=True), raw, result)
    sys.stdout.write((changed.document or "") + "\n")
    ratio = done.tokens_before / max(done.tokens_after, 1)
    kept = ", ".join(f"{name} {count}" for name, count in done.kept.items())
    print(
        f"{source}: {done.type} as {done.used}: {done.tokens_before} -> {done.tokens_after} "
        f"tokens ({ratio:.1f}x fewer), {done.chars_before} -> {done.chars_after} chars; {kept}",
        file=sys.stderr,
    )
    if done.missing:
        print(
            f"{source}: {done.format} would have lost {', '.join(done.missing)}; "
            f"sent as {done.used}",
            file=sys.stderr,
        )
    return 0
