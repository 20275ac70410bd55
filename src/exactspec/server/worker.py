"""The one thread that runs the model: requests are served first come, first served, as rows of one batch.

The engine is not thread-safe and the event loop must never run the model, so a single worker
thread owns the engine. Each job is one sample; its text pieces (each with the logprob entries of the
tokens whose text it completes, when the job asked for logprobs) travel back to the event loop via
`loop.call_soon_threadsafe` into an `asyncio.Queue` owned by the request.

Continuous batching: the worker decodes every job it holds as a row of one batch (one target
forward per iteration for all rows, see speculative/loop.py). Between iterations it admits the jobs
queued meanwhile, oldest first, up to `max_rows` rows; a request's n samples are queued together and
join together, sharing one prefill. Each row keeps its own sampling parameters, γ, drafter and
seed, so its output is exactly what it would be alone. A row leaves when it is done, hits a stop
string, or its consumer stops listening (client gone, request cancelled: the job's cancel flag).

Failures stay local: an exception while setting up a job, in its own row's work (its law, its
grammar, see speculative/loop.py) or in its detokenisation, goes to that job only; an exception in the
batched forward itself fails the rows of that batch, and the worker goes on with the queue. Targets without a batched cache, and draft models, run one job at a time instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from prometheus_client import Histogram

from ..engine import Engine
from ..generation import GenerationResult, Request
from ..speculative.loop import BatchDecoder, Row
from .metrics import Metrics
from .offload import start_with_large_stack

Emit = Callable[[tuple[str, object]], None]


def _batchable(entry: list["_Slot"]) -> bool:
    """Lenient (lossy) requests decode alone, through the one-sequence loop (see Engine.generate_batch)."""
    return all(slot.job.lenience == 1 for slot in entry)


@dataclass
class Job:
    """One sample: the result to fill (it carries the prompt token ids) and what it asks for: a
    prepared `Request` (the app's: a request's samples share it, its constraint compiled once) and
    its seed, or `Engine.request` keywords with "seed"."""

    result: GenerationResult
    options: Request | dict
    cancel: threading.Event = field(default_factory=threading.Event)
    seed: int | None = None

    @property
    def lenience(self) -> float:
        return self.options.params.lenience if isinstance(self.options, Request) else self.options.get("lenience", 1)

    def request(self, engine: Engine) -> tuple[Request, int | None]:
        """(its Request, its seed): the prepared one, or one built by the engine from the keywords."""
        if isinstance(self.options, Request):
            return self.options, self.seed
        options = dict(self.options)
        seed = options.pop("seed", self.seed)
        return engine.request(**options), seed


@dataclass
class Piece:
    """Released text of one sample, and the logprob entries (`GenerationResult.logprobs` items) of the
    tokens whose text ends within it; None without logprobs. The last piece of a finished job carries
    the entries of the tokens whose text is never sent (EOS, the tokens of a stop string)."""

    text: str
    logprobs: list[dict] | None = None


@dataclass(eq=False)
class _Slot:
    """A job in the worker's hands: where its events go, how much of its text and how many of its
    tokens' logprob entries were sent."""

    job: Job
    emit: Emit
    request: Request | None = None  # set when its row is built
    sent: int = 0
    tokens_sent: int = 0
    closed: bool = False  # its last event ("done" or "error") is sent

    def send(self, text: str, final: bool = False) -> None:
        """Emit `text` (the next released characters) with the entries of the tokens it completes;
        `final`: the job is complete, the entries of the tokens whose text is never sent follow alone."""
        self.sent += len(text)
        detok = self.job.result.detokenizer
        entries = self._entries(detok.tokens_within(self.sent) if detok is not None else 0)
        if text or entries:
            self.emit(("piece", Piece(text, entries)))
        if final and (rest := self._entries(len(self.job.result.token_ids))):
            self.emit(("piece", Piece("", rest)))

    def _entries(self, upto: int) -> list[dict] | None:
        """The logprob entries of tokens [tokens_sent, upto), now counted as sent; None without logprobs."""
        logprobs = self.job.result.logprobs
        if logprobs is None:
            return None
        upto = max(self.tokens_sent, min(upto, len(logprobs)))  # entries are appended as tokens commit
        entries, self.tokens_sent = logprobs[self.tokens_sent:upto], upto
        return entries


