// The device-resident kernels: the CUDA twins of shaders/resident_*.wgsl
// (each after resident_common.wgsl, whose non_finite and negative are
// common.cuh's); see there and shaders/README.md, "Device-resident kernels",
// for what each computes. Invocation for invocation as the WGSL.
//
// The same buffer may be bound to two bindings of these kernels, so no
// pointer is __restrict__. The status buffer's words are WGSL atomics:
// atomicMin / atomicExch here, and plain (volatile) loads for atomicLoad.
#pragma once
#include "common.cuh"

// WGSL's atomicLoad on a status word.
__device__ __forceinline__ u32 resident_load(const u32* p) {
    return *(const volatile u32*)p;
}

// A status word an earlier kernel resolved and this one only reads, read
// through the per-SM read-only cache: a volatile load from every thread
// queues on the one L2 line that holds it (a 5 GB gradient scaled that way
// ran at a fifth of the memory's rate).
__device__ __forceinline__ u32 resolved_load(const u32* p) {
    return __ldg(p);
}

// WGSL's atomicStore on a status word.
__device__ __forceinline__ void resident_store(u32* p, u32 v) {
    atomicExch(p, v);
}

// ---- resident_stats.wgsl

extern "C" __global__ void __launch_bounds__(WG)
    weight_stats(const WeightStatsParams params, const float* weights, u32* status) {
    __shared__ float red_sum[WG];
    __shared__ float red_max[WG];
    __shared__ u32 red_bad[WG];
    u32 lid = threadIdx.x;
    bool has_w = params.has_weights != 0u;
    float s = 0.0f;
    float m = 0.0f;
    u32 bad = NONE;
    for (u32 t = lid; t < params.rows; t += WG) {
        float w = 1.0f;
        if (has_w) {
            w = weights[t];
        }
        if (non_finite(w) || negative(w)) {
            bad = min(bad, t);
            w = 0.0f;
        }
        s += w;
        m = fmaxf(m, w);
    }
    block_reduce(lid, block_slot<BlockSum>(red_sum, s), block_slot<BlockMax>(red_max, m),
                 block_slot<BlockMin>(red_bad, bad));
    if (lid != 0u) {
        return;
    }
    if (red_bad[0] != NONE) {
        atomicMin(&status[S_WEIGHT], red_bad[0]);
    }
    float total = red_sum[0];
    if (params.total > 0.0f) {
        total = params.total;
    }
    float max_w = red_max[0];
    float gscale = 1.0f;
    if (params.gscale > 0.0f) {
        gscale = params.gscale;
    } else if (max_w > 0.0f) {
        gscale = 16384.0f * (total / max_w) / fmaxf(params.grad_bound, 1.0f);
    }
    u32 coef_mul = FLAGGED_ROW;
    float dx_mul = 0.0f;
    if (total > 0.0f && !non_finite(total) && !non_finite(gscale) && gscale > 0.0f) {
        coef_mul = bits(gscale / total);
        dx_mul = params.inv_temperature / gscale;
    } else {
        resident_store(&status[S_TOTAL_BAD], 1u);
        resident_store(&status[S_TOTAL_BITS], bits(total));
    }
    resident_store(&status[S_COEF_MUL], coef_mul);
    resident_store(&status[S_DX_MUL], bits(dx_mul));
}

// ---- resident_teacher.wgsl

// Whether value v is bad for the teacher's form (.x != 0), and its
// probability (.y): teacher_value.
__device__ __forceinline__ float2 resident_teacher_value(float v, bool logprobs) {
    if (logprobs) {
        // NaN (by its bits) or above 0 (+inf included).
        if ((bits(v) & 0x7fffffffu) > 0x7f800000u || v > 0.0f) {
            return make_float2(1.0f, 0.0f);
        }
        return make_float2(0.0f, expf(v));
    }
    if (non_finite(v) || negative(v)) {
        return make_float2(1.0f, 0.0f);
    }
    return make_float2(0.0f, v);
}

