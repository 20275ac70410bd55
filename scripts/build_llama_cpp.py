"""Build llama-cpp-python (the llama.cpp engine) from its PyPI sdist with exactspec's patches, once per
machine, and print the wheel's path (make setup installs it).

Why patched: ggml's CPU flash attention (vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp) gives a lone query
over 512+ keys a split-KV kernel, which sums in another order than the per-row kernel every query of a
multi-token block takes. One-token steps then differ from the same tokens inside a verification block,
so with llama.cpp's own f16 cache a one-token step had to carry a pad token (a second token through every
matmul: ~40% more per step here) or the cache had to be q8_0/bf16, whose prefill runs at ~2/3 of
llama.cpp's speed on a 3k-token prompt. With the split path off, a one-token step is the per-row kernel
on all threads, like each row of a block. The load-time self-test (models/llama_cpp_numerics.py) still
decides by measuring: on an unpatched build the unpadded setting is not bit-exact there and is not kept.

A second patch changes only speed: ggml splits a tiled attention pass's rows (query x head) across
threads in chunks of equal rows, which straddle the 64-row tiles unless the pass is a multiple of 512
tokens (9 heads, 2 threads), and a partial tile costs a whole one. So a 64-token chunk of a joining
prompt ran 16 tiles, not 9: at a 3k depth 170 tokens/s against 234 with whole-tile chunks (Zen 5).

The patched build carries a local version label (0.3.36+exactspec.N): it satisfies `==0.3.36`, and the
self-test's cache keys (which include the version) never mix it with a stock build. The wheel is cached
under the exactspec cache (`cachedir.cache_dir`: EXACTSPEC_CACHE, else $XDG_CACHE_HOME/exactspec, else
~/.cache/exactspec), named by the patch level, so later set-ups take seconds. CMAKE_ARGS and
CMAKE_BUILD_PARALLEL_LEVEL from the environment reach the build (the Makefile passes them).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from exactspec.cachedir import cache_dir  # make setup installs exactspec first

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
LABEL = "exactspec.2"  # bump with any change to PATCHES
OPS = "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp"
SPLIT_KV = ("const bool use_split_kv_path = !use_ref && (neq1 == 1 && neq3 == 1) && kv_is_f32_or_f16 && "
            "(k->type == v->type) && q->type == GGML_TYPE_F32 && nek1 >= 512;")
TILE_CHUNKS = ("int current_chunk = ith;\n\n        while (current_chunk < nchunk) {\n"
               "            const int64_t ir0 = dr * current_chunk;\n"
               "            const int64_t ir1 = MIN(ir0 + dr, nr);")
# (file, text, replacement): each text must occur exactly once in the sdist
PATCHES = [
    (OPS, SPLIT_KV, "// exactspec: a lone query takes the per-row kernel, as each query of a block does, so one-token\n"
                    "    // steps equal blocks bit for bit (upstream: a split-KV kernel past 512 keys)\n"
                    "    const bool use_split_kv_path = false;"),
    (OPS, TILE_CHUNKS, "int current_chunk = ith;\n\n"
                       "        // exactspec: chunks of whole 64-row tiles of one head (upstream cut rows evenly, so a\n"
                       "        // 64-token pass over 9 heads on 2 threads ran 16 tiles, not 9). Each row's sums in the\n"
                       "        // tiled kernel do not depend on the rows beside it, so only the speed changes.\n"
                       "        const int64_t tiles_per_head = (neq1 + Q_TILE_SZ - 1)/Q_TILE_SZ;\n"
                       "        const int64_t ntiles = tiles_per_head*neq2*neq3;\n"
                       "        const int64_t dt = (ntiles + nchunk - 1)/nchunk;\n"
                       "        auto tile_row = [&](int64_t t) { return (t/tiles_per_head)*neq1 + MIN((t%tiles_per_head)*Q_TILE_SZ, neq1); };\n\n"
                       "        while (current_chunk < nchunk) {\n"
                       "            const int64_t ir0 = use_tiled ? tile_row(MIN(dt*current_chunk, ntiles)) : dr * current_chunk;\n"
                       "            const int64_t ir1 = use_tiled ? tile_row(MIN(dt*(current_chunk + 1), ntiles)) : MIN(ir0 + dr, nr);"),
    ("llama_cpp/__init__.py", f'__version__ = "{VERSION}"', f'__version__ = "{VERSION}+{LABEL}"'),
]


def patch(tree: Path) -> None:
    """Apply PATCHES to an unpacked sdist; a text not found exactly once stops the build."""
    for name, text, replacement in PATCHES:
        file = tree / name
        source = file.read_text()
        if source.count(text) != 1:
            sys.exit(f"build_llama_cpp: {name} of {PACKAGE} {VERSION} does not hold the patched text exactly once")
        file.write_text(source.replace(text, replacement))


def build(out: Path) -> Path:
    """Download the sdist, patch it, build the wheel into `out` (pip's output on stderr: stdout is the
    path); the wheel's path."""
    pip = [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "download", "-q", "--no-deps", "--no-binary", PACKAGE, "-d", tmp,
                        f"{PACKAGE}=={VERSION}"], check=True, stdout=sys.stderr)
        sdist, = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        tree, = (p for p in Path(tmp).iterdir() if p.is_dir())
        patch(tree)
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(out), str(tree)], check=True, stdout=sys.stderr)
    return wheel(out)


def wheel(out: Path) -> Path | None:
    found = sorted(out.glob(f"llama_cpp_python-{VERSION}+{LABEL}-*.whl"))
    return found[-1] if found else None


if __name__ == "__main__":
    out = cache_dir("wheels")
    print(wheel(out) or build(out))
