// exactspec: the query heads that share one K/V head (grouped-query attention), in lockstep over the keys.
// Every head gets the per-row kernel's operations in its order, by the vector macros of ggml_vec_dot_f16
// and ggml_vec_mad_f16, so the bits do not change; what the heads of a group share is each K and V
// row's load and conversion, and their accumulator chains run side by side. f16 K and V, head sizes
// without leftovers, no softcap and no sinks; other passes keep the per-row kernel.
#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
#define EXACTSPEC_FA_GROUP 8    // at most this many heads in lockstep
#define EXACTSPEC_FA_DMAX  256  // head sizes up to this (stack buffers)

// The scalar steps, written as the per-row kernel compiles on x86 (GCC contracts its S*ms + vs into a
// fused multiply-add, and cannot contract s*scale + mv across the softcap branch), and kept so in every
// instantiation below: a compiler left free to contract would decide per instantiation, and a lone
// token's rows (runs of 3, 2 and 1 heads) would then differ from a block's (runs of 3).
#if defined(__GNUC__) && !defined(__clang__)  // clang contracts within one expression only, never across statements
#pragma GCC push_options
#pragma GCC optimize ("fp-contract=off")
#endif
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define EXACTSPEC_FA_FMAF(a, b, c) fmaf(a, b, c)
#else
#define EXACTSPEC_FA_FMAF(a, b, c) ((a)*(b) + (c))
#endif

static bool exactspec_fa_grouped(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    float logit_softcap;
    memcpy(&logit_softcap, (const float *) dst->op_params + 2, sizeof(float));
    return q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16 && dst->src[4] == nullptr &&
           logit_softcap == 0.0f && q->ne[2] > k->ne[2] && k->ne[2] == v->ne[2] && q->ne[3] == k->ne[3] && k->ne[3] == v->ne[3] &&
           k->ne[0] <= EXACTSPEC_FA_DMAX && v->ne[0] <= EXACTSPEC_FA_DMAX &&
           k->ne[0] % GGML_F16_DOT_STEP == 0 && v->ne[0] % GGML_F16_STEP == 0;
}

