// The KL row kernel (headkl_core::toolkit::KlDesc), one block per token row:
// the CUDA twin of shaders/kl_rows.wgsl; see there and shaders/README.md
// ("kl_rows.wgsl") for what it computes. The WGSL specialises on the
// KL_FLAGS override; here params.flags is read at run time and every branch
// on it is uniform over the block, so the same paths run ("plain" loops for
// flags without terms, the general ones otherwise).
#pragma once
#include "common.cuh"

static constexpr float KL_NEG_HUGE = -3.0e38f;
// 16-byte grad words one mask word covers (32 blocks of FILTER_BLOCK), and
// one segment of SEG_WORDS mask words.
static constexpr u32 KL_WORD4 = 32u * FILTER_BLOCK / 4u;
static constexpr u32 KL_SEG4 = SEG_WORDS * KL_WORD4;

// The WGSL's workgroup variables (same names, prefixed).
__shared__ float kl_red_max[WG];
__shared__ float kl_red_sum[WG];
__shared__ u32 kl_red_bad[WG];
__shared__ float kl_red_max1[WG];
__shared__ float kl_red_sum1[WG];
__shared__ float kl_red_aux[WG];
__shared__ float kl_row_lse;
// Bit 0: the row's logits are not finite; bit 1: the row is flagged.
__shared__ u32 kl_row_bad;
// The teacher's probability at the label, or -1 when not among the k.
__shared__ float kl_row_label_p;
// Pass 2's constants: (a, b, h, f_on) and (label_term, lse1, f_off, k1).
__shared__ float4 kl_row_c0;
__shared__ float4 kl_row_c1;
// Reverse KL / JSD: (E, log N).
__shared__ float2 kl_row_div;
// The block filter's mask words of one segment.
__shared__ u32 kl_seg_mask[SEG_WORDS];

__device__ __forceinline__ float kl_nan() {
    return from_bits(0x7fc00000u);
}

__device__ __forceinline__ u32 kl_div_code(u32 flags) {
    return (flags >> F_DIV_SHIFT) & 3u;
}

__device__ __forceinline__ u32 kl_tau_pow(u32 flags) {
    return (flags >> F_TAU_POW_SHIFT) & F_TAU_POW_MASK;
}

// Component c of a float4 (c a constant once the callers' loops unroll).
__device__ __forceinline__ float kl_comp(const float4& v, u32 c) {
    return c == 0u ? v.x : (c == 1u ? v.y : (c == 2u ? v.z : v.w));
}

// f(c, x, j) for the columns j = 4 * j4 + c below vocab of word j4 (x4, its
// logits), c in order (unrolled: c is a constant in each call).
template <typename F>
__device__ __forceinline__ void kl_word_cols(float4 x4, u32 j4, u32 vocab, F f) {
#pragma unroll
    for (u32 c = 0u; c < 4u; c++) {
        u32 j = j4 * 4u + c;
        if (j >= vocab) {
            break;
        }
        f(c, kl_comp(x4, c), j);
    }
}

__device__ __forceinline__ uint2 kl_pack4(float4 g) {
    return make_uint2((u32)to_f16(g.x) | ((u32)to_f16(g.y) << 16),
                      (u32)to_f16(g.z) | ((u32)to_f16(g.w) << 16));
}

// One bin of the reverse KL or the JSD: (f, f') at the student's share q
// (log_q its log) and the teacher's t (div_term).
__device__ __forceinline__ float2 kl_div_term(const RowParams& p, float q, float log_q, float t) {
    if (kl_div_code(p.flags) == DIV_REVERSE) {
        if (q > 0.0f) {
            float r = log_q - logf(fmaxf(t, TAIL_FLOOR));
            return make_float2(q * r, r + 1.0f);
        }
        return make_float2(0.0f, 0.0f);
    }
    float beta = p.beta;
    float m = beta * t + (1.0f - beta) * q;
    float2 out = make_float2(0.0f, 0.0f);
    if (t > 0.0f) {
        out.x = beta * t * (logf(t) - logf(m));
    }
    if (q > 0.0f) {
        float r = log_q - logf(m);
        out.x += (1.0f - beta) * q * r;
        out.y = (1.0f - beta) * r;
    }
    return out;
}

// The soft term's d/ds at a teacher column (soft_on).
__device__ __forceinline__ float kl_soft_on(const RowParams& p, float u, float pt, float p_t, float lse, float f_on) {
    if (kl_div_code(p.flags) == 0u) {
        return f_on * pt - p_t;
    }
    float2 div = kl_row_div;
    float log_q = u - lse - div.y;
    float q = expf(log_q);
    return q * (kl_div_term(p, q, log_q, p_t).y - div.x);
}

// Logit j of the row starting at element base (a multiple of 4).
__device__ __forceinline__ float kl_logit(const float4* __restrict__ logits, u32 base, u32 j) {
    return reinterpret_cast<const float*>(logits)[base + j];
}

// e^n for n = tau_pow (2, 3 or 4), straight-line.
__device__ __forceinline__ float kl_pow_tau(u32 flags, float e) {
    float e2 = e * e;
    if (kl_tau_pow(flags) == 3u) {
        return e2 * e;
    }
    if (kl_tau_pow(flags) == 4u) {
        return e2 * e2;
    }
    return e2;
}

// Logit x as the loss reads it, and d/dx: capped when the softcap is on.
__device__ __forceinline__ float2 kl_scaled2(const RowParams& p, float x) {
    if ((p.flags & F_SOFTCAP) != 0u) {
        float t = tanhf(x * (1.0f / p.cap));
        return make_float2(p.cap * t, 1.0f - t * t);
    }
    return make_float2(x, 1.0f);
}