// One block per row; k <= MAX_K (checked by the host, checks.rs teacher_k).
extern "C" __global__ void __launch_bounds__(WG) teacher_rows(const TeacherRowsParams params,
                                                              const u32* ids_in,
                                                              const float* probs_in,
                                                              const float* weights,
                                                              u32* status,
                                                              u32* ids_out,
                                                              float* probs_out,
                                                              u32* row_in) {
    __shared__ u32 row_ids[MAX_K];
    __shared__ float red_sum[WG];
    __shared__ u32 red_bad[WG];
    __shared__ u32 red_range[WG];
    u32 lid = threadIdx.x;
    u32 row = workgroup_index(params.grid_x);
    // Uniform over the block: no barrier is skipped by part of it.
    if (row >= params.rows) {
        return;
    }
    u32 k = params.k;
    bool logprobs = params.logprobs != 0u;
    bool renormalize = params.tail == TAIL_RENORMALIZE;
    u32 base_a = params.ids_offset + row * k;
    u32 base_b = params.probs_offset + row * k;
    float s = 0.0f;
    u32 bad = 0u;
    u32 first_range = NONE;
    for (u32 q = lid; q < k; q += WG) {
        u32 id = ids_in[base_a + q];
        row_ids[q] = id;
        if (id >= params.vocab) {
            first_range = min(first_range, q);
        }
        float2 bp = resident_teacher_value(probs_in[base_b + q], logprobs);
        if (bp.x != 0.0f) {
            bad = 1u;
        } else {
            s += bp.y;
        }
    }
    __syncthreads();
    for (u32 q = lid; q < k; q += WG) {
        u32 id = row_ids[q];
        for (u32 j = 0u; j < q; j++) {
            if (row_ids[j] == id) {
                bad = 1u;
            }
        }
    }
    block_reduce(lid, block_slot<BlockSum>(red_sum, s), block_slot<BlockMax>(red_bad, bad),
                 block_slot<BlockMin>(red_range, first_range));
    float sum = red_sum[0];
    bool mass_bad = !renormalize && sum > 1.0f + MASS_TOLERANCE;
    bool row_bad = red_bad[0] != 0u || !(sum > 0.0f) || non_finite(sum) || mass_bad;
    bool range_bad = red_range[0] != NONE;
    bool any_bad = row_bad || range_bad;
    float inv = 0.0f;
    if (!any_bad) {
        inv = 1.0f / sum;
        if (!renormalize) {
            inv = 1.0f;
        }
    }
    for (u32 q = lid; q < k; q += WG) {
        ids_out[row * k + q] = min(row_ids[q], params.vocab - 1u);
        float p = 0.0f;
        if (!any_bad) {
            p = resident_teacher_value(probs_in[base_b + q], logprobs).y * inv;
        }
        probs_out[row * k + q] = p;
    }
    if (lid != 0u) {
        return;
    }
    u32 token = params.token0 + row;
    if (range_bad) {
        atomicMin(&status[S_ID_RANGE], token * k + red_range[0]);
    }
    if (row_bad) {
        atomicMin(&status[S_ROW], token);
    }
    float w = 1.0f;
    bool w_bad = false;
    if (params.has_weights != 0u) {
        w = weights[params.weights_offset + row];
        // Flagged by the stats kernel (S_WEIGHT).
        w_bad = non_finite(w) || negative(w);
    }
    // Compared as bits: FLAGGED_ROW is a NaN.
    u32 coef_mul = resident_load(&status[S_COEF_MUL]);
    u32 c = FLAGGED_ROW;
    if (!any_bad && !w_bad && coef_mul != FLAGGED_ROW) {
        c = bits(w * from_bits(coef_mul));
    }
    row_in[row * 2u] = c;
}

// ---- resident_labels.wgsl

