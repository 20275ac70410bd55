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

A third patch also changes only speed: x86 (AVX2) gets a 2x2 kernel for Q4_1 weights (two weight rows by
two activation columns per call, each weight block unpacked once for both), as ARM's i8mm build has. Every
output is summed by the very operations of the one-output kernel, in the same order (the self-test checks
blocks, which take the 2x2 kernel, against one-token steps, which cannot), so the bits do not change. On
a Zen 5 a 3,072-token prefill of the embedded Q4_1 model ran 1.34x faster (354 -> 473 tokens/s) and an
8-token verification block 1.2x. A fourth patch gives a pass of an odd number of tokens the 2x2 kernel on
its pairs (upstream: the one-output kernel on all of them): a 5-token block 10% faster.

A fifth patch changes only speed. The Q4_1 and Q8_0 dot-product loops prefetch the weights 4 KB ahead
(no arithmetic changes: a one-token step was waiting on memory, ~40% of the Q4_1 loop's samples on
its weight load, at ~19 GB/s where two threads read ~50 GB/s). And the Q8_0 output projection of a
pass of fewer than 16 tokens takes ggml's own dot product, so a verification block's logits come from
the one-token step's very kernel (upstream: llamafile's tinyBLAS, ~3x a one-token projection at 2 tokens).
On a Zen 5, 150 tokens deep: T(1) 5.45 -> 4.75 ms, T(2) 10.1 -> 6.5 ms, T(4) 14.0 -> 9.4 ms.

A sixth patch, on x86 with AVX-512 (F, BW, VNNI), computes the 2x2 kernel's two columns of a weight row
in one 512-bit register: each 256-bit half gets the one-output loop's 8 lanes by the same per-lane
operations (exact integer dot products, then the same conversion, product of scales and fused
multiply-add per lane, and the same final sums), so again the same bits, in ~30% fewer instructions.
On a Zen 5: a 1,024-token prefill 606-663 -> 633-716 tokens/s, an 8-token pass 17.2 -> 16.4 ms.

A seventh patch (scripts/llama_cpp_fa_grouped.cpp) changes only speed: a pass that is not tiled (one-token
steps, verification blocks) runs the query heads that share a K/V head (grouped-query attention: 3 per
K/V head in SmolLM2) in lockstep over the keys. Each head gets the per-row kernel's operations in its
order, by ggml_vec_dot_f16's and ggml_vec_mad_f16's own vector macros, so the same bits (checked against
the sixth build's logits, AVX-512 and AVX2 builds); what a group shares is each K and V row's load and
conversion, and the heads' accumulator chains run side by side. On a Zen 5, 3,000 tokens deep: T(1)
11.5 -> 9.7 ms, T(8) 63 -> 50 ms (AVX2 build: 25.5 -> 22.2, 84 -> 69). f16 caches only; others keep the
per-row kernel.

An eighth patch changes only speed too: the tiled kernel's per-tile chores (perf, a 3,072-token prefill:
~36% of that kernel, which is ~40% of the prefill) are vectorized. The mask row and each K row are
converted by ggml's vector conversion, where upstream sent each value through the 256 KB f16 table
(exact either way), and each score row's largest value is found 16 (AVX-512) or 8 lanes at a time. On a
Zen 5 a 3,072-token prefill went from 480-518 to 554-575 tokens/s (3 interleaved rounds); the logits
after 130-, 700- and 3,000-token prefills were byte-identical to the seventh build's (AVX-512, AVX2).

A ninth patch changes only speed: x86 (AVX2) gets a 2x2 kernel for Q8_0 weights too (the embedded model's
output projection, 49152 x 576, which a verification pass of fewer than 16 tokens runs through vec_dot since the
fifth patch): each weight block is loaded once for two token columns, where the one-output loop read the whole
matrix once per token, and each output is summed by that loop's operations in its order (the same bits: the
self-test's blocks take it, one-token steps cannot). On a Zen 5, 150 tokens deep, interleaved (2 rounds each):
T(4) 8.85 -> 8.47 ms, T(8) 15.75 -> 14.87, T(12) 22.9 -> 21.6; one- and two-token passes unchanged.

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
LABEL = "exactspec.9"  # bump with any change to PATCHES
OPS = "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp"
QUANTS = "vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/quants.c"
TRAITS = "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c"
SPLIT_KV = ("const bool use_split_kv_path = !use_ref && (neq1 == 1 && neq3 == 1) && kv_is_f32_or_f16 && "
            "(k->type == v->type) && q->type == GGML_TYPE_F32 && nek1 >= 512;")
