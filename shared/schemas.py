"""What crosses process boundaries: requests, job records and events."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    computed_field,
    field_validator,
    model_validator,
)

MAX_STOP_SEQUENCES = 8


def _encodable(value: str) -> str:
    # JSON may carry lone UTF-16 surrogates ("\ud800"); they have no UTF-8 form to tokenize.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text contains an unpaired surrogate (not valid Unicode)") from None
    return value


Text = Annotated[str, AfterValidator(_encodable)]

# What clients send: unknown fields are refused, and so are values of the wrong JSON type
# ("4" or 4.0 or true for an integer, "0.5" for a number) rather than quietly converted.
REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)


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
    model_config = REQUEST_CONFIG

    role: Literal["system", "user", "assistant"]
    content: Text


Speculation = Literal["auto", "on", "off"]


class SamplingParams(BaseModel):
    model_config = REQUEST_CONFIG

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


CACHE = (
    "Answer from the result of an identical earlier request when one is stored (greedy or "
    "seeded requests only), and store this one's. False: always run, and store nothing."
)
DOCUMENT_PLACEHOLDER = "{document}"
SPECIAL_TOKENS = (
    "Read control-token text in a plain `prompt` (e.g. `<|im_start|>`) as the model's control "
    "tokens. Default false: all text a request supplies (prompt, messages, document, "
    "instructions, template, questions) is plain text; only the chat template's own markers "
    "are control tokens."
)
# How a document is read before it is rendered (shared/normalize): as sent, as clean text, or
# as one "label: value" fact per line.
DocumentFormat = Literal["raw", "text", "facts"]
DocumentType = Literal["text", "html", "markdown", "csv", "tsv"]


class DocumentFields(BaseModel):
    """A document and how it is introduced: the prefix many requests about it share.

    `instructions` become the system message; `template` (containing `{document}`) wraps the
    document in the user message. Everything up to the end of the wrapped document is the
    shared prefix, which the cache and the warmer keep whole.
    """

    model_config = REQUEST_CONFIG

    document: Text | None = Field(None, min_length=1)
    instructions: Text | None = None
    template: Text | None = None
    # Normalised in the API before rendering; the normalised text is the prefix that is
    # cached and warmed, and a job's order keeps it with the format used. `facts` by default:
    # the accuracy exam scored it at least as well as `raw` on both models (docs/BENCHMARKS.md).
    document_format: DocumentFormat = "facts"
    # Detected when not given; a declared type the document does not fit is refused.
    document_type: DocumentType | None = None

    @field_validator("template")
    @classmethod
    def _has_placeholder(cls, value: str | None) -> str | None:
        if value is not None and DOCUMENT_PLACEHOLDER not in value:
            raise ValueError(f"template must contain {DOCUMENT_PLACEHOLDER}")
        return value

    def _check_document_fields(self) -> None:
        if self.document is None and (self.instructions is not None or self.template is not None):
            raise ValueError("'instructions' and 'template' need a 'document'")
        if self.document is None and (
            "document_format" in self.model_fields_set or self.document_type is not None
        ):
            raise ValueError("'document_format' and 'document_type' need a 'document'")


class JobRequest(SamplingParams, DocumentFields):
    """`POST /v1/jobs`: a raw `prompt` or chat `messages`, exactly one of them.

    With a `document`, `prompt` is the question asked about it.
    """

    prompt: Text | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    special_tokens: bool = Field(False, description=SPECIAL_TOKENS)
    # Speculative decoding: drafts verified inside the worker's decode passes, output as
    # without (worker/conclave/drafts.py). None: the server's default (`jobs.speculation`).
    speculation: Speculation | None = None
    cache: bool = Field(True, description=CACHE)

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.document is not None and self.messages is not None:
            raise ValueError("with 'document', ask the question in 'prompt', not 'messages'")
        self._check_document_fields()
        _check_special_tokens(self)
        return self


def _check_special_tokens(request: JobRequest | WarmItem) -> None:
    if request.special_tokens and (request.prompt is None or request.document is not None):
        raise ValueError("'special_tokens' applies to a plain 'prompt' (no 'messages', 'document')")


QuestionId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
MAX_QUESTIONS = 256
# Voted answers: samples per question, and the streams one extraction may ask for in all.
MAX_SAMPLES = 16
MAX_SAMPLED_ANSWERS = 1024


class ExtractionQuestion(BaseModel):
    model_config = REQUEST_CONFIG

    id: QuestionId
    question: Text = Field(min_length=1)


class ExtractionRequest(SamplingParams, DocumentFields):
    """`POST /v1/extractions`: many questions about one document, answered together.

    `fields` ({"name": "description"}) asks one question per field and also returns the
    answers as one JSON object. `max_tokens` is per answer. Greedy by default.

    `samples` > 1 votes: sample 0 is the greedy answer, the others sample at `temperature`
    (seeded from `seed`), and the answer most of them agree on wins (worker/vote.py).
    """

    temperature: float = Field(0.0, ge=0.0, le=2.0)
    samples: int = Field(1, ge=1, le=MAX_SAMPLES)
    # As on jobs.
    speculation: Speculation | None = None
    cache: bool = Field(True, description=CACHE)
    questions: list[ExtractionQuestion] | None = Field(None, min_length=1, max_length=MAX_QUESTIONS)
    fields: dict[QuestionId, Text] | None = Field(None, min_length=1, max_length=MAX_QUESTIONS)

    @model_validator(mode="after")
    def _one_kind(self) -> ExtractionRequest:
        if self.document is None:
            raise ValueError("'document' is required")
        if (self.questions is None) == (self.fields is None):
            raise ValueError("give exactly one of 'questions' or 'fields'")
        ids = [q.id for q in self.questions or []]
        if len(set(ids)) != len(ids):
            raise ValueError("question ids must be unique")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(
                "'samples' above 1 votes over sampled answers: give a 'temperature' above 0 "
                "(sample 0 stays greedy)"
            )
        asked = len(self.questions or self.fields or ()) * self.samples
        if asked > MAX_SAMPLED_ANSWERS:
            raise ValueError(
                f"questions x samples is {asked}: at most {MAX_SAMPLED_ANSWERS} answers per request"
            )
        return self

    def as_questions(self) -> list[ExtractionQuestion]:
        if self.questions is not None:
            return self.questions
        return [
            ExtractionQuestion(
                id=name,
                question=f"What is the {name} ({description})? Answer with the value only.",
            )
            for name, description in (self.fields or {}).items()
        ]


class RenderedPrompt(BaseModel):
    """The exact text the model reads, after the chat template, and how to tokenize it."""

    text: str
    add_bos: bool
    # The shared prefix (a document) ends at this character. It is tokenized on its own, so
    # its tokens are the same whatever follows, and prefill ends a chunk there, so its cached
    # state is restorable in full.
    prefix_chars: int | None = None
    # The character spans the chat template wrote as control tokens (or, for a raw prompt
    # sent with `special_tokens`, the prompt's control-token text): only these are tokenized
    # as control tokens; everything else is plain text, whatever it contains. None: a job
    # recorded before spans were (queued across an upgrade, or re-run after a crash), whose
    # text is read as it was then, every control-token text a control token.
    control_spans: list[tuple[int, int]] | None = None


class WarmItem(DocumentFields):
    """One prefix to pre-compute: a `prompt`, chat `messages` or a `document`.

    A document is warmed up to its end (what every question about it shares); a prompt or
    messages up to the last token, so the same request later restores all of it.
    """

    model_config = REQUEST_CONFIG

    name: Text | None = Field(None, max_length=200)
    prompt: Text | None = Field(None, min_length=1)
    messages: list[Message] | None = Field(None, min_length=1)
    special_tokens: bool = Field(False, description=SPECIAL_TOKENS)

    @model_validator(mode="after")
    def _one_input(self) -> WarmItem:
        given = [f for f in ("prompt", "messages", "document") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'prompt', 'messages' or 'document'")
        self._check_document_fields()
        _check_special_tokens(self)
        return self


class WarmRequest(WarmItem):
    """`POST /v1/warm`: one item, or `documents` sharing `instructions` and `template`."""

    documents: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=1000
    )

    @model_validator(mode="before")
    @classmethod
    def _documents_are_items(cls, data: object) -> object:
        # Validated as if the first document were `document`; `items()` expands the rest.
        if isinstance(data, dict) and data.get("documents"):
            if data.get("document") is not None:
                raise ValueError("give 'document' or 'documents', not both")
            docs = data["documents"]
            if isinstance(docs, list) and docs:
                return {**data, "document": docs[0]}
        return data

    def items(self) -> list[WarmItem]:
        # Only what was sent: a default named here would count as given (`_check_document_fields`).
        base = self.model_dump(exclude={"documents"}, exclude_unset=True)
        if not self.documents:
            return [WarmItem.model_validate(base)]
        return [WarmItem.model_validate({**base, "document": d}) for d in self.documents]


WarmTrigger = Literal["schedule", "catch-up", "manual", "learned"]


class WarmOrder(BaseModel):
    """What a worker needs to run a warm job. The worker renders it with its own model."""

    item: WarmItem
    cache_namespace: str | None = None
    run_id: str | None = None


class WarmResult(BaseModel):
    """A finished warm job: how long the prefix is and how much of it had to be computed."""

    prefix_tokens: int
    cached_tokens: int
    warmed_tokens: int
    already_cached: bool
    # Times it stepped aside for interactive or batch jobs (resuming from its last chunk).
    yielded: int = 0


class ResultKey(BaseModel):
    """Where a job's result is stored to answer identical requests (shared/result_cache.py)."""

    digest: str
    # What decides output besides the request (model, context, chunking, engine), as the API
    # saw it: a worker whose own differs does not store its result under this digest.
    identity: str


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
    speculation: Speculation = "off"
    # The document the prompt was rendered from: workers record its use, and the warmer
    # re-warms documents that are used often (rendering them again for whatever model runs).
    document: DocumentFields | None = None
    # None: the result is not stored (not greedy or seeded, or the request said `cache: false`).
    result_key: ResultKey | None = None


