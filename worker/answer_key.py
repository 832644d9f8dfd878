"""What two sampled answers must share to count as one vote: their text with case, spacing,
number and date spellings made canonical.

Samples of one question often say the same thing differently: "€ 1,200.00" and "€1200",
"5 March 2024" and "2024-03-05", "After 24 hours." and "after 24 hours". A vote that told them
apart would split a majority into minorities. Only spellings are unified; words stay words.
"""

from __future__ import annotations

import datetime
import re
import unicodedata
from decimal import Decimal

_MONTHS = {
    name: number
    for number, names in enumerate(
        (
            "january jan januar janvier gennaio enero",
            "february feb februar février febbraio febrero",
            "march mar märz mars marzo",
            "april apr avril aprile abril",
            "may mai maggio mayo",
            "june jun juni juin giugno junio",
            "july jul juli juillet luglio julio",
            "august aug août agosto",
            "september sep sept septembre settembre septiembre",
            "october oct oktober octobre ottobre octubre",
            "november nov novembre noviembre",
            "december dec dezember décembre dicembre diciembre",
        ),
        start=1,
    )
    for name in names.split()
}
_MONTH = "(" + "|".join(sorted(map(re.escape, _MONTHS), key=len, reverse=True)) + r")\.?"
_DAY = r"(\d{1,2})(?:st|nd|rd|th|\.)?"
_YEAR = r"(\d{4})"
# (pattern, the order its groups give year, month, day in)
_DATES: tuple[tuple[re.Pattern[str], tuple[int, int, int]], ...] = (
    (re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b"), (1, 2, 3)),
    (re.compile(r"\b(\d{1,2})\.(\d{1,2})\.(\d{4})\b"), (3, 2, 1)),
    (re.compile(rf"\b{_DAY}\s+(?:of\s+|de\s+)?{_MONTH}\s+(?:de\s+)?{_YEAR}\b"), (3, 2, 1)),
    (re.compile(rf"\b{_MONTH}\s+{_DAY},?\s+{_YEAR}\b"), (3, 1, 2)),
)
_SLASHED = re.compile(r"\b(\d{1,2})/(\d{1,2})/(\d{4})\b")
# Digits grouped in thousands ("1,200", "1.200.000", "12 500", "1.200,50"), or plain ("1,5").
# An ISO date (what `_dates` wrote) is matched first, to be kept whole.
_NUMBER = re.compile(
    r"(?P<date>\b\d{4}-\d{2}-\d{2}\b)"
    r"|(?<![\d.,])(?:(?P<whole>\d{1,3}(?P<sep>[,.' \u202f])\d{3}(?:(?P=sep)\d{3})*)"
    r"|(?P<plain>\d+))(?:[.,](?P<fraction>\d+))?(?!\d)"
)
_CURRENCIES = "".join(chr(c) for c in range(0x20, 0x2100) if unicodedata.category(chr(c)) == "Sc")
# "€ 52", "€52", "52 €" and "52€" are one spelling: the amount, then its symbol.
_CURRENCY_FIRST = re.compile(rf"([{_CURRENCIES}])\s*(\d[\d.]*)")
_AROUND_CURRENCY = re.compile(rf"\s*([{_CURRENCIES}])\s*")
_EDGES = " \t\n\"'`*_.,;:!?()[]{}«»\u201c\u201d\u201e\u2018\u2019"


def answer_key(text: str) -> str:
    """The canonical form two answers share when they say the same thing."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = _dates(text)
    text = _NUMBER.sub(_number, text)
    text = _CURRENCY_FIRST.sub(r"\2\1", text)
    text = _AROUND_CURRENCY.sub(r"\1", text)
    return " ".join(text.split()).strip(_EDGES)


def _dates(text: str) -> str:
    for pattern, order in _DATES:
        text = pattern.sub(lambda m, o=order: _iso(m, o) or m.group(0), text)  # type: ignore[misc]
    return _SLASHED.sub(_slashed, text)


def _iso(match: re.Match[str], order: tuple[int, int, int]) -> str | None:
    year, month, day = (match.group(i) for i in order)
    number = int(month) if month.isdigit() else _MONTHS[month.rstrip(".")]
    try:
        return datetime.date(int(year), number, int(day)).isoformat()
    except ValueError:
        return None


def _slashed(match: re.Match[str]) -> str:
    """Day and month are told apart only when one of them cannot be a month."""
    first, second, year = (int(g) for g in match.groups())
    day, month = (first, second) if first > 12 else (second, first) if second > 12 else (0, 0)
    try:
        return datetime.date(year, month, day).isoformat()
    except ValueError:
        return match.group(0)


def _number(match: re.Match[str]) -> str:
    if match.group("date"):
        return match.group("date")
    whole = match.group("plain") or re.sub(r"\D", "", match.group("whole"))
    fraction = match.group("fraction")
    value = Decimal(f"{whole}.{fraction}" if fraction else whole)
    return format(value.normalize(), "f")
