// Shared by every kernel of shaders/cuda: integer and float helpers the WGSL
// kernels get from WGSL itself. kernels.cu includes this first. See
// shaders/README.md, "CUDA kernels".
#pragma once
#include "generated.cuh"

typedef unsigned int u32;
// f16 and bf16 values are stored as their 16 bits: the kernels convert with
// the PTX instructions themselves, so no CUDA header is needed.
typedef unsigned short half_bits;

// The block's index in a folded (x, y) grid (headkl_core::toolkit::fold_workgroups):
// the WGSL kernels' `wg.x + wg.y * params.grid_x`.
__device__ __forceinline__ u32 workgroup_index(u32 grid_x) {
    return blockIdx.x + blockIdx.y * grid_x;
}

// f32 -> f16, round to nearest even: out-of-range values become +-inf and
// NaN stays NaN (the conversion instruction's rule, which WGSL's to_f16 in
// resident_hidden.wgsl spells out on the bits).
__device__ __forceinline__ half_bits to_f16(float x) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float from_f16(half_bits h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}

__device__ __forceinline__ float from_bf16(half_bits h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u32 bits(float x) {
    return __float_as_uint(x);
}

__device__ __forceinline__ float from_bits(u32 b) {
    return __uint_as_float(b);
}

// Not a finite number (decided on the bits, whatever the compiler assumes).
__device__ __forceinline__ bool non_finite(float x) {
    return (bits(x) & 0x7fffffffu) >= 0x7f800000u;
}

// Negative and not -0 (decided on the bits).
__device__ __forceinline__ bool negative(float x) {
    u32 b = bits(x);
    return (b & 0x80000000u) != 0u && (b & 0x7fffffffu) != 0u;
}
