"""The one thread that runs the model: requests are served first come, first served, as rows of one batch.

The engine is not thread-safe and the event loop must never run the model, so a single worker
thread owns the engine. What may share a batch, and what a job receives, is the scheduler's
(batching.py: the one answer every caller shares); this module keeps only the thread, the queue
and the bridge to asyncio. Each job's events (text `Piece`s, then "done" or "error") travel back to
the event loop via `loop.call_soon_threadsafe` into an `asyncio.Queue` owned by the request.

Continuous batching: between iterations the worker hands the scheduler the jobs queued meanwhile,
oldest first, up to `max_rows` rows; a request's n samples are queued together and join together,
sharing one prefill. A job leaves when it is done, hits a stop string, or its consumer stops listening
(client gone, request cancelled: the job's cancel flag).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

import torch
from prometheus_client import Histogram

from .. import quiet
from ..batching import Delivery, Emit, Entry, Event, Job, Piece, Scheduler
from ..engine import Engine
from .metrics import Metrics
from .offload import start_with_large_stack

SAVE_COSTS_S = 300.0  # at most this often, when the batch drains, T(k) as serving refined it is persisted

__all__ = ["Job", "Piece", "Worker"]


class Worker:
    """Owns the engine; `generate` and `generate_all` are the event loop's async view of jobs."""

    def __init__(self, engine: Engine, metrics: Metrics, max_rows: int = 16) -> None:
        self.engine, self.metrics = engine, metrics
        self._stopping = threading.Event()
        self.scheduler = Scheduler(engine, max_rows, stopping=self._stopping)
        self.batch_rows = Histogram("exactspec_batch_rows", "Rows decoded by each batched target forward",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=metrics.registry)
        self._waiting: deque[Entry | None] = deque()  # oldest first; None: stop
        self._queued = 0
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="exactspec-worker", daemon=True)
        self._costs_watch = quiet.Watch.start(torch.get_num_threads())  # since T(k) was last persisted

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
        self._put([None])
        self._thread.join(timeout)

    async def generate(self, job: Job) -> AsyncIterator[str]:
        """Queue `job` and yield its text pieces; `job.result` is complete when this ends normally.
        Leaving early (break, exception, task cancellation) cancels the job."""
        async for _, piece in self.generate_all([job]):
            if piece is not None and piece.text:
                yield piece.text

    async def generate_all(self, jobs: list[Job], pieces: bool = True) -> AsyncIterator[tuple[int, Piece | None]]:
        """Queue `jobs` together (a request's samples: they join the same batch) and yield
        (index, Piece) as pieces arrive (unless not `pieces`: a whole response reads `job.result`, and
        the worker then wakes the event loop once per job, not once per token), and (index, None) once
        job `index` is complete. The first job error is raised here; leaving early cancels the jobs
        that are not finished."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emitter(index: int, job: Job) -> Emit:
            def emit(event: Event) -> None:
                if event[0] == "piece" and not pieces:
                    return
                if event[0] == "done":
                    self.metrics.observe_generation(job.result, cancelled=event[1])
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, *event))
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    job.cancel.set()
            return emit

        self._put(self.scheduler.entries([Delivery(job, emitter(i, job)) for i, job in enumerate(jobs)]))
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
    def _put(self, entries: list[Entry | None]) -> None:
        with self._ready:
            self._waiting.extend(entries)
            self._queued += sum(len(entry or []) for entry in entries)
            self._ready.notify()

    def _wait(self) -> bool:
        """Wait for an entry; False: the next one is the stop mark."""
        with self._ready:
            while not self._waiting:
                self._ready.wait()
            return self._waiting[0] is not None

    def _take(self) -> list[Entry]:
        """The oldest entries the scheduler admits now, without waiting."""
        with self._ready:
            taken = self.scheduler.take(self._waiting)
            self._queued -= sum(len(entry) for entry in taken)
            return taken

    # --- serving -------------------------------------------------------------------------------
    def save_costs(self) -> None:
        """Persist T(k) as serving refined it since the last save (`Learned.save_costs`), unless other
        processes were busy meanwhile (quiet.py): timings taken beside them price a machine that is gone
        when they end, and the next start would begin from them."""
        if not self._costs_watch.so_far().disturbed:
            self.engine.drafts.learned.save_costs()
        self._costs_watch = quiet.Watch.start(torch.get_num_threads())

    def _serve(self) -> None:
        saved = time.monotonic()
        while self._wait():
            self.scheduler.admit(self._take())
            while self.scheduler.rows:
                self.batch_rows.observe(self.scheduler.rows)
                self.scheduler.step()
                self.scheduler.admit(self._take())
            if time.monotonic() - saved > SAVE_COSTS_S:  # idle now: T(k) as serving refined it, persisted
                saved = time.monotonic()
                self.save_costs()