// query row iq1 of heads h0..h0+G-1, which share one K/V head, over all keys
template <int G>
static void exactspec_fa_run(ggml_tensor * dst, int64_t iq1, int64_t h0, int64_t iq3) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    const int64_t DK = k->ne[0], DV = v->ne[0], nkv = k->ne[1];
    const int64_t ik2 = h0/(q->ne[2]/k->ne[2]);

    float scale, max_bias;
    memcpy(&scale,    (float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (float *) dst->op_params + 1, sizeof(float));
    const uint32_t n_head      = q->ne[2];
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));
    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);

    ggml_fp16_t Q_q[G][EXACTSPEC_FA_DMAX];    // each head's query in f16, as the per-row kernel converts it
    ggml_fp16_t VKQ16[G][EXACTSPEC_FA_DMAX];  // each head's f16 accumulator
    float S[G], M[G], slope[G];
    const ggml_fp16_t * mp[G];
    for (int g = 0; g < G; ++g) {
        const uint32_t h = h0 + g;
        slope[g] = (max_bias > 0.0f) ? h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1) : 1.0f;
        S[g] = 0.0f;
        M[g] = -INFINITY;
        memset(VKQ16[g], 0, DV*sizeof(ggml_fp16_t));
        mp[g] = mask ? (const ggml_fp16_t *)((const char *) mask->data + iq1*mask->nb[1] + (h%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : NULL;
        ggml_cpu_fp32_to_fp16((const float *) ((const char *) q->data + iq1*q->nb[1] + h*q->nb[2] + iq3*q->nb[3]), Q_q[g], DK);
    }
    const char * k_head = (const char *) k->data + ik2*k->nb[2] + iq3*k->nb[3];
    const char * v_head = (const char *) v->data + ik2*v->nb[2] + iq3*v->nb[3];

    for (int64_t ic = 0; ic < nkv; ++ic) {
        float mv[G];
        bool any = false;
        for (int g = 0; g < G; ++g) {
            mv[g] = mp[g] ? slope[g]*GGML_CPU_FP16_TO_FP32(mp[g][ic]) : 0.0f;
            any |= mv[g] != -INFINITY;
        }
        if (!any) {
            continue;
        }

        // KQ: ggml_vec_dot_f16(DK, &s, K row, Q_q[g]) for every head, the K row loaded once
        const ggml_fp16_t * kr = (const ggml_fp16_t *) (k_head + ic*k->nb[1]);
        GGML_F16_DOT_VEC sum[G][GGML_F16_DOT_ARR];
        for (int g = 0; g < G; ++g) {
            for (int j = 0; j < GGML_F16_DOT_ARR; j++) {
                sum[g][j] = GGML_F16_DOT_VEC_ZERO;
            }
        }
        for (int64_t i = 0; i < DK; i += GGML_F16_DOT_STEP) {
            for (int j = 0; j < GGML_F16_DOT_ARR; j++) {
                const GGML_F16_DOT_VEC ax = GGML_F16_DOT_VEC_LOAD(kr + i + j*GGML_F16_DOT_EPR, j);
                for (int g = 0; g < G; ++g) {
                    sum[g][j] = GGML_F16_DOT_VEC_FMA(sum[g][j], ax, GGML_F16_DOT_VEC_LOAD(Q_q[g] + i + j*GGML_F16_DOT_EPR, j));
                }
            }
        }

        // the online softmax of each head, as the per-row kernel's (vs 0 where the mask hides the key)
        float vs[G];
        for (int g = 0; g < G; ++g) {
            ggml_float sumf = 0.0;
            GGML_F16_DOT_VEC_REDUCE(sumf, sum[g]);
            float s = sumf;
            vs[g] = 0.0f;
            if (mv[g] == -INFINITY) {
                continue;
            }
            s = s*scale;
            s += mv[g];
            const float Mold = M[g];
            float ms = 1.0f;
            vs[g] = 1.0f;
            if (s > M[g]) {
                M[g] = s;
                ms = expf(Mold - M[g]);
                ggml_vec_scale_f16(DV, VKQ16[g], ms);
            } else {
                vs[g] = expf(s - M[g]);
            }
            S[g] = EXACTSPEC_FA_FMAF(S[g], ms, vs[g]);
        }

        // V += v*vs: ggml_vec_mad_f16(DV, VKQ16[g], V row, vs[g]) for every head, the V row loaded once
        const ggml_fp16_t * vr = (const ggml_fp16_t *) (v_head + ic*v->nb[1]);
        for (int64_t i = 0; i < DV; i += GGML_F16_STEP) {
            GGML_F16_VEC ax[GGML_F16_ARR];
            for (int j = 0; j < GGML_F16_ARR; j++) {
                ax[j] = GGML_F16_VEC_LOAD(vr + i + j*GGML_F16_EPR, j);
            }
            for (int g = 0; g < G; ++g) {
                if (mv[g] == -INFINITY) {
                    continue;
                }
                const GGML_F16_VEC vx = GGML_F16_VEC_SET1(vs[g]);
                GGML_F16_VEC ay[GGML_F16_ARR];
                for (int j = 0; j < GGML_F16_ARR; j++) {
                    ay[j] = GGML_F16_VEC_LOAD(VKQ16[g] + i + j*GGML_F16_EPR, j);
                    ay[j] = GGML_F16_VEC_FMA(ay[j], ax[j], vx);
                    GGML_F16_VEC_STORE(VKQ16[g] + i + j*GGML_F16_EPR, ay, j);
                }
            }
        }
    }

    float VKQ32[EXACTSPEC_FA_DMAX];
    for (int g = 0; g < G; ++g) {
        for (int64_t d = 0; d < DV; ++d) {
            VKQ32[d] = GGML_CPU_FP16_TO_FP32(VKQ16[g][d]);
        }
        const float S_inv = S[g] == 0.0f ? 0.0f : 1.0f/S[g];
        ggml_vec_scale_f32(DV, VKQ32, S_inv);
        // permute(0, 2, 1, 3), as the per-row kernel writes
        memcpy((char *) dst->data + (iq3*dst->ne[2]*dst->ne[1] + (h0 + g) + iq1*dst->ne[1])*dst->nb[1], VKQ32, dst->nb[1]);
    }
}

// rows p0..p1 of the pass numbered (iq3, iq1, head), so that the heads of a group are consecutive
static void exactspec_fa_rows_grouped(ggml_tensor * dst, int64_t p0, int64_t p1) {
    const int64_t nh = dst->src[0]->ne[2], nq = dst->src[0]->ne[1], rk2 = nh/dst->src[1]->ne[2];
    for (int64_t p = p0; p < p1; ) {
        const int64_t iq3 = p/(nq*nh);
        const int64_t iq1 = (p - iq3*nq*nh)/nh;
        const int64_t h0  = p - iq3*nq*nh - iq1*nh;
        const int G = (int) MIN(MIN((h0/rk2 + 1)*rk2 - h0, p1 - p), (int64_t) EXACTSPEC_FA_GROUP);
        switch (G) {
            case 1:  exactspec_fa_run<1>(dst, iq1, h0, iq3); break;
            case 2:  exactspec_fa_run<2>(dst, iq1, h0, iq3); break;
            case 3:  exactspec_fa_run<3>(dst, iq1, h0, iq3); break;
            case 4:  exactspec_fa_run<4>(dst, iq1, h0, iq3); break;
            case 5:  exactspec_fa_run<5>(dst, iq1, h0, iq3); break;
            case 6:  exactspec_fa_run<6>(dst, iq1, h0, iq3); break;
            case 7:  exactspec_fa_run<7>(dst, iq1, h0, iq3); break;
            default: exactspec_fa_run<8>(dst, iq1, h0, iq3); break;
        }
        p += G;
    }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#endif

