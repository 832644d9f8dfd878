"""Which input type a document is, whether a declared type fits it, and whether it is text at
all. Bad input is an `InvalidRequest` naming the field to fix.
"""

from __future__ import annotations

import csv
import re
from typing import get_args

from shared.errors import InvalidRequest
from shared.normalize.delimited import delimited_rows
from shared.schemas import DocumentType as InputType

INPUT_TYPES: tuple[InputType, ...] = get_args(InputType)

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f]")
_HTML_START = re.compile(r"\s*(?:<!doctype\s+html|<html|<\?xml)", re.IGNORECASE)
_HTML_TAG = re.compile(
    r"</?(?:html|head|body|div|p|span|a|table|tr|td|th|ul|ol|li|h[1-6]|br|section|article|nav|"
    r"footer|header|main|meta|script|style|dl|dt|dd|strong|em|b|i)\b[^>]*>",
    re.IGNORECASE,
)
_ANY_TAG = re.compile(r"<[A-Za-z!?/][^>]*>")
_MARKDOWN = (
    re.compile(r"^#{1,6}\s+\S", re.MULTILINE),
    re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(?:\|\s*:?-{3,}:?\s*)+\|?\s*$", re.MULTILINE),
    re.compile(r"\[[^\]\n]+\]\([^)\s]+\)"),
    re.compile(r"^```", re.MULTILINE),
    re.compile(r"\*\*[^*\n]+\*\*|__[^_\n]+__"),
    re.compile(r"^\s*[-*+]\s+\S", re.MULTILINE),
)
# More control characters than this share of the text: a binary file sent as text.
_MAX_CONTROL_SHARE = 0.01
_MAX_REPLACEMENT_SHARE = 0.05


def check_textual(text: str) -> None:
    controls = len(_CONTROL.findall(text))
    if "\x00" in text or controls > _MAX_CONTROL_SHARE * len(text):
        raise InvalidRequest(
            "document looks binary (NUL or control characters): send text, HTML, Markdown, "
            "CSV or TSV",
            field="document",
        )
    if text.count("\ufffd") > _MAX_REPLACEMENT_SHARE * len(text):
        raise InvalidRequest(
            "document is mostly U+FFFD: binary data or a wrong encoding decoded as text",
            field="document",
        )


def detect(text: str) -> InputType:
    """The input type, from the text alone; plain text when nothing else fits."""
    if _HTML_START.match(text):
        return "html"
    if sum(1 for pattern in _MARKDOWN if pattern.search(text)) >= 2:
        return "markdown"
    tables: tuple[InputType, ...] = ("tsv", "csv")
    for kind in tables:
        if _table_problem(text, kind) is None:
            return kind
    if len(_HTML_TAG.findall(text)) >= 2:
        return "html"
    return "text"


def delimiter(text: str, kind: str) -> str:
    """TSV: tab; CSV: comma, or semicolon when that is what splits the header."""
    if kind == "tsv":
        return "\t"
    first = text.lstrip("\ufeff").split("\n", 1)[0]
    return ";" if first.count(";") > first.count(",") else ","


def check_declared(text: str, declared: InputType) -> None:
    """A stated type the document cannot be read as is refused, naming `document_type`."""
    problem: str | None = None
    if declared == "html" and not _ANY_TAG.search(text):
        problem = "the document has no HTML tags"
    elif declared in ("csv", "tsv"):
        problem = _table_problem(text, declared)
    if problem is not None:
        raise InvalidRequest(f"document_type is {declared!r} but {problem}", field="document_type")


def _table_problem(text: str, kind: str) -> str | None:
    """Why `text` is not a table of `kind` (None: it is one)."""
    sep = delimiter(text, kind)
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2 or sep not in lines[0]:
        return f"it is not a table: no {'tab' if sep == chr(9) else repr(sep)}-separated header row"
    try:
        rows = delimited_rows(text, sep)
    except csv.Error as exc:
        return f"it is not valid {kind.upper()}: {exc}"
    if len(rows) < 2:  # rows of empty cells are left out (",\r,": two lines, no row)
        return "it is not a table: fewer than two rows hold a value"
    width = len(rows[0])
    for n, row in enumerate(rows[1:], start=2):
        if len(row) != width:
            return f"row {n} has {len(row)} fields where the header has {width}"
    prose = sum(1 for row in rows for cell in row if ". " in cell)
    if prose * 2 > width * len(rows):
        return "its cells are sentences, not values"
    return None