__device__ __forceinline__ float kl_scaled(const RowParams& p, float x) {
    return kl_scaled2(p, x).x;
}

// Folds x into the running (max, sum of exp(x - max)).
__device__ __forceinline__ float2 kl_fold(float2 ms, float x) {
    if (x > ms.x) {
        return make_float2(x, ms.y * expf(ms.x - x) + 1.0f);
    }
    return make_float2(ms.x, ms.y + expf(x - ms.x));
}

// Folds the logits of word j4 (those past vocab skipped).
__device__ __forceinline__ void kl_fold4(float2& ms, u32& bad, float4 x4, u32 j4, u32 vocab) {
    kl_word_cols(x4, j4, vocab, [&](u32, float x, u32) {
        if (non_finite(x)) {
            bad = 1u;
        } else {
            ms = kl_fold(ms, x);
        }
    });
}

// The general fold: max m, sum at tau, sum at tau = 1, sum of u, bad flag.
struct KlFoldTerms {
    float m;
    float s;
    float s1;
    float sum_u;
    u32 bad;
};

__device__ __forceinline__ void kl_fold_u(const RowParams& p, KlFoldTerms& st, float u) {
    float d = u - st.m;
    float e = expf(-fabsf(d));
    float e1 = e;
    if ((p.flags & F_TAU) != 0u) {
        if (kl_tau_pow(p.flags) != 0u) {
            e1 = kl_pow_tau(p.flags, e);
        } else {
            e1 = expf(-fabsf(d) * p.temperature);
        }
    }
    if (d > 0.0f) {
        st.m = u;
        st.s = st.s * e + 1.0f;
        st.s1 = st.s1 * e1 + 1.0f;
    } else {
        st.s = st.s + e;
        st.s1 = st.s1 + e1;
    }
    st.sum_u += u;
}

__device__ __forceinline__ void kl_fold_x(const RowParams& p, KlFoldTerms& st, float x, bool live) {
    if (live) {
        if (non_finite(x)) {
            st.bad = 1u;
        } else {
            kl_fold_u(p, st, kl_scaled(p, x));
        }
    }
}

__device__ __forceinline__ void kl_fold4_terms(const RowParams& p, KlFoldTerms& st, float4 x4, u32 j4, u32 vocab) {
    u32 j = j4 * 4u;
    kl_fold_x(p, st, x4.x, j < vocab);
    kl_fold_x(p, st, x4.y, j + 1u < vocab);
    kl_fold_x(p, st, x4.z, j + 2u < vocab);
    kl_fold_x(p, st, x4.w, j + 3u < vocab);
}

// c * p_S for word j4's 4 logits, zero past vocab.
__device__ __forceinline__ float4 kl_grad4_f32(float4 x4, u32 j4, u32 vocab, float c, float lse) {
    u32 j = j4 * 4u;
    float4 g = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (j < vocab) {
        g.x = c * expf(x4.x - lse);
    }
    if (j + 1u < vocab) {
        g.y = c * expf(x4.y - lse);
    }
    if (j + 2u < vocab) {
        g.z = c * expf(x4.z - lse);
    }
    if (j + 3u < vocab) {
        g.w = c * expf(x4.w - lse);
    }
    return g;
}

// The row's constants of pass 2 in the general case (Pass2).
struct KlPass2 {
    float c;
    float lse;
    float a;
    float b;
    float h;
    float lse1;
    float k1;
};

// p at tau = 1 of the capped logit u, given p^tau = pt.
__device__ __forceinline__ float kl_p_one(const RowParams& p, float u, float pt, float lse1, float k1) {
    if ((p.flags & F_TAU) == 0u) {
        return pt;
    }
    if (kl_tau_pow(p.flags) != 0u) {
        return kl_pow_tau(p.flags, pt) * k1;
    }
    return expf(u * p.temperature - lse1);
}

// c * dL/ds for logit x in the general case.
__device__ __forceinline__ float kl_grad_x(const RowParams& p, float x, const KlPass2& r) {
    float2 us = kl_scaled2(p, x);
    float pt = expf(us.x - r.lse);
    float d;
    if ((p.flags & F_TAU) == 0u) {
        d = (r.a + r.b) * pt - r.h;
    } else {
        d = r.a * pt + r.b * kl_p_one(p, us.x, pt, r.lse1, r.k1) - r.h;
    }
    return r.c * us.y * d;
}

// All four computed, the padding's discarded (straight-line).
__device__ __forceinline__ float4 kl_grad4_terms_f32(const RowParams& p, float4 x4, u32 j4, u32 vocab, const KlPass2& r) {
    float4 g = make_float4(kl_grad_x(p, x4.x, r), kl_grad_x(p, x4.y, r), kl_grad_x(p, x4.z, r), kl_grad_x(p, x4.w, r));
    u32 j = j4 * 4u;
    return make_float4(j < vocab ? g.x : 0.0f, j + 1u < vocab ? g.y : 0.0f, j + 2u < vocab ? g.z : 0.0f,
                       j + 3u < vocab ? g.w : 0.0f);
}

// What teacher_grad and label_grad know of logit x: the capped logit and
// its d/dx (us), p^tau (pt) and p at tau = 1 (p1, from lse1).
struct KlColumn {
    float2 us;
    float pt;
    float p1;
};

