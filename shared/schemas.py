"""What crosses process boundaries: requests, job records and events."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_SEQUENCES = 8


def _encodable(value: str) -> str:
    # JSON may carry lone UTF-16 surrogates ("\ud800"); they have no UTF-8 form to tokenize.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text contains an unpaired surrogate (not valid Unicode)") from None
    return value


Text = Annotated[str, AfterValidator(_encodable)]


class JobStatus(StrEnum):
    QUEUED = "queued"
    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELLED)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Text


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, gt=0, le=1_000_000)
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: list[Text] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _non_empty(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value


class JobRequest(SamplingParams):
    """`POST /v1/jobs`: a raw `prompt` or chat `messages`, exactly one of them."""

    prompt: Text | None = None
    messages: list[Message] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class RenderedPrompt(BaseModel):
    """The exact text the model reads, after the chat template, and how to tokenize it."""

    text: str
    add_bos: bool


class WorkOrder(BaseModel):
    """What a worker needs to run a generation job; stored in the job record by the API."""

    prompt: RenderedPrompt
    prompt_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    # Jobs with different namespaces never share cached or in-memory prefixes.
    cache_namespace: str | None = None


class Usage(BaseModel):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class Timings(BaseModel):
    queued_ms: float | None = None
    restore_ms: float | None = None
    prefill_ms: float | None = None
    ttft_ms: float | None = None
    decode_tokens_per_s: float | None = None


FinishReason = Literal["stop", "length", "cancelled"]


class JobResult(BaseModel):
    text: str
    finish_reason: FinishReason


class JobView(BaseModel):
    """A job as the API shows it."""

    id: str
    status: JobStatus
    queue: str
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    result: JobResult | None = None
    usage: Usage = Usage()
    timings: Timings = Timings()
    error: str | None = None


class TokenEvent(BaseModel):
    index: int
    text: str


class CacheReport(BaseModel):
    """The prefix cache: entries and bytes on disk, counters summed over every worker."""

    enabled: bool
    dir: str
    fingerprint: str | None = None
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    # Everything in the directory (every model's entries): what max_bytes is enforced on.
    directory_bytes: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
