"""The llama.cpp runtime: importing llama-cpp-python, its threads and default parameters, the AMX
repack probe, and how large a context (tokens per row, rows) the machine affords. The adapter
(adapter.py) and the self-test (numerics.py) build on it; nothing here decodes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

from ...errors import ExactSpecError
from ..gguf import header_ints

INSTALL_HINT = "llama-cpp-python is not installed (make setup builds it; or pip install 'exactspec[llamacpp]')"
DEFAULT_N_CTX = 4096
DEFAULT_N_UBATCH = 32  # see BATCH INVARIANCE


def import_llama_cpp():
    """llama_cpp, or one line: it is not installed, or its library does not load here."""
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
def _default_params(use_extra_bufts: bool, n_seq_max: int, unified: bool = False):
    """`llama_cpp.Llama` takes no argument for llama_model_params.use_extra_bufts, nor for the context's
    n_seq_max and kv_unified: patch the defaults it starts from while it is being constructed."""
    import llama_cpp.llama_cpp as lib

    with _PATCH_LOCK:
        model_defaults, context_defaults = lib.llama_model_default_params, lib.llama_context_default_params

        def model():
            params = model_defaults()
            params.use_extra_bufts = use_extra_bufts
            return params

        def context():
            params = context_defaults()
            params.n_seq_max = n_seq_max
            params.kv_unified = unified  # False: one KV stream per sequence (see BATCHED ROWS)
            return params

        lib.llama_model_default_params, lib.llama_context_default_params = model, context
        try:
            yield
        finally:
            lib.llama_model_default_params, lib.llama_context_default_params = model_defaults, context_defaults


def make_llama(path: str, repack: bool, rows: int = 1, unified: bool = False, **kwargs):
    """`llama_cpp.Llama(path, verbose=False, **kwargs)` with weight repacking on or off and room for
    `rows` sequences (kwargs' n_ctx is then the sum of theirs, unless they share one `unified` cache)."""
    llama_cpp = import_llama_cpp()
    with _default_params(repack, rows, unified):
        return llama_cpp.Llama(model_path=path, verbose=False, **kwargs)


def cpu_has_amx() -> bool:
    """Whether /proc/cpuinfo lists AMX tiles (llama.cpp then keeps repacked weights in its AMX buffer)."""
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


AMX_ROWS = "EXACTSPEC_AMX_ROWS"  # read by the build's AMX buffer (scripts/llama_cpp_patches/08-*)
KQUANT_TILES = "EXACTSPEC_KQUANT_TILES"  # read by the build's K-quant kernels and repack (patch 12)
# The library reads each switch once, into a C static, at its first product: both are set here, at
# import, before this process loads a model; what they are then is what the library computes with.
_BEFORE_US = "llama_cpp" in sys.modules  # imported (and maybe run) before the switches were set
os.environ.setdefault(KQUANT_TILES, "1")
if cpu_has_amx():
    os.environ.setdefault(AMX_ROWS, "1")
_SWITCHES = ",".join(f"{name}={os.environ.get(name, '')}" for name in (AMX_ROWS, KQUANT_TILES))


def kernel_switches() -> str:
    """The patched build's kernel switches as the library latched them (as set at this module's import:
    a later change to the environment changes nothing in the library, nor here), `unsure` where
    llama_cpp was imported first (it may have computed under others): every measured verdict and every
    KV snapshot on disk is keyed by them, so a verdict is served only for the switches it was measured
    with (a verdict taken with the kernels off is not one with them on)."""
    return _SWITCHES + (",unsure" if _BEFORE_US else "")


def build_identity() -> str:
    """The llama.cpp libraries this process loads, by content: their machine code holds the CPU they
    were built for, the compiler and its flags, which no version label says."""
    from pathlib import Path

    from ...cachedir import content_hash

    lib = Path(import_llama_cpp().__file__).with_name("lib")
    return ",".join(content_hash(f)[:12] for f in sorted(lib.glob("lib*.so*")) if f.is_file() and not f.is_symlink())


def resolve_repack(path: str, repack: bool | None = None) -> bool:
    """Whether to let llama.cpp repack weights (its default): explicit choice, else the environment
    variable EXACTSPEC_LLAMACPP_REPACK, else yes unless the CPU advertises AMX and a probe subprocess
    decoding with this model dies from a signal (cached per process and file; costs one model load).

    Where the CPU advertises AMX the AMX buffer's multi-row Q4_0 / Q4_1 / Q8_0 products run each row
    through the one-row VNNI kernel (EXACTSPEC_AMX_ROWS=1, set at this module's import, the probe's too:
    faster than the tiles for a verification pass's few rows); K-quants keep AMX tiles, whose
    configuration a GCC 12 build of stock llama.cpp drops (SIGILL at the first decode; the build's patch
    11 keeps it). Both give blocks equal to one-token steps bit for bit. The probe still decides.

    Elsewhere (and wherever repacking is off) K-quant products of every row count (every K-quant type with
    AVX-512 VNNI; Q4_K, Q5_K and Q6_K with AVX2) take the build's K-quant kernels, their weights left
    unrepacked (EXACTSPEC_KQUANT_TILES=1, set when this module is imported: patch 12), so their blocks
    equal one-token steps too; other types and MoE experts keep llama.cpp's kernels (by tolerance)."""
    if repack is not None:
        return repack
    env = os.environ.get("EXACTSPEC_LLAMACPP_REPACK")
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no", "off")
    if not cpu_has_amx():
        return True
    key = f"{path}|{AMX_ROWS}={os.environ[AMX_ROWS]}"
    if key not in _PROBED:
        _PROBED[key] = _decodes(path, os.environ)
    return _PROBED[key]


def repack_label(repack: bool) -> str:
    """What the measurement caches key a repack setting by: with it, whether AMX rows were asked for (the
    kernels, so the verdict and T(k), differ)."""
    label = f"repack={repack}" + (f",{AMX_ROWS}={os.environ[AMX_ROWS]}" if repack and AMX_ROWS in os.environ else "")
    return label + (f",{KQUANT_TILES}={os.environ[KQUANT_TILES]}" if os.environ.get(KQUANT_TILES, "1") != "1" else "")


def _decodes(path: str, env) -> bool:
    """Whether a subprocess loading `path` with repacked weights survives a 16-token pass and a step
    (killed by a signal = crashed; other errors surface on load)."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, path], capture_output=True, timeout=600, env=dict(env))
        return done.returncode >= 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_gguf_file(path: str) -> None:
    if not os.path.exists(path):
        raise ExactSpecError(f"model path not found: {path}")
    if not os.path.isfile(path):
        raise ExactSpecError(f"the llama.cpp backend needs a .gguf file, not a directory: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ExactSpecError(f"corrupt GGUF file (bad magic): {path}")


def _train_context(path: str) -> int:
    """`{arch}.context_length` from the GGUF header (0 if absent or unreadable)."""
    return header_ints(path, ("context_length",)).get("context_length", 0)


YARN = 2  # LLAMA_ROPE_SCALING_TYPE_YARN


def yarn_kwargs(path: str, n_ctx: int) -> dict:
    """A context past the model's training context: llama.cpp's YaRN rope scaling by their ratio (what
    `llama-server --rope-scaling yarn --rope-scale F --yarn-orig-ctx N` does), so positions past the
    training context are ones the model can read. Not asked for ({}): within the training context the
    model runs as trained. The scaling changes the model's numbers at every position: a longer context
    is another model (greedy identity holds to it; the start-up line names it)."""
    train = _train_context(path)
    if not train or n_ctx <= train:
        return {}
    return {"rope_scaling_type": YARN, "yarn_orig_ctx": train, "rope_freq_scale": train / n_ctx}


def kv_bytes_per_token(path: str) -> int:
    """An upper bound of one cached token's K and V over all layers (f16), from the GGUF header; 0 if
    the header does not say."""
    h = header_ints(path, ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
                       "attention.key_length", "attention.value_length"))
    if not {"block_count", "embedding_length", "attention.head_count"} <= h.keys() or not h["attention.head_count"]:
        return 0
    head = h["embedding_length"] // h["attention.head_count"]
    kv_heads = h.get("attention.head_count_kv", h["attention.head_count"])
    return 2 * h["block_count"] * kv_heads * (h.get("attention.key_length", head) + h.get("attention.value_length", head))


def _kv_budget() -> int | None:
    """A quarter of the memory available now, in bytes (None where /proc/meminfo does not say): what the
    KV cache of every row may take (it is allocated when the context is created)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")) // 4
    except (OSError, StopIteration, ValueError):
        return None


def default_context(path: str, rows: int = 1) -> int:
    """Tokens per row when none are asked for: the model's training context (DEFAULT_N_CTX where the
    header has none), lowered to what the KV budget holds for `rows` rows, in steps of 256, but never
    below DEFAULT_N_CTX (`affordable_rows` then drops rows instead)."""
    train = _train_context(path) or DEFAULT_N_CTX
    per_token, budget = kv_bytes_per_token(path), _kv_budget()
    if not per_token or budget is None or rows * train * per_token <= budget:
        return train
    return min(train, max(DEFAULT_N_CTX, budget // (rows * per_token) // 256 * 256))


def affordable_rows(path: str, rows: int, n_ctx: int) -> int:
    """At most `rows`, as many as fit the KV budget (`_kv_budget`) with `n_ctx` positions each."""
    per_row, budget = kv_bytes_per_token(path) * n_ctx, _kv_budget()
    if budget is None or not per_row:
        return rows
    return max(1, min(rows, budget // per_row))