__device__ __forceinline__ KlColumn kl_column(const RowParams& p, float x, float lse, float lse1) {
    KlColumn col;
    col.us = kl_scaled2(p, x);
    col.pt = expf(col.us.x - lse);
    col.p1 = col.pt;
    if ((p.flags & F_TAU) != 0u) {
        col.p1 = expf(col.us.x * p.temperature - lse1);
    }
    return col;
}

// c * dL/ds at a teacher column (teacher_grad).
__device__ __forceinline__ float kl_teacher_grad(const RowParams& p, float x, float p_t, float c, float lse, float4 c0, float4 c1) {
    KlColumn col = kl_column(p, x, lse, c1.y);
    float d = p.soft_weight * kl_soft_on(p, col.us.x, col.pt, p_t, lse, c0.w) + c0.y * col.p1 - c0.z;
    return c * col.us.y * d;
}

// c * dL/ds at the label's column, whole (label_grad).
__device__ __forceinline__ float kl_label_grad(const RowParams& p, float x, float label_p, float c, float lse, float4 c0, float4 c1) {
    KlColumn col = kl_column(p, x, lse, c1.y);
    float d = c0.x * col.pt;
    if (label_p >= 0.0f) {
        d = p.soft_weight * kl_soft_on(p, col.us.x, col.pt, label_p, lse, c0.w);
    }
    d += c0.y * col.p1 - c0.z - c1.x;
    return c * col.us.y * d;
}

// A flagged row's pass 2: a zero gradient row (padding included) and, with
// the filter, an all-clear mask.
__device__ __forceinline__ void kl_zero_row(const RowParams& p, uint2* __restrict__ grad, u32 row, u32 lid) {
    u32 base4 = row * p.ld / 4u;
    for (u32 g4 = lid; g4 < p.ld / 4u; g4 += WG) {
        grad[base4 + g4] = make_uint2(0u, 0u);
    }
    if ((p.flags & F_FILTER) != 0u) {
        for (u32 w = lid; w < p.mask_ld; w += WG) {
            grad[p.mask_off4 + row * p.mask_ld + w] = make_uint2(0u, 0u);
        }
    }
}

// Whether c * dL/ds = g keeps its block: above eps, or not a number.
__device__ __forceinline__ bool kl_kept(const RowParams& p, float g, float c) {
    return !(fabsf(g) <= p.filter_eps * fabsf(c));
}

// Marks the block of column j in the segment starting at column col0.
__device__ __forceinline__ void kl_mark(u32 j, u32 col0) {
    u32 b = (j - col0) / FILTER_BLOCK;
    atomicOr(&kl_seg_mask[b / 32u], 1u << (b % 32u));
}

// Pass 2 with the block filter (filtered_grad): the gradient as the
// unfiltered pass writes it, and the row's block mask, one segment at a time.
__device__ __forceinline__ void kl_filtered_grad(const RowParams& p, const float4* __restrict__ logits,
                                                 const u32* __restrict__ ids, const float* __restrict__ probs,
                                                 uint2* __restrict__ grad, u32 row, u32 lid, float c, float lse,
                                                 bool plain, bool labelled, u32 label) {
    __syncthreads();
    float4 c0 = kl_row_c0;
    float4 c1 = kl_row_c1;
    float label_p = kl_row_label_p;
    KlPass2 r = {c, lse, c0.x, c0.y, c0.z, c1.y, c1.w};
    half_bits* grad_h = reinterpret_cast<half_bits*>(grad);
    u32 vocab = p.vocab;
    u32 base = row * p.ld;
    u32 base4 = base / 4u;
    u32 padded = p.ld / 4u;
    u32 k = p.k;
    u32 tbase = row * k;
    for (u32 s4 = 0u; s4 < padded; s4 += KL_SEG4) {
        u32 e4 = min(s4 + KL_SEG4, padded);
        u32 col0 = s4 * 4u;
        u32 col1 = e4 * 4u;
        if (lid < SEG_WORDS) {
            kl_seg_mask[lid] = 0u;
        }
        __syncthreads();
        for (u32 g4 = s4 + lid; g4 < e4; g4 += WG) {
            float4 x4 = logits[base4 + g4];
            float4 g;
            if (plain) {
                g = kl_grad4_f32(x4, g4, vocab, c, lse);
            } else {
                g = kl_grad4_terms_f32(p, x4, g4, vocab, r);
            }
            grad[base4 + g4] = kl_pack4(g);
            if (kl_kept(p, g.x, c) || kl_kept(p, g.y, c) || kl_kept(p, g.z, c) || kl_kept(p, g.w, c)) {
                kl_mark(g4 * 4u, col0);
            }
        }
        // The teacher's columns over the bulk's stores (storageBarrier) ...
        __syncthreads();
        for (u32 q = lid; q < k; q += WG) {
            u32 id = ids[tbase + q];
            if (id < col0 || id >= col1) {
                continue;
            }
            float gv;
            if (plain) {
                float ps = expf(kl_logit(logits, base, id) - lse);
                gv = c * (ps - probs[tbase + q]);
            } else {
                gv = kl_teacher_grad(p, kl_logit(logits, base, id), probs[tbase + q], c, lse, c0, c1);
            }
            grad_h[base + id] = to_f16(gv);
            if (kl_kept(p, gv, c)) {
                kl_mark(id, col0);
            }
        }
        // ... then the label's column, whole (general case only).
        __syncthreads();
        if (!plain && labelled && lid == 0u && label >= col0 && label < col1) {
            float gv = kl_label_grad(p, kl_logit(logits, base, label), label_p, c, lse, c0, c1);
            grad_h[base + label] = to_f16(gv);
            if (kl_kept(p, gv, c)) {
                kl_mark(label, col0);
            }
        }
        __syncthreads();
        u32 w = s4 / KL_WORD4 + lid;
        if (lid < SEG_WORDS && w < p.mask_ld) {
            u32 m = kl_seg_mask[lid];
            float4 h = make_float4((float)(m & 255u), (float)((m >> 8u) & 255u), (float)((m >> 16u) & 255u),
                                   (float)(m >> 24u));
            grad[p.mask_off4 + row * p.mask_ld + w] = kl_pack4(h);
        }
        __syncthreads();
    }
}