extern "C" __global__ void __launch_bounds__(WG)
    labels_in(const LabelsInParams params, const u32* labels, u32* status, u32* row_in) {
    u32 row = workgroup_index(params.grid_x) * WG + threadIdx.x;
    if (row >= params.rows) {
        return;
    }
    u32 label = NONE;
    if (params.has_labels != 0u) {
        label = labels[params.labels_offset + row];
        if (label != NONE && label >= params.vocab) {
            atomicMin(&status[S_LABEL], params.token0 + row);
            label = NONE;
            row_in[row * 2u] = FLAGGED_ROW;
        }
    }
    row_in[row * 2u + 1u] = label;
}

// ---- resident_hidden.wgsl

// The 16-bit half `e` of the word array (element index in halves): the
// WGSL's half_bits.
__device__ __forceinline__ half_bits resident_half(const u32* src, u32 e) {
    return (half_bits)((src[e >> 1u] >> ((e & 1u) * 16u)) & 0xffffu);
}

extern "C" __global__ void __launch_bounds__(WG)
    hidden_in(const HiddenInParams params, const u32* src, half_bits* dst) {
    u32 i = workgroup_index(params.grid_x) * WG + threadIdx.x;
    if (i >= params.rows_padded * params.ld) {
        return;
    }
    u32 r = i / params.ld;
    u32 c = i % params.ld;
    half_bits v = 0;
    if (r < params.rows && c < params.cols) {
        u32 e = params.src_offset + r * params.cols + c;
        if (params.dtype == DTYPE_F32) {
            v = to_f16(from_bits(src[e]));
        } else if (params.dtype == DTYPE_F16) {
            // The WGSL's f16(unpack2x16float(..).x): through f32 and back.
            v = to_f16(from_f16(resident_half(src, e)));
        } else {
            v = to_f16(from_bits(((u32)resident_half(src, e)) << 16u));
        }
    }
    dst[i] = v;
}

// ---- resident_loss_out.wgsl

// loss_chunk: kl_rows' [rows][4] (loss, lse, soft, hard); terms_dst:
// [ntok][3] (lse, soft, hard), written with params.write_terms.
extern "C" __global__ void __launch_bounds__(WG) loss_out(const LossOutParams params,
                                                          const float* loss_chunk,
                                                          const float* dx_chunk,
                                                          u32* status,
                                                          float* loss_dst,
                                                          float* dx_dst,
                                                          float* terms_dst) {
    u32 i = workgroup_index(params.grid_x) * WG + threadIdx.x;
    if (i < params.rows) {
        float l = loss_chunk[i * 4u];
        // The bits, never a float NaN test (which may be folded).
        bool flagged = bits(l) == FLAGGED_ROW;
        // l is a NaN for a flagged row.
        loss_dst[params.loss_offset + i] = l;
        if (params.write_terms != 0u) {
            for (u32 c = 0u; c < 3u; c++) {
                float v = loss_chunk[i * 4u + 1u + c];
                if (flagged) {
                    v = l;
                }
                terms_dst[(params.loss_offset + i) * 3u + c] = v;
            }
        }
        float logits_word = l;
        if (flagged) {
            logits_word = loss_chunk[i * 4u + 1u];
        }
        if (non_finite(logits_word)) {
            atomicMin(&status[S_LOGITS], params.token0 + i);
        }
    }
    if (i >= params.rows * params.hs) {
        return;
    }
    u32 r = i / params.hs;
    u32 c = i % params.hs;
    float v = from_bits(resolved_load(&status[S_DX_MUL])) * dx_chunk[r * params.ld + c];
    u32 o = params.dx_offset + i;
    if (params.accumulate != 0u) {
        dx_dst[o] = dx_dst[o] + v;
    } else {
        dx_dst[o] = v;
    }
}

// ---- resident_head_grad_out.wgsl

