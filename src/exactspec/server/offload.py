"""Threads with a large native stack, and one that prepares requests off the event loop.

llguidance compiles grammars and JSON schemas recursively in native code: a deep enough schema
overflows an 8 MiB thread stack and kills the whole process (a segfault, not an exception). The
server therefore compiles, and runs the model, only on threads started with STACK_BYTES of stack
(virtual memory: only the pages touched are committed), and bounds what a request may ask for
(limits.py) so that even those cannot overflow. Tokenising and chat-template rendering of a large
prompt also run here, so the event loop (and /health) stays responsive; after a long preparation
(a large request) the heap's freed pages go back to the OS (malloc_trim), so one multi-MB request
does not leave the server's resident memory at its peak.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

STACK_BYTES = 512 * 1024 * 1024
TRIM_AFTER_S = 0.25  # a preparation this long handled a large request: give its freed memory back
_stack_lock = threading.Lock()


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0) (returns freed heap pages to the OS), or a no-op where there is none."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0) and None


trim_heap = _malloc_trim()


def start_with_large_stack(thread: threading.Thread, stack_bytes: int = STACK_BYTES) -> None:
    """Start `thread` with a native stack of `stack_bytes` (the process default is left unchanged)."""
    with _stack_lock:
        previous = threading.stack_size(stack_bytes)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)


class Preparer:
    """One large-stack thread that runs request preparation (tokenising, compiling constraints) in
    arrival order; `run` is the event loop's awaitable view of it."""

    def __init__(self, name: str = "exactspec-prepare") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> None:
        start_with_large_stack(self._thread)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(10)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the preparing thread; its exception is raised here."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return await asyncio.wrap_future(future)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # delivered to the request that asked
                future.set_exception(e)
            if time.perf_counter() - started > TRIM_AFTER_S:  # a multi-MB prompt's text and encoding were
                trim_heap()  # freed into malloc's arenas, where they would stay resident
