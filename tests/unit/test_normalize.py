"""Document normalisation: golden outputs, the fact-preservation self-check, bad input."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.errors import InvalidRequest
from shared.normalize import FORMATS, normalize, read_blocks
from shared.normalize.blocks import Block
from shared.normalize.check import missing_facts
from shared.normalize.detect import detect
from shared.normalize.facts import facts_lines
from shared.normalize.render import Line, text_lines

FIXTURES = Path(__file__).parent.parent / "fixtures" / "normalize"
INPUTS = {
    "hotel.html": "html",
    "contract.txt": "text",
    "guide.md": "markdown",
    "prices.csv": "csv",
    "stock.tsv": "tsv",
    # Web pages of the shapes `facts` once failed on: values under product names, FAQs whose
    # answers say nothing alone, consent banners, menus as text, dense footers.
    "services.txt": "text",
    "services.html": "html",
}


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


# Tables only: each cell's column header makes `facts` longer than `text`, which is sent.
TEXT_IS_SHORTER = {"prices.csv", "stock.tsv"}


@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("fmt", ["text", "facts"])
def test_golden_output(name: str, fmt: str) -> None:
    # The golden files were reviewed by hand; a change to them is a change of behaviour.
    result = normalize(read(name), fmt)  # type: ignore[arg-type]
    assert result.text + "\n" == read(f"{name}.{fmt}.txt")
    used = "text" if name in TEXT_IS_SHORTER else fmt
    assert (result.used, result.missing, result.input_type) == (used, (), INPUTS[name])


@pytest.mark.parametrize("name", INPUTS)
def test_raw_is_the_document_as_sent(name: str) -> None:
    assert normalize(read(name), "raw").text == read(name)


@pytest.mark.parametrize("name", INPUTS)
def test_types_are_detected_and_can_be_declared(name: str) -> None:
    text = read(name)
    assert detect(text) == INPUTS[name]
    declared = normalize(text, "facts", INPUTS[name])  # type: ignore[arg-type]
    assert declared.text == normalize(text, "facts").text


def test_facts_are_shorter_and_keep_labels_negations_and_footer() -> None:
    raw = read("hotel.html")
    facts = normalize(raw, "facts").text
    text = normalize(raw, "text").text
    # (The 3x token target is for real pages, measured by the bench; this one is small.)
    assert len(facts) * 2 < len(raw) and len(text) * 1.5 < len(raw)
    assert "Room: Double; Low season: € 120; High season: € 150" in facts
    assert "Pets are not allowed in the rooms." in facts
    assert "VAT IT02345678901" in facts and "+390511234567" in facts
    for furniture in ("cookies", "Accept all", "Share on Facebook", "dataLayer", "Home"):
        assert furniture not in facts and furniture not in text


def _without_last_column(blocks: list[Block]) -> list[Line]:
    """A deliberately broken rule: table rows lose their last cell."""
    cut = [
        Block("table", header=b.header[:-1], rows=tuple(r[:-1] for r in b.rows))
        if b.kind == "table"
        else b
        for b in blocks
    ]
    return facts_lines(cut)


def test_self_check_catches_a_broken_rule_and_falls_back() -> None:
    result = normalize(read("hotel.html"), "facts", renderers={"facts": _without_last_column})
    assert result.used == "text"
    assert result.text == normalize(read("hotel.html"), "text").text
    assert set(result.missing) == {"€ 110", "€ 150", "€ 260"}


def test_self_check_falls_back_to_the_document_when_text_breaks_too() -> None:
    def no_digits(blocks: list[Block]) -> list[Line]:
        return [Line(line.text.replace("9", ""), line.section) for line in text_lines(blocks)]

    csv = read("prices.csv")
    result = normalize(csv, "facts", renderers={"facts": no_digits, "text": no_digits})
    assert (result.used, result.text) == ("raw", csv)
    assert "9.90 EUR" in result.missing


def test_check_names_a_lost_negation() -> None:
    units = ["Breakfast is not included in the Double room."]
    assert missing_facts(units, "Breakfast is included in the Double room.") == [
        "Breakfast is not included in the"
    ]
    assert missing_facts(units, units[0]) == []


def test_guard_keeps_furniture_that_holds_a_fact() -> None:
    html = (
        "<h1>Shop</h1><p>Prices include VAT.</p>"
        '<div class="social-links">Follow us! Company no. 0998877 · Call 800 555 0100</div>'
        '<div class="cookie-bar">We use cookies.</div>'
    )
    result = normalize(html, "text")
    assert "Company no. 0998877" in result.text and "cookies" not in result.text
    assert result.kept["restored"] == 1 and result.kept["dropped_boilerplate"] == 1


def test_repeated_page_headers_and_broken_words_are_repaired() -> None:
    text = normalize(read("contract.txt"), "text").text
    assert text.count("NORDWIND LOGISTICS - SERVICE AGREEMENT") == 1
    assert "goods of the Customer from its warehouse" in text
    # A running header stays once; page numbers number the layout and all go.
    assert "Page 1 of 2" not in text and "Page 2 of 2" not in text


def test_page_numbers_go_even_when_their_numbers_are_nowhere_else() -> None:
    # 7 and 9 appear only in "Page 7 of 9"-style lines: no fact of the document, so the guard
    # does not put them back and the self-check does not ask for them.
    pages = [
        f"ACME TERMS\n\nSection {name}: delivery within 30 days.\n\nSeite {n} von 9"
        for n, name in ((7, "A"), (8, "B"), (9, "C"))
    ]
    for fmt in ("text", "facts"):
        result = normalize("\f".join(pages), fmt)  # type: ignore[arg-type]
        assert (result.used, result.missing) == (fmt, ())
        assert "Seite" not in result.text and result.kept["dropped_page_number"] == 3
    assert normalize("\f".join(pages), "text").text.count("ACME TERMS") == 1
    # Without running headers (one page) a lone page number is a line like any other.
    assert "Seite 7 von 9" in normalize(pages[0], "text").text


def test_links_keep_a_target_their_text_does_not_show() -> None:
    html = (
        '<nav><a href="https://shop.example/home">Home</a></nav>'
        '<p>Read the <a href="https://shop.example/terms-2025">terms</a> or '
        '<a href="https://www.shop.example/">shop.example</a>, '
        '<a href="/local">a relative link</a>.</p>'
        '<div class="share"><a href="https://social.example/share?u=1">Share</a></div>'
        '<footer><a href="https://social.example/acme">Follow us</a></footer>'
    )
    for fmt in ("text", "facts"):
        result = normalize(html, fmt)  # type: ignore[arg-type]
        assert "terms (https://shop.example/terms-2025)" in result.text
        assert "Follow us (https://social.example/acme)" in result.text
        # Shown already, relative, or in furniture (a menu, a share bar): no target added.
        assert "shop.example (" not in result.text and "/local" not in result.text
        assert "shop.example/home" not in result.text and "share?u=1" not in result.text


def test_a_heading_is_a_line_once_and_labels_only_what_it_tells_apart() -> None:
    html = (
        "<h2>Double room</h2><p>Price: 120 EUR</p><dl><dt>Size</dt><dd>20 m2</dd></dl>"
        "<p>The room faces the sea. It has 2 beds.</p><h2>Single room</h2><p>Price: 85 EUR</p>"
    )
    assert normalize(html, "facts").text.split("\n") == [
        # Sentences and labels of this section alone ("Size") need the heading: once, above.
        "Double room",
        # "Price" is under both headings: there the heading tells the values apart.
        "Double room > Price: 120 EUR",
        "Size: 20 m2",
        "It has 2 beds.",
        # Every line of this section names it already.
        "Single room > Price: 85 EUR",
    ]


def test_facts_longer_than_text_is_sent_as_text() -> None:
    # Wide tables: a column header before every cell costs more than nothing dropped saves.
    html = "<table><tr><th>Room type</th><th>Low season price</th></tr>" + "".join(
        f"<tr><td>Room {n}</td><td>{n}0 EUR</td></tr>" for n in range(1, 6)
    )
    result = normalize(html + "</table>", "facts")
    assert (result.format, result.used, result.missing) == ("facts", "text", ())
    assert result.text == normalize(html, "text").text


def test_a_question_and_its_answer_are_one_line() -> None:
    html = (
        "<h2>FAQ</h2><details><summary>Kann ich im Geschäft zurückgeben?</summary>"
        "<p>Ja, Paketware nehmen alle Filialen zurück.</p><p>Gern beraten wir Sie.</p></details>"
        "<dl><dt>Do you ship abroad?</dt><dd>Yes, to the EU.</dd></dl>"
        "<h3>Muss ich die Verpackung aufheben?</h3><p>Eine sichere Verpackung genügt.</p>"
    )
    qa = "Kann ich im Geschäft zurückgeben? Ja, Paketware nehmen alle Filialen zurück. Gern"
    for fmt in ("text", "facts"):
        text = normalize(html, fmt).text  # type: ignore[arg-type]
        # The answer, filler or not, stays with its question.
        assert qa in text and "Do you ship abroad? Yes, to the EU." in text
        # A heading that asks, with its section's paragraphs: one line too.
        assert "Muss ich die Verpackung aufheben? Eine sichere Verpackung genügt." in text


def test_a_yes_or_no_answer_is_a_fact() -> None:
    html = "<p>Nein, eine sichere Verpackung genügt. Wir freuen uns. Yes, we do.</p>"
    assert normalize(html, "facts").text == "Nein, eine sichere Verpackung genügt.\nYes, we do."


def test_navigation_links_go_but_facts_in_the_header_stay() -> None:
    html = (
        '<header><a href="/" class="brand">Lindenhof</a>'
        '<nav class="navbar"><a href="/sale">Sale</a> <a href="/cart">Warenkorb (0)</a> '
        'Hotline <a href="tel:+49301234567">030 1234567</a></nav>'
        "<p>Service: 030 7654321</p></header>"
        "<main><h1>Returns</h1><p>Returns are free within 30 days.</p></main>"
        '<footer><ul class="footer-links"><li><a href="/agb">AGB</a></li>'
        '<li><a href="/impressum">Impressum</a></li></ul>'
        "<ul><li>Mo-Fr 8-18 Uhr</li><li><a href='/filialen'>12 Filialen</a> in Berlin</li></ul>"
        "<p>USt-IdNr. DE 271828182</p></footer>"
    )
    for fmt in ("text", "facts"):
        result = normalize(html, fmt)  # type: ignore[arg-type]
        assert (result.used, result.missing) == (fmt, ())
        # A menu link names a page: its text goes, a count in it too ("(0)" is no fact).
        for link in ("Sale", "Warenkorb", "AGB", "Impressum"):
            assert link not in result.text
        # A phone in the menu or the header, the footer's facts and a list that is not only
        # links stay; the text before the menu is the header's, not the menu's.
        for kept in ("030 1234567", "Service: 030 7654321", "DE 271828182", "12 Filialen in"):
            assert kept in result.text
    assert "Lindenhof" in normalize(html, "text").text
    assert normalize(html, "text").kept["dropped_navigation"] == 4


def test_exclusion_words_are_negations() -> None:
    # German "ausgeschlossen" (excluded) negates as "nicht" does: the sentence is a fact.
    html = (
        "<h2>Rückgabe</h2><p>Wir beraten Sie gern. Maßanfertigungen sind von der Rückgabe "
        "ausgeschlossen.</p>"
    )
    assert "Maßanfertigungen sind von der Rückgabe ausgeschlossen." in normalize(html, "facts").text


@pytest.mark.parametrize(
    ("text", "declared", "field"),
    [
        ("PK\x03\x04\x00\x00binary zip", None, "document"),
        ("x" * 50 + "\x01\x02\x03", None, "document"),
        ("Just a sentence about 12 apples.", "html", "document_type"),
        ("One sentence. Another one.\nA third line here.", "csv", "document_type"),
        ("a,b,c\n1,2\n", "csv", "document_type"),
        ('a,"b\n1,2,3\n', "csv", "document_type"),
        (",\r,", "csv", "document_type"),  # two lines, each only empty cells
        ("<script>var x = 1;</script><style>p {}</style>", None, "document"),
    ],
)
def test_bad_input_names_the_field(text: str, declared: str | None, field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        normalize(text, "facts", declared)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_broken_html_is_read_as_a_browser_would() -> None:
    broken = "<div><p>Price: 12 EUR<p>Deposit <b>not refundable</div></span><table><tr><td>Fee<td>5"
    result = normalize(broken, "facts")
    assert result.text == "Price: 12 EUR\nDeposit not refundable\nFee: 5"
    assert result.input_type == "html"


def _digest() -> str:
    parts = [normalize(read(n), f).text for n in INPUTS for f in FORMATS]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def test_same_bytes_across_processes() -> None:
    code = "from tests.unit.test_normalize import _digest; print(_digest())"
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        digests.add(out.stdout.strip())
    assert digests == {_digest()}


def test_blocks_read_what_each_type_holds() -> None:
    blocks = read_blocks(read("stock.tsv"), "tsv")
    assert blocks == [
        Block(
            "table",
            header=("Code", "Product", "Stock", "Note"),
            rows=(
                ("A-100", "Bolts M6", "1200", ""),
                ("A-200", "Nuts M6", "0", "not available until 3 May"),
            ),
        )
    ]


def test_facts_keep_the_title_and_put_the_footer_after_it() -> None:
    html = (
        "<h1>Bottega Rossi</h1><p>Siamo una piccola squadra di appassionati.</p>"
        "<h2>Prezzi</h2><p>Il tagliando costa € 35.</p>"
        '<footer><p>Bottega Rossi di Anna Rossi<br>Telefono: <a href="tel:+390451234567">'
        "chiamaci</a><br>Amtsgericht Potsdam · USt-IdNr. DE 271828182</p></footer>"
    )
    lines = normalize(html, "facts").text.split("\n")
    assert lines == [
        "Bottega Rossi",  # the title, though its section holds only filler
        "Bottega Rossi di Anna Rossi",  # a footer's line is never filler
        "Telefono: +390451234567 (chiamaci)",  # a contact link's value before its words
        "Amtsgericht Potsdam · USt-IdNr. DE 271828182",  # no sentence ends after "IdNr."
        "Prezzi",
        "Il tagliando costa € 35.",
    ]


def test_a_value_keeps_its_subject() -> None:
    # Bare "Price:" lines under product names (plain text, and HTML whose names are <strong>):
    # each price says whose it is.
    plain = normalize(read("services.txt"), "facts").text.split("\n")
    assert "Herringbone oak > Price: £ 52 per m²" in plain
    assert "Laminate Classic > Price: £ 18 per m²" in plain
    page = normalize(read("services.html"), "facts").text.split("\n")
    assert "Paket Komfort > Preis: 119 € pro Stunde" in page


def _without_headings(blocks: list[Block]) -> list[Line]:
    """A deliberately broken rule: heading lines go as filler (never put back)."""
    lines = facts_lines(blocks)
    subjects = {id(line.subject) for line in lines if line.subject is not None}
    for line in lines:
        if id(line) in subjects:
            line.drop = "filler"
    return lines


def test_a_value_without_its_heading_fails_the_check() -> None:
    html = "<h2>Single room</h2><p>Size: 14 m2</p><h2>Suite</h2><p>Area: 40 m2</p>"
    assert normalize(html, "facts").text == "Single room\nSize: 14 m2\nSuite\nArea: 40 m2"
    result = normalize(html, "facts", renderers={"facts": _without_headings})
    assert result.used == "text" and "Suite > Area: 40 m2" in result.missing


def test_boilerplate_goes_but_a_phone_only_it_gives_stays() -> None:
    page = (
        "ROSSI FLOORS\nWe lay oak floors in Verona: € 45 per m².\n\n"
        "Every floor is sanded twice and oiled by hand, then left to rest for a day before "
        "the furniture goes back; we protect doors, stairs and skirting while we work, and "
        "we take the old floor away. Our team has laid floors in the city and in the hills "
        "around it for many years, in old farmhouses as in new flats.\n\n"
        "We use cookies and, with your consent, Google Analytics (GA4) under Regulation (EU) "
        "2016/679; they last 13 months.\nAccept all | Reject | Settings\n\n"
        "Subscribe to our newsletter for 10% off, or call 045 800 1234.\n\n"
        "© 2026 Rossi Floors. All rights reserved.\n"
    )
    for fmt in ("text", "facts"):
        result = normalize(page, fmt)  # type: ignore[arg-type]
        assert (result.used, result.missing) == (fmt, ())
        for gone in ("GA4", "2016/679", "13 months", "Accept all", "©"):
            assert gone not in result.text
        assert "045 800 1234" in result.text and "€ 45 per m²" in result.text
        assert result.kept["restored"] == 1  # the newsletter line, for its phone


def test_a_page_about_cookies_keeps_them() -> None:
    # Most of the page names cookies and consent: it is about them, not a banner.
    policy = "\n\n".join(
        f"Cookie {n}: the {name} cookie keeps your consent settings for {n} months; "
        "you can reject it."
        for n, name in ((6, "session"), (12, "analytics"), (13, "marketing"))
    )
    result = normalize("COOKIE POLICY\n\n" + policy, "text")
    assert "13 months" in result.text and "dropped_boilerplate" not in result.kept
    # A short page in one <div> whose words a banner's would be, all of it.
    page = f"<div class='page'><h1>Cookies</h1><p>{policy}</p></div>"
    assert "13 months" in normalize(page, "text").text


def test_a_dense_run_is_one_fact_per_piece_but_prose_with_dashes_is_not() -> None:
    footer = "Rossi Srl — Via Roma 12, Verona — VAT IT01234567890 — Sales: 045 111 2222"
    prose = "Our floors — laid by hand in Verona — last 30 years, or more if oiled."
    text = normalize(f"{footer}\n\n{prose}", "text", "text").text.split("\n")
    assert text[:4] == [
        "- Rossi Srl",
        "- Via Roma 12, Verona",
        "- VAT IT01234567890",
        "Sales: 045 111 2222",
    ]
    assert prose in text
    # A range ("Mon - Fri" with an en dash) is not a run.
    hours = "Hours: Mon \u2013 Fri 8:00 \u2013 18:00"
    assert hours in normalize(hours, "text").text


def test_questions_keep_their_answers_and_price_lists_their_items() -> None:
    page = (
        "FAQ\n\nWhen can I walk on it?\nAfter 24 hours.\n\nDo you work on Saturdays?\n\nNo.\n\n"
        "PRICES\nSkirting ........ £ 9 per metre\nPrice: £ 45 per m²\nOther: £ 45 per m²\n\n"
        "Oak\nPrice: £ 45 per m²\n\nAsh\nPrice: £ 45 per m²\n"
    )
    out = normalize(page, "facts").text
    facts = out.split("\n")
    assert "When can I walk on it? After 24 hours." in facts
    assert "Do you work on Saturdays? No." in facts
    assert normalize("Intro\n\nWhy?", "text").text == "Intro\nWhy?"  # a last, unanswered one
    assert "Skirting: £ 9 per metre" in facts
    # The same line three times a few lines apart is the page's, not a running header.
    # (Sent as `text` here, where the heading above names them, or as `facts`, inline.)
    for wood in ("Oak", "Ash"):
        assert f"{wood}\nPrice: £ 45 per m²" in out or f"{wood} > Price: £ 45 per m²" in out