extern "C" __global__ void __launch_bounds__(WG)
    head_grad_out(const HeadGradOutParams params, const float* piece, u32* status, float* dst) {
    u32 i = workgroup_index(params.grid_x) * WG + threadIdx.x;
    if (i >= params.rows * params.hs) {
        return;
    }
    // Rows ld apart; a piece as wide as its rows is one run of words.
    u32 at = params.ld == params.hs ? i : (i / params.hs) * params.ld + i % params.hs;
    dst[params.dst_offset + i] = from_bits(resolved_load(&status[S_DX_MUL])) * piece[at];
}

// The scale of a head-gradient GEMM whose alpha cuBLASLt reads from the
// device (not a catalogue kernel): out[0] = factor · the status word
// `word` (the dx multiplier, known only once weight_stats has run), so the
// gradient needs no scale pass of its own. One thread.
struct AlphaWordParams {
    float factor;
    u32 word;
    u32 pad0;
    u32 pad1;
};

extern "C" __global__ void __launch_bounds__(1)
    gemm_alpha_word(const AlphaWordParams params, u32* status, float* out) {
    out[0] = params.factor * from_bits(resolved_load(&status[params.word]));
}

// ---- resident_topk_out.wgsl

extern "C" __global__ void __launch_bounds__(WG) topk_out(const TopkOutParams params,
                                                          const u32* ids_chunk,
                                                          const float* probs_chunk,
                                                          u32* status,
                                                          u32* ids_dst,
                                                          float* probs_dst) {
    u32 i = workgroup_index(params.grid_x) * WG + threadIdx.x;
    if (i >= params.rows * params.k) {
        return;
    }
    float p = probs_chunk[i];
    ids_dst[params.ids_offset + i] = ids_chunk[i];
    probs_dst[params.probs_offset + i] = p;
    if (i % params.k == 0u && non_finite(p)) {
        atomicMin(&status[S_LOGITS], params.token0 + i / params.k);
    }
}

// ---- resident_gather.wgsl: gather_in

// The thread's cell of the gather kernels' [rows][k + 1] grid: its flat
// index i, row and col; false past the grid's end.
struct ResidentCell {
    u32 i;
    u32 row;
    u32 col;
};

__device__ __forceinline__ bool resident_gather_cell(const GatherRowsParams& params, ResidentCell& cell) {
    cell.i = workgroup_index(params.grid_x) * WG + threadIdx.x;
    u32 cols = params.k + 1u;
    if (cell.i >= params.rows * cols) {
        return false;
    }
    cell.row = cell.i / cols;
    cell.col = cell.i % cols;
    return true;
}

extern "C" __global__ void __launch_bounds__(WG)
    gather_in(const GatherRowsParams params, const u32* ids, u32* status, u32* ids_chunk) {
    ResidentCell cell;
    if (!resident_gather_cell(params, cell)) {
        return;
    }
    u32 row = cell.row;
    u32 col = cell.col;
    u32 id = NONE;
    if (col < params.k) {
        id = ids[params.ids_offset + row * params.k + col];
        if (id != NONE && id >= params.vocab) {
            atomicMin(&status[S_ID_RANGE], (params.token0 + row) * params.k + col);
            id = NONE;
        }
    }
    ids_chunk[cell.i] = id;
}

// ---- resident_gather.wgsl: gather_out

extern "C" __global__ void __launch_bounds__(WG)
    gather_out(const GatherRowsParams params, const float* values_chunk, u32* status, float* logprobs, float* lse) {
    ResidentCell cell;
    if (!resident_gather_cell(params, cell)) {
        return;
    }
    u32 row = cell.row;
    u32 col = cell.col;
    float v = values_chunk[cell.i];
    if (col < params.k) {
        logprobs[params.out_offset + row * params.k + col] = v;
        // A NaN by its bits (a float test may be folded); -inf is a none id.
        if (col == 0u && (bits(v) & 0x7fffffffu) > 0x7f800000u) {
            atomicMin(&status[S_LOGITS], params.token0 + row);
        }
    } else {
        lse[params.token0 + row] = v;
        if (non_finite(v)) {
            atomicMin(&status[S_LOGITS], params.token0 + row);
        }
    }
}

