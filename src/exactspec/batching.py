"""One way into the loop: the scheduler that the server's worker, `Engine.generate_batch` and
`exactspec batch` all hand their jobs to, so that they agree on what may share a batch and on what a
job receives.

A `Job` is one sample: the result to fill (it carries the prompt token ids), a prepared
`generation.Request` (a request's samples share one) and a seed. A `Scheduler` decodes jobs as rows
of ONE `BatchDecoder` (speculative/loop.py) and decides two things, the same way for every caller:

admission  may a job decode beside others? Yes, whatever its settings: each row carries its own
           sampling parameters, law, γ, drafter, seed and acceptance rule (lenient ones included),
           so what it emits does not depend on its neighbours (see loop.py). No where the target's
           cache holds one sequence, or the job drafts with the engine's draft model (whose cache
           holds one): such a job decodes alone. At most `max_rows` rows; a request's samples join
           together (one prefill); first come, first served: an entry that must wait holds back
           those behind it.
delivery   a row's accepted tokens become released text (`generation.release`: UTF-8 hold-back,
           stop strings), sent as `Piece`s carrying their tokens' logprob entries; a row leaves when it
           is done, stopped, cancelled (its job's flag) or failing, and its job gets one last event.

Failures stay with their jobs: a job whose setup or detokenisation fails fails alone; a failing
batched forward fails the rows it served, and the next admission starts a fresh batch. No thread
here: the server's worker (server/worker.py) drives a Scheduler from its own; `run_jobs` drives one
to the end for the offline callers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby

from .generation import GenerationResult, Request
from .speculative.interfaces import RowContexts
from .speculative.loop import BatchDecoder, _sum_rows_into
from .speculative.rows import Row
from .stats import Stats

Event = tuple[str, object]  # ("piece", Piece), ("done", cancelled: bool) or ("error", Exception)
Emit = Callable[[Event], None]


@dataclass
class Job:
    """One sample: the result to fill and what it asks for (a request's samples share one Request)."""

    result: GenerationResult
    request: Request
    seed: int | None = None  # None: a random one
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class Piece:
    """Released text of one sample, and the logprob entries (`GenerationResult.logprobs` items) of the
    tokens whose text ends within it; None without logprobs. The last piece of a finished job carries
    the entries of the tokens whose text is never sent (EOS, the tokens of a stop string)."""

    text: str
    logprobs: list[dict] | None = None


@dataclass(eq=False)
class Delivery:
    """A job in the scheduler's hands: where its events go, how much of its text and how many of its
    tokens' logprob entries were sent."""

    job: Job
    emit: Emit
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

    def close(self, event: Event) -> None:
        self.closed = True
        self.emit(event)

    def _entries(self, upto: int) -> list[dict] | None:
        """The logprob entries of tokens [tokens_sent, upto), now counted as sent; None without logprobs."""
        logprobs = self.job.result.logprobs
        if logprobs is None:
            return None
        upto = max(self.tokens_sent, min(upto, len(logprobs)))  # entries are appended as tokens commit
        entries, self.tokens_sent = logprobs[self.tokens_sent:upto], upto
        return entries


Entry = list[Delivery]  # a request's samples (or one of them, where they may not share a batch)


class Scheduler:
    """Admission and delivery over one BatchDecoder of `engine`'s target. `max_rows`: rows decoded
    together (None: no limit; 1: one job at a time). `stopping`: once set, every job is cancelled.
    `prefill_chunk`: prompt tokens prefilled per iteration while other rows decode (None: whole prompts;
    default: the engine's `prefill_chunk`)."""

    def __init__(self, engine, max_rows: int | None = None, stats: Stats | None = None,
                 stopping: threading.Event | None = None, prefill_chunk: int | None = -1) -> None:
        if isinstance(engine.target, RowContexts):  # a llama.cpp context holds so many rows
            capacity = engine.target.max_rows
            max_rows = capacity if max_rows is None else min(max_rows, capacity)
        if prefill_chunk == -1:  # the engine's (`--prefill-chunk`)
            prefill_chunk = engine.prefill_chunk
        self.engine, self.max_rows, self.prefill_chunk = engine, max_rows, prefill_chunk
        self.stats = stats if stats is not None else Stats()  # the batch's: prefill time, batched forwards
        self._stopping = stopping if stopping is not None else threading.Event()
        self._decoder = self._new_decoder()

    def _new_decoder(self) -> BatchDecoder:
        return BatchDecoder(self.engine.target, stats=self.stats, prefill_chunk=self.prefill_chunk)

    @property
    def rows(self) -> int:
        """Rows in the batch now: decoding, or joining (their prompt being prefilled)."""
        return len(self._decoder.rows) + len(self._decoder.waiting)

    # --- admission ---------------------------------------------------------------------------------
    def shares(self, job: Job) -> bool:
        """May `job` decode beside other jobs (the one answer, see the module docstring)?"""
        return ((self.max_rows is None or self.max_rows > 1) and self.engine.target.batched
                and not self.engine.uses_draft_model(job.request.draft))

    def entries(self, deliveries: Entry) -> list[Entry]:
        """A request's samples as entries to queue: together where they may share a batch (in groups of
        at most `max_rows`), else one each."""
        if all(self.shares(d.job) for d in deliveries):
            size = self.max_rows or len(deliveries)
            return [deliveries[i:i + size] for i in range(0, len(deliveries), size)]
        return [[d] for d in deliveries]

    def take(self, waiting: deque) -> list[Entry]:
        """Pop from `waiting` the oldest entries that may join the batch now (a None entry, or one that
        must wait, holds back those behind it)."""
        jobs, taken = [row.key.job for row in self._decoder.rows + self._decoder.waiting], []
        while waiting and waiting[0] is not None and self._fits(jobs, [d.job for d in waiting[0]]):
            taken.append(waiting.popleft())
            jobs += [d.job for d in taken[-1]]
        return taken

    def _fits(self, running: list[Job], joining: list[Job]) -> bool:
        if not running:
            return True
        room = self.max_rows is None or len(running) + len(joining) <= self.max_rows
        return room and all(self.shares(job) for job in running + joining)

    def admit(self, entries: list[Entry]) -> None:
        """Set up the entries' jobs as rows and join them to the batch; a failure fails only its jobs."""
        requests = [samples for entry in entries for samples in _by_request(self._live(entry))]
        rows = [row for samples in requests for row in self._rows(samples)]
        if not rows:
            return
        try:
            (self._decoder.add if self.rows else self._decoder.start)(rows)
        except Exception as e:
            for row in rows:
                row.key.close(("error", e))

    def _live(self, entry: Entry) -> Entry:
        """The entry's jobs still wanted; those whose consumer left while they were queued end here."""
        live = []
        for d in entry:
            if self._cancelled(d.job):
                d.close(("done", True))
            else:
                live.append(d)
        return live

    def _rows(self, samples: Entry) -> list[Row]:
        """The rows of one request's samples, built by the engine as every generation's are
        (`Engine.rows`: one γ policy for them); [] if that fails, failing them."""
        jobs = [d.job for d in samples]
        # "auto"'s first measurement of the target's speed resets its cache: the batch's is lent meanwhile
        # (a copy of every row's cells on llama.cpp, so only while that measurement is still to come)
        lend = self._decoder.lend() if not self.engine.drafts.target_measured else contextlib.nullcontext()
        try:
            with lend:
                return self.engine.rows(jobs[0].request, [j.result for j in jobs], [j.seed for j in jobs], keys=samples)
        except Exception as e:
            for d in samples:
                d.close(("error", e))
            return []

    # --- decoding and delivery ---------------------------------------------------------------------
    def step(self, until_last: bool = False) -> None:
        """One iteration of the batch (a chunk of the joining prompts first), each row's news delivered
        to its job; joining requests whose consumers all left go first. `until_last`: the caller waits for
        the batch's last row and has nothing queued (drafts priced by what they save the batch)."""
        self._decoder.until_last = until_last
        for row in self._decoder.cancel_joining(lambda row: self._cancelled(row.key.job)):
            row.key.close(("done", True))
        try:
            for row, tokens in self._decoder.step():
                self._deliver(row, tokens)
        except Exception as e:  # the batched iteration failed: its rows fail, a fresh batch follows
            for row in self._decoder.rows + self._decoder.waiting:
                if not row.key.closed:
                    row.key.close(("error", e))
            self._decoder = self._new_decoder()

    def _deliver(self, row: Row, tokens: list[int]) -> None:
        """Send a row's new text; end its job when it is done, stopped, cancelled or failing."""
        d, job = row.key, row.key.job
        if row.error is not None:  # this row failed alone (its law, its grammar): the others go on
            d.close(("error", row.error))
            return
        if self._cancelled(job):
            row.cancelled = True
            d.close(("done", True))
            return
        try:
            piece, stopped = self.engine.append_tokens(job.result, tokens, job.request.stop, d.sent, final=row.done)
        except Exception as e:  # this job's detokenisation failed: it alone fails
            row.cancelled = True
            d.close(("error", e))
            return
        d.send(piece, final=stopped or row.done)
        if stopped or row.done:
            row.cancelled = True
            d.close(("done", False))

    def _cancelled(self, job: Job) -> bool:
        return job.cancel.is_set() or self._stopping.is_set()


def _by_request(deliveries: Entry) -> list[Entry]:
    """Consecutive deliveries whose jobs share one Request (a request's samples), as groups."""
    return [list(group) for _, group in groupby(deliveries, key=lambda d: id(d.job.request))]


def run_jobs(engine, requests: list[list[Job]], stats: Stats | None = None,
             max_rows: int | None = None) -> list[Exception | None]:
    """Decode every job to its end through one Scheduler (the offline callers: everything is queued
    up front; each inner list, a request's samples, joins together). Returns each job's error (None:
    it completed), in order; `stats` gets the batch's time, batched forwards and the rows' sums."""
    errors: dict[int, Exception] = {}

    def emitter(job: Job) -> Emit:
        def emit(event: Event) -> None:
            if event[0] == "error":
                errors[id(job)] = event[1]
        return emit

    scheduler = Scheduler(engine, max_rows, stats)
    waiting = deque(entry for jobs in requests
                    for entry in scheduler.entries([Delivery(job, emitter(job)) for job in jobs]))
    start, prefill = time.perf_counter(), scheduler.stats.prefill_s
    while waiting or scheduler.rows:
        scheduler.admit(scheduler.take(waiting))
        if scheduler.rows:
            scheduler.step(until_last=not waiting)
    batch = scheduler.stats
    batch.decode_s += time.perf_counter() - start - (batch.prefill_s - prefill)
    jobs = [job for group in requests for job in group]
    _sum_rows_into(batch, [job.result.stats for job in jobs])
    return [errors.get(id(job)) for job in jobs]
