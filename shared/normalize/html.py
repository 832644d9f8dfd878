"""HTML (and XML) into blocks, with selectolax's Lexbor parser: an HTML5 parser, so broken
markup reads the way a browser reads it.

Never read: scripts, styles, templates, embedded objects and the `<head>`. Read but marked as
furniture (dropped unless they hold a fact): navigation, forms, buttons, and anything whose
id, class, role or label names cookies, consent, sharing, menus, breadcrumbs, newsletters or
pop-ups. Footers are content: VAT numbers, phones and opening hours live there. A `tel:` or
`mailto:` link whose text does not show its target gets the target after it, in brackets; so
does an absolute http(s) link outside furniture (a menu's or share bar's targets would only be
put back by the guard, as facts, and bring dozens).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import unquote

from selectolax.lexbor import LexborHTMLParser, LexborNode

from shared.normalize.blocks import Block, BlockKind, DropReason
from shared.normalize.cleanup import inline

_SKIP = frozenset(
    [
        "script",
        "style",
        "noscript",
        "template",
        "svg",
        "math",
        "canvas",
        "iframe",
        "object",
        "embed",
        "head",
        "link",
        "meta",
        "input",
        "img",
        "picture",
        "video",
        "audio",
        "source",
        "track",
        "map",
        "area",
    ]
)
_INLINE = frozenset(
    [
        "a",
        "abbr",
        "b",
        "bdi",
        "bdo",
        "cite",
        "code",
        "data",
        "del",
        "dfn",
        "em",
        "font",
        "i",
        "ins",
        "kbd",
        "label",
        "mark",
        "q",
        "s",
        "samp",
        "small",
        "span",
        "strike",
        "strong",
        "sub",
        "sup",
        "time",
        "tt",
        "u",
        "var",
        "wbr",
    ]
)
_FURNITURE_TAGS = frozenset(["nav", "form", "button", "select", "dialog"])
_FURNITURE_ROLES = frozenset(["navigation", "search", "dialog", "alertdialog", "menu", "menubar"])
_FURNITURE_HINT = re.compile(
    r"cookie|consent|gdpr|share|sharing|social|breadcrumb|navbar|menu|skip|newsletter|"
    r"popup|modal|subscribe",
    re.IGNORECASE,
)
_HEADINGS = frozenset(["h1", "h2", "h3", "h4", "h5", "h6"])
_REGIONS = frozenset(["header", "footer", "aside"])


def html_blocks(text: str) -> list[Block]:
    tree = LexborHTMLParser(text)
    reader = _Reader()
    if tree.body is not None:
        reader.walk(tree.body, furniture=False, kind="paragraph")
        reader.flush("paragraph", furniture=False)
    return reader.blocks


def _is_furniture(node: LexborNode) -> bool:
    attrs = node.attributes
    if node.tag in _FURNITURE_TAGS or (attrs.get("role") or "") in _FURNITURE_ROLES:
        return True
    hints = " ".join(attrs.get(name) or "" for name in ("id", "class", "aria-label"))
    return _FURNITURE_HINT.search(hints) is not None


class _Reader:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._buffer: list[str] = []

    def flush(self, kind: BlockKind, furniture: bool) -> None:
        text = inline("".join(self._buffer))
        self._buffer.clear()
        if text:
            self.blocks.append(Block(kind, text, drop="furniture" if furniture else None))

    def walk(self, node: LexborNode, furniture: bool, kind: BlockKind) -> None:
        for child in node.iter(include_text=True):
            tag = child.tag or "-"
            if tag == "-text":
                self._buffer.append(child.text(deep=False) or "")
            elif tag.startswith("-") or tag in _SKIP:
                continue
            elif tag == "br":
                self.flush(kind, furniture)
            elif tag in _INLINE:
                self.walk(child, furniture, kind)
                self._buffer.append(_link_target(child, furniture))
            else:
                self._block(child, furniture or _is_furniture(child), kind)

    def _block(self, node: LexborNode, furniture: bool, kind: BlockKind) -> None:
        self.flush(kind, furniture)
        tag = node.tag
        if tag == "table":
            self._table(node, furniture)
        elif tag == "dl":
            self._definitions(node, furniture)
        elif tag == "pre":
            for line in (node.text(deep=True) or "").splitlines():
                self._buffer.append(line)
                self.flush("paragraph", furniture)
        else:
            if tag in _REGIONS:  # a page region's lines are not under the last heading read
                self.blocks.append(Block("heading", ""))
            inner: BlockKind = "heading" if tag in _HEADINGS else "item" if tag == "li" else kind
            self.walk(node, furniture, inner)
            self.flush(inner, furniture)

    def _table(self, table: LexborNode, furniture: bool) -> None:
        header: tuple[str, ...] = ()
        rows: list[tuple[str, ...]] = []
        for tr, in_head in _rows(table):
            cells = [c for c in tr.iter() if c.tag in ("td", "th")]
            row = tuple(_text_of(c, furniture) for c in cells)
            if not any(row):
                continue
            all_th = all(c.tag == "th" for c in cells)
            if not header and not rows and (in_head or (all_th and len(cells) > 1)):
                header = row
            else:
                rows.append(row)
        for caption in (c for c in table.iter() if c.tag == "caption"):
            self._buffer.append(_text_of(caption, furniture))
            self.flush("heading", furniture)
        if header or rows:
            drop: DropReason | None = "furniture" if furniture else None
            self.blocks.append(Block("table", header=header, rows=tuple(rows), drop=drop))

    def _definitions(self, dl: LexborNode, furniture: bool) -> None:
        label = ""
        drop: DropReason | None = "furniture" if furniture else None
        for child in _flatten_divs(dl):
            if child.tag == "dt":
                label = _text_of(child, furniture)
            elif child.tag == "dd" and (value := _text_of(child, furniture)):
                block = Block("pair", value, label=label) if label else Block("paragraph", value)
                self.blocks.append(Block(block.kind, block.text, label=block.label, drop=drop))


def _flatten_divs(dl: LexborNode) -> Iterator[LexborNode]:
    # HTML allows <div> wrappers around dt/dd groups.
    for child in dl.iter():
        if child.tag == "div":
            yield from _flatten_divs(child)
        else:
            yield child


def _rows(table: LexborNode) -> Iterator[tuple[LexborNode, bool]]:
    for child in table.iter():
        if child.tag in ("thead", "tbody", "tfoot"):
            for tr in child.iter():
                if tr.tag == "tr":
                    yield tr, child.tag == "thead"
        elif child.tag == "tr":
            yield child, False


def _text_of(node: LexborNode, furniture: bool) -> str:
    """All text under `node` on one line; block boundaries and `<br>` become spaces."""
    parts: list[str] = []
    for child in node.iter(include_text=True):
        tag = child.tag or "-"
        if tag == "-text":
            parts.append(child.text(deep=False) or "")
        elif tag.startswith("-") or tag in _SKIP:
            continue
        elif tag in _INLINE:
            parts.append(_text_of(child, furniture) + _link_target(child, furniture))
        else:
            parts.append(f" {_text_of(child, furniture)} ")
    return inline("".join(parts))


def _link_target(node: LexborNode, furniture: bool) -> str:
    """The target in brackets for a link whose text does not show it, else "": `tel:` and
    `mailto:` anywhere, absolute http(s) links outside furniture."""
    if node.tag != "a":
        return ""
    href = (node.attributes.get("href") or "").strip()
    scheme, _, target = href.partition(":")
    shown = inline(node.text(deep=True) or "")
    if scheme.lower() in ("http", "https"):
        if furniture or not target.startswith("//") or len(target) <= 2:
            return ""
        bare = _WEB_PREFIX.sub("", href).rstrip("/").lower()
        return "" if bare in shown.lower() else f" ({href})"
    if scheme.lower() not in ("tel", "mailto") or not target:
        return ""
    target = unquote(target.split("?", 1)[0]).strip()
    return "" if not target or target in shown else f" ({target})"


_WEB_PREFIX = re.compile(r"^https?://(?:www\.)?", re.IGNORECASE)
