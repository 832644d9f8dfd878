"""OpenAI's request shapes, and how each becomes an ordinary granary job request.

Fields granary honours are mapped onto the job; fields that would change the output in ways
granary cannot honour are refused with a 400 naming them (as vLLM and llama.cpp's server do);
fields that only label a request are ignored.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.errors import InvalidRequest
from shared.schemas import CACHE, MAX_STOP_SEQUENCES, SPECIAL_TOKENS, JobRequest, Message, Text

# `n` choices are `n` jobs on the same prompt (a worker reads it once: the later ones follow
# the first's prefill); more than this many is a 400.
MAX_CHOICES = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are read."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    """A chat message as OpenAI clients send it.

    `developer` is the system role under its newer name; content may be a list of text parts
    (joined with newlines, as vLLM does); `name` is accepted and not rendered (the models'
    chat templates have no place for it). Other fields of a message are ignored.
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart]
    name: Text | None = None

    def message(self, index: int) -> Message:
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return Message(role=role, content=self.content)
        texts = []
        for i, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"only text content parts are supported (got {part.type!r})",
                    field=f"messages.{index}.content.{i}",
                )
            texts.append(part.text)
        return Message(role=role, content="\n".join(texts))


class _Common(BaseModel):
    # Unknown fields (user, metadata, store, presence_penalty, ...) are accepted and ignored;
    # known ones must have their JSON type, as on granary's own endpoints.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    # granary's own (an extra body field): as on `POST /v1/jobs`.
    cache: bool = Field(True, description=CACHE)

    def refuse_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be from 1 to {MAX_CHOICES}", field="n")
        if self.logprobs not in (None, False, 0):
            raise InvalidRequest("logprobs are not supported", field="logprobs")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", field="logit_bias")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidRequest(f"at most {MAX_STOP_SEQUENCES} stop sequences", field="stop")

    def sampling(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "cache": self.cache,
        }

    @abstractmethod
    def job_request(self) -> JobRequest: ...

    def job_requests(self) -> list[JobRequest]:
        """One job per distinct choice. Greedy choices are all the same text (granary's greedy
        output depends on nothing but the prompt), so `n` of them are one job, its text given
        `n` times; sampled choice i is sampled with `seed + i` when a seed is given (so the
        whole response repeats), else each with a seed of its own."""
        job = self.job_request()
        if self.n == 1 or self.temperature == 0:
            return [job]
        seeds = [None if self.seed is None else (self.seed + i) % 2**32 for i in range(self.n)]
        return [job.model_copy(update={"seed": seed}) for seed in seeds]


class CompletionRequest(_Common):
    prompt: Text | list[Text]
    # granary's own: as on `POST /v1/jobs`, the prompt's control-token text stays plain text
    # unless asked for (clients send it as an extra body field).
    special_tokens: bool = Field(False, description=SPECIAL_TOKENS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def job_request(self) -> JobRequest:
        self.refuse_unsupported()
        if self.echo:
            raise InvalidRequest("echo is not supported", field="echo")
        if self.best_of not in (None, 1):
            raise InvalidRequest("only best_of=1 is supported", field="best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", field="suffix")
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise InvalidRequest("send one prompt per request", field="prompt")
            prompt = prompt[0]
        return JobRequest(prompt=prompt, special_tokens=self.special_tokens, **self.sampling())


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0, le=1_000_000)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def job_request(self) -> JobRequest:
        self.refuse_unsupported()
        if self.tools:
            raise InvalidRequest("tools are not supported", field="tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise InvalidRequest(
                "only the text response format is supported", field="response_format"
            )
        sampling = self.sampling()
        sampling["max_tokens"] = self.max_completion_tokens or self.max_tokens
        messages = [m.message(i) for i, m in enumerate(self.messages)]
        return JobRequest(messages=messages, **sampling)