// ---- resident_status.wgsl

__device__ __forceinline__ void resident_record(u32* status, u32 kind, u32 row, u32 a, u32 b, u32 value) {
    resident_store(&status[S_D_ROW], row);
    resident_store(&status[S_D_A], a);
    resident_store(&status[S_D_B], b);
    resident_store(&status[S_D_VALUE], value);
    resident_store(&status[S_KIND], kind);
}

// One thread (the WGSL's @workgroup_size(1)); the caller's buffers from
// their first element, rows = ntok.
extern "C" __global__ void __launch_bounds__(1) status_detail(const StatusDetailParams params,
                                                              const u32* ids_in,
                                                              const float* probs_in,
                                                              const float* weights,
                                                              u32* status,
                                                              const u32* labels) {
    if (resident_load(&status[S_KIND]) != 0u) {
        return;
    }
    u32 k = params.k;
    u32 flat = resident_load(&status[S_ID_RANGE]);
    if (flat != NONE) {
        // The WGSL's read is bounds-checked; here an index past the
        // [rows][k] ids (never written so by teacher_rows) reads 0.
        u32 id = flat / k < params.rows ? ids_in[flat] : 0u;
        resident_record(status, KIND_ID_RANGE, flat / k, flat % k, id, 0u);
        return;
    }
    u32 row = resident_load(&status[S_ROW]);
    if (row != NONE && row < params.rows) {
        u32 ib = row * k;
        u32 pb = row * k;
        // The smallest repeated id, at its first two entries.
        u32 best = NONE;
        u32 first = 0u;
        u32 second = 0u;
        for (u32 q = 1u; q < k; q++) {
            u32 id = ids_in[ib + q];
            if (id >= best) {
                continue;
            }
            for (u32 j = 0u; j < q; j++) {
                if (ids_in[ib + j] == id) {
                    best = id;
                    first = j;
                    second = q;
                    break;
                }
            }
        }
        if (best != NONE) {
            resident_record(status, KIND_DUPLICATE, row, first, second, best);
            return;
        }
        bool logprobs = params.logprobs != 0u;
        u32 tail = params.tail;
        float sum = 0.0f;
        for (u32 q = 0u; q < k; q++) {
            float p = probs_in[pb + q];
            if (logprobs) {
                if ((bits(p) & 0x7fffffffu) > 0x7f800000u || p > 0.0f) {
                    resident_record(status, KIND_LOGPROB, row, q, 0u, bits(p));
                    return;
                }
                sum += expf(p);
                continue;
            }
            if (non_finite(p)) {
                resident_record(status, KIND_PROB_NON_FINITE, row, q, 0u, bits(p));
                return;
            }
            if (negative(p)) {
                resident_record(status, KIND_PROB_NEGATIVE, row, q, 0u, bits(p));
                return;
            }
            sum += p;
        }
        if (tail != TAIL_RENORMALIZE && sum > 1.0f + MASS_TOLERANCE && !non_finite(sum)) {
            resident_record(status, KIND_MASS, row, 0u, tail, bits(sum));
            return;
        }
        resident_record(status, KIND_ROW_SUM, row, 0u, 0u, bits(sum));
        return;
    }
    u32 wrow = resident_load(&status[S_WEIGHT]);
    if (wrow != NONE && wrow < params.rows && params.has_weights != 0u) {
        float w = weights[wrow];
        if (non_finite(w)) {
            resident_record(status, KIND_WEIGHT_NON_FINITE, wrow, 0u, 0u, bits(w));
        } else {
            resident_record(status, KIND_WEIGHT_NEGATIVE, wrow, 0u, 0u, bits(w));
        }
        return;
    }
    u32 lrow = resident_load(&status[S_LABEL]);
    if (lrow != NONE && lrow < params.rows && params.has_labels != 0u) {
        resident_record(status, KIND_LABEL, lrow, 0u, 0u, labels[lrow]);
    }
}

