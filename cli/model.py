"""`granary model trim MODEL`: write a copy of a model whose vocabulary keeps fewer tokens.

The summary goes to standard error and the trimmed file's path is the last line on standard
output, as `granary prepare` prints a model's: `GRANARY_MODEL=$(granary model trim …)` serves it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from shared.errors import InvalidRequest
from shared.settings import Settings

# On Qwen (BENCHMARKS, "A trimmed vocabulary"): 64k decodes ~1.2x the full vocabulary and adds
# ~3% tokens to the exam's Italian, German and English documents; 32k decodes ~1.3x but adds
# ~10%, which prefill (the larger cost of a document) pays back and more.
DEFAULT_KEEP = 64_000


def add_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = sub.add_parser("model", help="derive model files")
    actions = model.add_subparsers(dest="action", required=True)
    trim = actions.add_parser("trim", help="write a copy with a smaller vocabulary")
    trim.add_argument("model", help="a named model or a GGUF path")
    trim.add_argument(
        "--keep", type=int, default=DEFAULT_KEEP, help=f"tokens to keep (default {DEFAULT_KEEP})"
    )
    trim.add_argument(
        "--corpus",
        action="append",
        default=[],
        help="a UTF-8 text file whose tokens are kept first (repeatable); also checked",
    )
    trim.add_argument(
        "--warm-specs",
        action="store_true",
        help="count the documents and instructions of the configured warm specs as corpus too",
    )
    trim.add_argument("-o", "--output", type=Path, help="where to write it (default: beside)")


def trim_from_cli(args: argparse.Namespace, settings: Settings) -> int:
    # Imported here: `granary` loads llama.cpp only for the commands that need it.
    from shared.models import is_named_model, resolve_model
    from shared.vocab_trim import trim_model, trimmed_path

    logging.getLogger("gguf").setLevel(logging.WARNING)  # it logs every file it writes
    if args.keep < 1:
        raise InvalidRequest("--keep must be a positive number of tokens")
    source = resolve_model(args.model, settings.data_dir)
    # A named model may live inside an installed package: its trim goes with the assembled ones.
    directory = settings.data_dir / "models" if is_named_model(args.model) else None
    target: Path = args.output or trimmed_path(source, args.keep, directory)
    corpus = [_read(Path(name)) for name in args.corpus]
    if args.warm_specs:
        corpus += _warm_spec_texts(settings)
    report = trim_model(source, target, args.keep, corpus)
    print(
        f"{source.name}: kept {report.tokens_kept:,} of {report.tokens_before:,} tokens and "
        f"{report.merges_kept:,} of {report.merges_before:,} merges; held-out text "
        f"{report.heldout_tokens_full:,} -> {report.heldout_tokens_trimmed:,} tokens "
        f"({report.overhead:+.1%}), written back byte for byte; {report.seconds:.1f} s",
        file=sys.stderr,
    )
    print(report.target)
    return 0


def _warm_spec_texts(settings: Settings) -> list[str]:
    """What the warm specs' requests send: their documents (in their format) and instructions."""
    from warmer.specs import declared_items

    declared = declared_items(settings.warmer, Path.cwd())
    texts = [t for item in declared.items for t in (item.document, item.instructions) if t]
    if not texts:
        problems = "; ".join(declared.errors) or "none is configured"
        raise InvalidRequest(f"--warm-specs: no warm spec names a document ({problems})")
    return texts


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"{path} is not UTF-8 text") from None
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror}") from None
