"""Prefix cache across requests: keep the KV cache of recent sequences, prefill only what is new.

Agent loops re-send the whole conversation every step; its history is the prompt the previous step
already ran (plus the answer it generated). After a generation the adapter's KV for the sequence
(prompt + generated tokens) is copied into this cache; a later prompt reuses the longest cached token
prefix (restore, then roll back to the common length) and prefills only the rest. The anchors are
vLLM's automatic prefix caching, llama.cpp server's `cache_prompt` and SGLang's radix cache; this is
their simplest form: whole sequences, exact token comparison, LRU under a byte budget.

Exactness: a restored prefix is the KV the same tokens produced before, so the target law is that
of the same tokens re-prefilled up to float rounding of block shapes (which the decode loop's
verification already varies); tests check identical greedy and seeded outputs with and without the
cache. Only positions whose tokens equal the new prompt's are ever kept (rollback to the common
prefix), so no other conversation's continuation is ever seen.

Adapters opt in with two methods and an attribute (consulted on prefill, see `prefill_prompt`):
    snapshot_prefix(length, row=0) -> (state, nbytes)   # a copy of row's KV for positions [0, length)
    restore_prefix(state, length) -> None               # a one-row cache holding state's first `length` positions
    prefix_cache: PrefixCache | None
and, where a prefill's numerics depend on the prompt it is part of (llama.cpp's TILED PREFILL),
    reusable(common, state, ids) -> int                 # how much of a match computed alike may be reused

Across restarts: with a `spill` (exactspec.prefix_store, on disk) every snapshot kept is also handed to
it, and a lookup whose longest prefix the spill holds longer than memory brings that snapshot back
first; an adapter opts in with `PersistentPrefix` (its states as bytes, under a key naming what they
depend on). The bytes restored are the bytes snapshotted, and `reusable` applies to them as to any
entry: a restored prefix is what a cold prefill computes.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import ExactSpecError
from .interfaces import PersistentPrefix, PrefixSnapshots, PrefixSpill, ReusablePrefix


@dataclass(eq=False)
class Entry:
    ids: list[int]  # the tokens whose KV `state` holds, in order
    state: object
    nbytes: int


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slice equality (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """LRU cache of KV snapshots keyed by token sequence, bounded to `budget_mb` MiB."""

    def __init__(self, budget_mb: float = 512.0, min_tokens: int = 1, spill: PrefixSpill | None = None) -> None:
        if budget_mb < 0:
            raise ValueError(f"prefix cache budget must be >= 0 MiB, got {budget_mb}")
        self.budget = int(budget_mb * 2**20)
        self.spill = spill  # where snapshots also go, and are looked for on a miss (across restarts)
        self.min_tokens = min_tokens  # shorter matches are not worth a restore
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self.used = 0
        self._next_key = 0
        self._lock = threading.Lock()  # the bench and tests may share one cache between engines
        # counters (what /metrics and the bench report)
        self.lookups = self.hits = self.reused_tokens = self.prefilled_tokens = self.evictions = 0
        self.restored = 0  # snapshots brought back from the spill (disk)

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, ids: list[int]) -> tuple[int | None, int]:
        """(key of the entry sharing the longest prefix with `ids`, that prefix's length)."""
        best, best_n = None, 0
        for key, entry in self.entries.items():
            n = common_prefix(entry.ids, ids)
            if n > best_n:
                best, best_n = key, n
        return (best, best_n) if best_n >= self.min_tokens else (None, 0)

    def prefill(self, target, ids: list[int]) -> int:
        """Leave `target` as a one-row cache holding exactly `ids`: the longest cached prefix restored,
        the rest prefilled. Returns the number of tokens reused."""
        n = self.restore(target, ids)
        if len(ids) > n:
            target.prefill(torch.tensor([ids[n:]], dtype=torch.long))
        return n

    def restore(self, target, ids: list[int]) -> int:
        """Leave `target` as a one-row cache holding the longest cached prefix of `ids` (empty if none),
        the rest for the caller to prefill (at once, or in chunks). Returns that prefix's length."""
        if self.spill is not None and isinstance(target, PersistentPrefix) and target.persist_key:
            self._unspill(target, ids)
        with self._lock:
            self.lookups += 1
            key, n = self.match(ids)
            if key is not None and isinstance(target, ReusablePrefix):
                n = target.reusable(n, self.entries[key].state, ids)
            state = None
            if key is not None and n >= self.min_tokens:
                self.entries.move_to_end(key)
                state = self.entries[key].state
                self.hits += 1
            else:
                n = 0
            self.reused_tokens += n
            self.prefilled_tokens += len(ids) - n
        if state is not None:
            try:
                target.restore_prefix(state, n)
            except ExactSpecError as e:  # bytes the engine refuses (a snapshot of another layout): never again
                self._refused(key, e)
                with self._lock:
                    self.reused_tokens -= n
                    self.prefilled_tokens += n
                n = 0
                target.reset()
        else:
            target.reset()
        return n

    def _refused(self, key, error: ExactSpecError) -> None:
        """Forget an entry the target could not restore, in memory and in the spill, with one warning."""
        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                return
            ids = entry.ids
            self._drop(key)
        if self.spill is not None:
            self.spill.forget(ids)
        print(f"exactspec: prefix cache: a snapshot of {len(ids)} tokens could not be restored ({error}); "
              "dropped, the prompt prefilled", file=sys.stderr, flush=True)

    def _unspill(self, target: PersistentPrefix, ids: list[int]) -> None:
        """Bring the spill's longest prefix of `ids` into memory when it is longer than memory's (a
        snapshot of an earlier process). Bytes that do not make a state are skipped (prefilled instead)."""
        with self._lock:
            _, n = self.match(ids)
        if self.spill.longest(ids) <= n:
            return
        found = self.spill.load(ids)
        if found is None:
            return
        held, data = found
        if len(data) > self.budget:
            return
        try:
            state = target.state_from_bytes(held, data)
        except ExactSpecError:
            return
        with self._lock:
            self._add(held, state, len(data))
            self.restored += 1

    def save(self, target, ids: list[int], row: int = 0) -> None:
        """Keep a copy of `target`'s KV for `ids` (its row `row` holds them at positions [0, len(ids))).
        Entries that are a prefix of `ids` are superseded and dropped; nothing is copied when `ids` is a
        prefix of an entry already kept."""
        if len(ids) < self.min_tokens or self.budget == 0:
            return
        with self._lock:
            for key, entry in list(self.entries.items()):
                n = common_prefix(entry.ids, ids)
                if n == len(ids):  # already covered
                    self.entries.move_to_end(key)
                    return
                if n == len(entry.ids):
                    self._drop(key)
        state, nbytes = target.snapshot_prefix(len(ids), row)
        if self.spill is not None and isinstance(target, PersistentPrefix) and target.persist_key:
            self.spill.keep(ids, lambda: target.state_bytes(state))
        if nbytes > self.budget:
            return
        with self._lock:
            self._add(ids, state, nbytes)

    def _add(self, ids: list[int], state: object, nbytes: int) -> None:
        """Keep a snapshot (under the lock), least recently used entries evicted past the budget."""
        self.entries[self._next_key] = Entry(list(ids), state, nbytes)
        self._next_key += 1
        self.used += nbytes
        while self.used > self.budget:
            self._drop(next(iter(self.entries)))
            self.evictions += 1

    def _drop(self, key: int) -> None:
        self.used -= self.entries.pop(key).nbytes

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.used = 0


def cache_of(target) -> PrefixCache | None:
    """The target's prefix cache, if it has one and can snapshot its KV."""
    return target.prefix_cache if isinstance(target, PrefixSnapshots) else None


def prefill_prompt(target, ids: list[int]) -> int:
    """The decode loop's prefill: reset `target` to hold `ids` (the prompt but its last token),
    through its prefix cache when it has one. Returns the number of tokens reused from the cache."""
    cache = cache_of(target)
    if cache is not None:
        return cache.prefill(target, ids)
    target.reset()
    if ids:
        target.prefill(torch.tensor([ids], dtype=torch.long))
    return 0


def remember(target, context: list[int], prompt_length: int, row: int = 0, cached: int | None = None) -> None:
    """After a generation: keep the KV of `context` (prompt + generated) that `target`'s row holds.
    `cached`: how many positions of the row are valid (default: the target's length). Adapters whose
    decode steps write KV that differs in its last bits from a prefill of the same tokens
    (`cache_generated_kv = False`: llama.cpp) keep only the prompt's prefilled part."""
    cache = cache_of(target)
    if cache is None:
        return
    held = target.length if cached is None else cached
    if not target.cache_generated_kv:
        held = min(held, prompt_length - 1)
    cache.save(target, context[: min(held, len(context))], row)