TILE_CHUNKS = ("int current_chunk = ith;\n\n        while (current_chunk < nchunk) {\n"
               "            const int64_t ir0 = dr * current_chunk;\n"
               "            const int64_t ir1 = MIN(ir0 + dr, nr);")
# x86's 2x2 Q4_1 kernel, inserted before the one-output AVX loop of ggml_vec_dot_q4_1_q8_1: that loop's
# operations, in its order, for 2 weight rows (vx, vx + bx) x 2 activation columns (vy, vy + by); outputs
# at s[row + column * bs], as mul_mat's 2x2 calls (and ARM's kernels) lay them out
Q4_1_2X2 = r"""#if defined(__AVX2__)
    // exactspec: 2 weight rows x 2 activation columns (each weight block unpacked once for both columns);
    // each output by the one-output loop's operations in its order, so bit for bit that loop's result
    if (nrc == 2) {
        const block_q4_1 * GGML_RESTRICT x1 = (const block_q4_1 *) ((const char *) vx + bx);
        const block_q8_1 * GGML_RESTRICT y1 = (const block_q8_1 *) ((const char *) vy + by);
        __m256 acc00 = _mm256_setzero_ps(), acc10 = _mm256_setzero_ps();
        __m256 acc01 = _mm256_setzero_ps(), acc11 = _mm256_setzero_ps();
        float summs00 = 0, summs10 = 0, summs01 = 0, summs11 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
        // the sixth patch: a weight row's two columns in one 512-bit register (lanes 0-7 column 0, 8-15
        // column 1), each half the one-output loop's 8 lanes by the same per-lane operations
        __m512 accw0 = _mm512_setzero_ps(), accw1 = _mm512_setzero_ps();
#endif
        for (; ib < nb; ++ib) {
            _mm_prefetch((const char *) (x + ib) + 4096, _MM_HINT_T0);  // the fifth patch
            _mm_prefetch((const char *) (x1 + ib) + 4096, _MM_HINT_T0);  // the fifth patch
            const float dx0 = GGML_CPU_FP16_TO_FP32(x[ib].d);
            const float dx1 = GGML_CPU_FP16_TO_FP32(x1[ib].d);
            const float dy0 = GGML_CPU_FP16_TO_FP32(y[ib].d);
            const float dy1 = GGML_CPU_FP16_TO_FP32(y1[ib].d);

            summs00 += GGML_CPU_FP16_TO_FP32(x[ib].m) * GGML_CPU_FP16_TO_FP32(y[ib].s);
            summs10 += GGML_CPU_FP16_TO_FP32(x1[ib].m) * GGML_CPU_FP16_TO_FP32(y[ib].s);
            summs01 += GGML_CPU_FP16_TO_FP32(x[ib].m) * GGML_CPU_FP16_TO_FP32(y1[ib].s);
            summs11 += GGML_CPU_FP16_TO_FP32(x1[ib].m) * GGML_CPU_FP16_TO_FP32(y1[ib].s);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
            const __m512 dyw = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(dy0))),
                                                                   _mm256_castps_pd(_mm256_set1_ps(dy1)), 1));
            const __m512i qyw = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) y[ib].qs)),
                                                   _mm256_loadu_si256((const __m256i *) y1[ib].qs), 1);
            const __m512i qx0w = _mm512_broadcast_i64x4(bytes_from_nibbles_32(x[ib].qs));
            const __m512i qx1w = _mm512_broadcast_i64x4(bytes_from_nibbles_32(x1[ib].qs));
            accw0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dx0), dyw),
                                    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qx0w, qyw)), accw0);
            accw1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dx1), dyw),
                                    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qx1w, qyw)), accw1);
#else
            const __m256 dx0v = _mm256_set1_ps( dx0 );
            const __m256 dx1v = _mm256_set1_ps( dx1 );
            const __m256 dy0v = _mm256_set1_ps( dy0 );
            const __m256 dy1v = _mm256_set1_ps( dy1 );

            const __m256i qx0 = bytes_from_nibbles_32(x[ib].qs);
            const __m256i qx1 = bytes_from_nibbles_32(x1[ib].qs);
            const __m256i qy0 = _mm256_loadu_si256( (const __m256i *)y[ib].qs );
            const __m256i qy1 = _mm256_loadu_si256( (const __m256i *)y1[ib].qs );

            acc00 = _mm256_fmadd_ps( _mm256_mul_ps( dx0v, dy0v ), mul_sum_us8_pairs_float(qx0, qy0), acc00 );
            acc10 = _mm256_fmadd_ps( _mm256_mul_ps( dx1v, dy0v ), mul_sum_us8_pairs_float(qx1, qy0), acc10 );
            acc01 = _mm256_fmadd_ps( _mm256_mul_ps( dx0v, dy1v ), mul_sum_us8_pairs_float(qx0, qy1), acc01 );
            acc11 = _mm256_fmadd_ps( _mm256_mul_ps( dx1v, dy1v ), mul_sum_us8_pairs_float(qx1, qy1), acc11 );
#endif
        }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
        acc00 = _mm512_castps512_ps256(accw0);
        acc01 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(accw0), 1));
        acc10 = _mm512_castps512_ps256(accw1);
        acc11 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(accw1), 1));
#endif
        s[0]      = hsum_float_8(acc00) + summs00;
        s[1]      = hsum_float_8(acc10) + summs10;
        s[bs]     = hsum_float_8(acc01) + summs01;
        s[bs + 1] = hsum_float_8(acc11) + summs11;
        return;
    }
#endif

"""
# the ninth patch: the Q8_0 weights (the embedded model's output projection, 49152 x 576) get a 2x2 kernel too:
# a verification pass of k < 16 tokens took the one-output loop per token, reading the whole matrix k times
Q8_0_2X2 = r"""#if defined(__AVX2__)
    // exactspec: 2 weight rows x 2 activation columns (each weight block loaded once for both columns);
    // each output by the one-output loop's operations in its order, so bit for bit that loop's result
    if (nrc == 2) {
        const block_q8_0 * GGML_RESTRICT x1 = (const block_q8_0 *) ((const char *) vx + bx);
        const block_q8_0 * GGML_RESTRICT y1 = (const block_q8_0 *) ((const char *) vy + by);
        __m256 acc00 = _mm256_setzero_ps(), acc10 = _mm256_setzero_ps();
        __m256 acc01 = _mm256_setzero_ps(), acc11 = _mm256_setzero_ps();
        for (; ib < nb; ++ib) {
            _mm_prefetch((const char *) (x + ib) + 4096, _MM_HINT_T0);  // the fifth patch
            _mm_prefetch((const char *) (x1 + ib) + 4096, _MM_HINT_T0);  // the fifth patch
            const float dx0 = GGML_CPU_FP16_TO_FP32(x[ib].d);
            const float dx1 = GGML_CPU_FP16_TO_FP32(x1[ib].d);
            const float dy0 = GGML_CPU_FP16_TO_FP32(y[ib].d);
            const float dy1 = GGML_CPU_FP16_TO_FP32(y1[ib].d);
            const __m256i qx0 = _mm256_loadu_si256((const __m256i *) x[ib].qs);
            const __m256i qx1 = _mm256_loadu_si256((const __m256i *) x1[ib].qs);
            const __m256i qy0 = _mm256_loadu_si256((const __m256i *) y[ib].qs);
            const __m256i qy1 = _mm256_loadu_si256((const __m256i *) y1[ib].qs);
            acc00 = _mm256_fmadd_ps(_mm256_set1_ps(dx0 * dy0), mul_sum_i8_pairs_float(qx0, qy0), acc00);
            acc10 = _mm256_fmadd_ps(_mm256_set1_ps(dx1 * dy0), mul_sum_i8_pairs_float(qx1, qy0), acc10);
            acc01 = _mm256_fmadd_ps(_mm256_set1_ps(dx0 * dy1), mul_sum_i8_pairs_float(qx0, qy1), acc01);
            acc11 = _mm256_fmadd_ps(_mm256_set1_ps(dx1 * dy1), mul_sum_i8_pairs_float(qx1, qy1), acc11);
        }
        s[0]      = hsum_float_8(acc00);
        s[1]      = hsum_float_8(acc10);
        s[bs]     = hsum_float_8(acc01);
        s[bs + 1] = hsum_float_8(acc11);
        return;
    }
#endif

"""
Q8_0_HEAD = ("    assert(nrc == 1);\n    UNUSED(nrc);\n    UNUSED(bx);\n    UNUSED(by);\n    UNUSED(bs);\n\n"
             "    const block_q8_0 * GGML_RESTRICT x = vx;\n    const block_q8_0 * GGML_RESTRICT y = vy;\n\n"
             "    int ib = 0;\n    float sumf = 0;\n\n#if defined(__AVX2__)\n    // Initialize accumulator with zeros\n")
