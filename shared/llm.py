"""Loading a model with llama-cpp-python, and turning requests into the exact text it reads.

The API loads the vocabulary only (to count tokens and render chat templates before a job is
queued); workers load the weights. Both render and tokenize with the same code, so the token
count the API checks is the one the worker computes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from shared import control_tokens
from shared.control_tokens import Concealer, ControlTokens
from shared.errors import InvalidRequest, ModelUnavailable
from shared.models import resolve_model
from shared.schemas import (
    DOCUMENT_PLACEHOLDER,
    DocumentFields,
    JobRequest,
    RenderedPrompt,
    WarmItem,
)
from shared.settings import Settings

log = logging.getLogger(__name__)

# Names the mark at the end of a document's shared prefix while a chat template renders.
_PREFIX_END = "prefix-end"


def load_llama(settings: Settings, *, vocab_only: bool = False) -> Llama:
    path = resolve_model(settings.model, settings.data_dir)
    try:
        with quiet_native_logs():
            return Llama(
                model_path=str(path),
                n_ctx=settings.n_ctx,
                n_batch=settings.n_batch,
                n_threads=settings.threads,
                n_threads_batch=settings.threads,
                flash_attn=settings.flash_attn,
                # Logits only where a token is sampled: keeping them for every prompt token
                # makes prefill ~50% slower and the KV state huge.
                logits_all=False,
                vocab_only=vocab_only,
                verbose=False,
            )
    except (ValueError, RuntimeError) as exc:
        raise ModelUnavailable(f"cannot load model {path}: {exc}") from exc


@contextlib.contextmanager
def quiet_native_logs() -> Iterator[None]:
    """llama.cpp prints its load log to fd 2 even with verbose=False; keep it for debug only."""
    if log.isEnabledFor(logging.DEBUG):
        yield None
        return
    saved = os.dup(2)
    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield None
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def token_bytes(llama: Llama, token: int, *, special: bool = False) -> bytes:
    """A token's text as bytes, however long.

    llama-cpp-python's `detokenize` reads each piece into 32 bytes and silently returns
    nothing for a longer one: 240 of Qwen's tokens (runs of spaces, dashes, `=`) and 47 of
    SmolLM2's would vanish from an answer.
    """
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    size = 64
    while True:
        buffer = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, special)
        if n >= 0:
            return buffer.raw[:n]
        size = -n  # too small: llama.cpp says how many bytes the piece needs


def detokenize(llama: Llama, tokens: Iterable[int], *, special: bool = False) -> bytes:
    return b"".join(token_bytes(llama, t, special=special) for t in tokens)


def _special_text(llama: Llama, token: int) -> str:
    if token < 0:
        return ""
    return token_bytes(llama, token, special=True).decode("utf-8", errors="replace")


def render_prompt(llama: Llama, request: JobRequest) -> RenderedPrompt:
    """The text the model reads for `request`: a raw prompt as is, messages via the template.

    Only the template's own markers become control tokens; a raw prompt's control-token text
    does only when the request asks for it (`special_tokens`).
    """
    if request.document is not None:
        return render_document(llama, request, question=request.prompt or "")
    if request.prompt is not None:
        spans = ControlTokens.of(llama).spans(request.prompt) if request.special_tokens else []
        return RenderedPrompt(text=request.prompt, add_bos=True, control_spans=spans)
    concealer = Concealer(ControlTokens.of(llama))
    messages = [
        {**m.model_dump(), "content": concealer.hide(m.content)} for m in request.messages or []
    ]
    return _revealed(llama, concealer, _render_chat(llama, messages, "messages"))


def render_warm(llama: Llama, item: WarmItem) -> RenderedPrompt:
    """What a warm job computes: a document's shared prefix, or a whole prompt."""
    if item.document is not None:
        return render_document(llama, item, question="")
    request = JobRequest(
        prompt=item.prompt, messages=item.messages, special_tokens=item.special_tokens
    )
    return render_prompt(llama, request)


