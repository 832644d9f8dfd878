"""Where a prompt's prefill ends a chunk besides the block grid, chosen from its own tokens.

A restore may end only where both the stored state's prefill and the new prompt's own cold
prefill ended a chunk (`shared.prefix_cache.restorable_tokens`). On the block grid alone, two
prompts that hold the same document followed by different questions (what OpenAI clients and
most tools send: the document inside a chat message or a plain prompt) share only the whole
256-token blocks before the document's end, and the rest of the document is prefilled again.
So a prompt without a declared document prefix also ends chunks where prompts part:

- before each message's content (see below): the messages before it, the system prompt
  above all, are shared whole;
- at the start of each stretch's last paragraph (after a blank line): where a question
  follows the document it asks about;
- before the next message's content, after a message followed by at least `MIN_TAIL`
  more tokens: where a document sent as a message of its own (a system message,
  as OpenAI clients send it) is followed by a short question in the next one, the next
  question reads little more than its own words. Without it the next question shared the
  document only up to its last block boundary and read the rest again; with the break at the
  document's end it read the turn markers and role line again (5 tokens on Qwen where 1 is
  read now). The last message is followed
  only by the template's turn markers, fewer than `MIN_TAIL`: no chunk would be worth its
  pass there;
- before the last token of each earlier line opening a message of the role the prompt asks
  to answer (its own last line: "assistant\n"): where the previous turn's prompt stopped its
  prefill, so a conversation's next turn restores the previous turn's prompt whole and reads
  only the answer and the new message, whatever their lengths.

A stretch is the text between the chat template's control tokens; a message's content starts
after the control tokens and the role line that open it ("user\n" in ChatML and Gemma's
template), which every message of that role shares. The break sits before the role line's last
token: where a prompt asking that role to answer stops its prefill, so that a conversation's
next turn restores the previous turn's prompt whole (`_content_start`).

Only stretches of at least `MIN_STRETCH` tokens count (a role name or a short reply is not
worth a chunk of its own), and a point closer than `MIN_STRETCH` to the stretch's start, or
than `MIN_SHARED_START` to the prompt's start, is no break. The latter is shorter: the system
prompt a chat template puts first when a chat has none of its own (Qwen2.5's and SmolLM2's,
~23 tokens with the user's role line) is the same in every chat, and llama-server's prompt
cache reuses it; without a break there each chat read it again.
Each break costs one more pass of prefill (a shorter chunk); there are at most three per long
stretch. The points depend on the prompt's tokens alone,
never on what is cached, so greedy output is the same with the cache as without it.

A prompt with a declared shared prefix (a document) has that prefix's end as its one break
instead (`prompt_breaks`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import llama_cpp
from llama_cpp import Llama

# Stretches (and distances within one) shorter than this get no break.
MIN_STRETCH = 32
# No break closer to the prompt's start than this: a shorter shared start is not worth a pass.
MIN_SHARED_START = 16
# A stretch's end is a break when at least this many tokens follow it: more than the turn
# markers a chat template puts after the last message (5 on Qwen, SmolLM2 and Gemma-3), as
# many as the shortest question with its own markers.
MIN_TAIL = 8
# A message's role line ("user\n", "assistant\n", Gemma's "model\n") is at most this many
# tokens, the last one ending the line.
MAX_ROLE_LINE = 4
_CONTROL = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN


class _Pieces:
    """What the break rule needs to know of a token, read from the vocabulary on first use."""

    def __init__(self) -> None:
        # token -> None for a control token, else (blank: only whitespace, newlines it ends
        # with, counted across spaces and tabs). Holds no reference to the model: kept per
        # model in a weak mapping, a reference would keep the model alive.
        self._known: dict[int, tuple[bool, int] | None] = {}

    def kind(self, llama: Llama, token: int) -> tuple[bool, int] | None:
        if token in self._known:
            return self._known[token]
        result: tuple[bool, int] | None
        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        if llama_cpp.llama_vocab_get_attr(vocab, token) & _CONTROL:
            result = None
        else:
            # llama-cpp-python's detokenize reads a piece longer than 32 bytes as empty (see
            # shared.llm.token_bytes). Breaks are chosen by that reading: cached states were cut
            # at them, and reading those pieces whole would move breaks (new fingerprint).
            text = llama.detokenize([token], special=False).decode("utf-8", "replace")
            tail = text[len(text.rstrip(" \t\r\n")) :]
            result = (text.strip() == "", tail.count("\n"))
        self._known[token] = result
        return result


_of_model: weakref.WeakKeyDictionary[Llama, _Pieces] = weakref.WeakKeyDictionary()


def content_breaks(llama: Llama, tokens: Sequence[int]) -> tuple[int, ...]:
    """The chunk ends `tokens` gets besides the block grid (see the module's docstring)."""
    pieces = _of_model.get(llama)
    if pieces is None:
        pieces = _of_model[llama] = _Pieces()

    def content_start(position: int) -> int:
        return _content_start(llama, pieces, tokens, position)

    breaks: set[int] = set()
    start = 0  # of the current stretch
    last_paragraph: int | None = None
    newlines = 0  # ending the text so far
    for position, token in enumerate(tokens):
        kind = pieces.kind(llama, token)
        if kind is None:
            _close_stretch(breaks, start, last_paragraph, position, content_start)
            if position - start >= MIN_STRETCH and len(tokens) - position >= MIN_TAIL:
                breaks.add(content_start(position))
            start, last_paragraph, newlines = position + 1, None, 0
            continue
        blank, trailing = kind
        if blank:
            newlines += trailing
            continue
        if newlines >= 2 and position > start:
            last_paragraph = position
        newlines = trailing
    _close_stretch(breaks, start, last_paragraph, len(tokens), content_start)
    breaks.update(_earlier_turn_ends(llama, pieces, tokens))
    return tuple(sorted(b for b in breaks if b >= MIN_SHARED_START))


def _close_stretch(
    breaks: set[int],
    start: int,
    last_paragraph: int | None,
    end: int,
    content_start: Callable[[int], int],
) -> None:
    if end - start < MIN_STRETCH:
        return
    breaks.add(content_start(start))
    if last_paragraph is not None and last_paragraph - start >= MIN_STRETCH:
        breaks.add(last_paragraph)


def _content_start(llama: Llama, pieces: _Pieces, tokens: Sequence[int], position: int) -> int:
    """The break before the content of the message opening at `position` (at or after its
    control tokens): after those control tokens and the blanks among them, at the last token
    of its role line when it has one. A prompt that asks that role to answer ends with the
    same role line, and its prefill stops right before that token (the last is decoded with
    the first sample): so the next turn of a conversation, which holds the same line before
    the answer, restores the previous turn's whole prompt."""
    while position < len(tokens) and _between_messages(pieces.kind(llama, tokens[position])):
        position += 1
    for end in range(position, min(position + MAX_ROLE_LINE, len(tokens))):
        kind = pieces.kind(llama, tokens[end])
        if kind is None:
            break
        if kind[1]:  # the token ends the line
            return end
    return position


def _earlier_turn_ends(llama: Llama, pieces: _Pieces, tokens: Sequence[int]) -> set[int]:
    """Where the prompts of a conversation's earlier turns stopped their prefill: before the
    last token of each earlier opening of the role the prompt ends by asking to answer (the
    control tokens, then the role line this prompt ends with)."""
    last_control = max(
        (i for i in range(len(tokens)) if pieces.kind(llama, tokens[i]) is None), default=None
    )
    if last_control is None:
        return set()
    role = list(tokens[last_control + 1 :])
    last = pieces.kind(llama, role[-1]) if role else None
    if not 0 < len(role) <= MAX_ROLE_LINE or last is None or not last[1]:
        return set()  # no role line ends the prompt: no template, or one without them
    width = len(role)
    return {
        i + width - 1
        for i in range(1, last_control - width + 1)
        if pieces.kind(llama, tokens[i - 1]) is None and list(tokens[i : i + width]) == role
    }


def _between_messages(kind: tuple[bool, int] | None) -> bool:
    """A control token, or a blank one (the newline ChatML puts after `<|im_end|>`)."""
    return kind is None or kind[0]


def prompt_breaks(
    llama: Llama, tokens: list[int], boundary: int | None, *ends: int | None, limit: int
) -> tuple[int, ...]:
    """A prompt's chunk ends besides the block grid: its declared prefix's end `boundary`, or
    without one, where its own text shows prompts part (`content_breaks`); and `ends`."""
    found = (boundary,) if boundary is not None else content_breaks(llama, tokens)
    return chunk_breaks(*found, *ends, limit=limit)


def chunk_breaks(*ends: int | None, limit: int) -> tuple[int, ...]:
    """The given chunk ends inside (0, limit), sorted, once each."""
    return tuple(sorted({end for end in ends if end is not None and 0 < end < limit}))