class ExtractOrder(BaseModel):
    """What a worker needs to run an extraction job."""

    document: DocumentFields
    questions: list[ExtractionQuestion]
    fields: bool
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    samples: int = 1
    cache_namespace: str | None = None
    speculation: Speculation = "off"
    result_key: ResultKey | None = None


class SpeculationReport(BaseModel):
    """How drafting did in one job that asked for it (worker/conclave/drafts.py): draft rows
    its passes carried, and how many of them it wrote."""

    mode: Speculation
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float | None = None


class DocumentReport(BaseModel):
    """How a request's document was normalised (`document_format` text or facts)."""

    format: DocumentFormat
    # The format of the text used: `format`, or a safer one when the requested one failed
    # the fact-preservation self-check (`missing` lists what it would have lost).
    used: DocumentFormat
    type: DocumentType
    chars_before: int
    chars_after: int
    # The document alone, counted with the model's tokenizer.
    tokens_before: int
    tokens_after: int
    # Lines output, lines dropped per reason, lines kept only for a fact, values checked.
    kept: dict[str, int]
    missing: list[str] = []


class Usage(BaseModel):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Completion tokens an earlier attempt streamed before its worker died, taken as given.
    resumed_tokens: int = 0
    # Answered from the stored result of an identical earlier request: nothing was computed.
    cached_result: bool = False


