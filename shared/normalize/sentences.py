"""Sentences of a paragraph, with sentencex (rule-based, deterministic, per-language
abbreviations), and the paragraph's language guessed from common words (no model).
"""

from __future__ import annotations

import re

from sentencex import segment

# The most frequent function words of each language the splitter is told about; a paragraph
# is in the language with most hits, English on a tie or none.
_COMMON = {
    "en": "the and of to is in for with are on this that you be by or not",
    "it": "il la di che è per con sono una gli del della non si le nel al",
    "de": "der die das und ist nicht mit für von zu den auf ein eine sie im",
    "fr": "le la les et est des pour une dans que du au pas sur avec vous",
    "es": "el la los las y es de que en para con una por del no se al",
}
_WORDS = {lang: frozenset(words.split()) for lang, words in _COMMON.items()}
_WORD = re.compile(r"[^\W\d_]+")


def language(text: str) -> str:
    words = [w.lower() for w in _WORD.findall(text)]
    scores = {lang: sum(w in common for w in words) for lang, common in _WORDS.items()}
    order = list(_WORDS)  # English first: it wins ties
    return max(order, key=lambda lang: (scores[lang], -order.index(lang)))


def sentences(text: str, lang: str | None = None) -> list[str]:
    """The sentences of `text`, stripped, in order; their concatenation is the text.

    A piece without a lowercase letter is not a sentence of its own but the value after an
    abbreviation the splitter took for a sentence's end ("USt-IdNr. DE 271828182",
    "Tel. 030 1234"): it stays with the sentence before it, so a label keeps its value."""
    merged: list[str] = []
    for part in (s.strip() for s in segment(lang or language(text), text)):
        if not part:
            continue
        if merged and not any(c.islower() for c in part):
            merged[-1] = f"{merged[-1]} {part}"
        else:
            merged.append(part)
    return merged
