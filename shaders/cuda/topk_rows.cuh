// The exact top-k row kernel: the CUDA twin of shaders/topk_rows.wgsl; see
// there and shaders/README.md for what it computes (a threshold path for
// k <= WG, else a radix select over order-preserving keys, then a bitonic
// sort of the selected; F_GATHER: log-probabilities at the caller's ids).
// Helpers and workgroup variables carry a `topk_` prefix: kernels.cu is one
// translation unit.
#pragma once
#include "common.cuh"

// Sorts after every real key: real keys of finite logits are never 0.
static constexpr u32 TOPK_PAD_KEY = 0u;
static constexpr u32 TOPK_PAD_ID = 0xffffffffu;

// The WGSL's workgroup variables (its atomics are plain words here: every
// atomicStore/atomicLoad of theirs is ordered by a barrier).
__shared__ u32 topk_hist[TOPK_HIST];
__shared__ u32 topk_scan[WG];
__shared__ u32 topk_sel_key[MAX_K];
__shared__ u32 topk_sel_id[MAX_K];
__shared__ u32 topk_gt_count;
__shared__ u32 topk_eq_count;
__shared__ u32 topk_bad_flag;
__shared__ u32 topk_more_flag;
__shared__ u32 topk_u_bad;
__shared__ u32 topk_u_prefix;
__shared__ u32 topk_u_need;
__shared__ u32 topk_u_bucket;
__shared__ u32 topk_u_total;

// Logit `j` of the row starting at element `base`: component j % 4 of word
// (base + j) / 4, as the WGSL reads it.
__device__ __forceinline__ float topk_logit(const float4* __restrict__ logits, u32 base, u32 j) {
    const float* w = reinterpret_cast<const float*>(logits);
    return w[((base + j) / 4u) * 4u + j % 4u];
}

