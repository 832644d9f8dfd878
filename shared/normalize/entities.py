"""What a document must never lose: numbers, dates, money, durations, phones, emails, URLs, IDs
and negation cues, found by patterns (no model), in any of the languages the cues cover.

Matches are compared in canonical form (`canonical`): the same text whatever whitespace,
zero-width characters or line-broken hyphenation surrounded it.
"""

from __future__ import annotations

import re
import unicodedata

from shared.normalize.sentences import sentences

_INVISIBLE = re.compile("[\u00ad\u200b\u200c\u200d\u2060\ufeff]")
_SPACE = re.compile(r"\s+")
# A word broken across lines: "docu-\nment" is "document". Only letters on both sides, so
# IDs, ranges and URLs ("AB-12", "9-18", "…/very-") are never joined.
_BROKEN_WORD = re.compile(r"(?<![\w./@:-])([^\W\d_]+)-\s*\n\s*(?=[^\W\d_A-Z])")

_NUMBER = r"\d+(?:[.,'\u2019]\d+)*"
_MONTHS = (
    "jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|jun(?:e)?|jul(?:y)?|aug(?:ust)?|"
    "sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?|"
    "gennaio|febbraio|marzo|aprile|maggio|giugno|luglio|agosto|settembre|ottobre|novembre|"
    "dicembre|januar|februar|märz|mai|juni|juli|oktober|dezember|janvier|février|mars|avril|"
    "juin|juillet|août|septembre|octobre|décembre|enero|febrero|abril|mayo|junio|julio|"
    "agosto|septiembre|octubre|noviembre|diciembre"
)
_CURRENCY = r"[€$£¥₹]|\b(?:EUR|USD|GBP|CHF|JPY|CAD|AUD|euros?|dollars?)\b"
_UNITS = (
    r"years?|months?|weeks?|days?|hours?|hrs?|minutes?|mins?|seconds?|"
    r"anni|anno|mesi|mese|settimane|settimana|giorni|giorno|ore|ora|minuti|"
    r"jahre|jahren|monate|monaten|wochen|tage|tagen|stunden|ans?|mois|semaines?|jours?|heures?|"
    r"años|año|meses|semanas|días|día|horas?"
)

