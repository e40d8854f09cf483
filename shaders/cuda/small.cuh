// The small kernels: a split-K GEMM's parts summed (sum_parts.wgsl), f16 rows
// into columns (transpose.wgsl). Each does what its WGSL twin does, invocation
// for invocation.
#pragma once
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    sum_parts(const SumPartsParams params, const float4* __restrict__ parts, float4* __restrict__ dst) {
    u32 i = workgroup_index(params.grid_x) * WG + threadIdx.x;
    if (i >= params.len / 4u) {
        return;
    }
    u32 stride = params.part_stride / 4u;
    float4 s = parts[i];
    for (u32 p = 1u; p < params.parts; p++) {
        float4 q = parts[p * stride + i];
        s.x += q.x;
        s.y += q.y;
        s.z += q.z;
        s.w += q.w;
    }
    if (params.accumulate != 0u) {
        float4 d = dst[i];
        s = make_float4(d.x + s.x, d.y + s.y, d.z + s.z, d.w + s.w);
    }
    dst[i] = s;
}

// One 32 x 32 tile per block through shared memory, one more column than
// the tile so a column read walks the banks.
static constexpr u32 TRANSPOSE_TILE = 32u;
static constexpr u32 TRANSPOSE_LD = 33u;

extern "C" __global__ void __launch_bounds__(WG)
    transpose(const TransposeParams params, const half_bits* __restrict__ src, half_bits* __restrict__ dst) {
    __shared__ float tile[TRANSPOSE_TILE * TRANSPOSE_LD];
    u32 tiles_c = (params.cols + TRANSPOSE_TILE - 1u) / TRANSPOSE_TILE;
    u32 tiles_r = (params.rows_padded + TRANSPOSE_TILE - 1u) / TRANSPOSE_TILE;
    u32 t = workgroup_index(params.grid_x);
    if (t >= tiles_c * tiles_r) {
        return;
    }
    u32 c0 = (t % tiles_c) * TRANSPOSE_TILE;
    u32 r0 = (t / tiles_c) * TRANSPOSE_TILE;
    u32 lane = threadIdx.x % TRANSPOSE_TILE;
    u32 step = WG / TRANSPOSE_TILE;
    for (u32 i = threadIdx.x / TRANSPOSE_TILE; i < TRANSPOSE_TILE; i += step) {
        u32 r = r0 + i;
        u32 c = c0 + lane;
        float v = 0.0f;
        if (r < params.rows && c < params.cols) {
            v = from_f16(src[r * params.ld_src + c]);
        }
        tile[i * TRANSPOSE_LD + lane] = v;
    }
    __syncthreads();
    for (u32 i = threadIdx.x / TRANSPOSE_TILE; i < TRANSPOSE_TILE; i += step) {
        u32 c = c0 + i;
        u32 r = r0 + lane;
        if (c < params.cols && r < params.rows_padded) {
            dst[c * params.rows_padded + r] = to_f16(tile[lane * TRANSPOSE_LD + i]);
        }
    }
}

// The row statistics a logits GEMM writes (headkl_core::toolkit::RowStats),
// for a GEMM whose library has no such epilogue (cuBLASLt): one thread per
// (row, 32-column group) of C, after the GEMM, giving (m, sum exp(x - m))
// over the group's real columns, m = -3e38 and sum 0 for a group with none,
// a NaN sum where one is not finite. Launched by the CUDA backend with the
// GEMM's own parameter block: rows m, groups ceil(n / 32).
extern "C" __global__ void __launch_bounds__(WG) gemm_row_stats(const GemmParams params, float* c) {
    u32 groups = (params.n + 31u) / 32u;
    u32 i = workgroup_index(params.grid_x) * WG + threadIdx.x;
    if (i >= params.m * groups) {
        return;
    }
    u32 row = i / groups;
    u32 g = i % groups;
    const float* x = c + params.c_offset + row * params.ldc;
    u32 end = min((g + 1u) * 32u, params.stats_cols);
    float m = -3.0e38f;
    bool bad = false;
    for (u32 j = g * 32u; j < end; j++) {
        if (non_finite(x[j])) {
            bad = true;
        } else {
            m = fmaxf(m, x[j]);
        }
    }
    float sum = 0.0f;
    for (u32 j = g * 32u; j < end; j++) {
        if (!non_finite(x[j])) {
            sum += expf(x[j] - m);
        }
    }
    u32 o = params.stats_offset + row * 2u * params.stats_ld + 2u * (params.stats_first + g);
    c[o] = m;
    c[o + 1u] = bad ? from_bits(0x7fc00000u) : sum;
}
