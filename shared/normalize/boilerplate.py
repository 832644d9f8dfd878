"""What a site's template says on every page, recognised by its words (plain text has no
markup to say so, and an HTML banner's class may be "bx-overlay"): consent banners, newsletter
prompts, copyright lines, and menus or breadcrumbs written as a line of text.

A consent banner names trackers, a regulation and cookie lifetimes: none of it is a fact of
the page, so it goes as "boilerplate" (only a phone or an email in it is kept, if said nowhere
else; `Block.units`). A menu line names pages: "navigation", like a `<nav>`'s links.
"""

from __future__ import annotations

import re

from shared.normalize.entities import entities

# A block longer than this is content that mentions cookies (a privacy policy), not a banner.
MAX_BANNER_WORDS = 120
# Boilerplate by words is dropped only while it is a small part of the page: a document that
# is mostly about cookies or newsletters is about them.
MAX_SHARE = 1 / 2

_COOKIES = re.compile(r"\bcookies?\b", re.IGNORECASE)
_CONSENT = re.compile(
    r"\b(?:consent|consenso|einwilligung|zustimmung|consentement|consentimiento|gdpr|dsgvo|"
    r"rgpd)\b",
    re.IGNORECASE,
)
# What a banner asks of its reader, or what it says it loads.
_BANNER = re.compile(
    r"\b(?:accept|agree|reject|decline|settings|preferences|manage|accetta|accetto|rifiuta|"
    r"impostazioni|preferenze|gestisci|akzeptieren|zustimmen|ablehnen|einstellungen|"
    r"accepter|refuser|paramètres|aceptar|rechazar|configuración|analytics|tracking|pixel|"
    r"ga4|profilazione|tracciamento|statistik|marketing)\b",
    re.IGNORECASE,
)
_NEWSLETTER = re.compile(
    r"\b(?:newsletter|subscribe|iscriviti|abonnieren|abonnez|suscríbete|suscribirse)\b",
    re.IGNORECASE,
)
_COPYRIGHT = re.compile(
    r"©|\(c\)\s*\d{4}|all rights reserved|tutti i diritti riservati|alle rechte vorbehalten|"
    r"tous droits réservés|todos los derechos reservados",
    re.IGNORECASE,
)
_YEARS = re.compile(r"(?:19|20)\d{2}(?:\s*[-\u2013]\s*(?:19|20)\d{2})?")
# A menu or a breadcrumb as text: short names of pages between separators.
# ("/" and "·" also separate a list of the document's own things: "Oak / Walnut / Ash".)
_MENU_SEPARATOR = re.compile(r"\s+[|>»]\s+")
_BREADCRUMB_SEPARATOR = re.compile(r"\s+[>»]\s+")
_HOME = re.compile(r"^(?:home|homepage|start|startseite|inicio|accueil)$", re.IGNORECASE)
_MAX_PAGE_NAME_WORDS = 3
_MENU_PIECES = 4


def is_boilerplate(text: str) -> bool:
    """`text` (a paragraph, a small HTML container's text) is a consent banner, a newsletter
    prompt or a copyright notice."""
    if len(text.split()) > MAX_BANNER_WORDS:
        return False
    if _COOKIES.search(text) and (_BANNER.search(text) or _CONSENT.search(text)):
        return True
    if (_CONSENT.search(text) and _BANNER.search(text)) or _NEWSLETTER.search(text):
        return True
    return is_copyright(text)


def is_copyright(text: str) -> bool:
    """A copyright notice: "© 2026 Oakline Ltd. All rights reserved." A year is the notice's;
    a VAT number beside it is a fact, and keeps the line."""
    return bool(_COPYRIGHT.search(text)) and all(_YEARS.fullmatch(v) for v in entities(text))


def is_menu(text: str) -> bool:
    """A line of page names between separators: a menu, or a breadcrumb."""
    pieces = _MENU_SEPARATOR.split(text.strip())
    if len(pieces) < 3 or any(not _page_name(piece) for piece in pieces):
        return False
    return (
        _HOME.match(pieces[0]) is not None
        or _BREADCRUMB_SEPARATOR.search(text) is not None
        or len(pieces) >= _MENU_PIECES
    )


def _page_name(piece: str) -> bool:
    return 0 < len(piece.split()) <= _MAX_PAGE_NAME_WORDS and not any(c.isdigit() for c in piece)


def boilerplate_paragraphs(paragraphs: list[str]) -> list[bool]:
    """Which paragraphs of a page are boilerplate, unless together they would be more than
    `MAX_SHARE` of its words: then the document is about what they name."""
    found = [is_boilerplate(paragraph) for paragraph in paragraphs]
    dropped = [p for p, flag in zip(paragraphs, found, strict=True) if flag]
    return found if within_share(dropped, paragraphs) else [False] * len(paragraphs)


def within_share(dropped: list[str], texts: list[str]) -> bool:
    """Whether the `dropped` texts are at most `MAX_SHARE` of the words of all `texts`."""
    return sum(len(t.split()) for t in dropped) <= MAX_SHARE * sum(len(t.split()) for t in texts)