def render_document(llama: Llama, fields: DocumentFields, question: str) -> RenderedPrompt:
    """A question about a document, marked where the part every such question shares ends.

    The question is rendered after a marker inside the same user message, and the marker's
    position is the prefix end: so the prefix text is identical for every question (and for
    the warmer, which renders an empty one).
    """
    concealer = Concealer(ControlTokens.of(llama))
    # The template and document join before hiding: together they must not make a control token.
    body = (fields.template or DOCUMENT_PLACEHOLDER).replace(
        DOCUMENT_PLACEHOLDER, fields.document or ""
    )
    user = f"{concealer.hide(body)}{concealer.mark(_PREFIX_END)}\n\n{concealer.hide(question)}"
    instructions = concealer.hide(fields.instructions) if fields.instructions else None
    if llama.metadata.get("tokenizer.chat_template"):
        messages = [{"role": "system", "content": instructions}] if instructions else []
        text = _render_chat(llama, [*messages, {"role": "user", "content": user}], "document")
    else:  # a base model reads plain text
        head = f"{instructions}\n\n" if instructions else ""
        text = f"{head}{user}\n"
    rendered = _revealed(llama, concealer, text)
    if rendered.prefix_chars is None:
        raise InvalidRequest("the chat template dropped the document", field="document")
    return rendered


def _render_chat(llama: Llama, messages: list[dict[str, Any]], field: str) -> str:
    template = llama.metadata.get("tokenizer.chat_template")
    if not template:
        raise InvalidRequest("this model has no chat template; send 'prompt'", field=field)
    bos = _special_text(llama, llama.token_bos())
    eos = _special_text(llama, llama.token_eos())
    formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    try:
        return formatter(messages=messages).prompt  # type: ignore[arg-type]
    except Exception as exc:  # jinja raises many types; the template rejected these messages
        raise InvalidRequest(f"chat template rejected the {field}: {exc}", field=field) from exc


def _revealed(llama: Llama, concealer: Concealer, text: str) -> RenderedPrompt:
    revealed = concealer.reveal(text)
    bos = _special_text(llama, llama.token_bos())
    # Templates that write the BOS token themselves must not get a second one.
    wrote_bos = bool(bos) and revealed.control_spans[:1] == [(0, len(bos))]
    return RenderedPrompt(
        text=revealed.text,
        add_bos=not (wrote_bos and revealed.text.startswith(bos)),
        prefix_chars=revealed.marks.get(_PREFIX_END),
        control_spans=revealed.control_spans,
    )


def tokenize(llama: Llama, prompt: RenderedPrompt) -> list[int]:
    return tokenize_parts(llama, prompt)[0]


def tokenize_parts(llama: Llama, prompt: RenderedPrompt) -> tuple[list[int], int | None]:
    """The prompt's tokens, and where its shared prefix ends (None: no declared prefix).

    The prefix is tokenized on its own so that no token straddles its end: its tokens do not
    depend on the text that follows.
    """
    if prompt.prefix_chars is None:
        spans = _control_spans(llama, prompt)
        return control_tokens.tokenize(llama, prompt.text, spans, prompt.add_bos), None
    head, tail = _split_tokens(llama, prompt, prompt.prefix_chars)
    return head + tail, len(head)


def document_prompts(
    llama: Llama, fields: DocumentFields, questions: list[str]
) -> tuple[list[int], list[list[int]]]:
    """The shared prefix's tokens and each question's own tokens after it.

    Prefix + tail is exactly what a single job with that `document` and question as `prompt`
    tokenizes to, so answering them together can be compared with answering them alone.
    """
    prefix: list[int] | None = None
    tails = []
    for question in questions:
        rendered = render_document(llama, fields, question)
        head, tail = _split_tokens(llama, rendered, rendered.prefix_chars or 0, head=prefix is None)
        prefix = head if prefix is None else prefix
        tails.append(tail)
    return prefix or [], tails


def _split_tokens(
    llama: Llama, prompt: RenderedPrompt, split: int, *, head: bool = True
) -> tuple[list[int], list[int]]:
    """The tokens before `split` (unless `head` is false: empty) and after it, apart."""
    spans = _control_spans(llama, prompt)
    before = [s for s in spans if s[1] <= split]
    after = [(start - split, end - split) for start, end in spans if start >= split]
    assert len(before) + len(after) == len(spans), "a control token straddles the prefix end"
    return (
        control_tokens.tokenize(llama, prompt.text[:split], before, prompt.add_bos) if head else [],
        control_tokens.tokenize(llama, prompt.text[split:], after, False),
    )


def _control_spans(llama: Llama, prompt: RenderedPrompt) -> list[tuple[int, int]]:
    if prompt.control_spans is None:  # recorded before spans were: read as it was then
        return ControlTokens.of(llama).spans(prompt.text)
    return prompt.control_spans