class Timings(BaseModel):
    queued_ms: float | None = None
    restore_ms: float | None = None
    prefill_ms: float | None = None
    ttft_ms: float | None = None
    decode_tokens_per_s: float | None = None
    # A prefix found on disk: restored, or prefilled again because reading it was expected to
    # cost more; both estimates (worker/restore_cost.py). The recompute estimate is null before
    # the worker has measured a prefill (it then restores).
    restore_choice: Literal["restore", "recompute"] | None = None
    restore_estimate_ms: float | None = None
    recompute_estimate_ms: float | None = None


FinishReason = Literal["stop", "length", "cancelled"]
JobKind = Literal["generate", "warm", "extract"]


class JobResult(BaseModel):
    text: str
    finish_reason: FinishReason


class Variant(BaseModel):
    text: str
    votes: int


class Vote(BaseModel):
    """How a voted answer's samples agreed (`samples` > 1)."""

    # The winner's votes over the samples counted.
    agreement: float
    # Samples decoded to their end; once no other answer could win, the rest were stopped.
    counted: int
    samples: int
    # Distinct answers, most votes first (ties: the lowest sample's); the first is the answer.
    variants: list[Variant]


class Answer(BaseModel):
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    vote: Vote | None = None


class ExtractionResult(BaseModel):
    answers: dict[str, Answer]
    # With `fields`: each field's answer, stripped.
    object: dict[str, str] | None = None


