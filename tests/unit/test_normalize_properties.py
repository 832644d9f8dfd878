"""Property: over generated documents (sections of filler, facts, negations, "label: value"
lines, lists and tables, written as HTML, Markdown, plain text or CSV), `text` and `facts`
pass their own self-check, every generated value and negation is in the output, and in
`facts` every value is with its section's heading (on its line, or the heading line above)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.errors import InvalidRequest
from shared.normalize import normalize
from shared.normalize.entities import Values, canonical, contains

# Letters only, and none of them a negation or condition cue: filler is filler.
WORDS = [
    "garden",
    "river",
    "blue",
    "table",
    "window",
    "coffee",
    "morning",
    "quiet",
    "large",
    "green",
    "friendly",
    "street",
    "bright",
    "evening",
    "music",
    "corner",
    "bakery",
    "little",
    "orange",
    "simple",
    "modern",
    "old",
    "sunny",
    "lake",
]
MONTHS = ["January", "March", "June", "September", "November"]

word = st.sampled_from(WORDS)
words = st.lists(word, min_size=2, max_size=8).map(" ".join)
amount = st.integers(1, 99_999)
values = st.one_of(
    amount.map(lambda n: f"{n} EUR"),
    st.tuples(amount, st.integers(0, 99)).map(lambda t: f"€ {t[0]},{t[1]:02d}"),
    st.tuples(st.integers(1, 28), st.sampled_from(MONTHS), st.integers(1990, 2040)).map(
        lambda t: f"{t[0]} {t[1]} {t[2]}"
    ),
    st.tuples(st.integers(1990, 2040), st.integers(1, 12), st.integers(1, 28)).map(
        lambda t: f"{t[0]}-{t[1]:02d}-{t[2]:02d}"
    ),
    st.tuples(st.integers(10, 99), st.integers(1000, 9999), st.integers(1000, 9999)).map(
        lambda t: f"+39 0{t[0]} {t[1]} {t[2]}"
    ),
    st.tuples(word, word).map(lambda t: f"{t[0]}@{t[1]}.example"),
    st.tuples(word, word).map(lambda t: f"https://{t[0]}.example/{t[1]}"),
    st.tuples(word, amount).map(lambda t: f"{t[0].upper()[:3]}-{t[1]}"),
    st.integers(1, 30).map(lambda n: f"{n} years"),
)


@dataclass
class Doc:
    sections: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    negations: list[str] = field(default_factory=list)
    # Each value with the heading of its section.
    subjects: list[tuple[str, str]] = field(default_factory=list)


@st.composite
def documents(draw: st.DrawFn) -> Doc:
    doc = Doc()
    for _ in range(draw(st.integers(1, 4))):
        heading = draw(words).title()
        parts: list[tuple[str, str]] = []
        for _ in range(draw(st.integers(1, 6))):
            kind = draw(st.sampled_from(["filler", "fact", "negation", "pair", "item", "table"]))
            if kind == "filler":
                parts.append(("sentence", f"{draw(words).capitalize()}."))
            elif kind == "negation":
                text = f"The {draw(word)} is not {draw(words)}"
                doc.negations.append(text)
                parts.append(("sentence", f"{text}."))
            elif kind == "table":
                rows = draw(st.lists(st.tuples(word, values), min_size=1, max_size=4))
                doc.values += [v for _, v in rows]
                parts.append(("table", "\n".join(f"{a}\t{v}" for a, v in rows)))
            else:
                value = draw(values)
                doc.values.append(value)
                text = {
                    "fact": f"{draw(words).capitalize()} {value} {draw(words)}.",
                    "pair": f"{draw(word).capitalize()}: {value}",
                    "item": f"{draw(word)} {value}",
                }[kind]
                parts.append((kind if kind != "fact" else "sentence", text))
        doc.sections.append((heading, parts))
        doc.subjects += [(heading, value) for value in doc.values[len(doc.subjects) :]]
    return doc


def as_html(doc: Doc) -> str:
    out = ["<html><body><nav>Home | Shop</nav>"]
    for heading, parts in doc.sections:
        out.append(f"<h2>{html.escape(heading)}</h2>")
        for kind, text in parts:
            if kind == "table":
                rows = [line.split("\t") for line in text.split("\n")]
                cells = "".join(f"<tr><td>{a}</td><td>{html.escape(v)}</td></tr>" for a, v in rows)
                out.append(f"<table><tr><th>Name</th><th>Value</th></tr>{cells}</table>")
            elif kind == "item":
                out.append(f"<ul><li>{html.escape(text)}</li></ul>")
            else:
                out.append(f"<p>{html.escape(text)}</p>")
    out.append('<div class="cookie-banner">We use cookies.</div></body></html>')
    return "\n".join(out)


def as_markdown(doc: Doc) -> str:
    out = []
    for heading, parts in doc.sections:
        out.append(f"## {heading}\n")
        for kind, text in parts:
            if kind == "table":
                rows = [line.split("\t") for line in text.split("\n")]
                out.append("| Name | Value |\n|---|---|\n")
                out[-1] += "".join(f"| {a} | {v} |\n" for a, v in rows)
            elif kind == "item":
                out.append(f"- {text}\n")
            else:
                out.append(f"{text}\n")
    return "\n".join(out)


def as_text(doc: Doc) -> str:
    out = []
    for heading, parts in doc.sections:
        lines = [heading.upper()]
        for kind, text in parts:
            if kind == "table":
                lines += [line.replace("\t", ": ") for line in text.split("\n")]
            elif kind == "item":
                lines.append(f"- {text}")
            else:
                lines.append(text)
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def assert_kept(doc: Doc, source: str, fmt: str) -> None:
    result = normalize(source, fmt)  # type: ignore[arg-type]
    assert result.missing == (), (source, result)
    if result.used != fmt:
        # Facts of a document of filler only is empty, and facts longer than text saves
        # nothing: either is sent as text instead.
        assert (fmt, result.used) == ("facts", "text"), (source, result)
        assert result.text == normalize(source, "text").text
    out = canonical(result.text)
    for value in doc.values:
        assert contains(out, canonical(value)), (value, source, result.text)
    for negation in doc.negations:
        assert canonical(negation) in out, (negation, result.text)
    if result.used == "facts":
        assert_with_subjects(doc, result.text)


def assert_with_subjects(doc: Doc, facts: str) -> None:
    lines = [canonical(line).casefold() for line in facts.split("\n")]
    headings = {heading.casefold() for heading, _ in doc.sections}

    def about(at: int) -> str | None:
        return next((line for line in reversed(lines[:at]) if line in headings), None)

    for heading, value in doc.subjects:
        subject, value = heading.casefold(), canonical(value).casefold()
        # (A value may be in two sections: one of its lines is this section's.)
        found = [n for n, line in enumerate(lines) if contains(line, value)]
        assert any(subject in lines[n] or about(n) == subject for n in found), (subject, facts)


CHECKS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@CHECKS
@given(documents(), st.sampled_from(["text", "facts"]))
def test_html_keeps_every_fact(doc: Doc, fmt: str) -> None:
    assert_kept(doc, as_html(doc), fmt)


@CHECKS
@given(documents(), st.sampled_from(["text", "facts"]))
def test_markdown_keeps_every_fact(doc: Doc, fmt: str) -> None:
    assert_kept(doc, as_markdown(doc), fmt)


@CHECKS
@given(documents(), st.sampled_from(["text", "facts"]))
def test_plain_text_keeps_every_fact(doc: Doc, fmt: str) -> None:
    assert_kept(doc, as_text(doc), fmt)


@CHECKS
@given(st.lists(st.tuples(word, values, values), min_size=1, max_size=8))
def test_csv_keeps_every_cell(rows: list[tuple[str, str, str]]) -> None:
    lines = ["name,first,second"] + [f'{a},"{b}","{c}"' for a, b, c in rows]
    doc = Doc(values=[v for _, b, c in rows for v in (b, c)])
    for fmt in ("text", "facts"):
        assert_kept(doc, "\n".join(lines) + "\n", fmt)


PIECES = st.sampled_from(
    [
        *["<p>", "</p>", "<table>", "<tr>", "<td>", "|", "---", "# ", "- ", ",", "\t", "\n"],
        *["\f", '"', "12 EUR", "not", "Price: ", "-\n", "<script>", "```", "[a](http://x.y)"],
        *["\n\n", "\r", "\u00a0", "\u200b", " "],
    ]
)
ANY_TEXT = st.characters(exclude_categories=["Cs"])
MIXED = st.one_of(
    st.text(ANY_TEXT, max_size=300),
    st.lists(st.one_of(PIECES, st.text(ANY_TEXT, max_size=8)), max_size=60).map("".join),
)


@CHECKS
@given(
    st.text(st.sampled_from("12.,€ aX-/:\n"), max_size=40),
    st.sampled_from(["12", "1.2", "€ 12", "X-12", "12,5"]),
)
def test_values_index_finds_what_a_search_finds(text: str, value: str) -> None:
    assert Values(text).contains(value) == contains(canonical(text), value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    MIXED,
    st.sampled_from(["text", "facts"]),
    st.sampled_from([None, "text", "html", "markdown", "csv", "tsv"]),
)
def test_any_text_normalises_or_is_refused_naming_the_field(
    text: str, fmt: str, declared: str | None
) -> None:
    # What the API turns into a 400; anything else raised here would be a 500.
    try:
        result = normalize(text, fmt, declared)  # type: ignore[arg-type]
    except InvalidRequest as exc:
        assert exc.field in ("document", "document_type")
        return
    assert result == normalize(text, fmt, declared)  # type: ignore[arg-type]
    assert result.used == fmt or result.used in ("text", "raw")