class Worker:
    """Owns the engine; `generate` and `generate_all` are the event loop's async view of jobs."""

    def __init__(self, engine: Engine, metrics: Metrics, max_rows: int = 16) -> None:
        self.engine, self.metrics, self.max_rows = engine, metrics, max_rows
        self.batched = max_rows > 1 and engine.target.batched and not engine.uses_draft_model()
        self.batch_rows = Histogram("exactspec_batch_rows", "Rows decoded by each batched target forward",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=metrics.registry)
        self._waiting: deque[list[_Slot] | None] = deque()  # one entry per request (its samples); None: stop
        self._queued = 0
        self._ready = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="exactspec-worker", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        """Jobs waiting for the worker (not counting those in its batch)."""
        with self._ready:
            return self._queued

    def start(self) -> None:
        """Start the thread, with a large stack: grammars are compiled and walked on it (offload.py)."""
        start_with_large_stack(self._thread)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running and queued jobs, then end the thread."""
        self._stopping.set()
        self._put(None)
        self._thread.join(timeout)

    async def generate(self, job: Job) -> AsyncIterator[str]:
        """Queue `job` and yield its text pieces; `job.result` is complete when this ends normally.
        Leaving early (break, exception, task cancellation) cancels the job."""
        async for _, piece in self.generate_all([job]):
            if piece is not None and piece.text:
                yield piece.text

    async def generate_all(self, jobs: list[Job]) -> AsyncIterator[tuple[int, Piece | None]]:
        """Queue `jobs` together (a request's samples: they join the same batch) and yield
        (index, Piece) as pieces arrive, and (index, None) once job `index` is complete. The
        first job error is raised here; leaving early cancels the jobs that are not finished."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emitter(index: int, job: Job) -> Emit:
            def emit(event: tuple[str, object]) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, *event))
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    job.cancel.set()
            return emit

        self._put([_Slot(job, emitter(i, job)) for i, job in enumerate(jobs)])
        pending = set(range(len(jobs)))
        try:
            while pending:
                index, kind, value = await events.get()
                if kind == "piece":
                    yield index, value
                elif kind == "error":
                    pending.discard(index)
                    raise value
                else:
                    pending.discard(index)
                    yield index, None
        finally:
            for index in pending:
                jobs[index].cancel.set()

    # --- the queue -----------------------------------------------------------------------------
    def _put(self, entry: list[_Slot] | None) -> None:
        with self._ready:
            self._waiting.append(entry)
            self._queued += len(entry or [])
            self._ready.notify()

    def _next(self) -> list[_Slot] | None:
        """The oldest entry, waiting for one; None: stop."""
        with self._ready:
            while not self._waiting:
                self._ready.wait()
            entry = self._waiting.popleft()
            self._queued -= len(entry or [])
            return entry

    def _more(self, room: int) -> list[list[_Slot]]:
        """The oldest entries that fit in `room` rows, without waiting (first come, first served:
        an entry that does not fit holds back the ones behind it)."""
        taken = []
        with self._ready:
            while (self._waiting and self._waiting[0] is not None and len(self._waiting[0]) <= room
                   and _batchable(self._waiting[0])):
                entry = self._waiting.popleft()
                self._queued -= len(entry)
                room -= len(entry)
                taken.append(entry)
        return taken

    # --- serving -------------------------------------------------------------------------------
    def _serve(self) -> None:
        while (entry := self._next()) is not None:
            if self.batched and _batchable(entry):
                self._serve_batch(entry)
            else:
                for slot in entry:
                    self._serve_one(slot)

    def _serve_one(self, slot: _Slot) -> None:
        try:
            self._run(slot)
        except Exception as e:  # delivered to this job's request only
            self._close(slot, ("error", e))
        else:
            if not self._cancelled(slot.job):
                slot.send("", final=True)
            self._close(slot, ("done", None))

    def _run(self, slot: _Slot) -> None:
        job = slot.job
        if self._cancelled(job):  # its client left while it was queued
            self.metrics.cancelled.inc()
            return
        request, seed = job.request(self.engine)
        pieces = self.engine.stream("", result=job.result, request=request, seed=seed)
        cancelled = False
        try:
            for piece in pieces:
                if self._cancelled(job):
                    cancelled = True
                    break
                slot.send(piece)
        finally:
            pieces.close()
        self.metrics.observe_generation(job.result, cancelled)

    def _serve_batch(self, entry: list[_Slot]) -> None:
        """Decode `entry` and every job admitted meanwhile as one batch, until no row is left."""
        decoder = BatchDecoder(self.engine.target)
        self._admit(decoder, entry)
        while decoder.rows:
            self.batch_rows.observe(len(decoder.rows))
            try:
                for row, tokens in decoder.step():
                    self._deliver(row, tokens)
            except Exception as e:  # the batched iteration failed: its rows fail, the worker goes on
                for row in decoder.rows:
                    if not row.key.closed:
                        self._close(row.key, ("error", e))
                return
            for more in self._more(self.max_rows - len(decoder.rows)):
                self._admit(decoder, more)

    def _admit(self, decoder: BatchDecoder, entry: list[_Slot]) -> None:
        """Set up a request's jobs as rows and join them to the batch; a failure fails only its jobs."""
        rows = []
        for slot in entry:
            if self._cancelled(slot.job):  # its client left while it was queued
                self.metrics.cancelled.inc()
                self._close(slot, ("done", None))
                continue
            try:
                rows.append(self._row(decoder, slot))
            except Exception as e:
                self._close(slot, ("error", e))
        if not rows:
            return
        try:
            decoder.add(rows)
        except Exception as e:
            for row in rows:
                self._close(row.key, ("error", e))

    def _row(self, decoder: BatchDecoder, slot: _Slot) -> Row:
        """The job's row, built by the engine as it builds every generation's (`Engine.rows`)."""
        slot.request, seed = slot.job.request(self.engine)
        with decoder.lend():  # "auto"'s first measurement of the target's speed resets its cache
            return self.engine.rows(slot.request, [slot.job.result], [seed], keys=[slot])[0]

    def _deliver(self, row: Row, tokens: list[int]) -> None:
        """Send a row's new text; end its job when it is done, stopped, cancelled or failing."""
        slot = row.key
        if row.error is not None:  # this row failed alone (its law, its grammar): the others go on
            self._close(slot, ("error", row.error))
            return
        if self._cancelled(slot.job):
            row.cancelled = True
            self._end(slot, cancelled=True)
            return
        try:
            piece, stopped = self.engine.append_tokens(slot.job.result, tokens, slot.request.stop, slot.sent,
                                                       final=row.done)
        except Exception as e:  # this job's detokenisation failed: it alone fails
            row.cancelled = True
            self._close(slot, ("error", e))
            return
        slot.send(piece, final=stopped or row.done)
        if stopped or row.done:
            row.cancelled = True
            self._end(slot, cancelled=False)

    def _end(self, slot: _Slot, cancelled: bool) -> None:
        self.metrics.observe_generation(slot.job.result, cancelled)
        self._close(slot, ("done", None))

    @staticmethod
    def _close(slot: _Slot, event: tuple[str, object]) -> None:
        slot.closed = True
        slot.emit(event)

    def _cancelled(self, job: Job) -> bool:
        return job.cancel.is_set() or self._stopping.is_set()