// ---- The dense teacher (F_DENSE): probs holds the teacher's logits at tau,
// laid out as the student's.

// Folds x into (max, sum of exp(x - max), sum of exp(x - max) * w).
__device__ __forceinline__ float3 kl_fold_w(float3 st, float x, float w) {
    if (x > st.x) {
        float f = expf(st.x - x);
        return make_float3(x, st.y * f + 1.0f, st.z * f + w);
    }
    float e = expf(x - st.x);
    return make_float3(st.x, st.y + e, st.z + e * w);
}

__device__ __forceinline__ float3 kl_merge_w(float3 a, float3 b) {
    float m = fmaxf(a.x, b.x);
    float fa = expf(a.x - m);
    float fb = expf(b.x - m);
    return make_float3(m, a.y * fa + b.y * fb, a.z * fa + b.z * fb);
}

// A (max, sum of exp(x - max)) quantity of block_reduce (common.cuh),
// merged by merge_max_sum: the thread's value, in two shared arrays.
struct KlFoldSlot {
    float* maxs;
    float* sums;
    float2 value;
    bool on = true;
    __device__ __forceinline__ void store(u32 lid) const {
        if (on) {
            maxs[lid] = value.x;
            sums[lid] = value.y;
        }
    }
    __device__ __forceinline__ void merge(u32 a, u32 b) const {
        if (on) {
            float2 m = merge_max_sum(maxs[a], sums[a], maxs[b], sums[b]);
            maxs[a] = m.x;
            sums[a] = m.y;
        }
    }
};

// A kl_fold_w state (max, sum, weighted sum) as a quantity of block_reduce,
// merged by kl_merge_w, in three shared arrays.
struct KlFoldWSlot {
    float* maxs;
    float* sums;
    float* auxs;
    float3 value;
    __device__ __forceinline__ void store(u32 lid) const {
        maxs[lid] = value.x;
        sums[lid] = value.y;
        auxs[lid] = value.z;
    }
    __device__ __forceinline__ void merge(u32 a, u32 b) const {
        float3 r = kl_merge_w(make_float3(maxs[a], sums[a], auxs[a]), make_float3(maxs[b], sums[b], auxs[b]));
        maxs[a] = r.x;
        sums[a] = r.y;
        auxs[a] = r.z;
    }
};

// One column of the dense reverse KL or JSD (dense_div).
__device__ __forceinline__ float2 kl_dense_div(const RowParams& p, float ls, float lt) {
    float q = expf(ls);
    if (kl_div_code(p.flags) == DIV_REVERSE) {
        if (q > 0.0f) {
            float r = ls - fmaxf(lt, LOG_PROB_FLOOR);
            return make_float2(q * r, r + 1.0f);
        }
        return make_float2(0.0f, 0.0f);
    }
    float beta = p.beta;
    float t = expf(lt);
    float log_m = logf(beta * t + (1.0f - beta) * q);
    float2 out = make_float2(0.0f, 0.0f);
    if (t > 0.0f) {
        out.x = beta * t * (lt - log_m);
    }
    if (q > 0.0f) {
        out.x += (1.0f - beta) * q * (ls - log_m);
        out.y = (1.0f - beta) * (ls - log_m);
    }
    return out;
}

// Sums a and b over the block's threads into kl_red_sum[0] and
// kl_red_aux[0] (every thread calls it: it holds barriers).
__device__ __forceinline__ void kl_sum2(float a, float b, u32 lid) {
    block_reduce(lid, block_slot<BlockSum>(kl_red_sum, a), block_slot<BlockSum>(kl_red_aux, b));
}

// A row's four loss outputs: [loss, lse, soft, 0] or the kernel's variant.
__device__ __forceinline__ void kl_write_loss(float* __restrict__ loss, u32 row, float4 out) {
    loss[row * 4u] = out.x;
    loss[row * 4u + 1u] = out.y;
    loss[row * 4u + 2u] = out.z;
    loss[row * 4u + 3u] = out.w;
}

// Reduces fold_w state st into (red_max, red_sum, red_aux)[0] and bad by or
// into red_bad[0]; with tau1, the fold ms1 into (red_max1, red_sum1)[0].
__device__ __forceinline__ void kl_reduce_w(float3 st, u32 bad, float2 ms1, bool tau1, u32 lid) {
    block_reduce(lid, KlFoldWSlot{kl_red_max, kl_red_sum, kl_red_aux, st}, block_slot<BlockOr>(kl_red_bad, bad),
                 KlFoldSlot{kl_red_max1, kl_red_sum1, ms1, tau1});
}

