"""llama.cpp adapter: a GGUF file run by llama-cpp-python's low-level API (installed by `make setup`; `pip install exactspec[llamacpp]` elsewhere).

The model and context are created by `llama_cpp.Llama` (so its loading, logging and defaults apply);
decoding then bypasses its high-level state: our own `llama_batch` asks for logits at EVERY position
(k new tokens -> one `llama_decode` -> [k, V] logits), and rollback is `llama_memory_seq_rm(seq 0,
[length, inf))`. llama.cpp reuses the freed KV cells from the lowest one, so after a rollback the cache
layout is the one a fresh evaluation would have (tested: logits equal a fresh evaluation).

Repacking: llama.cpp may move quantized weights into "extra buffer types" (AVX/AMX repacked layouts).
Its AMX kernels crash (SIGSEGV in ldtilecfg) on VMs whose CPU advertises AMX but whose hypervisor does not
enable it (seen on a Firecracker VM). `repack=None` therefore probes once per process, in a subprocess,
when the CPU advertises AMX, and disables extra buffers if the probe crashes; EXACTSPEC_LLAMACPP_REPACK=0/1
overrides. The llama.cpp bench anchors are built with the same setting, so comparisons stay like for like.

BATCH INVARIANCE: llama.cpp's CPU numerics can depend on how many tokens one compute step (ubatch)
holds and on how many threads a one-token step uses, and this model family is sensitive enough for that
to move logits by 1-3 and flip greedy choices:
- without flash attention (llama-cpp-python's default), with an f16 KV cache, a token evaluated alone
  differs from the same token inside any multi-token batch: we turn flash attention on;
- with flash attention and an f16 cache, ubatches of 64+ tokens take a tiled kernel, and one-token steps
  on several threads past ~256 tokens a split-KV kernel, each summing in another order than the per-row
  kernel; with a bf16 or q8_0 K cache neither runs.
So the cache type, the one-token threads and n_ubatch are chosen at load by a self-test
(llama_cpp_numerics.py: blocks vs one-token steps, the fastest bit-equal setting kept). n_ubatch defaults
to 32 here, the invariant choice for an f16 cache; the self-test raises it to 512 with a bf16/q8_0 cache.
The same settings make our greedy output equal llama.cpp's OWN `Llama.generate` (which prefills the
whole prompt in one batch, while we prefill prompt[:-1] and then feed the last token with the drafts);
the bench anchors use them. Measured with llama-cpp-python 0.3.36; tests check it.

Threads: llama.cpp uses `n_threads` for single-token batches and `n_threads_batch` for larger ones. Both
are `threads`, unless the self-test keeps one-token steps on one thread (an f16 cache, when no other
setting is bit-equal). The cost model measures T(1) and T(k) as they then run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import threading

import numpy as np
import torch

from ..errors import ExactSpecError
from .base import OneRow

INSTALL_HINT = "llama-cpp-python is not installed (make setup builds it; or pip install 'exactspec[llamacpp]')"
DEFAULT_N_CTX = 4096
DEFAULT_N_UBATCH = 32  # see BATCH INVARIANCE


def _import():
    try:
        import llama_cpp
    except ImportError:
        raise ExactSpecError(INSTALL_HINT) from None
    except (OSError, RuntimeError) as e:  # installed, but its shared library does not load on this machine
        raise ExactSpecError(f"llama-cpp-python's library does not load: {e}") from None
    return llama_cpp


def default_threads() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


_PATCH_LOCK = threading.Lock()
_PROBED: dict[str, bool] = {}


@contextlib.contextmanager
def _model_params(use_extra_bufts: bool):
    """`llama_cpp.Llama` takes no argument for llama_model_params.use_extra_bufts: patch the defaults
    it starts from while it is being constructed."""
    import llama_cpp.llama_cpp as lib

    with _PATCH_LOCK:
        original = lib.llama_model_default_params

        def defaults():
            params = original()
            params.use_extra_bufts = use_extra_bufts
            return params

        lib.llama_model_default_params = defaults
        try:
            yield
        finally:
            lib.llama_model_default_params = original


def make_llama(path: str, repack: bool, **kwargs):
    """`llama_cpp.Llama(path, verbose=False, **kwargs)` with weight repacking on or off."""
    llama_cpp = _import()
    with _model_params(repack):
        return llama_cpp.Llama(model_path=path, verbose=False, **kwargs)


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


_PROBE = """
import sys, llama_cpp
ll = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, n_ubatch=64, n_threads=2, n_threads_batch=2,
                     verbose=False)
