"""Loading a model with llama-cpp-python, and turning requests into the exact text it reads.

The API loads the vocabulary only (to count tokens and render chat templates before a job is
queued); workers load the weights. Both render and tokenize with the same code, so the token
count the API checks is the one the worker computes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

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

# Marks the end of a document's shared prefix while a chat template renders; never tokenized.
_SPLIT = "\x00granary:prefix-end\x00"


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


def _special_text(llama: Llama, token: int) -> str:
    if token < 0:
        return ""
    return llama.detokenize([token], special=True).decode("utf-8", errors="replace")


def render_prompt(llama: Llama, request: JobRequest) -> RenderedPrompt:
    """The text the model reads for `request`: a raw prompt as is, messages via the template."""
    if request.document is not None:
        return render_document(llama, request, question=request.prompt or "")
    if request.prompt is not None:
        return RenderedPrompt(text=request.prompt, add_bos=True)
    return _render_chat(llama, [m.model_dump() for m in request.messages or []], "messages")


def render_warm(llama: Llama, item: WarmItem) -> RenderedPrompt:
    """What a warm job computes: a document's shared prefix, or a whole prompt."""
    if item.document is not None:
        return render_document(llama, item, question="")
    return render_prompt(llama, JobRequest(prompt=item.prompt, messages=item.messages))


def render_document(llama: Llama, fields: DocumentFields, question: str) -> RenderedPrompt:
    """A question about a document, marked where the part every such question shares ends.

    The question is rendered after a marker inside the same user message, and the marker's
    position is the prefix end: so the prefix text is identical for every question (and for
    the warmer, which renders an empty one).
    """
    document = fields.document or ""
    if _SPLIT in document or _SPLIT in question:
        raise InvalidRequest("text contains a reserved control sequence", field="document")
    body = (fields.template or DOCUMENT_PLACEHOLDER).replace(DOCUMENT_PLACEHOLDER, document)
    user = f"{body}{_SPLIT}\n\n{question}"
    if llama.metadata.get("tokenizer.chat_template"):
        messages = (
            [{"role": "system", "content": fields.instructions}] if fields.instructions else []
        )
        rendered = _render_chat(llama, [*messages, {"role": "user", "content": user}], "document")
    else:  # a base model reads plain text
        head = f"{fields.instructions}\n\n" if fields.instructions else ""
        rendered = RenderedPrompt(text=f"{head}{user}\n", add_bos=True)
    split = rendered.text.index(_SPLIT)
    text = rendered.text[:split] + rendered.text[split + len(_SPLIT) :]
    return RenderedPrompt(text=text, add_bos=rendered.add_bos, prefix_chars=split)


def _render_chat(llama: Llama, messages: list[dict[str, Any]], field: str) -> RenderedPrompt:
    template = llama.metadata.get("tokenizer.chat_template")
    if not template:
        raise InvalidRequest("this model has no chat template; send 'prompt'", field=field)
    bos = _special_text(llama, llama.token_bos())
    eos = _special_text(llama, llama.token_eos())
    formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    try:
        text = formatter(messages=messages).prompt  # type: ignore[arg-type]
    except Exception as exc:  # jinja raises many types; the template rejected these messages
        raise InvalidRequest(f"chat template rejected the {field}: {exc}", field=field) from exc
    # Templates that write the BOS token themselves must not get a second one.
    add_bos = not (bos and text.startswith(bos))
    return RenderedPrompt(text=text, add_bos=add_bos)


def tokenize(llama: Llama, prompt: RenderedPrompt) -> list[int]:
    return tokenize_parts(llama, prompt)[0]


def tokenize_parts(llama: Llama, prompt: RenderedPrompt) -> tuple[list[int], int | None]:
    """The prompt's tokens, and where its shared prefix ends (None: no declared prefix).

    The prefix is tokenized on its own so that no token straddles its end: its tokens do not
    depend on the text that follows.
    """
    if prompt.prefix_chars is None:
        return _tokens(llama, prompt.text, prompt.add_bos), None
    head = _tokens(llama, prompt.text[: prompt.prefix_chars], prompt.add_bos)
    tail = _tokens(llama, prompt.text[prompt.prefix_chars :], False)
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
        split = rendered.prefix_chars or 0
        if prefix is None:
            prefix = _tokens(llama, rendered.text[:split], rendered.add_bos)
        tails.append(_tokens(llama, rendered.text[split:], False))
    return prefix or [], tails


def _tokens(llama: Llama, text: str, add_bos: bool) -> list[int]:
    return llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
