"""Deterministic document normalisation: fewer tokens to prefill, no fact lost.

`normalize(text, format, input_type)` reads plain text, HTML, Markdown, CSV or TSV (detected,
or as declared) into blocks, renders them as `text` (clean plain lines) or `facts` (one
"label: value" fact per line), puts back any dropped line that held a fact (`guard`), and
checks the result (`check`): every number, date, amount, duration, phone, email, URL, ID and
negated sentence the input holds is in the output. A result that fails the check falls back to
`text`, then to the document as sent, and says so; `facts` longer than `text` is sent as
`text` too. No model, no randomness, no clock: the same input and format give the same bytes,
so cached and warmed prefixes keep matching.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

from shared.errors import InvalidRequest
from shared.normalize.blocks import Block
from shared.normalize.boilerplate import boilerplate_paragraphs, is_copyright
from shared.normalize.check import count_facts, missing_facts, missing_subjects
from shared.normalize.cleanup import inline
from shared.normalize.delimited import delimited_blocks
from shared.normalize.detect import (
    INPUT_TYPES,
    check_declared,
    check_textual,
    delimiter,
    detect,
)
from shared.normalize.entities import contact_values
from shared.normalize.facts import facts_lines
from shared.normalize.guard import guard
from shared.normalize.html import html_blocks
from shared.normalize.markdown import markdown_blocks
from shared.normalize.plain import plain_blocks, without_page_numbers
from shared.normalize.render import Line, text_lines
from shared.normalize.structure import structured
from shared.schemas import DocumentFormat
from shared.schemas import DocumentType as InputType

FORMATS: tuple[DocumentFormat, ...] = get_args(DocumentFormat)
# Normalising runs in the API's request path: larger documents are refused, not parsed.
MAX_CHARS = 5_000_000

__all__ = [
    "FORMATS",
    "INPUT_TYPES",
    "MAX_CHARS",
    "DocumentFormat",
    "InputType",
    "Normalized",
    "normalize",
    "read_blocks",
]


@dataclass(frozen=True, slots=True)
class Normalized:
    text: str
    # What was asked for, and what the text is: they differ when the asked format failed the
    # self-check (`missing` then lists what it would have lost), or `facts` came out longer
    # than `text`.
    format: DocumentFormat
    used: DocumentFormat
    input_type: InputType
    # Lines output; lines dropped per reason; lines a rule dropped but the guard kept for a
    # fact; distinct values checked.
    kept: dict[str, int] = field(default_factory=dict)
    missing: tuple[str, ...] = ()


Renderer = Callable[[list[Block]], list[Line]]
RENDERERS: dict[DocumentFormat, Renderer] = {"text": text_lines, "facts": facts_lines}


def normalize(
    text: str,
    format: DocumentFormat,
    input_type: InputType | None = None,
    *,
    renderers: dict[DocumentFormat, Renderer] | None = None,
) -> Normalized:
    """`text` in `format`. `renderers` replaces the rendering rules (tests break one on purpose
    to see the self-check catch it)."""
    kind = input_type or detect(text)
    if format == "raw":
        return Normalized(text, "raw", "raw", kind)
    if len(text) > MAX_CHARS:
        raise InvalidRequest(
            f"document is {len(text)} characters; document_format {format!r} reads at most "
            f"{MAX_CHARS} (send it as 'raw' or split it)",
            field="document",
        )
    check_textual(text)
    if input_type is not None:
        check_declared(text, input_type)
    blocks = read_blocks(text, kind)
    units = _units(text, kind, blocks)
    rules = {**RENDERERS, **(renderers or {})}
    missing: tuple[str, ...] = ()
    passed: list[Normalized] = []
    for used in _fallbacks(format):
        lines = rules[used](blocks)
        kept = guard(lines)
        output = "\n".join(line.text for line in kept)
        lost = missing_facts(units, output) + missing_subjects(kept)
        if lost:
            missing = missing or tuple(lost)
        elif output.strip():  # (facts of a page of filler is empty: text it is, then)
            passed.append(Normalized(output, format, used, kind, _report(lines, units), missing))
    if passed:
        # `facts` is for reading fewer tokens: when its labels cost more than the filler it
        # drops saves (a page of wide tables), `text` is sent; on a tie the labels are free.
        return min(passed, key=lambda result: _size(result.text))
    if not missing:
        raise InvalidRequest(
            f"document has no text left as document_format {format!r} (read as {kind})",
            field="document",
        )
    return Normalized(text, format, "raw", kind, {"facts_checked": count_facts(units)}, missing)


def _fallbacks(format: DocumentFormat) -> list[DocumentFormat]:
    return ["facts", "text"] if format == "facts" else ["text"]


_TOKENISH = re.compile(r"\w+|[^\w\s]")


def _size(text: str) -> int:
    """Words and punctuation marks: no tokenizer here (normalising is model-free), and closer
    to a tokenizer's count than characters are (labels are short words and colons)."""
    return len(_TOKENISH.findall(text))


def read_blocks(text: str, kind: InputType) -> list[Block]:
    if kind == "html":
        return structured(html_blocks(text))
    if kind == "markdown":
        return structured(markdown_blocks(text))
    if kind in ("csv", "tsv"):
        return delimited_blocks(text, delimiter(text, kind))
    return structured(plain_blocks(text))


def _units(text: str, kind: InputType, blocks: list[Block]) -> list[str]:
    """What the self-check protects: plain text's own paragraphs (so clean-up is checked
    too) but its page numbers and copyright lines, and of its boilerplate only phones and
    emails; else the texts the parser read."""
    if kind != "text":
        return [unit for block in blocks for unit in block.units()]
    paragraphs = re.split(r"\n\s*\n|\f", without_page_numbers(text))
    template = boilerplate_paragraphs([inline(paragraph) for paragraph in paragraphs])
    units: list[str] = []
    for paragraph, is_template in zip(paragraphs, template, strict=True):
        if is_template:
            units += contact_values(paragraph)
        else:
            lines = paragraph.split("\n")
            units.append("\n".join("" if is_copyright(inline(line)) else line for line in lines))
    return units


def _report(lines: list[Line], units: list[str]) -> dict[str, int]:
    dropped = Counter(line.drop for line in lines if line.drop is not None)
    return {
        "lines": sum(1 for line in lines if line.drop is None),
        **{f"dropped_{reason}": count for reason, count in sorted(dropped.items())},
        "restored": sum(1 for line in lines if line.restored),
        "facts_checked": count_facts(units),
    }
