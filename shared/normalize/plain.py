"""Plain text (and PDFs turned into text) into blocks: headings, "label: value" lines, list
items and paragraphs, after the clean-up in `cleanup`.
"""

from __future__ import annotations

import re
from dataclasses import replace

from shared.normalize import cleanup
from shared.normalize.blocks import Block
from shared.normalize.boilerplate import boilerplate_paragraphs

# "Label: value": a short label (no sentence in it) then a value on the same line.
_PAIR = re.compile(r"^(?P<label>[^\W\d_][^:.!?]{0,58}?)\s*:\s+(?P<value>\S.*)$")
# A price list's line: "Oak parquet ........ € 45 per m²" (dot, ellipsis or underscore leaders).
_LEADERS = re.compile(r"^(?P<label>[^\W\d_].{0,58}?)\s*(?:\.{3,}|…+|_{3,})\s*(?P<value>\S.*)$")
_MARKED_HEADING = re.compile(r"^#{1,6}\s+(?P<title>\S.*?)\s*#*$")
_MAX_LABEL_WORDS = 6
_MAX_HEADING_WORDS = 8
MAX_QUESTION_WORDS = 25
# A longer answer stays lines of its own, under its question as a heading.
MAX_ANSWER_WORDS = 80


def pair(line: str) -> tuple[str, str] | None:
    match = _PAIR.match(line) or _LEADERS.match(line)
    if match is None or len(match["label"].split()) > _MAX_LABEL_WORDS:
        return None
    return match["label"].strip(), match["value"].strip()


def _standalone(line: str) -> bool:
    return cleanup.is_bullet(line) or cleanup.is_numbered(line) or pair(line) is not None


def plain_blocks(text: str) -> list[Block]:
    pages = cleanup.pages(text)
    furniture = cleanup.repeated_furniture(pages)
    paragraphs: list[list[str]] = []
    dropped: list[Block] = []
    paragraph: list[str] = []
    for p, lines in enumerate(pages):
        for i, line in enumerate(lines):
            if (p, i) in furniture:
                dropped.append(Block("paragraph", line, drop=furniture[(p, i)]))
            elif line:
                paragraph.append(line)
            else:
                paragraphs.append(paragraph)
                paragraph = []
    paragraphs.append(paragraph)
    paragraphs = [lines for lines in paragraphs if lines]
    template = boilerplate_paragraphs([" ".join(lines) for lines in paragraphs])
    blocks = []
    for lines, is_template in zip(paragraphs, template, strict=True):
        found = line_blocks(lines)
        blocks += [replace(b, drop="boilerplate") for b in found] if is_template else found
    # Running headers and footers sit at page edges; if one is kept, it reads as a footer.
    return blocks + dropped


def without_page_numbers(text: str) -> str:
    """`text` with the lines `plain_blocks` drops as page numbers blanked, else as it is: what
    the self-check protects of plain text (a page number is layout, not a fact)."""
    furniture = cleanup.repeated_furniture(cleanup.pages(text))
    numbering = {at for at, why in furniture.items() if why == "page_number"}
    if not numbering:
        return text
    raw = text.replace("\r\n", "\n").replace("\r", "\n").split("\f")
    return "\f".join(
        "\n".join("" if (p, i) in numbering else line for i, line in enumerate(page.split("\n")))
        for p, page in enumerate(raw)
    )


def is_question(text: str) -> bool:
    """A line that asks, short enough to be an FAQ entry rather than prose."""
    return text.endswith("?") and len(text.split()) <= MAX_QUESTION_WORDS


def line_blocks(lines: list[str], *, headings: bool = True) -> list[Block]:
    """The lines of one paragraph: broken lines joined, then one block per line; a question
    with the lines answering it below is one pair ("When can I walk on it? After 24 hours.")."""
    joined = cleanup.join_broken(lines, _standalone)
    answer = joined[1:]
    if (
        answer
        and is_question(joined[0])
        and not any(is_question(line) for line in answer)
        and sum(len(line.split()) for line in answer) <= MAX_ANSWER_WORDS
    ):
        return [Block("pair", " ".join(answer), label=joined[0])]
    blocks = []
    for n, line in enumerate(joined):
        # A title heads the lines below it, or stands out alone (capitals, a closing colon).
        first = n == 0 and (len(joined) > 1 or line.isupper() or line.endswith(":"))
        blocks.append(_line_block(line, heading_allowed=headings and first))
    return blocks


def _line_block(line: str, *, heading_allowed: bool) -> Block:
    marked = _MARKED_HEADING.match(line)
    if marked is not None:  # "## Prices" in a text that is otherwise not Markdown
        return Block("heading", marked["title"])
    if cleanup.is_bullet(line):
        return Block("item", cleanup.strip_bullet(line))
    if cleanup.is_numbered(line):
        return Block("item", line)  # its number may be cited: it stays
    found = pair(line)
    if found is not None:
        return Block("pair", found[1], label=found[0])
    if heading_allowed and looks_like_heading(line):
        return Block("heading", line.rstrip(":").strip())
    return Block("paragraph", line)


def looks_like_heading(line: str) -> bool:
    """The first line of a paragraph that is a short title, not a sentence."""
    words = line.split()
    return len(words) <= _MAX_HEADING_WORDS and not line.endswith((".", ",", ";", "!", "?"))
