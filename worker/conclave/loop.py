"""The Conclave: one model thread serving every active stream of a worker at once.

Each turn of the loop (1) ends cancelled streams, (2) gives waiting streams a sequence when
their cells fit, reusing the longest prefix memory or the disk cache holds, (3) prefills one
chunk of one stream (with other streams' short ones, within one chunk's rows), and
(4) decodes one token for every decoding stream in a single llama_decode (or several, where the
streams outnumber the rows a pass may have and stay exact).
So a long document is read one chunk at a time while the others keep decoding, and a short
prompt's prefill goes before a long one's. Which streams start, which one prefills and which
share a pass is decided apart from these passes, by plan.py.

Exactness: a prefill chunk ends where a lone run's does (worker/chunk_ends.py), or anywhere where a
prompt row reads alike in any pass (`_chunk_end`). With the kernels `make install` builds, a decode
row computed beside others gets the logits it gets alone, bit for bit (`rows_invariant`, checked at
start-up by row_check.py), so a batched step is exact as it is. With stock kernels it gets slightly
different logits (docs/BENCHMARKS.md); then, with `exact`, a greedy row whose top two logits nearly
tie is decided again after recomputing that stream's batched cells one token at a time
(near_tie.py), so greedy output does not depend on what else runs. Such a replay costs a lone
decode for every cell since the stream's last exact one, so a stream that met a near tie is decoded
alone from then on: on free text ties come every few tokens, and batching it would cost more than
the lone decodes it saves; a confident stream (an extraction's short answers) stays in the batch.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import Llama

from shared.errors import ContextOverflow
from shared.job_metrics import MODEL_COUNTERS
from shared.prefix_cache import (
    CacheHit,
    PrefixCache,
    ReadOffer,
    chunk_end,
    common_prefix_len,
    restorable_tokens,
)
from worker import kv_state
from worker.chunk_ends import chunk_ends, snapshot_points
from worker.conclave.disk_reads import DiskReads
from worker.conclave.drafts import Acceptance, PassCost, StreamDrafts, ubatch_rows
from worker.conclave.memory import Memory, Resident, Reuse
from worker.conclave.near_tie import TIE_MARGIN, is_near_tie
from worker.conclave.plan import (
    Decoding,
    Prefilling,
    Waiting,
    plan_admission,
    plan_decode,
    plan_prefill,
)
from worker.conclave.row_check import KernelFacts
from worker.conclave.streams import (
    Ended,
    EndReason,
    Event,
    Failed,
    Started,
    StreamHandle,
    StreamRequest,
    Token,
)
from worker.decode_batch import fill_batch
from worker.kernels import exact_row_limit, prompt_chunk_kernels
from worker.prefix_saver import PrefixSaver
from worker.restore_cost import Choice, RestoreCosts
from worker.sampling import sample
from worker.save_yield import SaveYield

log = logging.getLogger(__name__)

Logits = npt.NDArray[np.float32]
# A lookup that finds nothing, or a state the page cache holds, is done in a few milliseconds:
# waiting that long for it keeps such a start in its turn, as when it was read on the model
# thread; a longer read goes on while the other streams run.
QUICK_READ_S = 0.01
CacheFor = Callable[[str | None], PrefixCache | None]


class _State(Enum):
    WAITING = "waiting"  # no sequence yet
    READING = "reading"  # its prefix is being read from disk, off the model thread
    PREFILLING = "prefilling"
    DECODING = "decoding"
    HOLDING = "holding"  # prefilled, kept for the job's other streams to fork


@dataclass(frozen=True, slots=True)
class DiskRead:
    """What the disk gave a starting stream (`Conclave._look_on_disk`)."""

    hit: CacheHit | None  # a longer prefix than memory's, to restore
    offer: ReadOffer | None  # the state found, restored or not
    choice: Choice | None  # whether it was worth reading, and why
    seconds: float  # the lookup and read, on the reading thread


@dataclass(eq=False)
class _Stream:
    handle: StreamHandle
    arrival: int
    state: _State = _State.WAITING
    resident: Resident | None = None
    pos: int = 0  # next position to compute
    snapshots: set[int] = field(default_factory=set)
    next_token: int = 0
    generated: int = 0
    exact_until: int = 0  # cells below this were computed as a lone run computes them
    replays: int = 0
    # Exact batching: decoded alone from its first near tie on (see the module's doc).
    alone: bool = False
    drifted: bool = False  # see Ended.drifted
    passed_over: int = 0  # see plan.Prefilling
    rng: np.random.Generator | None = None
    # Waiting: the stream still prefilling a prefix of this one's prompt, and the cells of it
    # this one may reuse once that prefill reaches them (see `plan.plan_admission`).
    leader: _Stream | None = None
    reach: int = 0
    # Prefilling: the most urgent priority of the streams waiting on this one's prefill.
    led_priority: int | None = None
    # Decoding with `speculation` on or auto, on row-invariant kernels (drafts.py).
    drafts: StreamDrafts | None = None
    # Twins (see `_pair_twins`): a stream that has written every token another one has reads
    # that one's rows instead of computing its own; its own sequence holds cells
    # [0, own_until) only until it parts.
    twin_of: _Stream | None = None
    twins: list[_Stream] = field(default_factory=list)
    own_until: int = 0
    ended: bool = False
    read_from: float = 0.0  # Reading: perf_counter when its prefix was asked of the disk

    @property
    def request(self) -> StreamRequest:
        return self.handle.request

    @property
    def seq(self) -> int:
        assert self.resident is not None
        return self.resident.seq


class Conclave:
    def __init__(
        self,
        llama: Llama,
        cache_for: CacheFor,
        saver: PrefixSaver | None,
        *,
        block_tokens: int,
        min_snapshot_tokens: int,
        n_seq: int,
        truncatable: bool,
        startup: Callable[[], KernelFacts],
        exact: bool = True,
        costs: RestoreCosts | None = None,
        yielding: SaveYield | None = None,
    ) -> None:
        """`startup` runs first on the model thread, before any job: the warm-up decode, then
        whether batched rows equal lone ones (`rows_invariant`) and where a prompt chunk may be
        cut (row_check.py). If it raises, so does this.
        `costs`: what decides between restoring a prefix from disk and prefilling it again;
        `yielding`: the saver's, told what each decode pass took and when the model waits."""
        self.llama = llama
        self._cache_for = cache_for
        self._saver = saver
        self.costs = costs or RestoreCosts(None)
        self._yielding = yielding
        self._block_tokens = block_tokens
        self._min_snapshot_tokens = min_snapshot_tokens
        self._truncatable = truncatable
        # Snapshots are cut from one capture after the first token (`_save_snapshots`), where
        # the state can be cut: plain attention (a sliding window's cells are not the prompt's).
        self._cut_snapshots = truncatable
        self._exact = exact
        self.rows_invariant = False
        # Whether the chunks a turn reads share one pass (row_check.prompt_pieces_share_passes).
        self._chunks_share_passes = False
        self.shared_prompt_passes = 0  # passes that read chunks of several streams
        # Whether a prompt row reads alike in any pass (`_shape_free`).
        self._rows_shape_free = False
        self.first_tokens_in_chunks = 0  # drawn from a prompt chunk's last row (`_prompt_end`)
        self._granule: int | None = None  # `_use_granule`
        # What decode passes cost by their rows, and the most rows one may have and stay exact.
        self._pass_cost = PassCost()
        self._acceptance = Acceptance()  # of every drafting stream's guesses
        self.twin_rows = 0  # tokens drawn from another stream's row (`_pair_twins`)
        # Batched passes llama.cpp ran as several, their sequences not one run (memory.py).
        self.split_passes = 0
        # The model's work so far, by what it read: whole milliseconds and rows, as /metrics
        # shows them (`model_counters`); only the model thread writes them.
        self._model_work = dict.fromkeys(MODEL_COUNTERS, 0.0)
        self._max_rows = exact_row_limit()
        mem = llama_cpp.llama_get_memory(llama.ctx)
        self._mem = mem
        llama_cpp.llama_memory_clear(mem, True)
        self.n_seq = n_seq
        self.cells_per_seq = llama_cpp.llama_n_ctx_seq(llama.ctx)
        self._memory = Memory(mem, n_seq, block_tokens, truncatable)
        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        self._vocab = vocab
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self._capacity = max(llama.n_batch, n_seq)
        self._batch = llama_cpp.llama_batch_init(self._capacity, 0, 1)
        self._wake = threading.Event()
        self._reads: DiskReads[_Stream, DiskRead] = DiskReads(self._wake)
        self._lock = threading.Lock()
        self._incoming: list[_Stream] = []
        # Callers of `forget` waiting for the model thread to have dropped idle memory.
        self._forgets: list[threading.Event] = []
        self._streams: list[_Stream] = []
        self._arrivals = itertools.count()
        # Streams not yet ended, each owning (or waiting for) a sequence: what admission of
        # new jobs looks at.
        self._committed = 0
        # What memory holds, as the worker advertises it: replaced whole by the model thread,
        # so another thread reading it never sees one half-changed; `held_changed` is set
        # each time, so the worker tells routing at once, not at its next round.
        self._held: frozenset[str] = frozenset()
        self.held_changed = threading.Event()
        self._stopping = False
        started: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(startup, started), name="conclave", daemon=True
        )
        self._thread.start()
        failure = started.get()
        if failure is not None:
            self._thread.join()
            llama_cpp.llama_batch_free(self._batch)
            raise failure

    # --- the job threads' side -------------------------------------------------------------

    def submit(self, handle: StreamHandle) -> StreamHandle:
        """Queue a stream; its events arrive on the handle."""
        request = handle.request
        if request.cells > self.cells_per_seq:
            raise ContextOverflow(
                f"the request needs {request.cells} KV cells; a sequence has {self.cells_per_seq}"
            )
        with self._lock:
            if self._stopping:
                raise RuntimeError("the worker is stopping")
            self._incoming.append(_Stream(handle, next(self._arrivals)))
            self._committed += 1
        self._wake.set()
        return handle

    def handle(
        self,
        request: StreamRequest,
        on_token: Callable[[Token], bool] = lambda _token: False,
        events: queue.SimpleQueue[tuple[StreamHandle, Event]] | None = None,
        tag: int = 0,
    ) -> StreamHandle:
        """A handle for `request`; `events` may be shared with the job's other streams."""
        return StreamHandle(request, self._wake, on_token, events, tag)

    def held_documents(self) -> frozenset[str]:
        """Prefix ids of the documents memory holds whole (as of the last turn)."""
        return self._held

    def free_sequences(self) -> int:
        """Sequences no running or waiting stream has claimed (idle ones count as free)."""
        return self.n_seq - self._committed

    def forget(self) -> None:
        """Drop every idle sequence's cells, so the next prompt starts from the disk cache or
        cold; returns once the model thread has."""
        done = threading.Event()
        with self._lock:
            if self._stopping:
                return
            self._forgets.append(done)
        self._wake.set()
        done.wait()

    def close(self) -> None:
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join()
        self._reads.close()
        llama_cpp.llama_batch_free(self._batch)

    # --- the model thread ------------------------------------------------------------------

    def _run(
        self, startup: Callable[[], KernelFacts], started: queue.SimpleQueue[BaseException | None]
    ) -> None:
        # Every decode of the model happens on this one thread, the start-up's too. llama.cpp's
        # CPU backend runs a decode on an OpenMP team of the calling thread, and each thread
        # that ever decoded keeps a team: with a second one left from a decode on the main
        # thread, every decode here took much longer on 2 cores (docs/ARCHITECTURE.md).
        try:
            facts = startup()
        except BaseException as exc:
            started.put(exc)
            return
        self.rows_invariant = facts.rows_invariant
        self._chunks_share_passes = facts.shared_prompt_passes
        self._use_granule(facts.granule, self._chunks_share_passes)
        started.put(None)
        while True:
            with self._lock:
                stopping = self._stopping
                self._streams.extend(self._incoming)
                self._incoming.clear()
                forgets, self._forgets = self._forgets, []
            if forgets:
                self._memory.forget_idle()
                self._note_held()
            for done in forgets:
                done.set()
            if stopping:
                self._fail_all(RuntimeError("the worker stopped"))
                return
            try:
                worked = self._turn()
            except Exception as exc:  # a dead model thread would leave every job waiting
                log.exception("the conclave's turn failed; failing its streams")
                self._fail_all(exc)
                worked = False
            if not worked:
                self._waiting_for_work(True)
                self._wake.wait()
                self._wake.clear()
                self._waiting_for_work(False)

    def _use_granule(self, granule: int | None, shared_passes: bool) -> None:
        """Restores from memory, the disk and a leader may end inside a chunk at multiples of
        `granule` (`restorable_tokens`); not where prefill splits a chunk at other points
        (`n_batch` or llama.cpp's `n_ubatch` not multiples of it). With granule 1 and prompt
        pieces that read alike in a shared pass (`shared_passes`), a prompt row reads alike in
        any pass: restores may end at any token, and chunk ends are free (`_shape_free`)."""
        params = self.llama.context_params
        if granule is not None and (params.n_batch % granule or params.n_ubatch % granule):
            granule = None
        self._rows_shape_free = granule == 1 and shared_passes
        self._granule = self._memory.granule = granule
        self._memory.shape_free = self._rows_shape_free
        cache = self._cache_for(None)
        if cache is not None:  # namespaced caches are made from it, these included
            cache.granule, cache.shape_free = granule, self._rows_shape_free

    def _turn(self) -> bool:
        """One turn of the loop; False when there was nothing to do."""
        self._sweep()
        self._finish_read()
        self._start_waiting()
        worked = self._prefill()
        if worked:  # a prefill that just ended starts its followers, in time for its first step
            self._start_waiting()
        worked = self._step() or worked
        self._note_held()
        return worked

    def _note_held(self) -> None:
        held = self._memory.documents()
        if held != self._held:
            self._held = held
            self.held_changed.set()

    def _sweep(self) -> None:
        for stream in list(self._streams):
            handle = stream.handle
            if stream.state is _State.HOLDING and handle.closed.is_set():
                self._end(stream, None)
            elif stream.state is not _State.HOLDING and handle.cancelled.is_set():
                self._end(stream, "cancelled")

    def _start_waiting(self) -> None:
        """Start the streams `plan_admission` admits; the others wait, some for a leader."""
        streams = {s.arrival: s for s in self._streams}
        waiting = [_waiting(s) for s in self._streams if s.state is _State.WAITING]
        # A stream reading its prefix from disk leads as one prefilling does: its followers
        # wait for what it restores instead of reading it again.
        prefilling = {
            s.arrival: s.pos
            for s in self._streams
            if s.state in (_State.PREFILLING, _State.READING)
        }
        plan = plan_admission(
            waiting,
            prefilling,
            self._memory.room(),
            reach=lambda follower, leader: self._reach(
                streams[leader].request, streams[follower].request
            ),
            kept=lambda key: self._kept_now(streams[key].request),
        )
        for stream in self._streams:
            stream.led_priority = plan.led_priority.get(stream.arrival)
        for key, (leader, reach) in plan.follows.items():
            streams[key].leader, streams[key].reach = streams[leader], reach
        for key in plan.start:
            stream = streams[key]
            stream.leader = None
            try:
                self._start(stream)
            except Exception as exc:
                self._fail(stream, exc)

    def _kept_now(self, request: StreamRequest) -> int:
        reuse = self._memory.best_reuse(
            request.namespace, request.tokens, request.prefill_end, request.breaks
        )
        return 0 if reuse is None else reuse.tokens

    def _reach(self, leader: StreamRequest, follower: StreamRequest) -> int:
        """Cells of `leader`'s prefill `follower` may reuse once that prefill is done: where
        memory would let it fork (`Memory.best_reuse`) at the leader's best chunk end."""
        if leader.namespace != follower.namespace:
            return 0
        common = common_prefix_len(leader.tokens[: leader.prefill_end], follower.tokens)
        block = self._block_tokens
        ends = list(chunk_ends(leader.prefill_end, block, leader.breaks))
        # The chunk ends up to `common`, and the first past it: with a granule, a fork may
        # cut that chunk back to inside it.
        ends = ends[: bisect.bisect_right(ends, common) + (self._granule is not None)]
        return max(
            (
                restorable_tokens(
                    common,
                    end,
                    follower.prefill_end,
                    block,
                    self._truncatable,
                    follower.breaks,
                    tuple(b for b in leader.breaks if b <= end),
                    self._granule,
                    self._rows_shape_free,
                )
                for end in ends
            ),
            default=0,
        )

    def _start(self, stream: _Stream) -> None:
        """Give the stream a sequence with what memory holds of its prompt; if the disk may
        hold more, read it off the model thread (`_finish_read` goes on), else start now."""
        request = stream.request
        limit = request.prefill_end
        reuse = self._memory.best_reuse(request.namespace, request.tokens, limit, request.breaks)
        kept = reuse.tokens if reuse is not None else 0
        lead = self._lead_at_start(stream, reuse)
        resident = self._memory.claim(
            request.namespace,
            None if lead else reuse,
            decodes=request.max_new > 0,
            held=self._held_seqs(),
        )
        stream.resident = resident
        self._hold(stream, kept)
        if lead is not None:  # no cells of its own until it parts: none to offer for reuse
            resident.prefilled, resident.breaks, resident.documents = 0, (), {}
            stream.twin_of, stream.own_until = lead, 0
            lead.twins.append(stream)
        cache = self._cache_for(request.namespace)
        if cache is not None and kept < limit:
            stream.state, stream.read_from = _State.READING, time.perf_counter()
            self._reads.submit(stream, lambda: self._look_on_disk(cache, request, kept))
            self._finish_read(QUICK_READ_S)
            return
        self._begin(stream, None)

    def _hold(self, stream: _Stream, kept: int) -> None:
        """The stream's sequence holds the first `kept` tokens of its prompt."""
        request, resident = stream.request, stream.resident
        assert resident is not None
        stream.pos = kept
        resident.tokens = request.tokens[:kept]
        resident.prefilled = kept
        resident.breaks = tuple(b for b in request.breaks if b <= kept)
        resident.keep_documents(kept)
        resident.label(request.document)

    def _finish_read(self, wait_s: float = 0.0) -> None:
        """Restore what the disk gave a reading stream (a memory copy) and start it."""
        finished = self._reads.finished(wait_s)
        if finished is None:
            return
        stream, read = finished
        try:
            if stream.ended:  # cancelled while its prefix was read
                return
            if isinstance(read, Exception):
                self._begin(stream, None)
                return
            restore_ms = None
            if read.hit is not None:
                kept = self._restore(stream, read.hit)  # 0: it did not load, memory's is gone
                self._hold(stream, kept)
                if kept:
                    restore_ms = (time.perf_counter() - stream.read_from) * 1000
                    assert read.offer is not None
                    self.costs.restored(read.offer, read.seconds)
            self._begin(stream, read, restore_ms)
        except Exception as exc:
            self._fail(stream, exc)
        finally:
            self._reads.taken()

    def _begin(
        self, stream: _Stream, read: DiskRead | None, restore_ms: float | None = None
    ) -> None:
        """Start prefilling from what the stream's sequence holds."""
        request = stream.request
        choice = None if read is None else read.choice
        self._account_start(stream.pos, read, restore_ms)
        if self._cache_for(request.namespace) is not None and self._saver is not None:
            stream.snapshots = self._snapshot_points(request, stream.pos)
        stream.handle.put(Started(stream.pos, restore_ms, time.perf_counter(), choice))
        stream.state = _State.PREFILLING
        self._prefilled_to(stream)

    def _look_on_disk(self, cache: PrefixCache, request: StreamRequest, kept: int) -> DiskRead:
        """On the reading thread: a longer prefix than memory's `kept` tokens, if the disk has
        one and reading it is expected to cost less than prefilling what it gives
        (worker/restore_cost.py); what was decided of it either way."""
        started = time.perf_counter()
        looked: list[tuple[ReadOffer, Choice]] = []

        def pays(offer: ReadOffer) -> bool:
            looked.append((offer, self.costs.choose(offer, kept)))
            return looked[-1][1].restore

        hit = cache.lookup(request.tokens, kept + 1, request.breaks, pays)
        offer, choice = looked[-1] if looked else (None, None)
        if hit is not None and hit.n_tokens <= kept:
            hit = None
        return DiskRead(hit, offer, choice, time.perf_counter() - started)

    def _account_start(self, kept: int, read: DiskRead | None, restore_ms: float | None) -> None:
        """Count where a prompt's first `kept` tokens came from (`shared.prefix_cache`'s
        worker counters)."""
        accounts = self._cache_for(None)
        if accounts is None:
            return
        if read is None or read.hit is None or restore_ms is None:
            accounts.count(prompts=1, memory_hits=int(kept > 0), memory_hit_tokens=kept)
            return
        choice = read.choice
        saved_s = choice.prefill_s if choice is not None and choice.prefill_s else 0.0
        accounts.count(
            prompts=1, restore_ms=round(restore_ms), prefill_saved_ms=round(saved_s * 1000)
        )

    def _lead_at_start(self, stream: _Stream, reuse: Reuse | None) -> _Stream | None:
        """The decoding stream a starting one may twin from its first row on, with no copy of
        its cells (a sample following its question's first, whose prefill just ended): the
        memory to reuse is that stream's, holding all of this prompt, and its next row is this
        stream's first."""
        request = stream.request
        limit = request.prefill_end
        if (
            not self.rows_invariant
            or reuse is None
            or reuse.tokens != limit
            or reuse.source.idle
            or request.speculation != "off"
            or request.max_new == 0
        ):
            return None
        lead = next((s for s in self._streams if s.resident is reuse.source), None)
        if lead is None or not self._may_twin(lead) or lead.pos != limit:
            return None
        assert lead.resident is not None
        same = lead.resident.tokens == request.tokens[:limit]
        return lead if same and lead.next_token == request.tokens[limit] else None

    def _restore(self, stream: _Stream, hit: CacheHit) -> int:
        if self._memory.copies_pending():
            # One throwaway cell makes llama.cpp make its queued copies (out of this sequence,
            # or into it: memory's prefix, claimed before the disk was read) before the state
            # is loaded over; the restore drops the cell. After the cells the sequence holds:
            # llama.cpp refuses a position a copy into it fills.
            self._decode([(0, stream.pos, stream.seq)], logits=False)
        if kv_state.restore_into(self.llama, stream.seq, hit.state, hit.n_tokens):
            return hit.n_tokens
        log.warning("cached state %s did not load into sequence %d", hit.key, stream.seq)
        return 0

    def _snapshot_points(self, request: StreamRequest, start: int) -> set[int]:
        return snapshot_points(
            request.breaks,
            start,
            request.prefill_end,
            declared=request.declared,
            truncatable=self._truncatable,
            block_tokens=self._block_tokens,
            min_tokens=self._min_snapshot_tokens,
        )

    def _prefill(self) -> bool:
        """Decode the canonical chunks of the streams whose turn it is (`plan_prefill`)."""
        prefilling = {s.arrival: s for s in self._streams if s.state is _State.PREFILLING}
        views = [self._prefilling(s) for s in prefilling.values()]
        plan = plan_prefill(views, self._block_tokens)
        if plan is None:
            return False
        for key, count in plan.passed_over.items():
            prefilling[key].passed_over = count
        chosen = [prefilling[key] for key in plan.keys]
        # Short chunks of several streams (an extraction's question tails) in one pass where
        # each row reads as alone: one pass costs less than a pass of few rows each.
        for streams in [chosen] if self._chunks_share_passes else [[s] for s in chosen]:
            try:
                ends = self._read_chunks(streams)
            except Exception as exc:
                for stream in streams:
                    self._fail(stream, exc)
                continue
            for stream, end, last_row in ends:
                try:
                    self._after_chunk(stream, end, last_row)
                except Exception as exc:
                    self._fail(stream, exc)
        return True

    def _prefilling(self, stream: _Stream) -> Prefilling:
        """The stream as `plan_prefill` sees it: its followers' priority lifts its own."""
        request = stream.request
        priority = request.priority
        if stream.led_priority is not None:
            priority = min(priority, stream.led_priority)
        end = self._chunk_end(stream)
        remaining = self._prompt_end(request) - stream.pos
        return Prefilling(stream.arrival, priority, remaining, stream.passed_over, end - stream.pos)

    def _shape_free(self) -> bool:
        """Whether chunk ends are free: a prompt row reads alike in any pass, a lone one too
        (row_check.py: pieces share passes, a chunk may be cut at any token), and snapshots are
        cut from one capture, not saved where a chunk ends (not a sliding window's)."""
        return self._rows_shape_free and self._cut_snapshots

    def _prompt_end(self, request: StreamRequest) -> int:
        """Where a stream's prefill stops. A stream that decodes holds `prefill_end` cells
        before its first token. Where chunk ends are free, its last prompt token is read in its
        last chunk too, as llama-server reads it, and that row's logits give the first token
        (warm or cold, that row is read as a prompt row); else it is the first decode row, a
        pass of its own when no other stream decodes."""
        if self._shape_free() and request.end is None and request.max_new > 0:
            return len(request.tokens)
        return request.prefill_end

    def _chunk_end(self, stream: _Stream) -> int:
        """Where the stream's next chunk ends: a canonical end (worker/chunk_ends.py), or
        where chunk ends are free, the next block boundary or the prompt's end: no short
        pieces at the prompt's breaks, which only a state saved there needs."""
        request = stream.request
        breaks = () if self._shape_free() else request.breaks
        return chunk_end(stream.pos, self._prompt_end(request), self._block_tokens, breaks)

    def _read_chunks(self, streams: list[_Stream]) -> list[tuple[_Stream, int, Logits | None]]:
        """Decode the next canonical chunk of each of `streams`, in increasing sequence order
        (one run: llama.cpp makes a pass per run, memory.py), split at n_batch as Llama.eval
        does; each stream with its chunk's end, and the logits of its prompt's last token if
        the chunk read it."""
        ends = [(s, self._chunk_end(s)) for s in sorted(streams, key=lambda s: s.seq)]
        rows: list[tuple[int, int, int]] = []
        last_rows: dict[_Stream, int] = {}  # the row of a prompt's last token, where read
        for s, end in ends:
            rows += [(s.request.tokens[p], p, s.seq) for p in range(s.pos, end)]
            if end > s.request.prefill_end:  # see `_prompt_end`
                last_rows[s] = len(rows) - 1
        wanted = set(last_rows.values())
        logits: dict[int, Logits] = {}
        started = time.perf_counter()
        with prompt_chunk_kernels():
            for start in range(0, len(rows), self.llama.n_batch):
                piece = range(start, min(start + self.llama.n_batch, len(rows)))
                self._decode(rows[piece.start : piece.stop], [r in wanted for r in piece], True)
                for i, row in enumerate(piece):
                    if row in wanted:  # copied: the next pass overwrites them
                        logits[row] = self._logits(i).copy()
        seconds = time.perf_counter() - started
        self.shared_prompt_passes += len(streams) > 1
        for stream, end in ends:
            self.costs.prefilled(end - stream.pos, seconds * (end - stream.pos) / len(rows))
        return [(s, end, logits[last_rows[s]] if s in last_rows else None) for s, end in ends]

    def _after_chunk(self, stream: _Stream, end: int, last_row: Logits | None = None) -> None:
        """`stream`'s cells now reach `end`: what it holds, its snapshot there, its next state
        (`last_row`: the logits of its prompt's last token, if the chunk read it)."""
        request, position = stream.request, stream.pos
        assert stream.resident is not None
        stream.resident.tokens.extend(request.tokens[position:end])
        stream.resident.prefilled = stream.pos = end
        stream.resident.breaks = tuple(b for b in request.breaks if b <= end)
        stream.resident.label(request.document)
        if end in stream.snapshots and not self._cut_snapshots:
            stream.snapshots.discard(end)
            cache = self._cache_for(request.namespace)
            if cache is not None and self._saver is not None:
                inside = tuple(b for b in request.breaks if b < end)
                self._saver.snapshot(cache, self.llama, stream.seq, request.tokens[:end], inside)
        self._prefilled_to(stream, last_row)

    def _save_snapshots(self, stream: _Stream) -> None:
        """Capture once the states at the snapshot points `stream` has passed, each to be cut
        from that capture by the saver. Called after the stream's first token (a capture and
        the saver's writes would otherwise come before it: a snapshot point is mostly the
        prompt's end or a few tokens before it), when it ends, or when its prefill ends with
        no token to decode."""
        if not stream.snapshots:  # every step of every stream comes here
            return
        points = [p for p in stream.snapshots if p <= stream.pos]
        stream.snapshots.difference_update(points)
        request = stream.request
        cache = self._cache_for(request.namespace)
        if not points or cache is None or self._saver is None:
            return
        prompt = (request.tokens, request.breaks)
        if not self._saver.snapshots(cache, self.llama, stream.seq, prompt, points):
            self._cut_snapshots = False

    def _prefilled_to(self, stream: _Stream, last_row: Logits | None = None) -> None:
        """Move a stream on once its prefill is done; `last_row`: the logits of its prompt's
        last token, read with the prefill (`_prompt_end`), from which its first token is drawn."""
        request = stream.request
        if stream.pos < self._prompt_end(request):
            return
        if request.max_new == 0:
            self._save_snapshots(stream)  # before the end: a warm job's flush waits for them
            stream.handle.put(Ended("prefilled", stream.pos))
            if request.hold:
                stream.state = _State.HOLDING
            else:
                self._end(stream, None)
            return
        stream.state = _State.DECODING
        stream.exact_until = stream.pos
        stream.rng = np.random.default_rng(request.sampling.seed)
        if request.speculation != "off" and self.rows_invariant:
            prompt = request.tokens[: stream.pos + 1]
            stream.drafts = StreamDrafts(request.speculation, prompt, self._acceptance)
        if last_row is None:
            stream.next_token = request.tokens[stream.pos]
        else:
            self.first_tokens_in_chunks += 1
            self._draw(stream, last_row)

    def _step(self) -> bool:
        """One token for every decoding stream: the batched passes `plan_decode` makes, then
        one pass for each stream decoded alone."""
        self._pair_twins()
        decoding = [s for s in self._streams if s.state is _State.DECODING and s.twin_of is None]
        if not decoding:
            return False
        # One run of increasing sequence ids, or llama.cpp makes a pass per run (memory.py);
        # before the plan, which cuts the run into passes by sequence.
        self._memory.compact({s.seq for s in decoding if not s.alone}, self._held_seqs())
        streams = {s.arrival: s for s in decoding}
        max_rows = self._max_rows if self.rows_invariant else None
        views = [self._decoding(s) for s in decoding]
        plan = plan_decode(views, self._pass_cost.estimate, max_rows)
        for planned in plan.passes:
            drafts = {
                streams[key]: streams[key].drafts.take(k)  # type: ignore[union-attr]
                for key, k in planned.drafts.items()
            }
            self._batched_step([streams[key] for key in planned.keys], drafts)
        for key in plan.alone:
            self._lone_step(streams[key])
        return True

    def _held_seqs(self) -> frozenset[int]:
        """Sequences holding a prefix for later forks, nothing computed in them any more."""
        return frozenset(s.seq for s in self._streams if s.state is _State.HOLDING)

    def _pair_twins(self) -> None:
        """Streams whose tokens are all the same from the start (the samples of one question
        while they agree, `n` choices) share rows from now on: the first computes each row and
        the others draw their own token from its logits, which are theirs bit for bit on
        row-invariant kernels. A twin whose token differs parts with a copy of the first's
        cells (`_part`). Only streams without drafts, pending snapshots or lone decoding."""
        if not self.rows_invariant:
            return
        firsts: dict[tuple[str | None, int, int], list[tuple[_Stream, list[int]]]] = {}
        for stream in self._streams:  # in arrival order: the earliest leads
            if not self._may_twin(stream):
                continue
            assert stream.resident is not None
            tokens = stream.resident.tokens
            candidates = firsts.setdefault(
                (stream.request.namespace, stream.pos, stream.next_token), []
            )
            lead = next((c for c, theirs in candidates if theirs == tokens), None)
            if lead is None or stream.twins:
                candidates.append((stream, tokens))
                continue
            stream.twin_of, stream.own_until = lead, stream.pos
            lead.twins.append(stream)

    def _may_twin(self, stream: _Stream) -> bool:
        return (
            stream.state is _State.DECODING
            and stream.twin_of is None
            and not stream.alone
            and stream.drafts is None
            and not stream.snapshots
            and not stream.handle.cancelled.is_set()
        )

    def _part(self, twin: _Stream) -> None:
        """`twin` computes its own rows from now on, on a copy of its lead's cells (the same
        tokens, and the lead's are written up to where the twin is)."""
        lead = twin.twin_of
        assert lead is not None and lead.resident is not None and twin.resident is not None
        self._memory.copy(lead.resident, twin.resident)
        twin.own_until = lead.pos
        twin.twin_of = None
        lead.twins.remove(twin)

    def _decoding(self, stream: _Stream) -> Decoding:
        """The stream as `plan_decode` sees it, with the drafts it could add now."""
        offer = None
        if stream.drafts is not None and not stream.alone:
            # Drafts past the tokens it may still write, or past its sequence's cells, are waste.
            room = min(
                stream.request.max_new - stream.generated - 1,
                self.cells_per_seq - stream.pos - 1,
            )
            offer = stream.drafts.offer(stream.arrival, room)
        return Decoding(stream.arrival, stream.seq, stream.alone, stream.drafts is not None, offer)

    def _batched_step(self, batch: list[_Stream], drafts: dict[_Stream, list[int]]) -> None:
        rows: list[tuple[int, int, int]] = []
        firsts: list[int] = []
        for s in batch:
            firsts.append(len(rows))
            rows.append((s.next_token, s.pos, s.seq))
            rows += [(t, s.pos + 1 + i, s.seq) for i, t in enumerate(drafts.get(s, ()))]
        seqs = [s.seq for s in batch]
        one_run = seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        self.split_passes += not one_run
        started = time.perf_counter()
        try:
            self._decode(rows, logits=True)
        except Exception as exc:
            for stream in batch:
                self._fail(stream, exc)
            return
        # What a pass of these rows costs is known only from passes llama.cpp made as one.
        one_pass = one_run and len(ubatch_rows([1 + len(drafts.get(s, ())) for s in batch])) == 1
        self._passed(len(rows), time.perf_counter() - started, one_pass)
        ties = []
        for row, stream in zip(firsts, batch, strict=True):
            if stream.drafts is not None:
                self._take_drafted(stream, row, drafts.get(stream, []))
                continue
            logits = self._logits(row)
            exact_greedy = self._exact and stream.request.sampling.greedy
            if self.rows_invariant:
                if stream.exact_until == stream.pos:
                    stream.exact_until += 1
            elif exact_greedy and is_near_tie(logits, TIE_MARGIN):
                ties.append(stream)
                continue
            elif not exact_greedy:
                stream.drifted = True
            self._take(stream, logits)
        for stream in ties:  # after the others: a replay overwrites the batch's logits
            stream.alone = True
            try:
                self._replay_alone(stream)
            except Exception as exc:
                self._fail(stream, exc)
                continue
            self._take(stream, self._logits(0))

    def _waiting_for_work(self, waiting: bool) -> None:
        if self._yielding is not None:  # saves deferred for the model go while it waits
            self._yielding.busy(not waiting)

    def _passed(self, rows: int, seconds: float, one_pass: bool) -> None:
        if one_pass:
            self._pass_cost.record(rows, seconds)
        if self._yielding is not None:
            self._yielding.passed(rows, seconds)

    def _lone_step(self, stream: _Stream) -> None:
        """Decode one stream's next token in a batch of its own, as a lone run does."""
        exact_greedy = self._exact and stream.request.sampling.greedy
        try:
            started = time.perf_counter()
            self._decode([(stream.next_token, stream.pos, stream.seq)], logits=True)
            if self._yielding is not None:
                self._yielding.passed(1, time.perf_counter() - started)
            logits = self._logits(0)
            if stream.exact_until < stream.pos:  # it reads cells a batched step wrote
                if exact_greedy and is_near_tie(logits, TIE_MARGIN):
                    self._replay_alone(stream)
                    logits = self._logits(0)
                elif not exact_greedy:
                    stream.drifted = True
        except Exception as exc:
            self._fail(stream, exc)
            return
        if stream.exact_until == stream.pos:
            stream.exact_until += 1
        self._take(stream, logits)

    def _take_drafted(self, stream: _Stream, row: int, draft: list[int]) -> None:
        """Sample row after row while the stream's sampler writes what its draft guessed: each
        such row's cell is the one plain decoding writes there (row-invariant kernels). The
        cells past the last row taken are dropped."""
        drafts = stream.drafts
        assert drafts is not None
        written = stream.pos
        for i in range(len(draft) + 1):
            if i:  # the token sampled from the row before is the one this row was given
                drafts.accepted += 1  # before the take, which may end the stream
            stream.exact_until = stream.pos + 1
            going = self._take(stream, self._logits(row + i))
            if not going or i == len(draft) or stream.next_token != draft[i]:
                break
        drafts.scored(draft, stream.pos - written - 1, stream.next_token)
        if draft:
            llama_cpp.llama_memory_seq_rm(self._mem, stream.seq, stream.pos, -1)

    def _replay_alone(self, stream: _Stream) -> None:
        """Recompute one token at a time every cell of `stream` a batched step wrote; then row
        0's logits are a lone run's."""
        assert stream.resident is not None
        tokens = stream.resident.tokens
        begin = stream.exact_until
        llama_cpp.llama_memory_seq_rm(self._mem, stream.seq, begin, -1)
        for pos in range(begin, stream.pos + 1):
            token = tokens[pos] if pos < len(tokens) else stream.next_token
            self._decode([(token, pos, stream.seq)], logits=pos == stream.pos)
        stream.exact_until = stream.pos + 1
        stream.replays += 1

    def _take(self, stream: _Stream, logits: Logits) -> bool:
        """The cell for `next_token` is written: sample what follows it, and each twin from
        the same logits. False once the stream ended or is to end (a stop string, a cancel)
        before its next step."""
        twins = list(stream.twins)  # before the take, which may end the stream
        going = self._take_own(stream, logits)
        for twin in twins:
            self.twin_rows += 1
            twin.exact_until = twin.pos + 1
            self._take_own(twin, logits)
            if twin.twin_of is stream and not twin.ended and twin.next_token != stream.next_token:
                self._part(twin)
        return going

    def _take_own(self, stream: _Stream, logits: Logits) -> bool:
        assert stream.resident is not None
        stream.resident.tokens.append(stream.next_token)
        stream.pos += 1
        return self._draw(stream, logits)

    def _draw(self, stream: _Stream, logits: Logits) -> bool:
        """Sample the token after the stream's last cell from that cell's row's logits."""
        assert stream.rng is not None
        token = sample(logits, stream.request.sampling, stream.rng)
        if llama_cpp.llama_vocab_is_eog(self._vocab, token):
            self._end(stream, "stop")
            return False
        stream.generated += 1
        stream.next_token = token
        if stream.drafts is not None:
            stream.drafts.lookup.extend([token])
        stream.handle.token(Token(token, time.perf_counter()))
        self._save_snapshots(stream)
        if stream.generated >= stream.request.max_new:
            self._end(stream, "length")
            return False
        return not stream.handle.cancelled.is_set()

    def _end(self, stream: _Stream, reason: EndReason | None) -> None:
        """Finish a stream; its sequence stays resident for reuse. `None`: already said."""
        for twin in list(stream.twins):  # they go on alone, before its cells can be reused
            if not twin.handle.cancelled.is_set():  # (a cancelled one ends at the next sweep)
                self._part(twin)
        if stream.twin_of is not None:  # its own cells end where it stopped computing them
            assert stream.resident is not None
            self._memory.keep(stream.resident, stream.own_until)
            stream.twin_of.twins.remove(stream)
            stream.twin_of = None
        if stream.resident is not None:
            self._save_snapshots(stream)
        if reason is not None:
            drafts = stream.drafts
            drafted, accepted = (drafts.drafted, drafts.accepted) if drafts else (0, 0)
            stream.handle.put(
                Ended(
                    reason,
                    stream.pos,
                    stream.replays,
                    stream.drifted,
                    drafted=drafted,
                    accepted=accepted,
                )
            )
        if stream.resident is not None:
            self._memory.release(stream.resident)
        self._forget_stream(stream)

    def _fail(self, stream: _Stream, exc: Exception) -> None:
        for twin in list(stream.twins):  # its rows were theirs
            self._fail(twin, exc)
        if stream.twin_of is not None:
            stream.twin_of.twins.remove(stream)
            stream.twin_of = None
        log.exception("stream failed", exc_info=exc)
        stream.handle.put(Failed(exc))
        if stream.resident is not None:
            self._memory.forget(stream.resident)  # its cells may be half-written
        self._forget_stream(stream)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            self._streams.extend(self._incoming)
            self._incoming.clear()
        for stream in list(self._streams):
            stream.handle.put(Failed(exc))
            if stream.resident is not None:
                self._memory.forget(stream.resident)
            self._forget_stream(stream)
        self._note_held()

    def _forget_stream(self, stream: _Stream) -> None:
        stream.ended = True
        self._streams.remove(stream)
        with self._lock:
            self._committed -= 1

    def _decode(
        self, rows: list[tuple[int, int, int]], logits: bool | list[bool], prompt: bool = False
    ) -> None:
        """One llama_decode call; `prompt`: it reads prompt chunks (else decode rows)."""
        fill_batch(self._batch, rows, logits)
        started = time.perf_counter()
        status = llama_cpp.llama_decode(self.llama.ctx, self._batch)
        work = "prompt" if prompt else "decode"
        self._model_work[f"model_{work}_ms"] += (time.perf_counter() - started) * 1000
        self._model_work[f"model_{work}_rows"] += len(rows)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        self._memory.copies_made()

    def model_counters(self) -> dict[str, int]:
        """What the model has read so far (`MODEL_COUNTERS`), for any thread."""
        return {name: int(value) for name, value in self._model_work.copy().items()}

    def _logits(self, row: int) -> Logits:
        pointer = llama_cpp.llama_get_logits_ith(self.llama.ctx, row)
        return np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))


def _waiting(stream: _Stream) -> Waiting:
    """The stream as `plan_admission` sees it, with the leader it waited for last turn."""
    leader = None if stream.leader is None else stream.leader.arrival
    return Waiting(stream.arrival, stream.request.priority, leader, stream.reach)