Q8_0_ROWS = ("        .vec_dot                  = ggml_vec_dot_q8_0_q8_0,\n"
             "        .vec_dot_type             = GGML_TYPE_Q8_0,\n#if defined (__ARM_FEATURE_MATMUL_INT8)\n")
Q4_1_LOOP = ("    const block_q4_1 * GGML_RESTRICT x = vx;\n    const block_q8_1 * GGML_RESTRICT y = vy;\n\n"
             "    int ib = 0;\n\n#if defined(__AVX2__) || defined(__AVX__)\n    // Initialize accumulator with zeros")
Q4_1_ASSERT = "    assert(n % qk == 0);\n    assert(nrc == 1);\n    UNUSED(nrc);\n    UNUSED(bx);\n    UNUSED(by);\n    UNUSED(bs);\n\n    const block_q4_1"
Q4_1_ROWS = ("        .vec_dot                  = ggml_vec_dot_q4_1_q8_1,\n"
             "        .vec_dot_type             = GGML_TYPE_Q8_1,\n#if defined (__ARM_FEATURE_MATMUL_INT8)\n")
# the fifth patch: the one-output Q4_1 loop and the Q8_0 loop prefetch their weights (x) 4 KB ahead, as the 2x2 loop
# does (640 to 8192 bytes tried on a Zen 5: 2048-4096 best)
Q4_1_ONE = ("    for (; ib < nb; ++ib) {\n        const float d0 = GGML_CPU_FP16_TO_FP32(x[ib].d);\n"
            "        const float d1 = GGML_CPU_FP16_TO_FP32(y[ib].d);\n\n"
            "        summs += GGML_CPU_FP16_TO_FP32(x[ib].m) * GGML_CPU_FP16_TO_FP32(y[ib].s);")
