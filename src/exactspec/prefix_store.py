"""The prefix cache on disk: KV snapshots that survive a restart (an upgrade, a crash), bounded in MiB.

An agent session's tool-spec system prompt costs seconds to prefill cold; the in-memory prefix cache
(speculative/prefix_cache.py) forgets it at every restart. This store keeps each snapshot the memory
cache keeps as one file, written off the decode thread, and the memory cache asks it on a miss.

Layout: one folder per `persist_key` (the model file, the engine build, the self-test's setting: what
the bytes mean; a snapshot is never offered to another model or build), one file per token sequence:

    MAGIC | header length (8 bytes, little-endian) | header (JSON: key, ids, size, sha256) | payload

Written to a temporary name and renamed, so a reader sees a whole file or none; two servers sharing the
folder each write whole files, and each evicts least-recently-used files (by mtime, touched on every
load) while the folder holds more than its budget. A file that is truncated, corrupt (its payload's
sha256 differs), of another key or unreadable is skipped with one warning line, and the prompt is
prefilled as if it were absent: a file never changes an output.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .cachedir import write_atomic
from .speculative.prefix_cache import common_prefix

MAGIC = b"exactspec-kv\x01"
PREFIX_DISK_MB = 2048  # the default disk budget (cli_common.PREFIX_DISK_MB, the same for `serve` and `batch`)
STALE_TMP_S = 3600.0  # temporary files older than this are a writer that died mid-write: removed


class DiskPrefixStore:
    """`PrefixSpill` over a folder, for snapshots of one `persist_key`, in at most `budget_mb` MiB."""

    def __init__(self, folder: str | os.PathLike, key: str, budget_mb: float) -> None:
        if budget_mb <= 0:
            raise ValueError(f"the disk prefix cache budget must be > 0 MiB, got {budget_mb}")
        self.key, self.budget = key, int(budget_mb * 2**20)
        self.folder = Path(folder) / hashlib.sha256(key.encode()).hexdigest()[:24]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.index: dict[str, list[int]] = {}  # file name -> the tokens it holds
        self._seen = -1  # the folder's mtime when the index was read (another server's writes change it)
        self._bad: set[str] = set()  # files skipped (warned about once, never read again by this process)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self.loads = self.writes = self.skipped = 0
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
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return self._skip(path, "not an exactspec KV file")
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size)) if 0 < size < 2**31 else None
        except (OSError, ValueError):
            return self._skip(path, "unreadable header")
        if not isinstance(header, dict) or header.get("key") != self.key:
            return self._skip(path, "written for another model or build")
        ids = header.get("ids")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)
                and isinstance(header.get("size"), int) and isinstance(header.get("sha256"), str)):
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
            with open(path, "rb") as f:
                f.seek(len(MAGIC))
                f.seek(int.from_bytes(f.read(8), "little"), os.SEEK_CUR)  # past the header
                data = f.read()
        except OSError:
            return self._skip(path, "unreadable")
        if len(data) != header["size"]:
            return self._skip(path, f"truncated ({len(data)} of {header['size']} bytes)")
        if hashlib.sha256(data).hexdigest() != header["sha256"]:
            return self._skip(path, "corrupt (checksum differs)")
        return data

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
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        name = hashlib.sha256(" ".join(map(str, ids)).encode()).hexdigest()[:32] + ".kv"
        write_atomic(self.folder / name, MAGIC + len(header).to_bytes(8, "little") + header + payload)
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
