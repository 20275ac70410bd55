"""The prefix cache on disk: KV snapshots that survive a restart (an upgrade, a crash), bounded in MiB.

An agent session's tool-spec system prompt costs seconds to prefill cold; the in-memory prefix cache
(speculative/prefix_cache.py) forgets it at every restart. This store keeps each snapshot the memory
cache keeps as one file, written off the decode thread, and the memory cache asks it on a miss.

Layout: one folder per `persist_key` (the model file, the engine build, the self-test's setting, the
context's rows, the CPU and kernel switches: what the bytes mean; a snapshot is never offered to another
model or build), one file per token sequence:

    MAGIC | header length (8 bytes, little-endian) | header (JSON: key, ids, size, mac) | payload

`mac` is an HMAC-SHA256, under the folder's secret (`SECRET`, created 0600 at the folder's root by the
first server and shared by every server using the folder), of the header's other fields and the payload:
a file written by anyone without the secret -- a swapped or forged snapshot -- is never restored. Folders
are 0700 and files 0600 (a header holds a conversation's token ids); only regular files are read, opened
without following links and without blocking (a FIFO named `*.kv` is skipped, not waited on).

Written to a temporary name and renamed, so a reader sees a whole file or none; two servers sharing the
folder each write whole files, and each evicts least-recently-used files (by mtime, touched on every
load) while the folder holds more than its budget. A file that is truncated, not authentic (its MAC
differs), of another key, not a regular file or unreadable is skipped with one warning line, and the
prompt is prefilled as if it were absent: a file never changes an output. A snapshot the engine refuses
to restore is removed (`forget`). A write that fails (a full disk) leaves no temporary file behind.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import queue
import secrets
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .cachedir import write_atomic
from .errors import ExactSpecError
from .speculative.prefix_cache import common_prefix

MAGIC = b"exactspec-kv\x02"
SECRET = "secret"  # the folder's HMAC key: 32 random bytes, 0600
PREFIX_DISK_MB = 2048  # the default disk budget (cli_common.PREFIX_DISK_MB, the same for `serve` and `batch`)
STALE_TMP_S = 3600.0  # temporary files older than this are a writer that died mid-write: removed


class DiskPrefixStore:
    """`PrefixSpill` over a folder, for snapshots of one `persist_key`, in at most `budget_mb` MiB."""

    def __init__(self, folder: str | os.PathLike, key: str, budget_mb: float) -> None:
        if budget_mb <= 0:
            raise ValueError(f"the disk prefix cache budget must be > 0 MiB, got {budget_mb}")
        self.key, self.budget = key, int(budget_mb * 2**20)
        self.secret = folder_secret(Path(folder))
        self.folder = Path(folder) / hashlib.sha256(key.encode()).hexdigest()[:24]
        private_folder(self.folder)
        self.index: dict[str, list[int]] = {}  # file name -> the tokens it holds
        self._seen = -1  # the folder's mtime when the index was read (another server's writes change it)
        self._bad: set[str] = set()  # files skipped (warned about once, never read again by this process)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self.loads = self.writes = self.skipped = self.failed_writes = 0
        self._refresh()
        self._writer = threading.Thread(target=self._write_loop, name="exactspec-prefix-store", daemon=True)
        self._writer.start()

    def describe(self) -> str:
        """`12 snapshots (310 MiB of 2048) in DIR`: for the start-up line."""
        used = 0
        for path in self.folder.glob("*.kv"):
            try:
                used += path.stat().st_size
            except OSError:
                pass  # removed meanwhile (another server's eviction)
        return f"{len(self.index)} snapshots ({used / 2**20:.0f} MiB of {self.budget / 2**20:.0f}) in {self.folder}"

    # --- reading ----------------------------------------------------------------------------
    def _refresh(self) -> None:
        """Read every file's header again when the folder changed (a file added or removed)."""
        try:
            seen = self.folder.stat().st_mtime_ns
        except OSError:
            return
        if seen == self._seen:
            return
        index = {}
        for path in self.folder.glob("*.kv"):
            if path.name in self._bad:
                continue
            known = self.index.get(path.name)
            if known is not None:
                index[path.name] = known
                continue
            header = self._header(path)
            if header is not None:
                index[path.name] = header["ids"]
        with self._lock:
            self.index, self._seen = index, seen

    def _header(self, path: Path) -> dict | None:
        """A file's header, or None (with one warning) when it is not a whole file of this key."""
        try:
            with open_regular(path) as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return self._skip(path, "not an exactspec KV file of this version")
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size)) if 0 < size < 2**31 else None
        except (OSError, ValueError) as e:
            return self._skip(path, f"unreadable header ({e})")
        if not isinstance(header, dict) or header.get("key") != self.key:
            return self._skip(path, "written for another model or build")
        ids = header.get("ids")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)
                and isinstance(header.get("size"), int) and isinstance(header.get("mac"), str)):
            return self._skip(path, "malformed header")
        return header

    def _skip(self, path: Path, why: str) -> None:
        self.skipped += 1
        if path.name not in self._bad:
            self._bad.add(path.name)
            print(f"exactspec: prefix cache on disk: skipped {path}: {why}", file=sys.stderr, flush=True)
        return None

    def longest(self, ids: list[int]) -> int:
        self._refresh()
        with self._lock:
            return max((common_prefix(held, ids) for held in self.index.values()), default=0)

    def load(self, ids: list[int]) -> tuple[list[int], bytes] | None:
        self._refresh()
        with self._lock:
            found = sorted(((common_prefix(held, ids), name) for name, held in self.index.items()), reverse=True)
        for n, name in found:  # the longest match that reads back whole
            if n == 0:
                break
            path = self.folder / name
            header = self._header(path)
            data = self._payload(path, header) if header is not None else None
            if data is None:
                with self._lock:
                    self.index.pop(name, None)
                continue
            try:
                os.utime(path)  # recently used: evicted last
            except OSError:
                pass
            self.loads += 1
            return header["ids"], data
        return None

    def _payload(self, path: Path, header: dict) -> bytes | None:
        try:
            with open_regular(path) as f:
                f.seek(len(MAGIC))
                f.seek(int.from_bytes(f.read(8), "little"), os.SEEK_CUR)  # past the header
                data = f.read()
        except OSError:
            return self._skip(path, "unreadable")
        if len(data) != header["size"]:
            return self._skip(path, f"truncated ({len(data)} of {header['size']} bytes)")
        if not hmac.compare_digest(self._mac(header["ids"], data), header["mac"]):
            return self._skip(path, "not authentic (its MAC differs: written without this folder's secret, or corrupt)")
        return data

    def _mac(self, ids: list[int], payload: bytes) -> str:
        signed = hmac.new(self.secret, json.dumps({"key": self.key, "ids": ids, "size": len(payload)},
                                                  sort_keys=True).encode(), hashlib.sha256)
        signed.update(payload)
        return signed.hexdigest()

    def forget(self, ids: list[int]) -> None:
        with self._lock:
            names = [name for name, held in self.index.items() if held == ids]
            for name in names:
                self.index.pop(name)
        for name in names:
            (self.folder / name).unlink(missing_ok=True)

    # --- writing ----------------------------------------------------------------------------
    def keep(self, ids: list[int], data: Callable[[], bytes]) -> None:
        self._queue.put((list(ids), data))

    def flush(self) -> None:
        """Wait until every snapshot kept so far is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Write what is kept so far, then end the writer thread (a replaced or dropped cache)."""
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            ids, data = item
            try:
                self._write(ids, data)
            except Exception as e:  # a full disk, a removed folder: the memory cache goes on without it
                print(f"exactspec: prefix cache on disk: could not write: {e}", file=sys.stderr, flush=True)
            finally:
                self._queue.task_done()

    def _write(self, ids: list[int], data: Callable[[], bytes]) -> None:
        self._refresh()
        with self._lock:
            held = dict(self.index)
        if any(common_prefix(other, ids) == len(ids) for other in held.values()):
            return  # already covered by a longer (or the same) sequence
        payload = data()
        header = json.dumps({"key": self.key, "ids": ids, "size": len(payload),
                             "mac": self._mac(ids, payload)}).encode()
        name = hashlib.sha256(" ".join(map(str, ids)).encode()).hexdigest()[:32] + ".kv"
        try:
            write_atomic(self.folder / name, MAGIC + len(header).to_bytes(8, "little") + header + payload, 0o600)
        except OSError:
            self.failed_writes += 1
            raise
        self.writes += 1
        for other, other_ids in held.items():  # superseded: a prefix of what was just written
            if common_prefix(other_ids, ids) == len(other_ids):
                (self.folder / other).unlink(missing_ok=True)
        self._evict()
        self._refresh()

    def _evict(self) -> None:
        """Remove least-recently-used files while the folder holds more than the budget (and stale
        temporary files of a writer that died)."""
        files = []
        for path in self.folder.iterdir():
            try:
                st = path.stat()
            except OSError:
                continue  # removed meanwhile (another server)
            if path.suffix == ".kv":
                files.append((st.st_mtime, st.st_size, path))
            elif ".tmp" in path.name and time.time() - st.st_mtime > STALE_TMP_S:
                path.unlink(missing_ok=True)
        used = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if used <= self.budget:
                break
            path.unlink(missing_ok=True)
            used -= size


def open_regular(path: Path):
    """`path` opened for reading if it is a regular file: links not followed, and no wait (a FIFO opens at
    once, then is refused)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def private_folder(folder: Path) -> None:
    """Make `folder` (and the folders above it that did not exist) 0700; an existing one is made 0700 too."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
    except OSError as e:
        raise ExactSpecError(f"cannot make the prefix cache folder {folder}: {e.strerror or e}") from None


def folder_secret(folder: Path) -> bytes:
    """The folder's HMAC key, created (0600, exclusively: two servers starting together agree) if absent."""
    private_folder(folder)
    path = folder / SECRET
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    except FileExistsError:
        pass
    except OSError as e:
        raise ExactSpecError(f"cannot write the prefix cache's secret {path}: {e.strerror or e}") from None
    for _ in range(50):  # another server created it a moment ago: its 32 bytes are on their way
        try:
            with open_regular(path) as f:
                secret = f.read()
        except OSError as e:
            raise ExactSpecError(f"cannot read the prefix cache's secret {path}: {e.strerror or e}") from None
        if len(secret) == 32:
            return secret
        time.sleep(0.01)
    raise ExactSpecError(f"the prefix cache's secret {path} is not 32 bytes: remove it (a new one is made)")
