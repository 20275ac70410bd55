"""Whether the machine was quiet while something was timed: the CPU time other processes took meanwhile.

A timed verdict (the llama.cpp self-test's ranking of settings, the dtype self-test, auto γ's T(k)) taken
while another process computed on the same cores ranks and prices a machine that is gone once that
process ends. Linux counts every CPU's busy time since boot (/proc/stat: user, nice, system, irq,
softirq and steal, the time a hypervisor gave the CPU to another guest); what this process spent in the
same window (all its threads) is subtracted, so what remains is what others took. A window is disturbed
when others took more than the cores this process leaves idle, plus DISTURBED_CORES of one: a compile
at nice 19 beside a 2-thread measurement on 2 cores takes ~1 core. Where /proc/stat cannot be read the
window counts as quiet (as before this check)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

DISTURBED_CORES = 0.25  # others' cores beyond the idle ones that make a window disturbed
SAMPLE_S = 0.25  # how long `busy_now` watches


@dataclass(frozen=True)
class Window:
    """What others took while something ran: `others` CPU-seconds over `wall` seconds (None: unknown)."""

    wall: float
    others: float | None
    threads: int
    cpus: int = 1  # the CPUs /proc/stat counts

    @property
    def others_cores(self) -> float | None:
        return None if self.others is None or self.wall <= 0 else max(self.others, 0.0) / self.wall

    @property
    def disturbed(self) -> bool:
        cores = self.others_cores
        return cores is not None and cores > DISTURBED_CORES + max(0, self.cpus - self.threads)

    def describe(self) -> str:
        cores = self.others_cores
        if cores is None:
            return "unknown (no /proc/stat)"
        return f"other processes used {cores:.2f} of {self.cpus} CPUs"


def busy_seconds() -> tuple[float, int] | None:
    """(every CPU's busy seconds since boot, how many CPUs) -- None: not Linux, or unreadable. The CPUs
    are those /proc/stat counts (a container may see the host's)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        fields = lines[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    except (OSError, IndexError, ValueError):
        return None
    if fields[0] != "cpu":
        return None
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), max(cpus, 1)


class Watch:
    """Times a window: `with Watch(threads) as w: ...`, then `w.window`."""

    def __init__(self, threads: int):
        self.threads = threads
        self.window: Window | None = None

    @classmethod
    def start(cls, threads: int) -> "Watch":
        """A window opened now, read with `so_far` (not a `with` block: it spans a server's serving)."""
        return cls(threads).__enter__()

    def __enter__(self) -> "Watch":
        self._busy, self._own, self._wall = busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.window = self.so_far()

    def so_far(self) -> Window:
        """The window from `__enter__` to now (it goes on)."""
        wall, busy = time.perf_counter() - self._wall, busy_seconds()
        own = time.process_time() - self._own
        if busy is None or self._busy is None:
            return Window(wall, None, self.threads)
        return Window(wall, busy[0] - self._busy[0] - own, self.threads, busy[1])


def busy_now(threads: int, seconds: float = SAMPLE_S) -> Window:
    """What others take now, watched for `seconds` while this process sleeps."""
    with Watch(threads) as w:
        time.sleep(seconds)
    return w.window