class JobView(BaseModel):
    """A job as the API shows it."""

    id: str
    kind: JobKind = "generate"
    status: JobStatus
    queue: str
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    result: JobResult | None = None
    warm: WarmResult | None = None
    extraction: ExtractionResult | None = None
    speculation: SpeculationReport | None = None
    usage: Usage = Usage()
    timings: Timings = Timings()
    # A normalised document: its format, type and token counts before and after.
    document: DocumentReport | None = None
    error: str | None = None


class TokenEvent(BaseModel):
    index: int
    text: str
    # Extraction jobs: which question's answer this token belongs to.
    question: str | None = None
    # The token the text came from; None for text released when an answer ends.
    token: int | None = None


class AnswerEvent(BaseModel):
    """Extraction jobs: one question's answer is complete."""

    index: int
    question: str
    answer: Answer


class CacheReport(BaseModel):
    """The prefix cache: entries and bytes on disk, counters summed over every worker."""

    enabled: bool
    # Only `granary cache stats` (run on the host) shows where the cache lives; the API does not.
    dir: str | None = None
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
    # What workers count of their memory, restores and saves (shared/prefix_cache/cache.py
    # says what each holds), and below, what an operator watches, computed from them.
    prompts: int = 0
    memory_hits: int = 0
    memory_hit_tokens: int = 0
    restores_skipped: int = 0
    restore_ms: int = 0
    prefill_saved_ms: int = 0
    saves: int = 0
    save_ms: int = 0
    saves_deferred: int = 0
    saves_dropped: int = 0
    decode_pass_ms: int = 0
    saving_steps: int = 0
    saving_step_ms: int = 0
    saving_step_baseline_ms: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def memory_hit_ratio(self) -> float | None:
        """Prompts that started from a prefix worker memory held."""
        return self.memory_hits / self.prompts if self.prompts else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def disk_hit_ratio(self) -> float | None:
        """Prompts that started from a prefix restored from disk."""
        return self.hits / self.prompts if self.prompts else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def net_saved_s(self) -> float:
        """Prefill time restores saved, less the time spent restoring and saving."""
        return (self.prefill_saved_ms - self.restore_ms - self.save_ms) / 1000

    @computed_field  # type: ignore[prop-decorator]
    @property
    def restore_bytes_per_s(self) -> float | None:
        return self.bytes_read / self.restore_ms * 1000 if self.restore_ms else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def decode_vs_baseline(self) -> float | None:
        """Decode time against what it would have been with no save under way: the seeds'
        alarm is above 1.15."""
        added = self.saving_step_ms - self.saving_step_baseline_ms
        lone = self.decode_pass_ms - added
        return self.decode_pass_ms / lone if self.decode_pass_ms and lone > 0 else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def saving_step_ratio(self) -> float | None:
        """Decode passes run while a save was under way, against their time with none."""
        if not self.saving_step_baseline_ms:
            return None
        return self.saving_step_ms / self.saving_step_baseline_ms


class BatchItem(ExtractionRequest):
    custom_id: Annotated[str, Field(min_length=1, max_length=200)]


class BatchRequest(BaseModel):
    """`POST /v1/batches`: extraction requests, one job each on the `batch` queue."""

    model_config = REQUEST_CONFIG

    items: list[BatchItem] = Field(min_length=1, max_length=10_000)

    @field_validator("items")
    @classmethod
    def _unique_ids(cls, items: list[BatchItem]) -> list[BatchItem]:
        ids = [item.custom_id for item in items]
        if len(set(ids)) != len(ids):
            raise ValueError("custom_id values must be unique within a batch")
        return items


class BatchView(BaseModel):
    id: str
    created_at: float
    finished_at: float | None = None
    total: int
    # queued, running, succeeded, failed, cancelled
    counts: dict[str, int]
    # Summed over ended items.
    usage: Usage = Usage()


class BatchResultLine(BaseModel):
    """One line of a batch's JSON Lines results."""

    custom_id: str
    job_id: str
    status: JobStatus
    extraction: ExtractionResult | None = None
    usage: Usage | None = None
    error: str | None = None
