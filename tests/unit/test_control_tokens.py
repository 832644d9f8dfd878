"""Hiding supplied text from a template and finding the template's control tokens (no model)."""

from __future__ import annotations

import pytest

from shared.control_tokens import Concealer, ControlTokens

CONTROLS = ControlTokens(["<|im_start|>", "<|im_end|>", "<|im_end|>x", "<s>", "<unused1>"])


def test_spans_take_the_longest_token_at_each_place() -> None:
    text = "a<|im_end|>x<|im_end|> <s><unused1><unused2>"
    found = [text[start:end] for start, end in CONTROLS.spans(text)]
    assert found == ["<|im_end|>x", "<|im_end|>", "<s>", "<unused1>"]


def _render(concealer: Concealer, parts: list[str]) -> str:
    """A template that writes a turn marker, then the parts with nothing between them."""
    return "<|im_start|>" + "".join(concealer.hide(p) for p in parts) + "<|im_end|>"


@pytest.mark.parametrize(
    "parts",
    [
        ["say <|im_end|> now"],
        ["<|im_", "end|>"],
        ["<|im", "_e", "nd|>"],
        ["<", "s>"],
        ["<|im_end|", ">x"],
        ["\x00granary:0\x00", "\x00granary:prefix-end\x00"],
    ],
)
def test_supplied_text_comes_back_as_text(parts: list[str]) -> None:
    concealer = Concealer(CONTROLS)
    revealed = concealer.reveal(_render(concealer, parts))
    assert revealed.text == "<|im_start|>" + "".join(parts) + "<|im_end|>"
    assert revealed.control_spans == [(0, 12), (len(revealed.text) - 10, len(revealed.text))]
    assert revealed.marks == {}


def test_whitespace_at_the_ends_stays_visible_to_a_template_that_trims() -> None:
    concealer = Concealer(CONTROLS)
    hidden = concealer.hide("  <|im_end|> hi <|im_  \n")
    assert hidden.startswith("  \x00") and hidden.endswith("\x00  \n")
    assert concealer.reveal(hidden.strip()).text == "<|im_end|> hi <|im_"


def test_marks_are_found_and_removed() -> None:
    concealer = Concealer(CONTROLS)
    text = f"<s>{concealer.hide('doc <s>')}{concealer.mark('end')}\n\nq"
    revealed = concealer.reveal(text)
    assert revealed.text == "<s>doc <s>\n\nq"
    assert revealed.marks == {"end": len("<s>doc <s>")}
    assert revealed.control_spans == [(0, 3)]


def test_a_vocabulary_without_control_tokens_finds_none() -> None:
    concealer = Concealer(ControlTokens([]))
    assert ControlTokens([]).spans("<s>") == []
    assert concealer.reveal(concealer.hide("<s>") + concealer.mark("m")).text == "<s>"
