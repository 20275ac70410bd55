"""The models users bring: tiny random GGUFs of several architectures (Llama; Qwen 2 with attention
biases; Qwen 3 with q/k norms; Gemma 3 with an 8-token sliding window on five of its six layers) in the
quantizations common GGUFs use, written and quantized at test time. Each loads through the self-test,
gets a verdict that names why it is or is not bit-exact, decodes speculatively to exactly its own plain
greedy output (prompts run past the window), and reuses a cached prefix with the same output."""

from __future__ import annotations

import math
import os
import re

import pytest

from exactspec.device import cpu_flags
from exactspec.models.llamacpp.runtime import AMX_ROWS
from exactspec.speculative.sampling import SamplingParams
from exactspec.stats import Stats

from ..conftest import need, patched_llama_cpp
from ..helpers.gguf_models import ARCHS, MORE_K_QUANTS, QUANTS, quantize, write_gguf

need("llama_cpp")

# the patched build (a native one) on a CPU with AVX-512 VNNI, where patch 12's kernels serve every K-quant type:
# every quant type is bit-exact; with AVX2 and FMA only, they serve Q4_K, Q5_K and Q6_K (the other K-quant types
# keep ggml's stock kernels: blocks by tolerance)
PATCHED = patched_llama_cpp()
PATCHED_VNNI = PATCHED and {"avx512_vnni", "avx512vl", "avx512dq"} <= cpu_flags()
PATCHED_AVX2 = PATCHED and {"avx2", "fma"} <= cpu_flags()
PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5] * 3  # 57 tokens: repeats to copy, past the window
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("matrix")
    return {arch: write_gguf(arch, str(folder / f"{arch}.gguf")) for arch in ARCHS}


def decode(engine, ids, gamma, stats=None) -> list[int]:
    return list(engine.stream_ids(ids, GREEDY, 40, gamma, 0, stats or Stats()))


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_and_quant_decodes_exactly_with_a_named_verdict(sources, arch, quant, tmp_path,
                                                                           embedded_llamacpp):
    import exactspec

    path = quantize(sources[arch], str(tmp_path / f"{arch}-{quant}.gguf"), quant)
    engine = exactspec.load(target=path, backend="llama.cpp", ctx_size=256, draft="prompt-lookup", gamma=4)
    identity = engine.runtime()["greedy_identity"]
    exact = re.match(r"llama\.cpp: bit-exact \(self-test: blocks equal one-token steps; ", identity)
    inexact = re.match(r"llama\.cpp: by tolerance \((llama\.cpp's blocks differ from one-token steps by up to (\S+) "
                       r"here|a prompt prefilled in two parts differs from one prefill of it here)", identity)
    assert exact or (inexact and math.isfinite(float(inexact.group(2) or 0))), identity  # a reason, never "inf"
    if quant == "Q8_0" and "bit-exact" in embedded_llamacpp.runtime()["greedy_identity"]:
        assert exact, identity  # the kernels that make the embedded model bit-exact serve Q8_0 weights
    if engine.target.repack and os.environ.get(AMX_ROWS) == "1":
        assert exact, identity  # an AMX CPU: every row of these quants runs the AMX buffer's one-row kernel
    if PATCHED_VNNI:
        assert exact, identity  # elsewhere K-quants take patch 12's kernels at every row count

    plain, stats = decode(engine, PROMPT, 0), Stats()
    assert decode(engine, PROMPT, 4, stats) == plain and stats.proposed > 0
    longer = PROMPT * 3  # 171 tokens: a cached first 139 holds whole 64-token tiles (tiled prefill reuses only those)
    plain = decode(engine, longer, 0)
    engine.set_prefix_cache(16)
    try:
        decode(engine, longer[:140], 0)  # cached: its first 139 tokens
        cached = Stats()
        assert decode(engine, longer, 4, cached) == plain and cached.cached_tokens >= 64, cached.cached_tokens
    finally:
        engine.set_prefix_cache(None)


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q5_K_M", "Q6_K", *MORE_K_QUANTS])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_k_quants_unrepacked_are_bit_exact_as_on_a_cpu_without_amx(sources, arch, quant, tmp_path):
    """Repacking off, K-quant weights sit in ggml's plain buffer, as on a CPU without AMX after patch 12: every
    product of them takes its kernels (passes of up to 12 tokens of Q4_K / Q5_K / Q6_K read the blocks
    directly, the rest ggml's tiled K-quant kernel), each output by the tiled kernel's operations (with AVX2
    alone: Q4_K, Q5_K and Q6_K). Upstream gave fewer than 8 rows to vec_dot (another order of sums): blocks
    then differed from one-token steps by 0.2-0.9 here. A planted bug in the direct kernel (one subblock's
    min left out) fails it."""
    from exactspec.engine import llamacpp_engine

    path = quantize(sources[arch], str(tmp_path / f"{arch}-{quant}.gguf"), quant)
    engine = llamacpp_engine(path, draft="prompt-lookup", gamma=4, n_ctx=256, repack=False)
    identity = engine.runtime()["greedy_identity"]
    if PATCHED_VNNI or (PATCHED_AVX2 and quant in ("Q4_K_M", "Q5_K_M", "Q6_K")):
        assert identity.startswith("llama.cpp: bit-exact"), identity
    plain, stats = decode(engine, PROMPT, 0), Stats()
    assert decode(engine, PROMPT, 4, stats) == plain and stats.proposed > 0


def test_a_failed_prefix_check_is_named_not_reported_as_an_infinite_difference():
    from exactspec.models.llamacpp.numerics import CANDIDATES, Verdict

    words = Verdict(CANDIDATES[0], False, math.inf, 1.0).describe(2)
    assert "prefix check failed" in words and "inf" not in words.split(";")[0], words
    assert "up to 0.25 here" in Verdict(CANDIDATES[0], False, 0.25, 1.0).describe(2)
