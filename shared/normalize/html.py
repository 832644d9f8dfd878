"""HTML (and XML) into blocks, with selectolax's Lexbor parser: an HTML5 parser, so broken
markup reads the way a browser reads it.

Never read: scripts, styles, templates, embedded objects and the `<head>`. Read but marked as
furniture (dropped unless they hold a fact): navigation, forms, buttons, and anything whose
id, class, role or label names cookies, consent, sharing, menus, breadcrumbs, newsletters or
pop-ups. Footers are content: VAT numbers, phones and opening hours live there. The links of
navigation (a `<nav>` or navigation role, and a header's, footer's or aside's list of nothing
but links) name pages of the site: their text is dropped and never put back ("Warenkorb (0)"
holds a count, not a fact of the document); a `tel:` or `mailto:` link there is not one of them.
A `tel:` or `mailto:` link whose text does not show its target gets the target before its
text, which goes in brackets ("Phone: +39 045… (call us)": the label before the link labels
the value); an absolute http(s) link outside furniture gets its target after its text, in
brackets (a menu's or share bar's targets would only be put back by the guard, as facts,
and bring dozens). A `<details>` block is a
question and its answer (its `<summary>` and the rest): one label-value pair.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Literal
from urllib.parse import unquote

from selectolax.lexbor import LexborHTMLParser, LexborNode

from shared.normalize.blocks import Block, BlockKind, DropReason
from shared.normalize.boilerplate import is_boilerplate, within_share
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
_NAVIGATION_ROLES = frozenset(["navigation", "menu", "menubar"])
_FURNITURE_ROLES = frozenset(["search", "dialog", "alertdialog"]) | _NAVIGATION_ROLES
_FURNITURE_HINT = re.compile(
    r"share|sharing|social|breadcrumb|navbar|menu|skip|popup|modal", re.IGNORECASE
)
_BOILERPLATE_HINT = re.compile(r"cookie|consent|gdpr|newsletter|subscribe", re.IGNORECASE)
# Elements that hold the page's content as a whole, never a banner however short the page.
_PAGE = frozenset(["body", "main", "article"])
_HEADINGS = frozenset(["h1", "h2", "h3", "h4", "h5", "h6"])
_REGIONS = frozenset(["header", "footer", "aside"])
_LISTS = frozenset(["ul", "ol"])
# Schemes whose links carry a fact (a phone, an email), not the name of a page.
_CONTACT_SCHEMES = ("tel:", "mailto:")
# Where a node is: content; furniture (dropped unless it holds a fact); navigation, furniture
# whose page links are dropped for good; or boilerplate (`boilerplate`: a consent banner, a
# newsletter box), whose only facts are a phone or an email said nowhere else.
Region = Literal["content", "furniture", "navigation", "boilerplate"]


def html_blocks(text: str) -> list[Block]:
    """The page's blocks; read again without recognising banners by their words when those
    would be most of the page (a short cookie policy in one `<div>` is about cookies)."""
    tree = LexborHTMLParser(text)
    blocks = _read(tree, by_words=True)
    dropped = [b.text for b in blocks if b.drop == "boilerplate"]
    if within_share(dropped, [b.text for b in blocks]):
        return blocks
    return _read(tree, by_words=False)


def _read(tree: LexborHTMLParser, *, by_words: bool) -> list[Block]:
    reader = _Reader(by_words)
    if tree.body is not None:
        reader.walk(tree.body, "content", kind="paragraph")
        reader.flush("paragraph", None)
    return reader.blocks


def _region(node: LexborNode, outer: Region, by_words: bool) -> Region:
    if outer == "navigation" or _is_navigation(node):
        return "navigation"
    if outer != "content":
        return outer
    if _is_boilerplate(node, by_words):
        return "boilerplate"
    return "furniture" if _is_furniture(node) else "content"


def _drop(region: Region) -> DropReason | None:
    if region == "content":
        return None
    return "boilerplate" if region == "boilerplate" else "furniture"


def _hints(node: LexborNode) -> str:
    return " ".join(node.attributes.get(name) or "" for name in ("id", "class", "aria-label"))


def _is_furniture(node: LexborNode) -> bool:
    attrs = node.attributes
    if node.tag in _FURNITURE_TAGS or (attrs.get("role") or "") in _FURNITURE_ROLES:
        return True
    return _FURNITURE_HINT.search(_hints(node)) is not None


def _is_boilerplate(node: LexborNode, by_words: bool) -> bool:
    """A consent banner or a newsletter box: named so by its attributes, or (`by_words`) by
    its words when it is a small container (a banner's class may say nothing: "bx-overlay")."""
    if _BOILERPLATE_HINT.search(_hints(node)) is not None:
        return True
    if not by_words or node.tag in _PAGE:
        return False
    return is_boilerplate(inline(node.text(deep=True) or ""))


def _is_navigation(node: LexborNode) -> bool:
    """A menu: `<nav>`, a navigation role, or a list of page links in a page region (a footer's
    "Imprint / Terms / Privacy"). Not a class hint: a restaurant's "menu" is content."""
    if node.tag == "nav" or (node.attributes.get("role") or "") in _NAVIGATION_ROLES:
        return True
    if node.tag not in _LISTS or not _in_region(node):
        return False
    items = [child for child in node.iter() if child.tag == "li"]
    return bool(items) and all(_only_a_page_link(item) for item in items)


def _in_region(node: LexborNode) -> bool:
    parent = node.parent
    while parent is not None:
        if parent.tag in _REGIONS:
            return True
        parent = parent.parent
    return False


def _only_a_page_link(item: LexborNode) -> bool:
    links = item.css("a")
    return (
        len(links) == 1
        and _names_a_page(links[0])
        and inline(item.text(deep=True) or "") == inline(links[0].text(deep=True) or "")
    )


def _names_a_page(link: LexborNode) -> bool:
    href = (link.attributes.get("href") or "").strip().lower()
    return not href.startswith(_CONTACT_SCHEMES)


class _Reader:
    def __init__(self, by_words: bool) -> None:
        self.by_words = by_words
        self.blocks: list[Block] = []
        self._buffer: list[str] = []

    def flush(self, kind: BlockKind, drop: DropReason | None) -> None:
        text = inline("".join(self._buffer))
        self._buffer.clear()
        if text:
            self.blocks.append(Block(kind, text, drop=drop))

    def walk(self, node: LexborNode, region: Region, kind: BlockKind) -> None:
        furniture = region != "content"
        for child in node.iter(include_text=True):
            tag = child.tag or "-"
            if tag == "-text":
                self._buffer.append(child.text(deep=False) or "")
            elif tag.startswith("-") or tag in _SKIP:
                continue
            elif tag == "br":
                self.flush(kind, _drop(region))
            elif tag == "a" and region == "navigation" and _names_a_page(child):
                self.flush(kind, _drop(region))  # the menu's other text may hold a fact
                self._buffer.append(_text_of(child, furniture))
                self.flush(kind, "navigation")
            elif tag in _INLINE and (contact := _contact_target(child)):
                # The value first, the link's words after it.
                worded = bool(inline(child.text(deep=True) or ""))
                self._buffer.append(f"{contact} (" if worded else contact)
                if worded:
                    self.walk(child, region, kind)
                    self._buffer.append(")")
            elif tag in _INLINE:
                self.walk(child, region, kind)
                self._buffer.append(_link_target(child, furniture))
            else:
                # The text read so far is this node's, not the child's: it keeps this region.
                self.flush(kind, _drop(region))
                self._block(child, _region(child, region, self.by_words), kind)

    def _block(self, node: LexborNode, region: Region, kind: BlockKind) -> None:
        tag, furniture = node.tag, region != "content"
        if tag == "table":
            self._table(node, region)
        elif tag == "dl":
            self._definitions(node, region)
        elif tag == "pre":
            for line in (node.text(deep=True) or "").splitlines():
                self._buffer.append(line)
                self.flush("paragraph", _drop(region))
        elif tag == "details" and (qa := _question_and_answer(node, furniture)):
            self.blocks.append(Block("pair", qa[1], label=qa[0], drop=_drop(region)))
        else:
            if tag in _REGIONS:  # a page region's lines are not under the last heading read
                self.blocks.append(Block("heading", "", label=tag))
            inner: BlockKind = "heading" if tag in _HEADINGS else "item" if tag == "li" else kind
            self.walk(node, region, inner)
            self.flush(inner, _drop(region))

    def _table(self, table: LexborNode, region: Region) -> None:
        furniture, drop = region != "content", _drop(region)
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
            self.flush("heading", drop)
        if header or rows:
            self.blocks.append(Block("table", header=header, rows=tuple(rows), drop=drop))

    def _definitions(self, dl: LexborNode, region: Region) -> None:
        label = ""
        furniture, drop = region != "content", _drop(region)
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


def _question_and_answer(details: LexborNode, furniture: bool) -> tuple[str, str] | None:
    """A `<details>` block's summary and the rest, each on one line; None without a summary or
    an answer, or when the rest holds a table or definitions (read as they are, then)."""
    summary = next((c for c in details.iter() if c.tag == "summary"), None)
    if summary is None or details.css_first("table, dl") is not None:
        return None
    question = _text_of(summary, furniture)
    rest = (c for c in details.iter(include_text=True) if c.tag != "summary")
    answer = _joined(rest, furniture)
    return (question, answer) if question and answer else None


def _text_of(node: LexborNode, furniture: bool) -> str:
    """All text under `node` on one line; block boundaries and `<br>` become spaces."""
    return _joined(node.iter(include_text=True), furniture)


def _joined(nodes: Iterable[LexborNode], furniture: bool) -> str:
    parts: list[str] = []
    for child in nodes:
        tag = child.tag or "-"
        if tag == "-text":
            parts.append(child.text(deep=False) or "")
        elif tag.startswith("-") or tag in _SKIP:
            continue
        elif tag in _INLINE and (contact := _contact_target(child)):
            words = _text_of(child, furniture)
            parts.append(f"{contact} ({words})" if words else contact)
        elif tag in _INLINE:
            parts.append(_text_of(child, furniture) + _link_target(child, furniture))
        else:
            parts.append(f" {_text_of(child, furniture)} ")
    return inline("".join(parts))


def _contact_target(node: LexborNode) -> str:
    """A `tel:` or `mailto:` link's phone or address when its text does not show it ("Phone:
    <a href="tel:+3904…">call us</a>"), else "". It is written first, the link's words after
    it in brackets ("Phone: +3904… (call us)"): the label before the link labels the value."""
    if node.tag != "a":
        return ""
    href = (node.attributes.get("href") or "").strip()
    scheme, _, target = href.partition(":")
    if scheme.lower() not in ("tel", "mailto") or not target:
        return ""
    target = unquote(target.split("?", 1)[0]).strip()
    return "" if target in inline(node.text(deep=True) or "") else target


def _link_target(node: LexborNode, furniture: bool) -> str:
    """The target in brackets for an absolute http(s) link outside furniture whose text does
    not show it, else ""."""
    if node.tag != "a":
        return ""
    href = (node.attributes.get("href") or "").strip()
    scheme, _, target = href.partition(":")
    shown = inline(node.text(deep=True) or "")
    if scheme.lower() not in ("http", "https"):
        return ""
    if furniture or not target.startswith("//") or len(target) <= 2:
        return ""
    bare = _WEB_PREFIX.sub("", href).rstrip("/").lower()
    return "" if bare in shown.lower() else f" ({href})"


_WEB_PREFIX = re.compile(r"^https?://(?:www\.)?", re.IGNORECASE)
