"""Text clean-up: Unicode whitespace, invisible characters, words broken across lines, lines
a PDF-to-text tool broke mid-sentence, and page headers and footers repeated on every page.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from itertools import pairwise

from shared.normalize.blocks import DropReason

_INVISIBLE = re.compile("[\u00ad\u200b\u200c\u200d\u2060\ufeff]")
_SPACES = re.compile(r"[^\S\n]+")
_BROKEN_WORD = re.compile(r"(?<![\w./@:-])([^\W\d_]+)-$")
_DIGITS = re.compile(r"\d+")
_BULLET = re.compile(r"^[-*•·‣▪◦]\s+")
# "3. Contacts", "2) Pay": numbered lines stand alone but keep their number (it may be cited).
_NUMBERED = re.compile(r"^\d{1,3}[.)]\s+")
# A page header or footer repeats at least this often (without page breaks to go by), no
# closer than this many lines (a short page).
REPEATS = 3
PAGE_LINES = 20
# A line that only numbers its page: "Page 2 of 9", "Seite 2 von 9", "p. 2", "2/9", "- 2 -".
_PAGE_NUMBER = re.compile(
    r"(?:(?:page|p\.|pag\.|pagina|seite|s\.|página|pág\.)\s*)?\d{1,4}"
    r"(?:\s*(?:of|di|von|de|sur|/)\s*\d{1,4})?|[-\u2013\u2014]\s*\d{1,4}\s*[-\u2013\u2014]",
    re.IGNORECASE,
)


def inline(text: str) -> str:
    """One line of text: NFC, no invisible characters, whitespace runs as one space."""
    text = _INVISIBLE.sub("", unicodedata.normalize("NFC", text))
    return re.sub(r"\s+", " ", text).strip()


def pages(text: str) -> list[list[str]]:
    """Pages (split at form feeds) of lines, each cleaned; blank lines kept as ""."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _INVISIBLE.sub("", unicodedata.normalize("NFC", text))
    return [
        [_SPACES.sub(" ", line).strip() for line in page.split("\n")] for page in text.split("\f")
    ]


def _mask(line: str) -> str:
    return _DIGITS.sub("#", line)


# A page reference inside a line: "Page 3", "S. 3", "3 of 9", "3/9".
_PAGE_REFERENCE = re.compile(
    r"(?:\b(?:page|p\.|pag\.|pagina|seite|s\.|página|pág\.)\s*\d)|\d\s*(?:of|di|von|de|sur|/)\s*\d",
    re.IGNORECASE,
)


def _running(line: str) -> str:
    """What a running header or footer repeats on a document without page breaks: the line
    with its digits masked when it refers to its page ("Page 3 of 9"), else the line as it
    is. (Masked everywhere, a price list's "Price: £ 45 per m²" and "Price: £ 52 per m²" were
    one line repeated, and all but the first were moved away from their products.)"""
    return _mask(line) if _PAGE_REFERENCE.search(line) else line


def is_page_number(line: str) -> bool:
    return _PAGE_NUMBER.fullmatch(line) is not None


def repeated_furniture(page_lines: list[list[str]]) -> dict[tuple[int, int], DropReason]:
    """(page, line) positions of running headers and footers, all but their first occurrence,
    each with why: "header_footer", or "page_number" for a line that only numbers its page,
    whose first occurrence goes too (it holds no fact of the document, only of its layout).

    With page breaks: a line (digits masked, so "Page 2 of 9" matches "Page 3 of 9") that is
    the first or last of at least two pages. Without: `_running_lines`.
    """
    found: dict[tuple[int, int], DropReason] = {}
    if len(page_lines) > 1:
        edges = [(p, i) for p, lines in enumerate(page_lines) for i in _edge_lines(lines)]
        counts = Counter(_mask(page_lines[p][i]) for p, i in edges)
        repeated = [(p, i) for p, i in edges if counts[_mask(page_lines[p][i])] > 1]
    else:
        repeated = [(0, i) for i in _running_lines(page_lines[0])]
    seen: set[str] = set()
    for p, i in repeated:
        mask = _running(page_lines[p][i]) if len(page_lines) == 1 else _mask(page_lines[p][i])
        if is_page_number(page_lines[p][i]):
            found[(p, i)] = "page_number"
        elif mask in seen:
            found[(p, i)] = "header_footer"
        seen.add(mask)
    return found


def _running_lines(lines: list[str]) -> list[int]:
    """Without page breaks: lines with letters seen `REPEATS` times, each at least a page's
    `PAGE_LINES` from the one before (a price list's "Price: £ 45 per m²" under three
    products a few lines apart is the list's, not a page's header)."""
    at: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        if line and re.search(r"[^\W\d_]", line):
            at.setdefault(_running(line), []).append(i)
    running = [
        places
        for places in at.values()
        if len(places) >= REPEATS and all(b - a >= PAGE_LINES for a, b in pairwise(places))
    ]
    return sorted(i for places in running for i in places)


def _edge_lines(lines: list[str]) -> list[int]:
    filled = [i for i, line in enumerate(lines) if line]
    return sorted({filled[0], filled[-1]}) if filled else []


def is_bullet(line: str) -> bool:
    return _BULLET.match(line) is not None


def is_numbered(line: str) -> bool:
    return _NUMBERED.match(line) is not None


def strip_bullet(line: str) -> str:
    return _BULLET.sub("", line, count=1)


def join_broken(lines: list[str], standalone: Callable[[str], bool]) -> list[str]:
    """Lines of one paragraph, with a line continued on the next joined back into one.

    A line continues on the next when neither is a standalone line (`standalone(line)`: a
    list item, a "label: value" line) and the next starts in lower case, or the line is as
    long as wrapped lines are and does not end a sentence. A word split by a hyphen before a
    lower-case continuation is joined without it.
    """
    out: list[str] = []
    for line in lines:
        if out and _continues(out[-1], line) and not standalone(line) and not standalone(out[-1]):
            prev = out[-1]
            broken = _BROKEN_WORD.search(prev) if line[0].islower() else None
            out[-1] = (
                prev[: broken.start()] + broken.group(1) + line if broken else f"{prev} {line}"
            )
        else:
            out.append(line)
    return out


# Shorter lines are addresses, titles, short statements: lines of their own.
WRAPPED_CHARS = 50


def _continues(prev: str, line: str) -> bool:
    # A line opening with a symbol ("© 2026 …") starts something of its own; a line in
    # capitals is a title, continued only in capitals.
    if not line or prev.endswith((".", "!", "?", ":")) or unicodedata.category(line[0]) == "So":
        return False
    if prev.isupper() and not line.isupper():
        return False
    return line[0].islower() or len(prev) >= WRAPPED_CHARS