// ---- resident_shard.wgsl

// Row `row`'s global ids to the shard's local ids in place, probabilities
// scaled by inv_alpha; an entry outside the shard copies the row's first
// in-shard entry when `duplicate`, else gets probability 0 (the WGSL's
// map_row).
__device__ __forceinline__ void resident_map_row(
    const ShardRowsParams& params, u32* ids, float* probs, u32 row, float inv_alpha, bool duplicate) {
    u32 k = params.k;
    u32 base = row * k;
    u32 first_id = 0u;
    float first_p = 0.0f;
    for (u32 q = 0u; q < k; q++) {
        u32 id = ids[base + q];
        if (id >= params.v0 && id < params.v1) {
            first_id = id - params.v0;
            first_p = probs[base + q] * inv_alpha;
            break;
        }
    }
    if (!duplicate) {
        first_p = 0.0f;
    }
    for (u32 q = 0u; q < k; q++) {
        u32 id = ids[base + q];
        if (id >= params.v0 && id < params.v1) {
            ids[base + q] = id - params.v0;
            probs[base + q] = probs[base + q] * inv_alpha;
        } else {
            ids[base + q] = first_id;
            probs[base + q] = first_p;
        }
    }
}

// loss_chunk: kl_rows' [rows][4] (loss, lse, soft, hard); stats and
// partials: [ntok][3]; row_in: [rows][2] (coefficient bits, label).
extern "C" __global__ void __launch_bounds__(WG) shard_rows(const ShardRowsParams params,
                                                            float* loss_chunk,
                                                            const float* stats,
                                                            float* partials,
                                                            u32* ids,
                                                            float* probs,
                                                            u32* row_in,
                                                            u32* status) {
    u32 row = workgroup_index(params.grid_x) * WG + threadIdx.x;
    if (row >= params.rows) {
        return;
    }
    u32 t = (params.token0 + row) * 3u;
    u32 stage = params.stage;
    if (stage == STAGE_MAP) {
        resident_map_row(params, ids, probs, row, 1.0f, false);
    } else if (stage == STAGE_PARTIALS) {
        float lse = loss_chunk[row * 4u + 1u];
        float mass = 0.0f;
        for (u32 q = 0u; q < params.k; q++) {
            mass += probs[row * params.k + q];
        }
        partials[t] = lse;
        if (params.lse1_too != 0u) {
            partials[t + 1u] = lse;
        }
        partials[t + 2u] = loss_chunk[row * 4u + 2u] - mass * lse;
        if (non_finite(lse)) {
            atomicMin(&status[S_LOGITS], params.token0 + row);
        }
    } else if (stage == STAGE_LSE1) {
        partials[t + 1u] = loss_chunk[row * 4u + 1u];
    } else if (stage == STAGE_MAP_FINISH) {
        float alpha = fmaxf(expf(partials[t] - stats[t]), ALPHA_FLOOR);
        resident_map_row(params, ids, probs, row, 1.0f / alpha, true);
        // A flagged row's word stays FLAGGED_ROW (compared as bits: a NaN
        // times alpha need not keep them).
        u32 word = row_in[row * 2u];
        if (word != FLAGGED_ROW) {
            row_in[row * 2u] = bits(from_bits(word) * alpha);
        }
    } else if (stage == STAGE_LOSS) {
        // A row with bad logits, or a flagged one, stays as kl_rows wrote it.
        if (!non_finite(loss_chunk[row * 4u])) {
            float l = stats[t + 2u] + stats[t];
            loss_chunk[row * 4u] = l;
            loss_chunk[row * 4u + 1u] = stats[t + 1u];
            loss_chunk[row * 4u + 2u] = l;
            loss_chunk[row * 4u + 3u] = 0.0f;
        }
    }
}
