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

// Merges two (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ float2 merge_max_sum(float m1, float s1, float m2, float s2) {
    float m = fmaxf(m1, m2);
    return make_float2(m, s1 * expf(m1 - m) + s2 * expf(m2 - m));
}

// ---- Block reductions (a block of WG threads, WG a power of two).
//
// block_reduce(lid, slot...) reduces one or more quantities over the block:
// each thread stores its value of every quantity in its slot of a shared
// array, then a tree halves the live slots (slot i takes in slot i + stride
// for stride = WG / 2 down to 1, a barrier after each step), leaving the
// block's result in slot 0 of each array. A quantity is anything with
// store(lid) and merge(a, b) (slot a takes in slot b), merged in the order
// given; BlockSlot is the one-array kind, with its combine (BlockSum, ...:
// into(a, b) folds b into a). Every thread calls it (it holds barriers). A
// quantity that is off (its `on`, uniform over the block) neither stores
// nor merges.
template <typename T, typename Op>
struct BlockSlot {
    T* slots;
    T value;
    bool on;
    __device__ __forceinline__ void store(u32 lid) const {
        if (on) {
            slots[lid] = value;
        }
    }
    __device__ __forceinline__ void merge(u32 a, u32 b) const {
        if (on) {
            Op::into(slots[a], slots[b]);
        }
    }
};

struct BlockSum {
    template <typename T>
    static __device__ __forceinline__ void into(T& a, const T& b) {
        a += b;
    }
};

struct BlockMax {
    static __device__ __forceinline__ void into(float& a, const float& b) {
        a = fmaxf(a, b);
    }
    static __device__ __forceinline__ void into(u32& a, const u32& b) {
        a = max(a, b);
    }
};

struct BlockMin {
    static __device__ __forceinline__ void into(u32& a, const u32& b) {
        a = min(a, b);
    }
};

struct BlockOr {
    static __device__ __forceinline__ void into(u32& a, const u32& b) {
        a |= b;
    }
};

template <typename Op, typename T>
__device__ __forceinline__ BlockSlot<T, Op> block_slot(T* slots, T value, bool on = true) {
    return BlockSlot<T, Op>{slots, value, on};
}

template <typename... Slots>
__device__ __forceinline__ void block_reduce(u32 lid, const Slots&... slots) {
    (slots.store(lid), ...);
    __syncthreads();
    for (u32 stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            (slots.merge(lid, lid + stride), ...);
        }
        __syncthreads();
    }
}
