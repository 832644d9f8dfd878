"""Which text becomes the model's control tokens: only what its chat template wrote.

Asked to parse special tokens, llama.cpp's tokenizer turns every occurrence of a control
token's text (`<|im_end|>`, `<end_of_turn>`) into that token, wherever the text came from: a
message or document carrying one could close its turn and forge another. So text a request
supplies is hidden behind sentinels while the template renders; the rendered text is then
scanned for control tokens (all of them the template's own), their spans are kept with the
prompt, and the prompt is tokenized piecewise: each span with special parsing, the text between
spans without. llama.cpp tokenizes the text between two control tokens as one fragment either
way, so a prompt whose supplied text holds no control-token text gets exactly the tokens that
parsing the whole text gives (what the model's own runtime reads), and cache keys do not move.

Tokens a vocabulary marks user-defined (Qwen's `<tool_call>`, Gemma's runs of newlines) are
read in plain text too, by llama.cpp as by Hugging Face tokenizers: they are not control tokens.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import llama_cpp
from llama_cpp import Llama

Span = tuple[int, int]
_Trie = dict[str, "_Trie"]

# Sentinels are "\x00granary:<name>\x00". Supplied text never keeps this prefix (it is hidden
# like a control token), so the only sentinels in a rendered text are the ones put there.
_RESERVED = "\x00granary:"
_SENTINEL = re.escape(_RESERVED) + r"([^\x00]*)\x00"
# What llama.cpp reads only when asked to parse special tokens.
_CONTROL = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN

_of_model: weakref.WeakKeyDictionary[Llama, ControlTokens] = weakref.WeakKeyDictionary()


class ControlTokens:
    """A vocabulary's control-token texts, and where they occur in text."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = frozenset(t for t in texts if t)
        trie = _trie_pattern(self.texts)
        self._find = re.compile(trie) if trie else None
        self._to_hide = re.compile("|".join([re.escape(_RESERVED), *([trie] if trie else [])]))
        # Group 1: a sentinel's name; group 2: a control token.
        self._revealed = re.compile("|".join([_SENTINEL, f"({trie})" if trie else "(?!)()"]))
        self._prefixes = {t[:k] for t in self.texts for k in range(1, len(t))}
        self._suffixes = {t[k:] for t in self.texts for k in range(1, len(t))}
        self._longest = max(map(len, self.texts), default=0)

    @classmethod
    def of(cls, llama: Llama) -> ControlTokens:
        """The model's control tokens (read from its vocabulary once per model object)."""
        found = _of_model.get(llama)
        if found is None:
            vocab = llama_cpp.llama_model_get_vocab(llama.model)
            texts = (
                llama_cpp.llama_vocab_get_text(vocab, token).decode("utf-8", errors="ignore")
                for token in range(llama.n_vocab())
                if llama_cpp.llama_vocab_get_attr(vocab, token) & _CONTROL
            )
            found = _of_model[llama] = cls(texts)
        return found

    def spans(self, text: str) -> list[Span]:
        """Every control-token text in `text` (for a raw prompt that asks for them)."""
        return [m.span() for m in self._find.finditer(text)] if self._find else []

    def hide(self, text: str, sentinel: Callable[[str], str]) -> str:
        """`text` with each control-token text, and each end that could complete one with the
        text around it, replaced by `sentinel(part)`: what comes back holds no control token.

        Whitespace at the ends stays outside the sentinels, so a template that trims what it
        is given (Gemma's does) trims the same text.
        """
        core = text.strip()
        lead = len(text) - len(text.lstrip())
        start, end = self._exposed_ends(core) if core else (0, 0)
        middle = core[start : len(core) - end]
        parts = [
            text[:lead],
            sentinel(core[:start]) if start else "",
            self._to_hide.sub(lambda m: sentinel(m.group()), middle),
            sentinel(core[len(core) - end :]) if end else "",
            text[lead + len(core) :],
        ]
        return "".join(parts)

    def rendered_parts(self, rendered: str) -> Iterator[re.Match[str]]:
        """Sentinels (group 1: name) and control tokens (group 2) in a rendered text."""
        return self._revealed.finditer(rendered)

    def _exposed_ends(self, text: str) -> tuple[int, int]:
        """How many characters at each end of `text` could join the text beside it into a
        control token: a start that ends one, an end that begins one (all: inside one)."""
        if len(text) < self._longest and any(text in t for t in self.texts):
            return len(text), 0
        start = _longest_end(text, self._suffixes, self._longest, from_start=True)
        end = _longest_end(text[start:], self._prefixes, self._longest, from_start=False)
        return start, end


def _longest_end(text: str, parts: set[str], longest: int, *, from_start: bool) -> int:
    for n in range(min(len(text), longest - 1), 0, -1):
        if (text[:n] if from_start else text[-n:]) in parts:
            return n
    return 0


@dataclass
class Revealed:
    text: str
    control_spans: list[Span]
    # Where each named mark was, in `text` (marks themselves are removed).
    marks: dict[str, int]


@dataclass
class Concealer:
    """Hides supplied text while a template renders, then puts it back as plain text."""

    controls: ControlTokens
    _originals: list[str] = field(default_factory=list)

    def hide(self, text: str) -> str:
        return self.controls.hide(text, self._sentinel)

    @staticmethod
    def mark(name: str) -> str:
        """A named position to find in the revealed text (names are not numbers)."""
        return f"{_RESERVED}{name}\x00"

    def reveal(self, rendered: str) -> Revealed:
        """The rendered text with the supplied text back, and the template's control tokens."""
        out: list[str] = []
        spans: list[Span] = []
        marks: dict[str, int] = {}
        length = position = 0
        for match in self.controls.rendered_parts(rendered):
            out.append(rendered[position : match.start()])
            length += match.start() - position
            position = match.end()
            name, control = match.group(1), match.group(2)
            if control is not None:
                spans.append((length, length + len(control)))
                piece = control
            elif name.isdigit():
                piece = self._originals[int(name)]
            else:
                marks[name] = length
                piece = ""
            out.append(piece)
            length += len(piece)
        out.append(rendered[position:])
        return Revealed("".join(out), spans, marks)

    def _sentinel(self, text: str) -> str:
        self._originals.append(text)
        return self.mark(str(len(self._originals) - 1))


def tokenize(llama: Llama, text: str, control_spans: Sequence[Span], add_bos: bool) -> list[int]:
    """`text`'s tokens, with control tokens read only inside `control_spans`."""
    pieces: list[tuple[str, bool]] = []
    position = 0
    for start, end in control_spans:
        pieces += [(text[position:start], False), (text[start:end], True)]
        position = end
    pieces.append((text[position:], False))
    tokens: list[int] = []
    first = True
    for piece, special in pieces:
        if piece or (first and add_bos):
            encoded = piece.encode("utf-8")
            tokens += llama.tokenize(encoded, add_bos=first and add_bos, special=special)
            first = False
    return tokens


def _trie_pattern(texts: Iterable[str]) -> str:
    """One regex for many literals, as a trie: longest match first, one branch per character
    (an alternation of thousands of literals would try each of them at every position)."""
    root: _Trie = {}
    for text in texts:
        node = root
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}
    return _node_pattern(root)


def _node_pattern(node: _Trie) -> str:
    branches = [re.escape(char) + _node_pattern(child) for char, child in node.items() if char]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(sorted(branches))})"
    return f"(?:{body})?" if "" in node else body