# Alternatives in order of precedence: a longer, more specific match consumes its span first.
_PATTERNS: list[tuple[str, str]] = [
    ("url", r"\b(?:https?://|www\.)[^\s<>\"'()\[\]]+[^\s<>\"'()\[\].,;:!?]"),
    ("email", r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b"),
    ("time", r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[-\u2013]\s?\d{1,2}:\d{2})?\b"),
    ("date", r"\b\d{1,4}[./-]\d{1,2}[./-]\d{1,4}\b"),
    ("date", rf"\b\d{{1,2}}\.?\s+(?:{_MONTHS})\.?(?:\s+\d{{4}})?\b"),
    ("date", rf"\b(?:{_MONTHS})\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?(?:\s+\d{{4}})?\b"),
    ("phone", r"(?<![\w+])\+?\(?\d{1,4}\)?(?:[ .\-/]?\(?\d{2,4}\)?){2,5}(?![\w])"),
    ("money", rf"(?:{_CURRENCY})\s?{_NUMBER}(?:[.,]-)?"),
    ("money", rf"{_NUMBER}(?:[.,]-)?\s?(?:{_CURRENCY})"),
    ("duration", rf"\b{_NUMBER}\s?(?:{_UNITS})\b"),
    ("id", r"\b(?=[\w/-]*\d)(?=[\w/-]*[^\W\d_])[\w][\w/-]*[\w]\b"),
    ("number", rf"{_NUMBER}%?"),
]
_ENTITY = re.compile(
    "|".join(f"(?P<{kind}{i}>{pattern})" for i, (kind, pattern) in enumerate(_PATTERNS)),
    re.IGNORECASE,
)

NEGATION_CUES = (
    # en
    "not|no|never|none|nor|neither|without|cannot|can't|won't|don't|doesn't|isn't|aren't|"
    "wasn't|weren't|didn't|hasn't|haven't|shouldn't|mustn't|excluded|"
    # it
    "non|mai|nessun|nessuno|nessuna|senza|né|niente|nulla|escluso|esclusa|esclusi|escluse|"
    # de
    "nein|nicht|kein|keine|keinen|keinem|keiner|nie|niemals|ohne|ausgeschlossen|ausgenommen|"
    # fr
    "ne|n'|pas|jamais|aucun|aucune|sans|ni|exclu|exclue|exclus|exclues|"
    # es
    "nunca|ningún|ninguno|ninguna|sin|jamás|excluido|excluida|excluidos|excluidas"
)
_NEGATION = re.compile(rf"(?<![\w'])(?:{NEGATION_CUES})(?![\w'])", re.IGNORECASE)
_CONDITION = re.compile(
    # Conditions, and obligations ("shall", "must"): what changes or binds an answer.
    r"(?<!\w)(?<!\bas )(?:if|unless|only|except|provided|when|until|subject to|must|shall|required|"
    r"se|solo|soltanto|salvo|tranne|purché|entro|qualora|deve|devono|"
    r"wenn|falls|nur|außer|bis|muss|müssen|"
    r"seulement|sauf|avant|doit|doivent|"
    r"sólo|excepto|siempre que|hasta|debe|deben)(?!\w)",
    re.IGNORECASE,
)

# A sentence that opens by answering yes or no ("Ja, alle Filialen nehmen Paketware zurück.")
# is the answer to a question, whatever else it holds.
_YES_NO = re.compile(
    r"^\W*(?:yes|no|ja|nein|doch|sì|si|oui|non|sí)\s*[,.!;:\u2013\u2014]", re.IGNORECASE
)


def canonical(text: str) -> str:
    """One form for comparing text: NFC, no invisible characters, hyphenation repaired,
    whitespace runs as one space."""
    text = _INVISIBLE.sub("", unicodedata.normalize("NFC", text))
    text = _BROKEN_WORD.sub(r"\1", text)
    return _SPACE.sub(" ", text).strip()


def entities(text: str) -> list[str]:
    """The protected values in `text`, canonical, in order of appearance."""
    return [m.group(0) for m in _ENTITY.finditer(canonical(text))]


def contact_values(text: str) -> list[str]:
    """The phones and emails in `text`, canonical: what a boilerplate block (a consent banner,
    a newsletter box) may hold that the rest of a page does not say. A phone here is dialled
    as one: it starts with "+", "0" or "(", or is grouped by two separators or more
    ("800 555 0100"); "2016/679", a regulation's number, is not."""
    values = []
    for m in _ENTITY.finditer(canonical(text)):
        kind, value = m.lastgroup or "", m.group(0)
        if kind.startswith("email") or (kind.startswith("phone") and _dialled(value)):
            values.append(value)
    return values


def _dialled(phone: str) -> bool:
    return phone.startswith(("+", "0", "(")) or len(re.findall(r"[ .\-/]", phone)) >= 2


def has_negation(text: str) -> bool:
    return _NEGATION.search(text) is not None


# A negation is kept with the words around it: enough to keep what it negates attached.
_BEFORE, _AFTER = 2, 3


def negation_windows(text: str) -> list[str]:
    """Each negation cue in `text` with up to 2 words before and 3 after, within its sentence
    and line (after hyphenation repair), canonical: what the output must contain."""
    if not has_negation(text):
        return []
    windows = []
    for line in _BROKEN_WORD.sub(r"\1", text).split("\n"):
        for sentence in sentences(line):
            words = canonical(sentence).split(" ")
            for i, word in enumerate(words):
                if _NEGATION.search(word):
                    windows.append(" ".join(words[max(0, i - _BEFORE) : i + _AFTER + 1]))
    return windows


def has_condition(text: str) -> bool:
    return _CONDITION.search(text) is not None


def carries_fact(text: str) -> bool:
    """A sentence worth keeping: an entity, a negation, a condition or a yes/no answer."""
    return (
        bool(entities(text))
        or has_negation(text)
        or has_condition(text)
        or _YES_NO.match(text) is not None
    )


def contains(haystack: str, needle: str) -> bool:
    """`needle` appears in canonical `haystack` as a whole value: "12" is not found in "2012"
    or "12.50"."""
    pattern = rf"(?<![\w])(?<!\d[.,]){re.escape(needle)}(?![\w])(?![.,]\d)"
    return re.search(pattern, haystack) is not None


_WORD = re.compile(r"\w")
_DECIMAL_BEFORE = re.compile(r"\d[.,]")
_DECIMAL_AFTER = re.compile(r"[.,]\d")


class Values:
    """A canonical text indexed by the values it holds: `contains` for each of a document's
    values reads the text once, not once per value (a 1.5 MB page has ~20,000 values; one
    regex search each took minutes in the API's request path)."""

    def __init__(self, text: str) -> None:
        self.text = canonical(text)
        self._starts: dict[str, list[int]] = {}
        for m in _ENTITY.finditer(self.text):
            self._starts.setdefault(m.group(0), []).append(m.start())

    def contains(self, value: str) -> bool:
        """`contains(self.text, value)`, answered from the index where it can be."""
        if any(self._whole(at, at + len(value)) for at in self._starts.get(value, ())):
            return True
        return value in self.text and contains(self.text, value)

    def _whole(self, start: int, end: int) -> bool:
        """`contains`' lookarounds, tested at one place."""
        text = self.text
        return (
            (start == 0 or not _WORD.match(text, start - 1))
            and (start < 2 or not _DECIMAL_BEFORE.match(text, start - 2))
            and not _WORD.match(text, end)
            and not _DECIMAL_AFTER.match(text, end)
        )
