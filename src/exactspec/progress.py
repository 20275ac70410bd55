"""One-line status messages on stderr while exactspec loads and measures ("loading … (cached)").

The CLI and the server turn them on; the Python API is quiet unless `load(verbose=True)` or
`EXACTSPEC_VERBOSE=1`. `timed(label)` also records how long each phase took, for `--verbose`;
`shrink` resizes a progress bar (the bench's tqdm bars on stderr) when a budget cuts its work."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

_enabled = os.environ.get("EXACTSPEC_VERBOSE", "") not in ("", "0")
timings: dict[str, float] = {}  # phase -> seconds, for the last load


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def status(message: str) -> None:
    """Print `exactspec: message` on stderr when status messages are on."""
    if _enabled:
        print(f"exactspec: {message}", file=sys.stderr, flush=True)


@contextmanager
def timed(label: str):
    """Record the seconds spent in the block under `label` (also when status messages are off)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[label] = timings.get(label, 0.0) + time.perf_counter() - start


def shrink(bar, units: int) -> None:
    """Take `units` off a tqdm bar's total (None: no bar): a budget cut the work it was sized for."""
    if bar is not None and units:
        bar.total -= units
        bar.refresh()
