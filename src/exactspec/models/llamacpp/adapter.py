"""llama.cpp adapter: a GGUF file run by llama-cpp-python's low-level API (installed by `make setup`; `pip install exactspec[llamacpp]` elsewhere).

The model and context are created by `llama_cpp.Llama`; decoding then uses our own `llama_batch` with
logits at every position (k new tokens -> one `llama_decode` -> [k, V]), rollback is
`llama_memory_seq_rm`, and batched rows are llama.cpp sequences in KV streams of their own. How the
cache type, threads, n_ubatch, tiled prefill, pads and rows keep blocks equal to one-token steps bit for
bit, and why: docs/llama-cpp.md, "Inside the adapter".
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import torch

from ...errors import ExactSpecError
from . import prefill_plan
from .runtime import (DEFAULT_N_UBATCH, yarn_kwargs, affordable_rows, check_gguf_file, default_context, default_threads,
                      import_llama_cpp, kv_bytes_per_token, make_llama, resolve_repack)

class Cells(NamedTuple):
    """A copy of one row's KV cells (llama.cpp's per-sequence state), with the tokens they hold and the
    kernel kind that computed each (prefill_plan.py)."""

    buf: object  # ctypes array
    ids: list[int]
    kinds: bytes


class LlamaCppLM:
    """`CausalLM` over a llama.cpp context holding up to `rows` sequences (row b = sequence b). With
    rows > 1 it is `batched` (see BATCHED ROWS); the one-row methods (`forward`, `prefill`, `truncate`,
    `length`) are row 0's."""

    def __init__(self, path: str, n_ctx: int | None = None, threads: int | None = None,
                 eos_token_ids: set[int] | None = None, n_batch: int = 512, n_ubatch: int = DEFAULT_N_UBATCH,
                 repack: bool | None = None, rows: int = 1, prefill_tile: int = 0, pad_steps: bool = True,
                 **llama_kwargs):
        llama_cpp = import_llama_cpp()
        check_gguf_file(path)
        if rows < 1:
            raise ExactSpecError(f"a llama.cpp context holds at least one row, got {rows}")
        self._lib = llama_cpp
        self.path = path
        self.threads = threads or default_threads()
        self.single_threads = self.threads  # one-token steps (llamacpp/numerics.py may lower it at load)
        self.identity = "not self-tested at load"  # what greedy identity rests on (llamacpp/numerics.py)
        self.cost_key: str | None = None  # keys auto γ's cached T(k) (numerics.load_self_tested)
        self.persist_key: str | None = None  # keys its prefix snapshots on disk (numerics.load_self_tested)
        want = n_ctx or default_context(path, rows)
        if want < 2:
            raise ExactSpecError(f"the context must hold at least 2 tokens, got {want}")
        rows = affordable_rows(path, rows, want) if rows > 1 else 1
        self.max_rows, self.batched = rows, rows > 1
        self.ragged = self.batched  # forward_ragged: rows of different lengths in one decode, unpadded
        self.n_batch = max(1, min(n_batch, want))
        self.n_ubatch = max(1, min(n_ubatch, self.n_batch))
        self.repack = resolve_repack(path, repack)
        # TILED PREFILL: whole tiles must fit one compute step
        self.prefill_tile = prefill_tile if 1 < prefill_tile <= min(self.n_batch, self.n_ubatch) else 0
        self.pad_steps = pad_steps  # a lone token gets a PAD (off: this llama.cpp build has no split-KV kernel)
        self._spare = 1 if self.prefill_tile and pad_steps and rows == 1 else None  # the one-row context's pad sequence
        # extra `Llama` arguments (type_k, ...), reused by the bench anchors; see BATCH INVARIANCE above
        self.llama_kwargs = {"flash_attn": True, **yarn_kwargs(path, want), **llama_kwargs}
        try:
            kwargs = self.context_kwargs(want)
            if self._spare is None:
                self.llama = make_llama(path, self.repack, rows, **{**kwargs, "n_ctx": want * rows})
            else:  # row 0 and the pad sequence share one cache (a pad takes one cell, for one pass)
                self.llama = make_llama(path, self.repack, 2, unified=True, **{**kwargs, "n_ctx": want})
        except Exception as e:  # llama-cpp-python raises ValueError/RuntimeError for unreadable models
            raise ExactSpecError(f"llama.cpp cannot load {path}: {str(e)[:200]}") from None
        self.ctx = self.llama.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        vocab = llama_cpp.llama_model_get_vocab(self.llama.model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(vocab))
        if eos_token_ids is None:
            eos_token_ids = {t for t in (llama_cpp.llama_vocab_eos(vocab), llama_cpp.llama_vocab_eot(vocab)) if t >= 0}
        self.eos_token_ids = set(eos_token_ids)
        # llama.cpp pads each sequence's context up to a multiple of 256; never go past what was asked for
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(self.ctx))
        self.max_length = min(want, self.n_ctx_seq)
        self.kv_bytes = int(llama_cpp.llama_n_ctx(self.ctx)) * kv_bytes_per_token(path)  # f16 bound, all rows
        yarn = self.llama_kwargs.get("yarn_orig_ctx")
        self.rope_note = f"YaRN rope scaling x{want / yarn:.3g} past the {yarn}-token training context" if yarn else ""
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.prefix_cache = None  # a PrefixCache consulted on prefill (see prefix_cache.py)
        # Only prompt KV goes to the prefix cache unless the load-time self-test shows one-token steps write
        # the cells a prefill writes (numerics.steps_write_prefill_kv): with an f16 cache they
        # differ in their last bits at long contexts (seen at ~500 tokens, where it flipped a greedy choice
        # of the next agent step); with a q8_0-K cache they were equal here, byte for byte.
        self.cache_generated_kv = False
        self.turn_marker: list[int] = []  # the chat template's generation prompt, tokens (prefill_plan.py)
        self._ids: list[list[int]] = [[]]  # [B] each live row's cached tokens (its length: how many) ...
        self._kinds: list[bytearray] = [bytearray()]  # ... and the kernel kind that computed each (prefill_plan)
        self._plans: dict[int, bytearray] = {}  # a joining row's kinds still to prefill (open_row)
        self.reset()

    def context_kwargs(self, n_ctx: int | None = None) -> dict:
        """Context settings of this adapter (per sequence), for another `Llama` over the same file (bench anchors)."""
        return dict(n_ctx=n_ctx or self.max_length, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                    n_threads=self.single_threads, n_threads_batch=self.threads, **self.llama_kwargs)

    @property
    def chunked_prefill(self) -> bool:
        """open_row / extend_row / copy_row: a joining prompt prefilled in chunks between decode steps
        (BatchDecoder's prefill budget) -- while rows are batched; `prefill_chunk` cuts the chunks, and the
        self-test's verdict (blocks equal one-token steps) covers the rest."""
        return self.batched

    def plan(self, ids: list[int]) -> bytearray:
        """The kernel kind of each position of a prefill of `ids` (TILED PREFILL; prefill_plan.kinds)."""
        return prefill_plan.kinds(ids, self.turn_marker, self.eos_token_ids, self.prefill_tile)

    def reusable(self, common: int, state, ids: list[int]) -> int:
        """How many of `common` positions a `snapshot_prefix` state shares with a prefill of `ids` that
        prefill may keep: all of them, unless TILED PREFILL computed some of them with another kernel than
        a cold prefill of `ids` would (prefill_plan.reusable)."""
        if not self.prefill_tile:
            return common
        return prefill_plan.reusable(state.kinds, self.plan(ids), common, self.prefill_tile)

    def prefill_chunk(self, seq: int, want: int) -> int:
        """How many of joining row `seq`'s tokens to prefill now, about `want`: with TILED PREFILL a cut
        that keeps every position's kernel (prefill_plan.chunk); else ending at a multiple of n_ubatch
        where it can (whole compute steps)."""
        if self.prefill_tile:
            return prefill_plan.chunk(self._plans[seq], want, self.prefill_tile)
        return want - want % self.n_ubatch if want >= self.n_ubatch else max(1, want)

    def set_single_threads(self, n: int) -> None:
        """Threads of one-token steps (blocks keep `threads`): see numerics.py.py."""
        self.single_threads = n
        self._lib.llama_set_n_threads(self.ctx, n, self.threads)

    # --- cache -------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self._ids[0])

    @property
    def batch_size(self) -> int:
        return len(self._ids)

    def _room(self, rows: int) -> None:
        if rows > self.max_rows:
            if self.max_rows == 1:
                raise ExactSpecError("LlamaCppLM holds one sequence: decode its rows one at a time "
                                     "(load it with rows=N to batch N)")
            raise ExactSpecError(f"this llama.cpp context holds {self.max_rows} rows, not {rows}")

    def reset(self, batch: int = 1) -> None:
        self._room(batch)
        # metadata only: zeroing the buffers (data=True) took 7-10 ms per generation with a 4096-token
        # context; freed cells are never read, as after any rollback
        self._lib.llama_memory_clear(self.memory, False)
        self._ids, self._kinds, self._plans = [[] for _ in range(batch)], [bytearray() for _ in range(batch)], {}
        self.llama.n_tokens = 0  # the high-level Llama object must not reuse a "cached prefix" it did not write

    def _clear(self, seq: int) -> None:
        self._lib.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def _truncate(self, seq: int, length: int) -> None:
        if not 0 <= length <= len(self._ids[seq]):
            raise ValueError(f"cannot truncate to {length}: {len(self._ids[seq])} tokens cached")
        if length < len(self._ids[seq]):
            if not self._lib.llama_memory_seq_rm(self.memory, seq, length, -1):
                raise ExactSpecError("llama.cpp cannot roll back this model's memory (recurrent model?)")
            del self._ids[seq][length:], self._kinds[seq][length:]

    def truncate(self, length: int) -> None:
        self._truncate(0, length)

    def truncate_rows(self, lengths: list[int] | torch.Tensor) -> None:
        """lengths [B]: keep the first lengths[b] positions of each row."""
        for seq, length in enumerate(lengths):
            self._truncate(seq, int(length))

    def _state(self, seq: int) -> Cells:
        """A copy of sequence `seq`'s cells (llama.cpp's per-sequence state: its used cells only), its
        tokens and their kinds."""
        size = self._lib.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        written = self._lib.llama_state_seq_get_data(self.ctx, buf, size, seq)
        if written != size:
            raise ExactSpecError(f"llama.cpp wrote {written} of {size} bytes of its sequence state")
        return Cells(buf, list(self._ids[seq]), bytes(self._kinds[seq]))

    def _set_state(self, seq: int, cells: Cells) -> None:
        """Sequence `seq` holds exactly the positions of a `_state` copy (laid out from its first cell, as
        a prefill of them would be)."""
        self._clear(seq)
        self._ids[seq], self._kinds[seq] = [], bytearray()
        if not self._lib.llama_state_seq_set_data(self.ctx, cells.buf, len(cells.buf), seq):
            self._clear(seq)
            raise ExactSpecError("llama.cpp could not restore a sequence's cache (context full?)")
        self._ids[seq], self._kinds[seq] = list(cells.ids), bytearray(cells.kinds)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) the given rows [B'], in that order: rows that change sequence are copied
        (their used cells only), every source read before any is overwritten."""
        rows = [int(r) for r in rows]
        self._room(len(rows))
        moves = [(seq, src) for seq, src in enumerate(rows) if src != seq]
        states = {src: self._state(src) for src in {src for _, src in moves}}
        grow = len(rows) - len(self._ids)
        self._ids += [[] for _ in range(grow)]
        self._kinds += [bytearray() for _ in range(grow)]
        for seq, src in moves:
            self._set_state(seq, states[src])
        for seq in range(len(rows), len(self._ids)):
            self._clear(seq)
        del self._ids[len(rows):], self._kinds[len(rows):]
        self._plans = {seq: self._plans[src] for seq, src in enumerate(rows) if src in self._plans}  # a joining row's rest

    def append_rows(self, prompt_ids: list[int], copies: int = 1) -> int:
        """Append `copies` rows holding prompt_ids[:-1]: the first is prefilled (through the prefix cache,
        if any) in its own sequence, the running rows untouched; the others copy its cells. -> tokens reused."""
        seq = self.batch_size
        reused, rest = self.open_row(prompt_ids, copies)
        try:
            self.extend_row(seq, rest)
            self.copy_row(seq, copies - 1)
        except BaseException:
            self.drop_rows(seq)
            raise
        return reused

    # --- chunked prefill: a joining row opened, extended between decode steps, then copied -------
    def open_row(self, prompt_ids: list[int], copies: int = 1) -> tuple[int, list[int]]:
        """A new last row holding the longest prefix of prompt_ids[:-1] its prefix cache has (none: empty),
        with room checked for `copies` rows -> (tokens reused, the tokens still to prefill)."""
        if not prompt_ids or len(prompt_ids) >= self.max_length:
            raise ExactSpecError(f"a prompt of {len(prompt_ids)} tokens cannot join a {self.max_length}-token context")
        seq = self.batch_size
        self._room(seq + copies)
        self._ids.append([])
        self._kinds.append(bytearray())
        row, ids = _Row(self, seq), prompt_ids[:-1]
        try:
            cache = self.prefix_cache
            reused = cache.restore(row, ids) if cache is not None else 0
        except BaseException:
            self.drop_rows(seq)
            raise
        if self.prefill_tile:
            self._plans[seq] = self.plan(ids)[reused:]
        return reused, ids[reused:]

    def extend_row(self, seq: int, ids: list[int]) -> None:
        """Prefill `ids` into row `seq` (no logits): a whole prompt, or one chunk of it (the next
        `prefill_chunk` tokens of an `open_row` prompt)."""
        if ids:
            plan = self._plans.pop(seq, None)
            if plan is not None and len(plan) > len(ids):
                plan, self._plans[seq] = plan[:len(ids)], plan[len(ids):]
            self._decode(seq, ids, None, plan if plan is not None and len(plan) == len(ids) else None)

    def copy_row(self, seq: int, copies: int) -> None:
        """Append `copies` rows holding row `seq`'s cells (a request's n samples share one prefill)."""
        if copies > 0:
            state = self._state(seq)
            for _ in range(copies):
                self._ids.append([])
                self._kinds.append(bytearray())
                self._set_state(len(self._ids) - 1, state)

    def drop_rows(self, first: int) -> None:
        """Forget rows `first`.. (a joining row that failed or left before its prefill ended)."""
        for extra in range(first, len(self._ids)):
            self._clear(extra)
            self._plans.pop(extra, None)
        del self._ids[first:], self._kinds[first:]

    def save_cache(self) -> list[Cells]:
        """Every row's cells, for `restore_cache` after the context was used for something else."""
        return [self._state(seq) for seq in range(self.batch_size)]

    def restore_cache(self, saved: list[Cells]) -> None:
        self.reset(len(saved))
        for seq, cells in enumerate(saved):
            self._set_state(seq, cells)

    def snapshot_prefix(self, length: int, row: int = 0) -> tuple[Cells, int]:
        """A copy of row `row`'s first `length` cached positions and its size in bytes, for the prefix
        cache. Rolls that row back to `length` first: call it when the row leaves."""
        self._truncate(row, length)
        cells = self._state(row)
        return cells, len(cells.buf)

    def restore_prefix(self, state: Cells, length: int) -> None:
        """A one-row cache holding the first `length` positions of a `snapshot_prefix` state."""
        self.reset()
        self._restore(0, state, length)

    def state_bytes(self, state: Cells) -> bytes:
        """A snapshot as bytes: its kinds' count (4 bytes, little-endian), the kinds, llama.cpp's sequence
        state as it wrote it."""
        return len(state.kinds).to_bytes(4, "little") + state.kinds + bytes(state.buf)

    def state_from_bytes(self, ids: list[int], data: bytes) -> Cells:
        """The snapshot of `ids` that `state_bytes` gave."""
        n = int.from_bytes(data[:4], "little") if len(data) >= 4 else -1
        if n != len(ids) or len(data) < 4 + n:
            raise ExactSpecError(f"a saved KV state for {len(ids)} tokens holds {n} kernel kinds")
        buf = (ctypes.c_uint8 * (len(data) - 4 - n)).from_buffer_copy(data, 4 + n)
        return Cells(buf, list(ids), bytes(data[4:4 + n]))

    def _restore(self, seq: int, state: Cells, length: int) -> None:
        self._set_state(seq, state)
        self._truncate(seq, length)

    # --- forward -----------------------------------------------------------------------------
    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        """new_ids [1, k] -> logits [1, k, V] float32; appends k positions to row 0."""
        rows = self._decode(0, new_ids.reshape(-1).tolist(), np.copy)  # [n, V] per llama_decode call
        return torch.from_numpy(rows[0] if len(rows) == 1 else np.concatenate(rows))[None]

    def forward_argmax(self, new_ids: list[int]) -> list[int]:
        """The argmax of each new position's logits (row 0), read in place (no [k, V] copy, no torch): the
        decode loop's temperature-0 path. Python work after a llama_decode runs with cold caches (~10-50 µs
        per torch op here), so at ~10 ms per token every op skipped is worth ~0.3%."""
        return [int(t) for rows in self._decode(0, new_ids, lambda logits: logits.argmax(-1)) for t in rows]

    def prefill(self, new_ids: torch.Tensor) -> None:
        """Like `forward` but computes no logits (no output projection, no copy): ~15-25% of a prefill of
        the embedded model."""
        self._decode(0, new_ids.reshape(-1).tolist(), None)

    def forward_rows(self, new_ids: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        """new_ids [B, k]: row b appends k positions at its own length -> logits [B, k, V] (None if not
        `logits`). Every row's tokens go into the same llama_decode calls (as many columns as fit n_batch)."""
        B = new_ids.shape[0]
        if B != self.batch_size:
            raise ValueError(f"got {B} rows for a cache of {self.batch_size}")
        if B == 1:
            return self.forward(new_ids) if logits else self.prefill(new_ids)
        return self.forward_ragged(new_ids.tolist(), logits)  # [B, k, V]

    def forward_ragged(self, ids: list[list[int]], logits: bool = True) -> torch.Tensor | None:
        """Row b appends ids[b] (its own length) -> logits [B, max len, V], zero past each row's own
        tokens (those positions were not computed: nothing is written past a row's tokens); None if not
        `logits` (a prefill of prompts of different lengths, none padded)."""
        if len(ids) != self.batch_size:
            raise ValueError(f"got {len(ids)} rows for a cache of {self.batch_size}")
        if not logits:
            if self.prefill_tile:  # each prompt by the tiled-prefill rules, as it would be alone
                self._check_room(ids)
                for seq, row in enumerate(ids):
                    self._decode(seq, row, None)
            else:
                self._decode_columns(ids, None)
            return None
        width = max(len(row) for row in ids)
        if self.batch_size == 1:
            return self.forward(torch.tensor(ids))
        out = np.zeros((len(ids), width, self.vocab_size), dtype=np.float32)  # [B, width, V]
        self._decode_columns(ids, out)
        return torch.from_numpy(out)

    def forward_ragged_argmax(self, ids: list[list[int]]) -> list[list[int]]:
        """Row b appends ids[b] -> the argmax of each of its new positions' logits, read in place (no
        [B, k, V] array is filled): the batched temperature-0 path, as `forward_argmax` is one row's."""
        if len(ids) != self.batch_size:
            raise ValueError(f"got {len(ids)} rows for a cache of {self.batch_size}")
        found: list[list[int]] = [[] for _ in ids]
        self._decode_columns(ids, found)
        return found

    def _check_room(self, ids: list[list[int]]) -> None:
        end = max(len(cached) + len(row) for cached, row in zip(self._ids, ids))
        if end > self.max_length:
            raise ExactSpecError(f"context length {end} exceeds the model's {self.max_length} tokens")

    def _decode_columns(self, ids: list[list[int]], out: np.ndarray | list[list[int]] | None) -> None:
        """Every row's tokens in passes, one llama_decode each (`_passes`); logits into out [B, width, V],
        or their argmax appended to out[b] (None: none computed)."""
        self._check_room(ids)
        cap = self.prefill_tile - 1 if self.prefill_tile else self.n_batch
        done = [0] * len(ids)  # tokens of each row decoded so far
        for first, count, n in _passes([len(row) for row in ids], cap, self.n_batch):
            parts = [(b, ids[b][done[b]:done[b] + n]) for b in range(first, first + count)]
            logits = self._pass(parts, None if out is None else (lambda x: x))  # [count * n, V]
            for i, (b, part) in enumerate(parts):
                if isinstance(out, list):
                    out[b] += logits[i * n:(i + 1) * n].argmax(-1).tolist()
                elif out is not None:
                    out[b, done[b]:done[b] + n] = logits[i * n:(i + 1) * n]
                done[b] += n

    def _pass(self, parts: list[tuple[int, list[int]]], read):
        """One llama_decode of each (sequence, tokens) part at that sequence's length -> `read(logits
        [n, V])` (in place, before the next pass overwrites them), or None if `read` is None. A lone
        token gets a PAD (TILED PREFILL), removed again."""
        batch, flag, i = self.batch, int(read is not None), 0
        starts = [(seq, len(self._ids[seq])) for seq, _ in parts]
        for (seq, ids), (_, length) in zip(parts, starts):
            for j, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, length + j, 1
                batch.seq_id[i][0], batch.logits[i] = seq, flag
                i += 1
        n = i
        # a lone token on more than one thread would take the split-KV kernel (on one, it is the per-row one)
        pad = self._pad(*starts[0]) if self.pad_steps and self.prefill_tile and n == 1 and self.single_threads > 1 else None
        if pad is not None:
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = 0, pad[1], 1
            batch.seq_id[i][0], batch.logits[i] = pad[0], 0
            starts.append(pad)
        self._run(n + (pad is not None), starts)
        if pad is not None:
            self._lib.llama_memory_seq_rm(self.memory, pad[0], pad[1], -1)
        kind = prefill_plan.TILED if self.prefill_tile and len(parts[0][1]) >= self.prefill_tile else prefill_plan.ROW
        for seq, ids in parts:
            self._ids[seq] += ids
            self._kinds[seq] += bytes([kind]) * len(ids)
        if read is not None:
            return read(np.ctypeslib.as_array(self._lib.llama_get_logits(self.ctx), shape=(n, self.vocab_size)))
        return None

    def _pad(self, seq: int, length: int) -> tuple[int, int] | None:
        """(sequence, position) of the pad beside one token of `seq` at `length`: an empty sequence next
        to it (so llama.cpp keeps the two in one compute step), else right after the token; None where
        the context has no room for it."""
        if self._spare is not None:
            return self._spare, 0
        if len(self._ids) <= seq + 1 < self.max_rows:
            return seq + 1, 0
        return (seq, length + 1) if length + 1 < self.n_ctx_seq else None

    def _run(self, n: int, starts: list[tuple[int, int]]) -> None:
        """llama_decode of the first n tokens of the batch; on failure every sequence is cut back to its
        start (a failed decode may leave part of the batch in the cache)."""
        self.batch.n_tokens = n
        rc = self._lib.llama_decode(self.ctx, self.batch)
        if rc != 0:
            for seq, start in starts:
                self._lib.llama_memory_seq_rm(self.memory, seq, start, -1)
            raise ExactSpecError(f"llama_decode failed (code {rc}) at position {min(s for _, s in starts)}")

    def _decode(self, seq: int, ids: list[int], read, plan: bytes | None = None) -> list:
        """Append `ids` to row `seq` in passes of `_pieces`. `read(logits [n, V])` gets each pass's
        logits in place, before the next one overwrites them; -> its results (none if `read` is None).
        `plan`: the kinds of a prefill's positions (default: its row's tokens and `ids` as one prompt)."""
        if len(self._ids[seq]) + len(ids) > self.max_length:
            raise ExactSpecError(f"context length {len(self._ids[seq]) + len(ids)} exceeds the model's {self.max_length} tokens")
        out, start = [], 0
        for size in self._pieces(seq, ids, read is None, plan):
            result = self._pass([(seq, ids[start:start + size])], read)
            if read is not None:
                out.append(result)
            start += size
        return out

    def _pieces(self, seq: int, ids: list[int], prefill: bool, plan: bytes | None = None) -> list[int]:
        """Pass sizes for `ids` appended to row `seq`: n_batch at a time; with TILED PREFILL, a prefill
        by its plan (prefill_plan.pieces: whole tiles per pass for TILED runs), anything with logits in
        passes of at most tile - 1 tokens (the per-row kernel)."""
        tile = self.prefill_tile
        if not tile:
            return _split(len(ids), self.n_batch)
        if not prefill:
            return _split(len(ids), tile - 1)
        if plan is None:
            plan = self.plan(self._ids[seq] + ids)[len(self._ids[seq]):]
        return [n for n, _ in prefill_plan.pieces(plan, min(self.n_batch, self.n_ubatch) // tile * tile, tile)]

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            self._lib.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "llama", None) is not None:
            self.llama.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _split(k: int, size: int) -> list[int]:
    """k tokens in pieces of `size`, the last one shorter."""
    return [min(size, k - start) for start in range(0, k, size)]


def _passes(widths: list[int], cap: int, n_batch: int) -> list[tuple[int, int, int]]:
    """The passes that decode rows of `widths` new tokens -> [(first row, rows, tokens each)]: each the
    run of consecutive rows that still have tokens from the first such row, as many tokens each as all of
    them have (at most `cap`, and n_batch in all). Such a pass is one compute step of llama.cpp's own
    split (its sequential equal split of per-sequence streams), so we know each step's shape."""
    left, passes = list(widths), []
    while any(left):
        first = next(b for b, w in enumerate(left) if w)
        count = next((i for i, w in enumerate(left[first:]) if not w), len(left) - first)
        count = min(count, n_batch)
        n = min(min(left[first:first + count]), cap, max(1, n_batch // count))
        passes.append((first, count, n))
        for b in range(first, first + count):
            left[b] -= n
    return passes


class _Row:
    """Row `seq` of a LlamaCppLM seen as a one-row adapter, for a joining row's cached prefix
    (PrefixCache.restore): its reset empties that row alone."""

    def __init__(self, lm: LlamaCppLM, seq: int) -> None:
        self.lm, self.seq = lm, seq

    def reset(self) -> None:
        self.lm._clear(self.seq)
        self.lm._ids[self.seq], self.lm._kinds[self.seq] = [], bytearray()

    def restore_prefix(self, state: Cells, length: int) -> None:
        self.lm._restore(self.seq, state, length)

    def reusable(self, common: int, state: Cells, ids: list[int]) -> int:
        return self.lm.reusable(common, state, ids)

    @property
    def persist_key(self) -> str | None:
        return self.lm.persist_key

    def state_bytes(self, state: Cells) -> bytes:
        return self.lm.state_bytes(state)

    def state_from_bytes(self, ids: list[int], data: bytes) -> Cells:
        return self.lm.state_from_bytes(ids, data)


def load_llama_cpp(path: str, n_ctx: int | None = None, threads: int | None = None,
                   eos_token_ids: set[int] | None = None, repack: bool | None = None, **kwargs) -> LlamaCppLM:
    """A GGUF file as a `CausalLM` on llama.cpp. ExactSpecError (one line) if llama-cpp-python is
    missing or the file cannot be loaded. `kwargs`: n_batch, n_ubatch, or extra `llama_cpp.Llama` arguments."""
    return LlamaCppLM(path, n_ctx=n_ctx, threads=threads, eos_token_ids=eos_token_ids, repack=repack, **kwargs)