__device__ __forceinline__ void kl_dense_row(const RowParams& p, const float4* __restrict__ logits,
                                             const float* __restrict__ probs, const u32* __restrict__ row_in,
                                             float* __restrict__ loss, uint2* __restrict__ grad, u32 row, u32 lid) {
    u32 vocab = p.vocab;
    u32 base = row * p.ld;
    u32 base4 = base / 4u;
    u32 words = (vocab + 3u) / 4u;
    bool forward = kl_div_code(p.flags) == 0u;
    bool tau_on = (p.flags & F_TAU) != 0u;
    // Pass 1: the student's fold, its tau = 1 fold, and the teacher's (with
    // sum p_T * (t - s) on the way).
    float3 fs = make_float3(KL_NEG_HUGE, 0.0f, 0.0f);
    float3 ft = make_float3(KL_NEG_HUGE, 0.0f, 0.0f);
    float2 ms1 = make_float2(KL_NEG_HUGE, 0.0f);
    u32 bad = 0u;
    for (u32 j4 = lid; j4 < words; j4 += WG) {
        kl_word_cols(logits[base4 + j4], j4, vocab, [&](u32, float s, u32 j) {
            float t = probs[base + j];
            if (non_finite(s) || non_finite(t)) {
                bad = 1u;
                return;
            }
            fs = kl_fold_w(fs, s, 0.0f);
            ft = kl_fold_w(ft, t, forward ? t - s : 0.0f);
            if (tau_on) {
                ms1 = kl_fold(ms1, s * p.temperature);
            }
        });
    }
    kl_reduce_w(make_float3(fs.x, fs.y, 0.0f), bad, ms1, tau_on, lid);
    if (lid == 0u) {
        u32 b = kl_red_bad[0];
        if (non_finite(kl_red_sum[0]) || !(kl_red_sum[0] > 0.0f)) {
            b = 1u;
        }
        if (row_in[row * 2u] == FLAGGED_ROW) {
            b |= 2u;
        }
        kl_row_bad = b;
        kl_row_lse = kl_red_max[0] + logf(kl_red_sum[0]);
        float lse1 = kl_row_lse;
        if (tau_on) {
            lse1 = kl_red_max1[0] + logf(kl_red_sum1[0]);
        }
        kl_row_div = make_float2(lse1, 0.0f);
    }
    __syncthreads();
    kl_reduce_w(ft, 0u, ms1, false, lid);
    if (lid == 0u) {
        float lse_t = kl_red_max[0] + logf(kl_red_sum[0]);
        if (non_finite(lse_t)) {
            kl_row_bad |= 1u;
        }
        // (lse_t, sum p_T * (t - s)).
        kl_row_c0 = make_float4(lse_t, kl_red_aux[0] / kl_red_sum[0], 0.0f, 0.0f);
    }
    // workgroupUniformLoad of row_lse, row_c0, row_bad.
    __syncthreads();
    float lse = kl_row_lse;
    float4 c0 = kl_row_c0;
    float lse_t = c0.x;
    u32 row_state = kl_row_bad;
    // Forward from pass 1; the reverse KL and the JSD in pass 2, with
    // E = sum p_S * f' for their gradient.
    float soft = c0.y - lse_t + lse;
    float e = 0.0f;
    if (!forward) {
        float f_sum = 0.0f;
        float e_sum = 0.0f;
        for (u32 j4 = lid; j4 < words; j4 += WG) {
            kl_word_cols(logits[base4 + j4], j4, vocab, [&](u32, float s, u32 j) {
                float ls = s - lse;
                float2 f = kl_dense_div(p, ls, probs[base + j] - lse_t);
                f_sum += f.x;
                e_sum += expf(ls) * f.y;
            });
        }
        kl_sum2(f_sum, e_sum, lid);
        soft = kl_red_sum[0];
        e = kl_red_aux[0];
    }
    // workgroupUniformLoad of row_div.
    __syncthreads();
    float lse1 = kl_row_div.x;
    if (lid == 0u) {
        float4 out = make_float4(p.soft_weight * soft, lse1, soft, 0.0f);
        if ((row_state & 1u) != 0u) {
            out = make_float4(kl_nan(), kl_nan(), kl_nan(), kl_nan());
        }
        if ((row_state & 2u) != 0u) {
            out.x = from_bits(row_in[row * 2u]);
        }
        kl_write_loss(loss, row, out);
    }
    if ((row_state & 2u) != 0u) {
        kl_zero_row(p, grad, row, lid);
        return;
    }
    // Pass 3: grad = c * alpha_soft * dL/ds; zero in the padding.
    float cw = from_bits(row_in[row * 2u]) * p.soft_weight;
    for (u32 g4 = lid; g4 < p.ld / 4u; g4 += WG) {
        float g[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        kl_word_cols(logits[base4 + g4], g4, vocab, [&](u32 c, float s, u32 j) {
            float ls = s - lse;
            float lt = probs[base + j] - lse_t;
            if (forward) {
                g[c] = cw * (expf(ls) - expf(lt));
            } else {
                g[c] = cw * expf(ls) * (kl_dense_div(p, ls, lt).y - e);
            }
        });
        grad[base4 + g4] = kl_pack4(make_float4(g[0], g[1], g[2], g[3]));
    }
}

// The row kernel's parts, in the order kl_rows runs them (a block a row,
// WG threads).

// What the row kernel knows of a row before its first pass, and (after
// kl_row_state) the row's lse and state.
struct KlRow {
    u32 row;
    // First element of the row in logits and grad.
    u32 base;
    u32 flags;
    // The flags but the filter: the seed's loss.
    bool plain;
    // The general fold: a cap, tau != 1 or the hard term.
    bool fold_terms;
    u32 label;
    bool labelled;
    float lse;
    u32 row_is_bad;
    bool flagged;
};

__device__ __forceinline__ KlRow kl_row_begin(const RowParams& p, const u32* __restrict__ row_in, u32 row) {
    KlRow r;
    r.row = row;
    r.base = row * p.ld;
    r.flags = p.flags;
    // The filter changes what pass 2 writes, not what is computed.
    r.plain = (r.flags & ~F_FILTER) == 0u;
    r.fold_terms = (r.flags & (F_SOFTCAP | F_TAU | F_HARD)) != 0u;
    // No label, or one past vocab, is no label; read only with the hard term.
    r.label = 0xffffffffu;
    if ((r.flags & F_HARD) != 0u) {
        r.label = row_in[row * 2u + 1u];
    }
    r.labelled = r.label < p.vocab;
    r.lse = 0.0f;
    r.row_is_bad = 0u;
    r.flagged = false;
    return r;
}

// One thread's pass-1 state.
struct KlRowFold {
    // Online (max, sum of exp(s - max)).
    float2 ms;
    // The general fold's tau = 1 (max, sum) and sum of the capped logits.
    float2 ms1;
    float sum_u;
    u32 bad;
};

// Pass 1 over the row's words, four 16-byte loads in flight per thread.
__device__ __forceinline__ KlRowFold kl_fold_words(const RowParams& p, const KlRow& r, const float4* __restrict__ logits,
                                                   u32 lid) {
    KlRowFold f = {make_float2(KL_NEG_HUGE, 0.0f), make_float2(KL_NEG_HUGE, 0.0f), 0.0f, 0u};
    u32 vocab = p.vocab;
    const float4* row4 = logits + r.base / 4u;
    u32 w1 = (vocab + 3u) / 4u;
    if (!r.fold_terms) {
        u32 j4 = lid;
        for (; j4 + 3u * WG < w1; j4 += 4u * WG) {
            float4 x[4] = {row4[j4], row4[j4 + WG], row4[j4 + 2u * WG], row4[j4 + 3u * WG]};
#pragma unroll
            for (u32 i = 0u; i < 4u; i++) {
                kl_fold4(f.ms, f.bad, x[i], j4 + i * WG, vocab);
            }
        }
        for (; j4 < w1; j4 += WG) {
            float4 x = row4[j4];
            kl_fold4(f.ms, f.bad, x, j4, vocab);
        }
        return f;
    }
    KlFoldTerms ft = {KL_NEG_HUGE, 0.0f, 0.0f, 0.0f, 0u};
    u32 j4 = lid;
    for (; j4 + 3u * WG < w1; j4 += 4u * WG) {
        float4 x[4] = {row4[j4], row4[j4 + WG], row4[j4 + 2u * WG], row4[j4 + 3u * WG]};
#pragma unroll
        for (u32 i = 0u; i < 4u; i++) {
            kl_fold4_terms(p, ft, x[i], j4 + i * WG, vocab);
        }
    }
    for (; j4 < w1; j4 += WG) {
        float4 x = row4[j4];
        kl_fold4_terms(p, ft, x, j4, vocab);
    }
    f.ms = make_float2(ft.m, ft.s);
    f.bad = ft.bad;
    // The tau = 1 fold as (max, sum): its max is tau * m (NEG_HUGE for a
    // thread that saw no logit).
    f.ms1 = make_float2(fmaxf(ft.m * p.temperature, KL_NEG_HUGE), ft.s1);
    f.sum_u = ft.sum_u;
    return f;
}

// Pass 1 from the (max, sum) pairs per 32 columns the logits GEMM wrote
// (the plain fold's stand-in where they exist).
__device__ __forceinline__ KlRowFold kl_fold_stats(const RowParams& p, const float4* __restrict__ logits, u32 row,
                                                   u32 lid) {
    KlRowFold f = {make_float2(KL_NEG_HUGE, 0.0f), make_float2(KL_NEG_HUGE, 0.0f), 0.0f, 0u};
    u32 sbase = p.stats_offset / 4u + row * (p.stats_ld / 2u);
    for (u32 g = lid; g < p.stats_groups; g += WG) {
        float4 w = logits[sbase + g / 2u];
        float2 pair = make_float2(w.x, w.y);
        if ((g & 1u) != 0u) {
            pair = make_float2(w.z, w.w);
        }
        if (non_finite(pair.y)) {
            f.bad = 1u;
        } else if (pair.y > 0.0f) {
            f.ms = merge_max_sum(f.ms.x, f.ms.y, pair.x, pair.y);
        }
    }
    return f;
}

// The block's folds merged into kl_red_*[0].
__device__ __forceinline__ void kl_reduce_fold(const KlRowFold& f, bool fold_terms, u32 lid) {
    block_reduce(lid, KlFoldSlot{kl_red_max, kl_red_sum, f.ms}, block_slot<BlockOr>(kl_red_bad, f.bad),
                 KlFoldSlot{kl_red_max1, kl_red_sum1, f.ms1, fold_terms},
                 block_slot<BlockSum>(kl_red_aux, f.sum_u, fold_terms));
}

// The row's lse and state from kl_red_*[0] (thread 0), then r's copy of
// them in every thread.
__device__ __forceinline__ void kl_row_state(const RowParams& p, const u32* __restrict__ row_in, KlRow& r, u32 lid) {
    if (lid == 0u) {
        float total = kl_red_sum[0];
        u32 b = kl_red_bad[0];
        if (non_finite(total) || !(total > 0.0f)) {
            b = 1u;
        }
        // The word's bits, never a float NaN test.
        if (row_in[r.row * 2u] == FLAGGED_ROW) {
            b |= 2u;
        }
        kl_row_bad = b;
        kl_row_lse = kl_red_max[0] + logf(total);
        kl_row_label_p = -1.0f;
        if (!r.plain) {
            float lse1 = kl_row_lse;
            if ((r.flags & F_TAU) != 0u) {
                lse1 = kl_red_max1[0] + logf(kl_red_sum1[0]);
            }
            kl_row_c1 = make_float4(0.0f, lse1, 1.0f, kl_red_aux[0]);
        }
    }
    // workgroupUniformLoad of row_lse and row_bad.
    __syncthreads();
    r.lse = kl_row_lse;
    r.row_is_bad = kl_row_bad & 1u;
    r.flagged = (kl_row_bad & 2u) != 0u;
}

// The row's loss and pass 2's constants: the
// soft term over the teacher's k entries and, outside the plain case, their
// mass, the student's mass on them, the divergence's bins and the terms.
__device__ __forceinline__ void kl_row_terms(const RowParams& p, const KlRow& r, const float4* __restrict__ logits,
                                             const u32* __restrict__ ids, const float* __restrict__ probs,
                                             const u32* __restrict__ row_in, float* __restrict__ loss, u32 lid) {
    u32 flags = r.flags;
    bool plain = r.plain;
    u32 tail = (flags >> F_TAIL_SHIFT) & 3u;
    float lse = r.lse;
    u32 k = p.k;
    u32 tbase = r.row * k;
    float part = 0.0f;
    float mass = 0.0f;
    float student = 0.0f;
    for (u32 q = lid; q < k; q += WG) {
        float pq = probs[tbase + q];
        u32 id = ids[tbase + q];
        float log_ps = kl_scaled(p, kl_logit(logits, r.base, id)) - lse;
        if (pq > 0.0f) {
            part += pq * (logf(pq) - log_ps);
        }
        if (!plain) {
            mass += pq;
            student += expf(log_ps);
            if (r.labelled && id == r.label) {
                kl_row_label_p = pq;
            }
        }
    }
    block_reduce(lid, block_slot<BlockSum>(kl_red_sum, part), block_slot<BlockSum>(kl_red_max, mass, !plain),
                 block_slot<BlockSum>(kl_red_aux, student, !plain));
    float mass_k = kl_red_max[0];
    float student_k = kl_red_aux[0];
    // Reverse KL and JSD: a second pass over the k, with the student's mass
    // on them known, sums each bin's f (red_sum) and q * f' (red_aux).
    float log_norm = 0.0f;
    if (kl_div_code(flags) != 0u) {
        if (tail == 0u) {
            log_norm = logf(fmaxf(student_k, 1e-37f));
        }
        __syncthreads();
        float f_sum = 0.0f;
        float e_sum = 0.0f;
        for (u32 q = lid; q < k; q += WG) {
            float log_q = kl_scaled(p, kl_logit(logits, r.base, ids[tbase + q])) - lse - log_norm;
            float qv = expf(log_q);
            float2 f = kl_div_term(p, qv, log_q, probs[tbase + q]);
            f_sum += f.x;
            e_sum += qv * f.y;
        }
        kl_sum2(f_sum, e_sum, lid);
    }
    if (lid != 0u) {
        return;
    }
    float4 out;
    if (plain) {
        out = make_float4(kl_red_sum[0], lse, kl_red_sum[0], 0.0f);
    } else {
        float tau = p.temperature;
        float lse1 = kl_row_c1.y;
        float soft = kl_red_sum[0];
        float f_off = 1.0f;
        float f_on = 1.0f;
        if (kl_div_code(flags) != 0u) {
            // f_off: f'(tail) - E with a tail bin, -E over the k alone, 0
            // renormalized.
            float e = kl_red_aux[0];
            f_off = 0.0f;
            if (tail == TAIL_BUCKET) {
                float r_t = fmaxf(1.0f - mass_k, 0.0f);
                float r_s = fmaxf(1.0f - student_k, TAIL_FLOOR);
                float2 f = kl_div_term(p, r_s, logf(r_s), r_t);
                soft += f.x;
                e += r_s * f.y;
                f_off = f.y - e;
            } else if (tail == TAIL_NONE) {
                f_off = -e;
            }
            kl_row_div = make_float2(e, log_norm);
        } else if (tail == TAIL_NONE) {
            f_off = mass_k;
            f_on = mass_k;
        } else if (tail == TAIL_BUCKET) {
            float r_t = fmaxf(1.0f - mass_k, 0.0f);
            float r_s = fmaxf(1.0f - student_k, TAIL_FLOOR);
            if (r_t > 0.0f) {
                soft += r_t * (logf(r_t) - logf(r_s));
                f_off = 1.0f - r_t / r_s;
            }
        }
        float alpha_hard = 0.0f;
        float eps = 0.0f;
        float hard = 0.0f;
        if (r.labelled) {
            alpha_hard = p.hard_weight;
            eps = p.smoothing;
            float su = kl_row_c1.w;
            float u_y = kl_scaled(p, kl_logit(logits, r.base, r.label));
            hard = lse1 - (1.0f - eps) * tau * u_y - eps * tau * su / (float)p.vocab;
        }
        float lambda = p.z_loss;
        float total_loss = p.soft_weight * soft + alpha_hard * hard + lambda * lse1 * lse1;
        out = make_float4(total_loss, lse1, soft, hard);
        float a = p.soft_weight * f_off;
        float b = tau * (alpha_hard + 2.0f * lambda * lse1);
        float h = tau * alpha_hard * eps / (float)p.vocab;
        kl_row_c0 = make_float4(a, b, h, f_on);
        // k1 = exp(tau * lse - lse1): p at tau = 1 is (p^tau)^tau * k1.
        kl_row_c1 = make_float4(tau * alpha_hard * (1.0f - eps), lse1, f_off, expf(tau * lse - lse1));
    }
    if (r.row_is_bad != 0u) {
        out = make_float4(kl_nan(), kl_nan(), kl_nan(), kl_nan());
    }
    if (r.flagged) {
        out.x = from_bits(row_in[r.row * 2u]);
    }
    kl_write_loss(loss, r.row, out);
}

// Pass 2 over the row's words up to ld: grad = c * dL/ds (c * p_S plain),
// zero in the padding, read from src (the row's logits); then the teacher's
// and the label's columns, whole, over what was written there.
__device__ __forceinline__ void kl_grad_words(const RowParams& p, const KlRow& r, const float4* __restrict__ src,
                                              const u32* __restrict__ ids, const float* __restrict__ probs,
                                              const u32* __restrict__ row_in, uint2* __restrict__ grad, u32 lid) {
    float c = from_bits(row_in[r.row * 2u]);
    float lse = r.lse;
    u32 vocab = p.vocab;
    u32 base4 = r.base / 4u;
    u32 k = p.k;
    u32 tbase = r.row * k;
    half_bits* grad_h = reinterpret_cast<half_bits*>(grad);
    const float* srcf = reinterpret_cast<const float*>(src);
    u32 w1 = p.ld / 4u;
    if (r.plain) {
        u32 g4 = lid;
        for (; g4 + 3u * WG < w1; g4 += 4u * WG) {
            float4 x[4] = {src[g4], src[g4 + WG], src[g4 + 2u * WG], src[g4 + 3u * WG]};
#pragma unroll
            for (u32 i = 0u; i < 4u; i++) {
                grad[base4 + g4 + i * WG] = kl_pack4(kl_grad4_f32(x[i], g4 + i * WG, vocab, c, lse));
            }
        }
        for (; g4 < w1; g4 += WG) {
            grad[base4 + g4] = kl_pack4(kl_grad4_f32(src[g4], g4, vocab, c, lse));
        }
        // ... then c * (p_S - p_T) on the teacher's columns, after the
        // stores above (storageBarrier).
        __syncthreads();
        for (u32 q = lid; q < k; q += WG) {
            u32 id = ids[tbase + q];
            float ps = expf(srcf[id] - lse);
            grad_h[r.base + id] = to_f16(c * (ps - probs[tbase + q]));
        }
        return;
    }
    // workgroupUniformLoad of row_c0, row_c1, row_label_p.
    __syncthreads();
    float4 c0 = kl_row_c0;
    float4 c1 = kl_row_c1;
    float label_p = kl_row_label_p;
    KlPass2 pr = {c, lse, c0.x, c0.y, c0.z, c1.y, c1.w};
    u32 g4 = lid;
    for (; g4 + 3u * WG < w1; g4 += 4u * WG) {
        float4 x[4] = {src[g4], src[g4 + WG], src[g4 + 2u * WG], src[g4 + 3u * WG]};
#pragma unroll
        for (u32 i = 0u; i < 4u; i++) {
            grad[base4 + g4 + i * WG] = kl_pack4(kl_grad4_terms_f32(p, x[i], g4 + i * WG, vocab, pr));
        }
    }
    for (; g4 < w1; g4 += WG) {
        grad[base4 + g4] = kl_pack4(kl_grad4_terms_f32(p, src[g4], g4, vocab, pr));
    }
    // ... then the teacher's columns (after the stores above) ...
    __syncthreads();
    for (u32 q = lid; q < k; q += WG) {
        u32 id = ids[tbase + q];
        grad_h[r.base + id] = to_f16(kl_teacher_grad(p, srcf[id], probs[tbase + q], c, lse, c0, c1));
    }
    // ... then the label's column, whole, over whatever was written there
    // (the barrier outside the label's branch: uniform control flow).
    __syncthreads();
    if (r.labelled && lid == 0u) {
        grad_h[r.base + r.label] = to_f16(kl_label_grad(p, srcf[r.label], label_p, c, lse, c0, c1));
    }
}

extern "C" __global__ void __launch_bounds__(WG)
    kl_rows(const RowParams params, const float4* __restrict__ logits, const u32* __restrict__ ids,
            const float* __restrict__ probs, const u32* __restrict__ row_in, float* __restrict__ loss,
            uint2* __restrict__ grad) {
    const RowParams& p = params;
    u32 lid = threadIdx.x;
    u32 row = workgroup_index(p.grid_x);
    if (row >= p.rows) {
        return;
    }
    if ((p.flags & F_DENSE) != 0u) {
        kl_dense_row(p, logits, probs, row_in, loss, grad, row, lid);
        return;
    }
    KlRow r = kl_row_begin(p, row_in, row);
    // Pass 1: online max and sum of exp(s - max), and a non-finite flag.
    KlRowFold f;
    if (!r.fold_terms && p.stats_offset != 0u) {
        f = kl_fold_stats(p, logits, row, lid);
    } else {
        f = kl_fold_words(p, r, logits, lid);
    }
    kl_reduce_fold(f, r.fold_terms, lid);
    kl_row_state(p, row_in, r, lid);
    kl_row_terms(p, r, logits, ids, probs, row_in, loss, lid);
    // A flagged row contributes nothing (flagged is uniform: all return).
    if (r.flagged) {
        kl_zero_row(p, grad, row, lid);
        return;
    }
    if ((r.flags & F_FILTER) != 0u) {
        kl_filtered_grad(p, logits, ids, probs, grad, row, lid, from_bits(row_in[row * 2u]), r.lse, r.plain,
                         r.labelled, r.label);
        return;
    }
    kl_grad_words(p, r, logits + r.base / 4u, ids, probs, row_in, grad, lid);
}
