"""The one thread that runs the model: jobs are served first come, first served.

The engine is not thread-safe and the event loop must never run the model, so a single worker
thread owns the engine. Each job is one sample; its text pieces travel back to the event loop via
`loop.call_soon_threadsafe` into an `asyncio.Queue` owned by the request. A consumer that stops
listening (client gone, request cancelled) sets the job's cancel flag; the worker checks it between
pieces and closes the generation. An exception in a job goes to that job's consumer only.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ..engine import Engine, GenerationResult
from .metrics import Metrics

Emit = Callable[[tuple[str, object]], None]


@dataclass
class Job:
    """One sample: the result to fill (it carries the prompt token ids) and `Engine.stream` keywords."""

    result: GenerationResult
    options: dict
    cancel: threading.Event = field(default_factory=threading.Event)


class Worker:
    """Owns the engine; `generate` is the event loop's async view of one job."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics
        self._jobs: queue.Queue[tuple[Job, Emit] | None] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="exactspec-worker", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        """Jobs waiting for the worker (not counting the one it runs)."""
        return self._jobs.qsize()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running and queued jobs, then end the thread."""
        self._stopping.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    async def generate(self, job: Job) -> AsyncIterator[str]:
        """Queue `job` and yield its text pieces; `job.result` is complete when this ends normally.
        Leaving early (break, exception, task cancellation) cancels the job."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event: tuple[str, object]) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                job.cancel.set()

        self._jobs.put((job, emit))
        finished = False
        try:
            while True:
                kind, value = await events.get()
                if kind == "piece":
                    yield value
                elif kind == "error":
                    finished = True
                    raise value
                else:
                    finished = True
                    return
        finally:
            if not finished:
                job.cancel.set()

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, emit = item
            try:
                self._run(job, emit)
            except Exception as e:  # delivered to this job's request only
                emit(("error", e))
            else:
                emit(("done", None))

    def _run(self, job: Job, emit: Emit) -> None:
        if self._cancelled(job):  # its client left while it was queued
            self.metrics.cancelled.inc()
            return
        pieces = self.engine.stream("", result=job.result, **job.options)
        cancelled = False
        try:
            for piece in pieces:
                if self._cancelled(job):
                    cancelled = True
                    break
                emit(("piece", piece))
        finally:
            pieces.close()
        self.metrics.observe_generation(job.result, cancelled)

    def _cancelled(self, job: Job) -> bool:
        return job.cancel.is_set() or self._stopping.is_set()
