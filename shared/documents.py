"""A request's document normalised (`document_format`) before it is rendered, in one place for
jobs, extractions, batch items, warm requests and declared warm specs.

The normalised text replaces the document in the request, so everything after this (rendering,
token counts, the order a worker reads, the prefix cache, learned prefixes the warmer re-warms)
sees only it; the format stays in the fields, so the record shows what was used. Normalising is
deterministic, so the same document and format always give the same prefix.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, TypeVar

from shared.normalize import Normalized, normalize
from shared.schemas import DocumentFields, DocumentFormat, DocumentReport, DocumentType

if TYPE_CHECKING:  # the warmer normalises spec documents and loads no llama library
    from llama_cpp import Llama

Fields = TypeVar("Fields", bound=DocumentFields)


def normalized(fields: Fields) -> tuple[Fields, Normalized | None]:
    """`fields` with its document normalised (unchanged for `raw` or no document)."""
    if fields.document is None or fields.document_format == "raw":
        return fields, None
    result = _normalize(fields.document, fields.document_format, fields.document_type)
    update = {"document": result.text, "document_type": result.input_type}
    return fields.model_copy(update=update), result


# Many requests ask about the same document: normalising a page takes tens of milliseconds,
# which a request whose prefix is restored from the cache would otherwise spend on every call.
# Bounded in entries and in the size of a document worth keeping.
_MEMO_MAX_CHARS = 500_000
_memo = lru_cache(maxsize=32)(normalize)


def _normalize(text: str, format: DocumentFormat, input_type: DocumentType | None) -> Normalized:
    if len(text) > _MEMO_MAX_CHARS:
        return normalize(text, format, input_type)
    return _memo(text, format, input_type)


def report(tokenizer: Llama, before: str, result: Normalized) -> DocumentReport:
    """What normalising did, with the document's tokens before and after (two tokenizer
    passes over text the API holds anyway; no model weights)."""
    return DocumentReport(
        format=result.format,
        used=result.used,
        type=result.input_type,
        chars_before=len(before),
        chars_after=len(result.text),
        tokens_before=_count(tokenizer, before),
        tokens_after=_count(tokenizer, result.text),
        kept=result.kept,
        missing=list(result.missing),
    )


def _count(tokenizer: Llama, text: str) -> int:
    return len(tokenizer.tokenize(text.encode("utf-8"), add_bos=False, special=False))
