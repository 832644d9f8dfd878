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

from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from shared.errors import InvalidRequest, ModelUnavailable
from shared.models import resolve_model
from shared.schemas import JobRequest, RenderedPrompt
from shared.settings import Settings

log = logging.getLogger(__name__)


def load_llama(settings: Settings, *, vocab_only: bool = False) -> Llama:
    path = resolve_model(settings.model, settings.data_dir)
    try:
        with _quiet_native_logs():
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
def _quiet_native_logs() -> Iterator[None]:
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
    if request.prompt is not None:
        return RenderedPrompt(text=request.prompt, add_bos=True)
    template = llama.metadata.get("tokenizer.chat_template")
    if not template:
        raise InvalidRequest("this model has no chat template; send 'prompt'", field="messages")
    bos = _special_text(llama, llama.token_bos())
    eos = _special_text(llama, llama.token_eos())
    formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    messages = [m.model_dump() for m in request.messages or []]
    try:
        text = formatter(messages=messages).prompt  # type: ignore[arg-type]
    except Exception as exc:  # jinja raises many types; the template rejected these messages
        raise InvalidRequest(
            f"chat template rejected the messages: {exc}", field="messages"
        ) from exc
    # Templates that write the BOS token themselves must not get a second one.
    add_bos = not (bos and text.startswith(bos))
    return RenderedPrompt(text=text, add_bos=add_bos)


def tokenize(llama: Llama, prompt: RenderedPrompt) -> list[int]:
    return llama.tokenize(prompt.text.encode("utf-8"), add_bos=prompt.add_bos, special=True)
