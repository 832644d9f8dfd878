"""Turning a validated request into a queued job: render, count tokens, check, record, enqueue.

Everything that can be wrong with a request is found here, before anything reaches a worker.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import uuid

from llama_cpp import Llama
from redis import Redis

from shared import codec, documents, keys, result_cache, routing
from shared.errors import ContextOverflow, IdempotencyConflict, InvalidRequest
from shared.job_store import JobStore
from shared.llm import document_prompts, render_prompt, render_warm, token_bytes, tokenize
from shared.prefix_usage import document_prefix_id
from shared.queues import ROUTED, RUN_EXTRACT, RUN_JOB, enqueue, queue
from shared.result_cache import ResultCache
from shared.schemas import (
    DocumentFields,
    DocumentReport,
    ExtractionRequest,
    ExtractOrder,
    JobKind,
    JobRequest,
    JobStatus,
    JobView,
    Speculation,
    WarmItem,
    WorkOrder,
)
from shared.settings import Settings

log = logging.getLogger(__name__)

DOCUMENT_FIELDS = set(DocumentFields.model_fields)


def work_order_for(
    tokenizer: Llama,
    request: JobRequest,
    *,
    n_ctx: int,
    default_max_tokens: int,
    default_speculation: Speculation = "off",
) -> WorkOrder:
    """Render and count the prompt; refuse one that leaves no room in the context window."""
    prompt = render_prompt(tokenizer, request)
    n_prompt = len(tokenize(tokenizer, prompt))
    field = "messages"
    if request.document is not None:
        field = "document"
    elif request.prompt is not None:
        field = "prompt"
    if n_prompt == 0:
        raise InvalidRequest(f"{field} is empty: there is nothing to generate from", field=field)
    if n_prompt >= n_ctx:
        raise ContextOverflow(
            f"{field} is {n_prompt} tokens; the context window is {n_ctx} tokens "
            f"(at most {n_ctx - 1} prompt tokens)",
            field=field,
        )
    return WorkOrder(
        prompt=prompt,
        prompt_tokens=n_prompt,
        max_tokens=request.max_tokens or default_max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        # A fixed seed makes a re-run after a worker crash repeat the tokens already sent.
        seed=request.seed if request.seed is not None else secrets.randbelow(2**32),
        stop=request.stop,
        speculation=request.speculation or default_speculation,
        document=DocumentFields.model_validate(request.model_dump(include=DOCUMENT_FIELDS))
        if request.document is not None
        else None,
    )


def extract_order_for(
    tokenizer: Llama,
    request: ExtractionRequest,
    *,
    n_ctx: int,
    default_max_tokens: int,
    default_speculation: Speculation = "off",
) -> ExtractOrder:
    """Check that every question fits next to the document; answers may come in waves."""
    questions = request.as_questions()
    max_tokens = request.max_tokens or default_max_tokens
    prefix, tails = document_prompts(tokenizer, request, [q.question for q in questions])
    for question, tail in zip(questions, tails, strict=True):
        over = len(prefix) + len(tail) + max_tokens - n_ctx
        if over > 0:
            raise ContextOverflow(
                f"question {question.id!r} does not fit: document {len(prefix)} + question "
                f"{len(tail)} + max_tokens {max_tokens} tokens is {over} more than the context "
                f"window ({n_ctx})",
                field="questions" if request.questions is not None else "fields",
            )
    return ExtractOrder(
        document=DocumentFields.model_validate(request.model_dump(include=DOCUMENT_FIELDS)),
        questions=questions,
        fields=request.fields is not None,
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed if request.seed is not None else secrets.randbelow(2**32),
        stop=request.stop,
        samples=request.samples,
        speculation=request.speculation or default_speculation,
    )


class Submitter:
    def __init__(
        self,
        redis: Redis,
        store: JobStore,
        tokenizer: Llama,
        settings: Settings,
        results: ResultCache | None = None,
    ) -> None:
        self._redis = redis
        self._store = store
        self._tokenizer = tokenizer
        self._settings = settings
        self._results = results
        # Rendering and tokenizing a long prompt holds a core; bound how many run at once.
        self._tokenizing = threading.BoundedSemaphore(settings.api.tokenize_concurrency)
        self._longest_token = longest_token_bytes(tokenizer)
        self._routing = routing.Routing(redis) if settings.routing.enabled else None

    def submit(
        self,
        request: JobRequest | ExtractionRequest,
        *,
        queue_name: str,
        idempotency_key: str | None = None,
        owner: str | None = None,
    ) -> JobView:
        """A generation job, or an extraction job (many questions about one document)."""
        with self._tokenizing:
            document = self._normalized(request)
            used = request if document is None else document[0]
            # After normalising: a page that reads short as facts is judged as facts.
            self._refuse_certain_overflow(used)
            order = self._order(used)
        kind: JobKind = "extract" if isinstance(order, ExtractOrder) else "generate"
        if self._settings.cache.per_key and owner is not None:
            order = order.model_copy(update={"cache_namespace": owner})
        order = self._keyed(order, request)
        job_id = uuid.uuid4().hex
        report = None if document is None else document[1]
        view = self._store.create(job_id, queue_name, order, owner, kind=kind, document=report)
        if idempotency_key is not None:
            existing = self._deduplicate(job_id, request, owner, idempotency_key)
            if existing is not None:
                return self._store.get(existing)
        stored = self._stored_result(order)
        if stored is not None:  # finished now: no worker needed
            result_cache.answer(self._store, job_id, view.created_at, stored)
            return self._store.get(job_id)
        self._enqueue(order, kind, queue_name, job_id)
        return view

    def _keyed(
        self, order: WorkOrder | ExtractOrder, request: JobRequest | ExtractionRequest
    ) -> WorkOrder | ExtractOrder:
        """The order with its result-store key, if it has one: its worker stores the result
        under it, and an identical request later finds it."""
        if self._results is None:
            return order
        wanted, seeded = request.cache, request.seed is not None
        key = self._results.key_for(order, explicit_seed=seeded, wanted=wanted)
        return order if key is None else order.model_copy(update={"result_key": key})

    def _stored_result(self, order: WorkOrder | ExtractOrder) -> result_cache.Entry | None:
        """The result an identical earlier request left in the store, if any."""
        if self._results is None or order.result_key is None:
            return None
        return self._results.lookup(order.result_key)

    def _enqueue(
        self, order: WorkOrder | ExtractOrder, kind: JobKind, queue_name: str, job_id: str
    ) -> None:
        """Onto its queue; a job about a document goes, in the same transaction, to the private
        list of the live worker whose memory holds it, if one has room (shared/routing.py)."""
        function = RUN_EXTRACT if kind == "extract" else RUN_JOB
        if self._routing is None or order.document is None or queue_name not in ROUTED:
            enqueue(self._redis, queue_name, function, job_id, self._settings)
            return
        prefix = document_prefix_id(order.document, order.cache_namespace)
        with self._redis.pipeline() as pipe:
            enqueue(self._redis, queue_name, function, job_id, self._settings, pipeline=pipe)
            self._routing.route(pipe, queue_name, job_id, prefix)
            owner = pipe.execute()[-1]
        if owner:
            log.debug("job %s goes to worker %s, which holds its document", job_id, owner)

    def warm_item(self, item: WarmItem) -> WarmItem:
        """The item as it will be warmed (document normalised, as requests normalise it),
        refused if its prefix does not fit the context window, as a request's prompt is."""
        with self._tokenizing:
            item = documents.normalized(item)[0]
            self._refuse_certain_overflow(item)
            n_tokens = len(tokenize(self._tokenizer, render_warm(self._tokenizer, item)))
        n_ctx = self._settings.n_ctx
        if n_tokens >= n_ctx:
            field = "document" if item.document is not None else "prompt"
            label = item.name or field
            raise ContextOverflow(
                f"{label} is {n_tokens} tokens; the context window is {n_ctx} tokens", field=field
            )
        return item

    def _refuse_certain_overflow(self, request: JobRequest | ExtractionRequest | WarmItem) -> None:
        """Refuse, without tokenizing it, a text too long for the context whatever its tokens.

        No token is longer than the vocabulary's longest, so a text of n bytes is at least
        n / longest tokens; tokenizing a few megabytes would hold a core for seconds first.
        """
        texts = {"document": request.document}
        if not isinstance(request, ExtractionRequest):
            texts["prompt"] = request.prompt
            texts["messages"] = "".join(m.content for m in request.messages or [])
        n_ctx = self._settings.n_ctx
        for field, text in texts.items():
            at_least = len((text or "").encode()) // self._longest_token
            if at_least >= n_ctx:
                raise ContextOverflow(
                    f"{field} is at least {at_least} tokens; the context window is {n_ctx} tokens",
                    field=field,
                )

    def _normalized(
        self, request: JobRequest | ExtractionRequest
    ) -> tuple[JobRequest | ExtractionRequest, DocumentReport] | None:
        """The request with its document normalised (`document_format`), and the report."""
        changed, result = documents.normalized(request)
        if result is None:
            return None
        return changed, documents.report(self._tokenizer, request.document or "", result)

    def _order(self, request: JobRequest | ExtractionRequest) -> WorkOrder | ExtractOrder:
        jobs = self._settings.jobs
        n_ctx, max_tokens, speculation = (
            self._settings.n_ctx,
            jobs.default_max_tokens,
            jobs.speculation,
        )
        if isinstance(request, ExtractionRequest):
            return extract_order_for(
                self._tokenizer,
                request,
                n_ctx=n_ctx,
                default_max_tokens=max_tokens,
                default_speculation=speculation,
            )
        return work_order_for(
            self._tokenizer,
            request,
            n_ctx=n_ctx,
            default_max_tokens=max_tokens,
            default_speculation=speculation,
        )

    def failed(
        self, request: ExtractionRequest, queue_name: str, owner: str | None, error: str
    ) -> JobView:
        """Record a request that cannot run as a failed job (a batch item; the rest go on)."""
        job_id = uuid.uuid4().hex
        self._store.create(job_id, queue_name, request, owner, kind="extract")
        self._store.finish(job_id, JobStatus.FAILED, error=error)
        return self._store.get(job_id)

    def cancel(self, job_id: str, owner: str | None) -> JobView:
        """Cancel; a queued job also leaves its rq queue, so queue depth stays true."""
        view = self._store.cancel(job_id, owner)
        queue(self._redis, view.queue).remove(job_id)
        routing.unqueue(self._redis, view.queue, job_id)
        return view

    def _deduplicate(
        self, job_id: str, request: JobRequest | ExtractionRequest, owner: str | None, key: str
    ) -> str | None:
        """The job `key` already names (this new one is then discarded), or None."""
        scoped = f"{owner or ''}:{key}"  # one key's idempotency keys never reach another's jobs
        try:
            existing = self._claim_idempotency_key(scoped, job_id, _digest(request))
        except IdempotencyConflict:
            self._store.discard(job_id)
            raise
        if existing is not None:
            self._store.discard(job_id)
        return existing

    def _claim_idempotency_key(self, key: str, job_id: str, digest: str) -> str | None:
        """Bind `key` to `job_id`; returns the job id it was already bound to, if any.

        The binding keeps a digest of the request: the same key with another body is a client
        bug (or two clients sharing keys), answered 422 rather than with an unrelated job.
        """
        redis_key = keys.idempotency(key)
        ttl_s = self._settings.api.idempotency_ttl_s
        if self._redis.set(redis_key, f"{job_id} {digest}", nx=True, ex=ttl_s):
            return None
        raw: bytes | None = self._redis.get(redis_key)  # type: ignore[assignment]
        if raw is None:
            return None
        existing, _, bound_digest = raw.decode().partition(" ")
        if bound_digest and bound_digest != digest:  # bindings made before digests: trusted
            raise IdempotencyConflict(
                "Idempotency-Key was already used with a different request body",
                field="Idempotency-Key",
            )
        return existing


def _digest(request: JobRequest | ExtractionRequest) -> str:
    """The request as sent (defaults filled in), whatever its key order or spacing."""
    return hashlib.blake2b(codec.dumps(request.model_dump(mode="json")), digest_size=16).hexdigest()


def longest_token_bytes(tokenizer: Llama) -> int:
    """Bytes of the vocabulary's longest token (a fraction of a second, once per process)."""
    return max(len(token_bytes(tokenizer, t)) for t in range(tokenizer.n_vocab())) or 1
