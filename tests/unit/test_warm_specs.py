"""Declared warm specs: settings and a spec directory become warm items; bad ones are reported."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.schemas import WarmItem, WarmRequest
from shared.settings import WarmerSettings, WarmSpec
from warmer.specs import declared_items


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_spec_files_and_globs_expand_to_one_item_per_document(tmp_path: Path) -> None:
    write(tmp_path / "docs" / "a.txt", "Invoice A")
    write(tmp_path / "docs" / "b.txt", "Invoice B")
    write(
        tmp_path / "specs" / "invoices.toml",
        'instructions = "Extract totals."\ndocuments = ["../docs/*.txt"]\n',
    )
    found = declared_items(WarmerSettings(spec_dir=tmp_path / "specs"), tmp_path)
    assert found.errors == []
    assert [(i.name, i.document, i.instructions) for i in found.items] == [
        ("invoices:a.txt", "Invoice A", "Extract totals."),
        ("invoices:b.txt", "Invoice B", "Extract totals."),
    ]


def test_specs_in_settings_resolve_from_the_working_directory(tmp_path: Path) -> None:
    write(tmp_path / "t.txt", "Ticket 7")
    spec = WarmSpec(name="tickets", template="Ticket:\n{document}", documents=["t.txt"])
    found = declared_items(WarmerSettings(specs=[spec]), tmp_path)
    assert [i.template for i in found.items] == ["Ticket:\n{document}"]


def test_bad_specs_are_reported_and_skipped(tmp_path: Path) -> None:
    write(tmp_path / "good.txt", "fine")
    write(tmp_path / "latin1.txt", "caf\xe9".encode("latin-1"))
    write(tmp_path / "specs" / "broken.toml", "documents = [")
    write(tmp_path / "specs" / "nofiles.toml", 'documents = ["missing/*.txt"]')
    write(tmp_path / "specs" / "ok.toml", 'documents = ["../good.txt", "../latin1.txt"]')
    found = declared_items(WarmerSettings(spec_dir=tmp_path / "specs"), tmp_path)
    assert [i.document for i in found.items] == ["fine"]
    assert len(found.errors) == 3
    assert any("broken.toml" in e for e in found.errors)
    assert any("no file matches missing/*.txt" in e for e in found.errors)
    assert any("latin1.txt" in e for e in found.errors)


def test_warm_request_items() -> None:
    request = WarmRequest.model_validate({"documents": ["a", "b"], "instructions": "x"})
    assert [(i.document, i.instructions) for i in request.items()] == [("a", "x"), ("b", "x")]
    assert WarmRequest.model_validate({"prompt": "p"}).items() == [WarmItem(prompt="p")]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": "p", "document": "d"},
        {"document": "d", "documents": ["e"]},
        {"prompt": "p", "instructions": "i"},
        {"document": "d", "template": "no placeholder"},
        {"documents": []},
    ],
)
def test_bad_warm_requests_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        WarmRequest.model_validate(body)


def test_specs_warm_documents_as_their_format_reads_them(tmp_path: Path) -> None:
    from shared.normalize import normalize

    page = "<h1>Shop</h1><p>Nice place.</p><p>Open 9:00-18:00. No cards.</p><nav>Home</nav>"
    write(tmp_path / "docs" / "shop.html", page)
    write(tmp_path / "docs" / "bad.html", "no markup at all")
    write(
        tmp_path / "specs" / "pages.toml",
        'documents = ["../docs/*.html"]\ndocument_format = "facts"\ndocument_type = "html"\n',
    )
    found = declared_items(WarmerSettings(spec_dir=tmp_path / "specs"), tmp_path)
    [item] = found.items
    # The heading once above its facts; the filler sentence and the menu are gone.
    assert item.document == normalize(page, "facts").text == "Shop\nOpen 9:00-18:00.\nNo cards."
    assert (item.document_format, item.document_type) == ("facts", "html")
    [error] = found.errors
    assert "bad.html" in error and "document_type is 'html'" in error