ll.eval([i % ll.n_vocab() for i in range(1, 17)])
ll.eval([1])
"""


def resolve_repack(path: str, repack: bool | None = None) -> bool:
    """Whether to let llama.cpp repack weights (its default): explicit choice, else the environment
    variable EXACTSPEC_LLAMACPP_REPACK, else yes unless the CPU advertises AMX and a probe subprocess
    decoding with this model dies from a signal (cached per process and file; costs one model load)."""
    if repack is not None:
        return repack
    env = os.environ.get("EXACTSPEC_LLAMACPP_REPACK")
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no", "off")
    if not _cpu_has_amx():
        return True
    if path not in _PROBED:
        try:
            done = subprocess.run([sys.executable, "-c", _PROBE, path], capture_output=True, timeout=600)
            _PROBED[path] = done.returncode >= 0  # killed by a signal = crashed; other errors surface on load
        except (OSError, subprocess.TimeoutExpired):
            _PROBED[path] = False
    return _PROBED[path]


def check_gguf_file(path: str) -> None:
    if not os.path.exists(path):
        raise ExactSpecError(f"model path not found: {path}")
    if not os.path.isfile(path):
        raise ExactSpecError(f"the llama.cpp backend needs a .gguf file, not a directory: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ExactSpecError(f"corrupt GGUF file (bad magic): {path}")


class LlamaCppLM(OneRow):
    """`CausalLM` (batch 1, sequence 0) over a llama.cpp context."""

    def __init__(self, path: str, n_ctx: int | None = None, threads: int | None = None,
                 eos_token_ids: set[int] | None = None, n_batch: int = 512, n_ubatch: int = DEFAULT_N_UBATCH,
                 repack: bool | None = None, **llama_kwargs):
        llama_cpp = _import()
        check_gguf_file(path)
        self._lib = llama_cpp
        self.path = path
        self.threads = threads or default_threads()
        self.single_threads = self.threads  # one-token steps (llama_cpp_numerics.py may lower it at load)
        self.identity = "not self-tested at load"  # what greedy identity rests on (llama_cpp_numerics.py)
        train_ctx = _train_context(path)
        want = n_ctx or (min(DEFAULT_N_CTX, train_ctx) if train_ctx > 0 else DEFAULT_N_CTX)
        self.n_batch = max(1, min(n_batch, want))
        self.n_ubatch = max(1, min(n_ubatch, self.n_batch))
        self.repack = resolve_repack(path, repack)
        # extra `Llama` arguments (type_k, ...), reused by the bench anchors; see BATCH INVARIANCE above
        self.llama_kwargs = {"flash_attn": True, **llama_kwargs}
        try:
            self.llama = make_llama(path, self.repack, **self.context_kwargs(want))
        except Exception as e:  # llama-cpp-python raises ValueError/RuntimeError for unreadable models
            raise ExactSpecError(f"llama.cpp cannot load {path}: {str(e)[:200]}") from None
        self.ctx = self.llama.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        vocab = llama_cpp.llama_model_get_vocab(self.llama.model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(vocab))
        if eos_token_ids is None:
            eos_token_ids = {t for t in (llama_cpp.llama_vocab_eos(vocab), llama_cpp.llama_vocab_eot(vocab)) if t >= 0}
        self.eos_token_ids = set(eos_token_ids)
        # llama.cpp pads n_ctx up to a multiple of 256; never go past what was asked for
        self.max_length = min(want, int(llama_cpp.llama_n_ctx(self.ctx)))
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.prefix_cache = None  # a PrefixCache consulted on prefill (see prefix_cache.py)
        # Only prompt KV goes to the prefix cache: KV written by one-token decode steps differs in its last
        # bits from a prefill of the same tokens at long contexts (seen at ~500 tokens, where it flipped a
        # greedy choice of the next agent step); prefills split anywhere are bit-equal (checked at 665).
        self.cache_generated_kv = False
        self._length = 0
        self.reset()

    def context_kwargs(self, n_ctx: int | None = None) -> dict:
        """Context settings of this adapter, for another `Llama` over the same file (bench anchors)."""
        return dict(n_ctx=n_ctx or self.max_length, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                    n_threads=self.single_threads, n_threads_batch=self.threads, **self.llama_kwargs)

    def set_single_threads(self, n: int) -> None:
        """Threads of one-token steps (blocks keep `threads`): see llama_cpp_numerics.py."""
        self.single_threads = n
        self._lib.llama_set_n_threads(self.ctx, n, self.threads)

    # --- cache -------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    def reset(self, batch: int = 1) -> None:
        self._set_rows(batch)
        # metadata only: zeroing the buffers (data=True) took 7-10 ms per generation with a 4096-token
        # context; freed cells are never read, as after any rollback
        self._lib.llama_memory_clear(self.memory, False)
        self._length = 0
        self.llama.n_tokens = 0  # the high-level Llama object must not reuse a "cached prefix" it did not write

    def snapshot_prefix(self, length: int, row: int = 0) -> tuple[tuple[object, int], int]:
        """A copy of the first `length` cached positions (llama.cpp's per-sequence state) and its size in
        bytes, for the prefix cache. Rolls the cache back to `length` first: call it after a generation."""
        self.truncate(length)
        size = self._lib.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = self._lib.llama_state_seq_get_data(self.ctx, buf, size, 0)
        if written != size:
            raise ExactSpecError(f"llama.cpp wrote {written} of {size} bytes of its sequence state")
        return (buf, length), size

    def restore_prefix(self, state: tuple[object, int], length: int) -> None:
        """Hold the first `length` positions of a `snapshot_prefix` state (nothing else)."""
        buf, stored = state
        self.reset()
        if not self._lib.llama_state_seq_set_data(self.ctx, buf, len(buf), 0):
            self.reset()
            raise ExactSpecError("llama.cpp could not restore a cached prefix (context full?)")
        self._length = stored
        self.truncate(length)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate to {length}: {self._length} tokens cached")
        if length < self._length:
            if not self._lib.llama_memory_seq_rm(self.memory, 0, length, -1):
                raise ExactSpecError("llama.cpp cannot roll back this model's memory (recurrent model?)")
            self._length = length

    # --- forward -----------------------------------------------------------------------------
    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        """new_ids [1, k] -> logits [1, k, V] float32; appends k positions to the cache."""
        rows = self._decode(new_ids.reshape(-1).tolist(), np.copy)  # [n, V] per llama_decode call
        return torch.from_numpy(rows[0] if len(rows) == 1 else np.concatenate(rows))[None]

    def forward_argmax(self, new_ids: list[int]) -> list[int]:
        """The argmax of each new position's logits, read in place (no [k, V] copy, no torch): the decode
        loop's temperature-0 path. Python work after a llama_decode runs with cold caches (~10-50 µs per
        torch op here), so at ~10 ms per token every op skipped is worth ~0.3%."""
        return [int(t) for rows in self._decode(new_ids, lambda logits: logits.argmax(-1)) for t in rows]

    def prefill(self, new_ids: torch.Tensor) -> None:
        """Like `forward` but computes no logits (no output projection, no copy): ~15-25% of a prefill of
        the embedded model."""
        self._decode(new_ids.reshape(-1).tolist(), None)

    def _decode(self, ids: list[int], read) -> list:
        """Append `ids` in llama_decode calls of up to n_batch tokens. `read(logits [n, V])` gets each
        call's logits in place, before the next call overwrites them; -> its results (none if `read` is None)."""
        k, V = len(ids), self.vocab_size
        if self._length + k > self.max_length:
            raise ExactSpecError(f"context length {self._length + k} exceeds the model's {self.max_length} tokens")
        batch, lib, flag, out = self.batch, self._lib, int(read is not None), []
        for start in range(0, k, self.n_batch):
            chunk = ids[start:start + self.n_batch]
            n = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = self._length + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = flag
            batch.n_tokens = n
            rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                # a failed decode may leave part of the batch in the cache: drop it
                lib.llama_memory_seq_rm(self.memory, 0, self._length, -1)
                raise ExactSpecError(f"llama_decode failed (code {rc}) at position {self._length}")
            if read is not None:
                out.append(read(np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), shape=(n, V))))
            self._length += n
        return out

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


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _train_context(path: str) -> int:
    """`{arch}.context_length` from the GGUF header (0 if absent or unreadable). Reads key by key and
    stops there, before the tokenizer arrays (gguf.GGUFReader parses them all: seconds per file)."""
    import struct

    def read(f, fmt):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, f.read(size))[0]

    def string(f):
        n = read(f, "<Q")
        if n > 1 << 20:  # no key or architecture name is that long: a corrupt header
            raise ValueError(f"GGUF string of {n} bytes")
        return f.read(n).decode("utf-8", "replace")

    def skip(f, vtype):
        if vtype in _SCALAR:
            f.seek(struct.calcsize(_SCALAR[vtype]), 1)
        elif vtype == 8:
            f.seek(read(f, "<Q"), 1)
        elif vtype == 9:
            item, count = read(f, "<I"), read(f, "<Q")
            if item in _SCALAR:
                f.seek(count * struct.calcsize(_SCALAR[item]), 1)
            else:
                for _ in range(count):
                    skip(f, item)
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") < 2:
                return 0
            read(f, "<Q")  # tensor count
            arch = None
            for _ in range(read(f, "<Q")):
                key, vtype = string(f), read(f, "<I")
                if key == "general.architecture" and vtype == 8:
                    arch = string(f)
                elif arch is not None and key == f"{arch}.context_length" and vtype in _SCALAR:
                    return int(read(f, _SCALAR[vtype]))
                else:
                    skip(f, vtype)
    except (OSError, ValueError, OverflowError, MemoryError, struct.error, UnicodeDecodeError):
        pass  # llama.cpp's own load then says what is wrong with the file
    return 0


def load_llama_cpp(path: str, n_ctx: int | None = None, threads: int | None = None,
                   eos_token_ids: set[int] | None = None, repack: bool | None = None, **kwargs) -> LlamaCppLM:
    """A GGUF file as a `CausalLM` on llama.cpp. ExactSpecError (one line) if llama-cpp-python is
    missing or the file cannot be loaded. `kwargs`: n_batch, n_ubatch, or extra `llama_cpp.Llama` arguments."""
    return LlamaCppLM(path, n_ctx=n_ctx, threads=threads, eos_token_ids=eos_token_ids, repack=repack, **kwargs)