Q8_0_ONE = ("    for (; ib < nb; ++ib) {\n        // Compute combined scale for the block\n"
            "        const __m256 d = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].d) * GGML_CPU_FP16_TO_FP32(y[ib].d));")
PREFETCH = "    for (; ib < nb; ++ib) {\n        _mm_prefetch((const char *) (x + ib) + 4096, _MM_HINT_T0);  // exactspec\n"
# llamafile's tinyBLAS only for passes of 16+ columns (both of mul_mat's calls to it); fewer take ggml's vec_dot
# ("faster there": measured for the Q8_0 output projection; F16/F32 weights take the same rule)
SGEMM_F32 = "    if (src1_cont) {\n        for (int64_t i13 = 0; i13 < ne13; i13++)"
SGEMM_QUANT = "    if (src1->type != vec_dot_type) {\n        const void* wdata"
SGEMM_NOTE = "    // exactspec: tinyBLAS for 16+ columns; fewer take vec_dot, as a one-token step does (faster there)\n"
# mul_mat's chunks: where the columns (tokens) are odd in number, upstream took the one-output kernel for
# all of them; on x86 a Q4_1 chunk (no batch dimensions: no column pair crosses a matrix) now runs its
# pairs on the 2x2 kernel and an odd last column on the one-output kernel, each the same sums
ODD_COLUMNS = """        if ((nr0 % 2 != 0) || (ne11 % 2 != 0) || ((ir0_end - ir0_start) % 2 != 0) || ((ir1_end - ir1_start) % 2 != 0)) {
            num_rows_per_vec_dot = 1;
        }
        ggml_compute_forward_mul_mat_one_chunk(params, dst, src0->type, num_rows_per_vec_dot, ir0_start, ir0_end, ir1_start, ir1_end);
"""
ODD_COLUMNS_2X2 = """#if defined(__AVX2__)
        // exactspec: Q4_1 or Q8_0 with no batch dimensions (no column pair crosses a matrix): the chunk's column pairs on
        // the 2x2 kernel, an odd last column on the one-output one (upstream: all of an odd chunk one by one)
        const int64_t pairs_end = ir1_start + (ir1_end - ir1_start) / 2 * 2;
        if ((src0->type == GGML_TYPE_Q4_1 || src0->type == GGML_TYPE_Q8_0) && ne12 == 1 && ne13 == 1 && nr0 % 2 == 0 && (ir0_end - ir0_start) % 2 == 0 &&
                pairs_end > ir1_start) {
            ggml_compute_forward_mul_mat_one_chunk(params, dst, src0->type, 2, ir0_start, ir0_end, ir1_start, pairs_end);
            if (pairs_end < ir1_end) {
                ggml_compute_forward_mul_mat_one_chunk(params, dst, src0->type, 1, ir0_start, ir0_end, pairs_end, ir1_end);
            }
        } else
#endif
        {
""" + ODD_COLUMNS + """        }
"""
# the seventh patch: the per-row attention kernel for the query heads that share a K/V head, in lockstep
# (scripts/llama_cpp_fa_grouped.cpp), and the rows of a pass that is not tiled handed to it in whole groups
FA_F16 = "static void ggml_compute_forward_flash_attn_ext_f16(\n"
FA_GROUPED = (Path(__file__).with_name("llama_cpp_fa_grouped.cpp")).read_text()
FA_CHUNKS = "        // exactspec: chunks of whole 64-row tiles of one head"  # the second patch's text
FA_GROUPED_CHUNKS = """#ifdef EXACTSPEC_FA_GROUP
        if (!use_tiled && exactspec_fa_grouped(dst)) {
            // exactspec: rows (query x head) of whole groups of heads, 4 chunks per thread where there are
            // enough groups, else one run of rows per thread (9 heads of 3 groups, 2 threads: 5 + 4 rows)
            const int64_t G = MIN(neq2/nek2, (int64_t) EXACTSPEC_FA_GROUP);
            const int64_t ngroups = (nr + G - 1)/G;
            const int64_t dg = ngroups >= 2*nth ? G*((ngroups + 4*nth - 1)/(4*nth)) : (nr + nth - 1)/nth;
            const int64_t ng = (nr + dg - 1)/dg;
            for (int64_t c = ith; c < ng; c = ggml_threadpool_chunk_add(params->threadpool, 1)) {
                exactspec_fa_rows_grouped(dst, c*dg, MIN((c + 1)*dg, nr));
            }
            return;
        }
#endif
"""
# the eighth patch: the tiled attention kernel's per-tile chores, vectorized (same values): the mask row
# converted by ggml's vector conversion (upstream: each value through the 256 KB f16 table, then tested),
# each K row likewise before its transposed copy, and each score row's largest value 16 (AVX-512) or 8
# lanes at a time
TILE_MASK = """                    for (int tk = 0; tk < kv_tile; tk++) {
                        mask32[tq * KV_TILE_SZ + tk] = slope * GGML_CPU_FP16_TO_FP32(mp_row[ic + tk]);
                        if (mask32[tq * KV_TILE_SZ + tk] != -INFINITY) {
                            can_skip = false;
                        }
                    }
"""
TILE_MASK_NEW = """                    // exactspec: the row by ggml's vector conversion (exact, as the table lookup is), then
                    // slope * each value as upstream (x * 1.0f is x); upstream converted each value through
                    // the 256 KB table and tested it, one by one
                    float * mask_row = mask32 + tq * KV_TILE_SZ;
                    ggml_cpu_fp16_to_fp32(mp_row + ic, mask_row, kv_tile);
                    if (slope != 1.0f) {
                        for (int tk = 0; tk < kv_tile; tk++) {
                            mask_row[tk] = slope * mask_row[tk];
                        }
                    }
                    int open = 0;
                    for (int tk = 0; tk < kv_tile; tk++) {
                        open |= mask_row[tk] != -INFINITY;
                    }
                    can_skip = can_skip && !open;
"""
TILE_K = """                    const ggml_fp16_t * k_f16 = (const ggml_fp16_t *)k_data;
                    for (int64_t dk = 0; dk < DK; dk++) {
                        K_f32[dk * KV_TILE_SZ + tk] = GGML_CPU_FP16_TO_FP32(k_f16[dk]);
                    }
"""
TILE_K_NEW = """                    const ggml_fp16_t * k_f16 = (const ggml_fp16_t *)k_data;
                    // exactspec: the row by ggml's vector conversion, then scattered (upstream: the table, per value)
                    float k_row[EXACTSPEC_TILE_DK];
                    if (DK <= EXACTSPEC_TILE_DK) {
                        ggml_cpu_fp16_to_fp32(k_f16, k_row, DK);
                        for (int64_t dk = 0; dk < DK; dk++) {
                            K_f32[dk * KV_TILE_SZ + tk] = k_row[dk];
                        }
                    } else
                    for (int64_t dk = 0; dk < DK; dk++) {
                        K_f32[dk * KV_TILE_SZ + tk] = GGML_CPU_FP16_TO_FP32(k_f16[dk]);
                    }
"""
TILE_MAX = """                float tile_max;
                ggml_vec_max_f32(KV_TILE_SZ, &tile_max, kq_row);
"""
TILE_MAX_NEW = """                float tile_max;
                exactspec_tile_max(kq_row, &tile_max);
"""
FA_TILED = "static void ggml_compute_forward_flash_attn_ext_tiled(\n"
TILE_MAX_FN = """// exactspec: the largest of a tile row's GGML_FA_TILE_KV scores, 16 or 8 lanes at a time (upstream: one by
// one). Each lane keeps the larger by the very test of MAX (a > b ? a : b); the largest of a set of scores is
// one value whatever the order (a -0 for +0 at most, which every use here, exp(x - M), maps alike).
#define EXACTSPEC_TILE_DK 256
static inline void exactspec_tile_max(const float * x, float * s) {
#if defined(__AVX512F__)
    static_assert(GGML_FA_TILE_KV % 16 == 0, "whole vectors");
    __m512 m = _mm512_loadu_ps(x);
    for (int i = 16; i < GGML_FA_TILE_KV; i += 16) {
        m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    }
    *s = _mm512_reduce_max_ps(m);
#elif defined(__AVX__)
    static_assert(GGML_FA_TILE_KV % 8 == 0, "whole vectors");
    __m256 m = _mm256_loadu_ps(x);
    for (int i = 8; i < GGML_FA_TILE_KV; i += 8) {
        m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    *s = _mm_cvtss_f32(h);
#else
    ggml_vec_max_f32(GGML_FA_TILE_KV, s, x);
#endif
}

"""
# (file, text, replacement): each text must occur exactly once in the sdist (FA_CHUNKS: once the second
# patch has run)
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
    (QUANTS, Q4_1_ASSERT, Q4_1_ASSERT.replace("assert(nrc == 1);", "assert(nrc == 1 || nrc == 2);")),
    (QUANTS, Q4_1_LOOP, Q4_1_LOOP.replace("    int ib = 0;\n\n", "    int ib = 0;\n\n" + Q4_1_2X2)),
    (TRAITS, ODD_COLUMNS, ODD_COLUMNS_2X2),
    (QUANTS, Q4_1_ONE, Q4_1_ONE.replace("    for (; ib < nb; ++ib) {\n", PREFETCH)),
    (QUANTS, Q8_0_ONE, Q8_0_ONE.replace("    for (; ib < nb; ++ib) {\n", PREFETCH)),
    (TRAITS, SGEMM_F32, SGEMM_NOTE + SGEMM_F32.replace("(src1_cont)", "(src1_cont && ne11 >= 16)")),
    (TRAITS, SGEMM_QUANT, SGEMM_NOTE + SGEMM_QUANT.replace("vec_dot_type)", "vec_dot_type && ne11 >= 16)")),
    (OPS, FA_F16, FA_GROUPED + FA_F16),
    (OPS, FA_TILED, TILE_MAX_FN + FA_TILED),
    (OPS, TILE_MASK, TILE_MASK_NEW),
    (OPS, TILE_K, TILE_K_NEW),
    (OPS, TILE_MAX, TILE_MAX_NEW),
    (OPS, FA_CHUNKS, FA_GROUPED_CHUNKS + FA_CHUNKS),
    (TRAITS, Q4_1_ROWS, Q4_1_ROWS.replace("MATMUL_INT8)", "MATMUL_INT8) || defined(__AVX2__)  // exactspec: x86's 2x2 Q4_1 kernel")),
    (QUANTS, Q8_0_HEAD, Q8_0_HEAD.replace("assert(nrc == 1);", "assert(nrc == 1 || nrc == 2);")
                        .replace("    float sumf = 0;\n\n", "    float sumf = 0;\n\n" + Q8_0_2X2, 1)),
    (TRAITS, Q8_0_ROWS, Q8_0_ROWS.replace("MATMUL_INT8)", "MATMUL_INT8) || defined(__AVX2__)  // exactspec: x86's 2x2 Q8_0 kernel")),
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
