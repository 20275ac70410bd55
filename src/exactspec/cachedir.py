"""Where exactspec keeps what it can compute once per machine and model: converted checkpoints and the
measured dtype decision. `$EXACTSPEC_CACHE` overrides the folder (default: `$XDG_CACHE_HOME/exactspec`,
else `~/.cache/exactspec`). A model file is keyed by its identity: a hash of its bytes, so a changed
file is never served from an old entry, and the same file under another path (a second venv, a copy)
is served from the first one's."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from . import quiet


def cache_dir(*parts: str) -> Path:
    """The cache folder (made on demand), or a sub-folder of it."""
    root = os.environ.get("EXACTSPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "exactspec")
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_identity(path: str | os.PathLike) -> str:
    """A short hex key for a file or a model directory's files, by content (a directory's: its files'
    names and contents): the same bytes anywhere share a key, changed bytes get another."""
    if os.path.isfile(path):
        return content_hash(Path(path))[:20]
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).iterdir() if p.is_file()):
        h.update(f"{f.name}|{content_hash(f)}\n".encode())
    return h.hexdigest()[:20]


def content_hash(f: Path) -> str:
    """sha256 of a file's bytes, remembered by its path, size and mtime: read whole once per copy and
    change (~0.3 s per 100 MB here), a lookup afterwards."""
    st = f.stat()
    where = hashlib.sha256(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_dir("identities") / f"{where}.txt"
    try:
        digest = memo.read_text()
        if len(digest) == 64:
            return digest
    except OSError:
        pass  # not hashed yet (or unreadable): hashed now
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    write_atomic(memo, h.hexdigest())
    return h.hexdigest()


OPENMP_WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # how idle OpenMP threads wait: llama.cpp ran 2.5x
# slower here with PASSIVE, so a verdict ranked by speed under one policy is not the other's


def machine_key(version: object, *parts: object) -> str:
    """A short hex key for something measured on this CPU: `version`, the CPU's model, architecture and
    flags, OpenMP's waiting policy, then `parts` (library versions, settings, a file identity)."""
    from .device import cpu_flags, cpu_name

    waiting = " ".join(f"{name}={os.environ.get(name, '')}" for name in OPENMP_WAITING)
    text = "|".join([str(version), cpu_name(), platform.machine(), " ".join(sorted(cpu_flags())), waiting,
                     *map(str, parts)])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def write_atomic(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Write a cache entry (text or bytes) so that a reader never sees half of it: a temporary file named
    by this process and the time (processes share the cache), created with `mode` (links not followed),
    then a rename. On failure (a full disk) the temporary file is removed."""
    tmp = path.with_suffix(f".tmp{os.getpid()}-{time.time_ns()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def one_at_a_time(path: Path) -> Iterator[None]:
    """Hold the lock of cache entry `path` (a lock file beside it) while measuring what goes there: a
    second process after the same entry waits, then reads the first one's, instead of measuring beside
    it (two processes timing on the same cores skew each other's figures, and do the work twice)."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


T = TypeVar("T")


REMEASURE_ATTEMPTS = 3  # later starts that re-measure a provisional entry before it waits for `exactspec tune`
_force: set[str] = set()  # kinds of timed entries measured again whatever the cache holds (`remeasure`)
_looked: set[Path] = set()  # provisional entries this process has already decided about


def remeasure(*kinds: str) -> None:
    """Measure timed entries of these kinds (cache sub-folders: "llamacpp-numerics", "target-costs",
    "layouts") again in this process, whatever the cache holds (`exactspec tune`)."""
    _force.update(kinds)


def provisional(path: Path) -> str | None:
    """Why the timed entry at `path` is provisional (measured on a busy machine), or None: final."""
    try:
        return json.loads(_mark(path).read_text())["why"]
    except (OSError, ValueError, TypeError, KeyError):
        return None


def say_if_provisional(path: Path, what: str) -> None:
    """One status line when the timed entry at `path` (`what` it holds) is provisional."""
    why = provisional(path)
    if why:
        from . import progress

        progress.status(f"{what} is PROVISIONAL: timed while {why}; measured again at the next quiet start, "
                        "or by `exactspec tune --remeasure`")


def _mark(path: Path) -> Path:
    return path.with_name(path.name + ".provisional")


def _attempts(path: Path) -> int:
    try:
        return int(json.loads(_mark(path).read_text())["attempts"])
    except (OSError, ValueError, TypeError, KeyError):
        return 0


def _due(path: Path, threads: int) -> bool:
    """Whether this process measures the timed entry at `path` (present) again: asked for (`remeasure`),
    or provisional with attempts left and the machine quiet now (once per process and entry)."""
    if path in _looked:
        return False
    _looked.add(path)
    if path.parent.name in _force:  # every entry of the kind, once per process
        return True
    if provisional(path) is None:
        return False
    attempts = int(os.environ.get("EXACTSPEC_REMEASURE_ATTEMPTS", REMEASURE_ATTEMPTS))
    return _attempts(path) < attempts and not quiet.busy_now(threads).disturbed


def measured_once(path: Path, read: Callable[[], T | None], measure: Callable[[], T], write: Callable[[T], None],
                  timed: int | None = None) -> T:
    """The cache entry at `path`: `read()` (None: absent or unreadable), else `measure()` and `write` it,
    one process at a time (`one_at_a_time`; a process that waited reads what the first one wrote).
    `timed`: the measurement is timed on this many threads, and watched (quiet.py): taken while other
    processes computed, it is written PROVISIONAL (`provisional` says why), and a later start that finds
    the machine quiet measures it again (at most REMEASURE_ATTEMPTS disturbed times; then only when asked:
    `remeasure`, `exactspec tune`)."""
    value = read()
    if value is not None and (timed is None or not _due(path, timed)):
        return value
    with one_at_a_time(path):
        again = value is not None  # a provisional or forced entry, measured again
        value = None if again else read()
        if value is None:
            if timed is None:
                value = in_own_thread(measure)
            else:
                with quiet.Watch(timed) as watch:
                    value = in_own_thread(measure)
            write(value)
            if timed is not None:
                _record(path, watch.window, _attempts(path) + 1 if again else 0)
    return value


def _record(path: Path, window: quiet.Window, attempts: int) -> None:
    """Mark the entry at `path` provisional (a disturbed window) or final."""
    if window.disturbed:
        write_atomic(_mark(path), json.dumps({"why": window.describe(), "attempts": attempts}))
    else:
        _mark(path).unlink(missing_ok=True)


_own = threading.local()  # `inside`: this thread is one of `in_own_thread`'s


def in_own_thread(work: Callable[[], T]) -> T:
    """work()'s result, computed in a thread of its own that then exits (its exception raised here).
    llama.cpp and torch compute on OpenMP, and libgomp keeps a team of threads for every thread that ever
    ran a parallel region. A measurement run on the caller's thread left its team parked there; once a
    server's worker thread decoded with a team of its own, libgomp counted more threads than CPUs and
    stopped spinning between a step's parallel regions (its throttled mode), so every step paid for
    waking its threads: after a fresh llama.cpp self-test, the agent workload decoded from a worker
    thread at 46 and 84 tokens/s (cold, warm), against 73 and 164 with the verdict read from the cache
    (Zen 5, 2 threads). A thread that exits takes its team with it. Called from inside such a thread
    (a measurement during `engine.load`'s), work() runs there: a thread started from one whose team
    lives would compute in that throttled mode itself (docs/benchmarks.md, "The same trap, from loading")."""
    if getattr(_own, "inside", False):
        return work()
    out: dict = {}

    def run() -> None:
        _own.inside = True
        try:
            out["value"] = work()
        except BaseException as e:  # raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name="exactspec-measure")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