// Order-preserving u32 image of a finite f32 (-0 and +0 share a key).
__device__ __forceinline__ u32 topk_key_of(float x) {
    u32 b = bits(x);
    if (b == 0x80000000u) {
        b = 0u;
    }
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

__device__ __forceinline__ float topk_value_of(u32 key) {
    if ((key & 0x80000000u) != 0u) {
        return from_bits(key & 0x7fffffffu);
    }
    return from_bits(~key);
}

// Inclusive prefix sum of topk_scan[0..WG) (Hillis-Steele). Uniform control
// flow only.
__device__ __forceinline__ void topk_scan_inclusive(u32 lid) {
    for (u32 off = 1u; off < WG; off <<= 1u) {
        u32 v = topk_scan[lid];
        if (lid >= off) {
            v += topk_scan[lid - off];
        }
        __syncthreads();
        topk_scan[lid] = v;
        __syncthreads();
    }
}

// Whether (ka, ia) comes before (kb, ib): key descending, id ascending.
__device__ __forceinline__ bool topk_before(u32 ka, u32 ia, u32 kb, u32 ib) {
    return ka > kb || (ka == kb && ia < ib);
}

// Sorts topk_sel_key/topk_sel_id[0..n) (n a power of two, <= MAX_K) by key
// descending, id ascending. Uniform control flow only.
__device__ __forceinline__ void topk_bitonic_sort(u32 n, u32 lid) {
    for (u32 size = 2u; size <= n; size <<= 1u) {
        for (u32 stride = size >> 1u; stride > 0u; stride >>= 1u) {
            for (u32 t = lid; t < n / 2u; t += WG) {
                u32 i = (t / stride) * stride * 2u + t % stride;
                u32 jj = i + stride;
                u32 ki = topk_sel_key[i];
                u32 ii = topk_sel_id[i];
                u32 kj = topk_sel_key[jj];
                u32 ij = topk_sel_id[jj];
                // Ascending blocks (in "before" order) when bit `size` of i is 0.
                bool up = (i & size) == 0u;
                if (topk_before(kj, ij, ki, ii) == up) {
                    topk_sel_key[i] = kj;
                    topk_sel_id[i] = ij;
                    topk_sel_key[jj] = ki;
                    topk_sel_id[jj] = ii;
                }
            }
            __syncthreads();
        }
    }
}

// Sorts the `count` selected pairs, padded to a power of two with pairs
// that sort last. Uniform control flow only, after the pairs are written.
__device__ __forceinline__ void topk_sort_selected(u32 count, u32 lid) {
    u32 n = 1u;
    while (n < count) {
        n <<= 1u;
    }
    for (u32 i = count + lid; i < n; i += WG) {
        topk_sel_key[i] = TOPK_PAD_KEY;
        topk_sel_id[i] = TOPK_PAD_ID;
    }
    __syncthreads();
    topk_bitonic_sort(n, lid);
}

// WGSL's sign(): 1, -1 or 0.
__device__ __forceinline__ float topk_sign(float x) {
    return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
}

// A value as written: cap·tanh(x/cap) with the softcap on (from
// e = exp(-2|x/cap|), which cannot overflow), else x.
__device__ __forceinline__ float topk_capped(u32 flags, float cap, float x) {
    if ((flags & F_SOFTCAP) != 0u) {
        float e = expf(-2.0f * fabsf(x / cap));
        return topk_sign(x) * cap * ((1.0f - e) / (1.0f + e));
    }
    return x;
}

// Quantities of block_reduce (common.cuh) kept as f32 bits in the
// selection's u32 arrays: a sum (TopkSumBits), and a (max, sum of
// exp(x - max)) fold merged by merge_max_sum in two arrays (TopkFoldBits).
struct TopkSumBits {
    u32* slots;
    float value;
    __device__ __forceinline__ void store(u32 lid) const {
        slots[lid] = bits(value);
    }
    __device__ __forceinline__ void merge(u32 a, u32 b) const {
        slots[a] = bits(from_bits(slots[a]) + from_bits(slots[b]));
    }
};

struct TopkFoldBits {
    u32* maxs;
    u32* sums;
    float2 value;
    __device__ __forceinline__ void store(u32 lid) const {
        maxs[lid] = bits(value.x);
        sums[lid] = bits(value.y);
    }
    __device__ __forceinline__ void merge(u32 a, u32 b) const {
        float2 m = merge_max_sum(from_bits(maxs[a]), from_bits(sums[a]), from_bits(maxs[b]), from_bits(sums[b]));
        maxs[a] = bits(m.x);
        sums[a] = bits(m.y);
    }
};

// Writes the first k sorted pairs of `row`: ids, and the softmax over the k
// relative to the largest, or (F_LOGPROBS) the log-probabilities over the
// full vocabulary (one more read of the row). Uniform control flow only.
__device__ __forceinline__ void topk_write_row(const RowParams& params, const float4* __restrict__ logits,
                                               u32* __restrict__ ids, float* __restrict__ probs, u32 row, u32 k,
                                               u32 lid) {
    const u32 flags = params.flags;
    const float cap = params.cap;
    float top = topk_capped(flags, cap, topk_value_of(topk_sel_key[0]));
    bool full = (flags & F_LOGPROBS) != 0u;
    float part = 0.0f;
    if (full) {
        u32 base = row * params.ld;
        for (u32 j = lid; j < params.vocab; j += WG) {
            part += expf(topk_capped(flags, cap, topk_logit(logits, base, j)) - top);
        }
    } else {
        for (u32 q = lid; q < k; q += WG) {
            part += expf(topk_capped(flags, cap, topk_value_of(topk_sel_key[q])) - top);
        }
    }
    // topk_scan holds the f32 bits for the reduction.
    block_reduce(lid, TopkSumBits{topk_scan, part});
    float total = from_bits(topk_scan[0]);
    u32 out = row * k;
    float log_total = logf(total);
    for (u32 q = lid; q < k; q += WG) {
        ids[out + q] = topk_sel_id[q];
        float d = topk_capped(flags, cap, topk_value_of(topk_sel_key[q])) - top;
        if (full) {
            probs[out + q] = d - log_total;
        } else {
            probs[out + q] = expf(d) / total;
        }
    }
}

// F_GATHER's online (max, Σ exp(u − max)) fold and non-finite flag.
struct TopkGatherFold {
    float m;
    float s;
    u32 bad;
};

// Folds logit x when `live` (below vocab); a non-finite one only flags.
__device__ __forceinline__ void topk_gather_fold(TopkGatherFold& st, u32 flags, float cap, float x, bool live) {
    if (live) {
        if (non_finite(x)) {
            st.bad = 1u;
        } else {
            float u = topk_capped(flags, cap, x);
            if (u > st.m) {
                st.s = st.s * expf(st.m - u) + 1.0f;
                st.m = u;
            } else {
                st.s += expf(u - st.m);
            }
        }
    }
}

// F_GATHER: no selection (see gather_row in the WGSL). Uniform control
// flow only.
__device__ __forceinline__ void topk_gather_row(const RowParams& params, const float4* __restrict__ logits,
                                                u32* __restrict__ ids, float* __restrict__ probs, u32 row, u32 k,
                                                u32 lid) {
    const u32 flags = params.flags;
    const float cap = params.cap;
    u32 base = row * params.ld;
    u32 vocab = params.vocab;
    u32 base4 = base / 4u;
    u32 n4 = (vocab + 3u) / 4u;
    // Straight-line over each word's four logits.
    TopkGatherFold st = {-3.0e38f, 0.0f, 0u};
    for (u32 j4 = lid; j4 < n4; j4 += WG) {
        float4 x4 = logits[base4 + j4];
        u32 j = j4 * 4u;
        topk_gather_fold(st, flags, cap, x4.x, j < vocab);
        topk_gather_fold(st, flags, cap, x4.y, j + 1u < vocab);
        topk_gather_fold(st, flags, cap, x4.z, j + 2u < vocab);
        topk_gather_fold(st, flags, cap, x4.w, j + 3u < vocab);
    }
    // The selection's arrays hold the merge (no selection runs here).
    block_reduce(lid, TopkFoldBits{topk_sel_key, topk_sel_id, make_float2(st.m, st.s)},
                 block_slot<BlockOr>(topk_scan, st.bad));
    float lse = from_bits(topk_sel_key[0]) + logf(from_bits(topk_sel_id[0]));
    u32 row_bad = topk_scan[0];
    u32 out = row * k;
    for (u32 q = lid; q + 1u < k; q += WG) {
        u32 id = ids[out + q];
        float v = from_bits(0xff800000u);
        if (id < vocab) {
            v = topk_capped(flags, cap, topk_logit(logits, base, id)) - lse;
        }
        probs[out + q] = v;
    }
    if (lid == 0u) {
        probs[out + k - 1u] = lse;
        if (row_bad != 0u) {
            probs[out] = from_bits(0x7fc00000u);
        }
    }
}

// An invocation's 4 largest keys so far, descending (k0 largest), with
// their ids, and whether it saw a non-finite logit. Named fields, not an
// array, so they stay in registers.
struct TopkTop4 {
    u32 k0, k1, k2, k3;
    u32 i0, i1, i2, i3;
    bool bad;
};

// Keeps `(key, j)` if it is among the 4 largest. Ids rise as an invocation
// reads, so an equal key never displaces a kept one.
__device__ __forceinline__ void topk_keep(TopkTop4& r, u32 key, u32 j) {
    if (key > r.k3) {
        if (key > r.k2) {
            r.k3 = r.k2;
            r.i3 = r.i2;
            if (key > r.k1) {
                r.k2 = r.k1;
                r.i2 = r.i1;
                if (key > r.k0) {
                    r.k1 = r.k0;
                    r.i1 = r.i0;
                    r.k0 = key;
                    r.i0 = j;
                } else {
                    r.k1 = key;
                    r.i1 = j;
                }
            } else {
                r.k2 = key;
                r.i2 = j;
            }
        } else {
            r.k3 = key;
            r.i3 = j;
        }
    }
}

// One logit of keep4: id j, skipped at or past vocab.
__device__ __forceinline__ void topk_keep1(TopkTop4& r, float x, u32 j, u32 vocab) {
    if (j < vocab) {
        if (non_finite(x)) {
            r.bad = true;
        }
        topk_keep(r, topk_key_of(x), j);
    }
}

// The 4 logits of word `w` (`w < n4`; ids past `vocab` skipped), straight-line.
__device__ __forceinline__ void topk_keep4(TopkTop4& r, float4 x, u32 w, u32 n4, u32 vocab) {
    if (w < n4) {
        topk_keep1(r, x.x, w * 4u, vocab);
        topk_keep1(r, x.y, w * 4u + 1u, vocab);
        topk_keep1(r, x.z, w * 4u + 2u, vocab);
        topk_keep1(r, x.w, w * 4u + 3u, vocab);
    }
}

// One kept pair into the selection when it reaches the threshold.
__device__ __forceinline__ void topk_take_kept(u32 key, u32 id, u32 threshold) {
    if (key >= threshold) {
        u32 slot = atomicAdd(&topk_gt_count, 1u);
        topk_sel_key[slot] = key;
        topk_sel_id[slot] = id;
    }
}

// One logit of the threshold path's second read.
__device__ __forceinline__ void topk_take_at_least(float x, u32 j, u32 vocab, u32 threshold) {
    u32 key = topk_key_of(x);
    if (j < vocab && key >= threshold) {
        u32 slot = atomicAdd(&topk_gt_count, 1u);
        if (slot < MAX_K) {
            topk_sel_key[slot] = key;
            topk_sel_id[slot] = j;
        }
    }
}

// Marks `row` as holding a non-finite logit.
__device__ __forceinline__ void topk_write_bad(float* __restrict__ probs, u32 row, u32 k, u32 lid) {
    if (lid == 0u) {
        probs[row * k] = from_bits(0x7fc00000u);
    }
}

// The threshold path (k <= WG): see the WGSL for why T, the k-th largest
// of the invocations' largest keys, bounds the top k from below. Returns
// whether the row is done (written, or marked non-finite); false when more
// than MAX_K keys reach T, with the counters the radix select reads reset.
__device__ __forceinline__ bool topk_by_threshold(const RowParams& params, const float4* __restrict__ logits,
                                                  u32* __restrict__ ids, float* __restrict__ probs, u32 row, u32 lid) {
    u32 vocab = params.vocab;
    u32 k = params.k;
    u32 base = row * params.ld;
    TopkTop4 top = {TOPK_PAD_KEY, TOPK_PAD_KEY, TOPK_PAD_KEY, TOPK_PAD_KEY,
                    TOPK_PAD_ID,  TOPK_PAD_ID,  TOPK_PAD_ID,  TOPK_PAD_ID, false};
    u32 base4 = base / 4u;
    u32 n4 = (vocab + 3u) / 4u;
    // Four 16-byte loads in flight per invocation. Indices past the row
    // repeat its last word; topk_keep4 skips them.
    for (u32 j4 = lid; j4 < n4; j4 += 4u * WG) {
        float4 x0 = logits[base4 + j4];
        float4 x1 = logits[base4 + min(j4 + WG, n4 - 1u)];
        float4 x2 = logits[base4 + min(j4 + 2u * WG, n4 - 1u)];
        float4 x3 = logits[base4 + min(j4 + 3u * WG, n4 - 1u)];
        topk_keep4(top, x0, j4, n4, vocab);
        topk_keep4(top, x1, j4 + WG, n4, vocab);
        topk_keep4(top, x2, j4 + 2u * WG, n4, vocab);
        topk_keep4(top, x3, j4 + 3u * WG, n4, vocab);
    }
    if (top.bad) {
        topk_bad_flag = 1u;
    }
    topk_sel_key[lid] = top.k0;
    topk_sel_id[lid] = lid;
    __syncthreads();
    if (lid == 0u) {
        topk_u_bad = topk_bad_flag;
    }
    __syncthreads();
    if (topk_u_bad != 0u) {
        topk_write_bad(probs, row, k, lid);
        return true;
    }
    topk_bitonic_sort(WG, lid);
    if (lid == 0u) {
        topk_u_prefix = topk_sel_key[k - 1u];
    }
    __syncthreads();
    u32 threshold = topk_u_prefix;
    // An invocation whose 4th key reaches T may hold more keys >= T
    // than it kept.
    if (top.k3 >= threshold) {
        topk_more_flag = 1u;
    }
    __syncthreads();
    if (lid == 0u) {
        topk_u_total = topk_more_flag;
    }
    __syncthreads();
    if (topk_u_total == 0u) {
        topk_take_kept(top.k0, top.i0, threshold);
        topk_take_kept(top.k1, top.i1, threshold);
        topk_take_kept(top.k2, top.i2, threshold);
        topk_take_kept(top.k3, top.i3, threshold);
        __syncthreads();
        if (lid == 0u) {
            topk_u_total = topk_gt_count;
        }
        __syncthreads();
        // At most 4 · WG = 1024 <= MAX_K pairs.
        topk_sort_selected(topk_u_total, lid);
        topk_write_row(params, logits, ids, probs, row, k, lid);
        return true;
    }
    for (u32 j4 = lid; j4 * 4u < vocab; j4 += WG) {
        float4 x4 = logits[base4 + j4];
        u32 j = j4 * 4u;
        topk_take_at_least(x4.x, j, vocab, threshold);
        topk_take_at_least(x4.y, j + 1u, vocab, threshold);
        topk_take_at_least(x4.z, j + 2u, vocab, threshold);
        topk_take_at_least(x4.w, j + 3u, vocab, threshold);
    }
    __syncthreads();
    if (lid == 0u) {
        topk_u_total = topk_gt_count;
    }
    __syncthreads();
    u32 count = topk_u_total;
    if (count <= MAX_K) {
        topk_sort_selected(count, lid);
        topk_write_row(params, logits, ids, probs, row, k, lid);
        return true;
    }
    if (lid == 0u) {
        topk_u_prefix = 0u;
        topk_gt_count = 0u;
    }
    __syncthreads();
    return false;
}

// What the radix select leaves: the k-th largest key's resolved bits
// (`prefix` under `mask`) and how many keys with them are still to be taken
// (`need`, 1 <= need <= bucket, the keys with them); or a non-finite row.
struct TopkSelect {
    u32 mask;
    u32 prefix;
    u32 need;
    u32 bucket;
    bool bad;
};

// Radix select: the k-th largest key in 3 digits of 11, 11 and 10 bits.
// After a pass, `prefix` holds the key's bits resolved so far (under
// `mask`) and `need` how many keys with that prefix are still to be
// taken (1 <= need <= bucket, the keys with that prefix).
__device__ __forceinline__ TopkSelect topk_radix_select(const RowParams& params, const float4* __restrict__ logits,
                                                       u32 row, u32 lid) {
    u32 vocab = params.vocab;
    u32 k = params.k;
    u32 base = row * params.ld;
    TopkSelect sel = {0u, 0u, k, 0u, false};
    for (u32 digit_pass = 0u; digit_pass < 3u; digit_pass++) {
        u32 shift = 21u - 11u * digit_pass;
        u32 bins = TOPK_HIST;
        if (digit_pass == 2u) {
            shift = 0u;
            bins = TOPK_HIST / 2u;
        }
        u32 digit_mask = bins - 1u;
        for (u32 i = lid; i < TOPK_HIST; i += WG) {
            topk_hist[i] = 0u;
        }
        __syncthreads();
        bool bad = false;
        for (u32 j = lid; j < vocab; j += WG) {
            float x = topk_logit(logits, base, j);
            if (digit_pass == 0u && non_finite(x)) {
                bad = true;
            }
            u32 key = topk_key_of(x);
            if ((key & sel.mask) == sel.prefix) {
                atomicAdd(&topk_hist[(key >> shift) & digit_mask], 1u);
            }
        }
        if (bad) {
            topk_bad_flag = 1u;
        }
        __syncthreads();
        if (digit_pass == 0u) {
            if (lid == 0u) {
                topk_u_bad = topk_bad_flag;
            }
            __syncthreads();
            if (topk_u_bad != 0u) {
                sel.bad = true;
                return sel;
            }
        }
        // Invocation t owns digits [t·per, (t+1)·per). The scan over
        // invocations in reverse order counts the keys above its digits.
        u32 per = bins / WG;
        u32 own = 0u;
        for (u32 d = lid * per; d < (lid + 1u) * per; d++) {
            own += topk_hist[d];
        }
        topk_scan[WG - 1u - lid] = own;
        __syncthreads();
        topk_scan_inclusive(lid);
        u32 above = topk_scan[WG - 1u - lid] - own;
        for (u32 i = 0u; i < per; i++) {
            u32 d = (lid + 1u) * per - 1u - i;
            u32 h = topk_hist[d];
            if (above < sel.need && sel.need <= above + h) {
                topk_u_prefix = sel.prefix | (d << shift);
                topk_u_need = sel.need - above;
                topk_u_bucket = h;
            }
            above += h;
        }
        // The WGSL's three workgroupUniformLoads: one barrier, then the reads
        // (the next writes come after later barriers).
        __syncthreads();
        sel.prefix = topk_u_prefix;
        sel.need = topk_u_need;
        sel.bucket = topk_u_bucket;
        sel.mask |= digit_mask << shift;
        if (sel.need == sel.bucket) {
            // Every key in the bucket is taken: no tie to break below.
            break;
        }
    }
    return sel;
}

// Gather: keys above the bucket anywhere, and the bucket's keys when all
// of them are taken; else, below, the `need` lowest ids among the keys
// equal to the k-th largest.
__device__ __forceinline__ void topk_take_selected(const RowParams& params, const float4* __restrict__ logits, u32 row,
                                                   u32 lid, const TopkSelect& sel) {
    u32 vocab = params.vocab;
    u32 k = params.k;
    u32 base = row * params.ld;
    bool take_all = sel.need == sel.bucket;
    u32 n_gt = k - sel.need;
    for (u32 j = lid; j < vocab; j += WG) {
        u32 key = topk_key_of(topk_logit(logits, base, j));
        u32 hi = key & sel.mask;
        if (hi > sel.prefix) {
            u32 slot = atomicAdd(&topk_gt_count, 1u);
            topk_sel_key[slot] = key;
            topk_sel_id[slot] = j;
        } else if (take_all && hi == sel.prefix) {
            u32 slot = n_gt + atomicAdd(&topk_eq_count, 1u);
            topk_sel_key[slot] = key;
            topk_sel_id[slot] = j;
        }
    }
    if (!take_all) {
        // All 32 bits were resolved: the bucket is the keys equal to the
        // k-th largest. Take the `need` lowest ids among them, tile by tile
        // in id order.
        u32 taken = 0u;
        for (u32 tile = 0u; tile < vocab; tile += WG) {
            u32 j = tile + lid;
            u32 hit = 0u;
            u32 key = 0u;
            if (j < vocab) {
                key = topk_key_of(topk_logit(logits, base, j));
                if (key == sel.prefix) {
                    hit = 1u;
                }
            }
            __syncthreads();
            topk_scan[lid] = hit;
            __syncthreads();
            topk_scan_inclusive(lid);
            u32 before_me = taken + topk_scan[lid] - hit;
            if (hit == 1u && before_me < sel.need) {
                topk_sel_key[n_gt + before_me] = key;
                topk_sel_id[n_gt + before_me] = j;
            }
            if (lid == WG - 1u) {
                topk_u_total = topk_scan[lid];
            }
            __syncthreads();
            taken += topk_u_total;
            if (taken >= sel.need) {
                break;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(WG)
    topk_rows(const RowParams params, const float4* __restrict__ logits, u32* __restrict__ ids,
              float* __restrict__ probs) {
    const u32 lid = threadIdx.x;
    u32 row = workgroup_index(params.grid_x);
    if (row >= params.rows) {
        return;
    }
    u32 k = params.k;
    if ((params.flags & F_GATHER) != 0u) {
        topk_gather_row(params, logits, ids, probs, row, k, lid);
        return;
    }

    if (lid == 0u) {
        topk_u_prefix = 0u;
        topk_u_need = k;
        topk_bad_flag = 0u;
        topk_more_flag = 0u;
        topk_gt_count = 0u;
        topk_eq_count = 0u;
    }
    // The resets land before any thread can flag the row below.
    __syncthreads();
    if (k <= WG && topk_by_threshold(params, logits, ids, probs, row, lid)) {
        return;
    }
    TopkSelect sel = topk_radix_select(params, logits, row, lid);
    if (sel.bad) {
        topk_write_bad(probs, row, k, lid);
        return;
    }
    topk_take_selected(params, logits, row, lid, sel);
    topk_sort_selected(k, lid);
    topk_write_row(params, logits, ids, probs, row, k, lid);
}
