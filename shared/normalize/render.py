"""Blocks into the lines of a format: `text` (every block as a plain line) and the
bookkeeping both formats share: sections, dropped lines and why, duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.normalize.blocks import Block
from shared.normalize.cleanup import is_numbered


@dataclass(slots=True)
class Line:
    text: str
    # Lines under the same heading share a section; duplicates are judged within one.
    section: int
    # Why a rule leaves it out ("furniture", "header_footer", "page_number", "navigation",
    # "filler", "heading", "duplicate"); None: it is output. `guard` puts back any that
    # holds a fact.
    drop: str | None = None
    restored: bool = False
    # The heading line that says what this line is about (`facts`, which drops headings
    # whose lines are all filler); None where the line names it itself or has no heading.
    subject: Line | None = None


def text_lines(blocks: list[Block]) -> list[Line]:
    lines: list[Line] = []
    section = 0
    for block in blocks:
        if block.kind == "heading":
            section += 1
        lines += [Line(text, section, block.drop) for text in _plain(block) if text]
    return mark_duplicates(lines)


def _plain(block: Block) -> list[str]:
    if block.kind == "item":
        return [block.text if is_numbered(block.text) else f"- {block.text}"]
    if block.kind == "pair":
        return [block.labelled()]
    if block.kind == "table":
        return [" | ".join(_trimmed(row)) for row in (block.header, *block.rows) if any(row)]
    return [block.text]


def _trimmed(row: tuple[str, ...]) -> tuple[str, ...]:
    end = len(row)
    while end and not row[end - 1]:
        end -= 1
    return row[:end]


def mark_duplicates(lines: list[Line]) -> list[Line]:
    """A line already output in the same section is dropped as a duplicate."""
    seen: set[tuple[int, str]] = set()
    for line in lines:
        if line.drop is not None:
            continue
        key = (line.section, line.text)
        if key in seen:
            line.drop = "duplicate"
        seen.add(key)
    return lines
