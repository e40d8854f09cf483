// Research tiles, not shipped (docs/PERFORMANCE.md, row 53): wgmma fed by
// cp.async.bulk (1-D bulk copies completed through mbarriers) from operands
// pre-tiled in global memory, so that one stage of A and one of B are each
// one contiguous block already in the swizzled order wgmma reads; and the
// variants that tell which part of that matters. Every family waits on a
// stage's "full" barrier, keeps one group of multiply-adds in flight and
// has no __syncthreads in its loop:
//   lab (m…)  a producer warp copies; NC warpgroups free stages on "empty"
//   solo      one warpgroup, its thread 0 copies (three blocks an SM):
//             shipped as gemm_wgmma.cu's bulk tiles, timed there
//   persist   solo, several tiles a block, the next tile's copies before
//             the epilogue
//   duo       two warpgroups, thread 0 copies after both freed the stage
//   gather    solo's dx reading the head in the logits' layout (16 copies
//             of 512 bytes a stage)
//   blocked   every operand as 8 x 8 core matrices, no swizzle
//   async     solo's pipeline on row-major operands, per-thread cp.async
//
// run.py compiles this after shaders/gemm_wgmma.cu (whose helpers it uses:
// Mma, descriptor, kmajor_offset, nmajor_offset, epilogue) and times it
// against cuBLAS. The question: is the shipped tiles' plateau (about 380
// TFLOP/s) the per-thread copies and per-step barriers, or the 48 KiB a
// block?

__device__ __forceinline__ void bar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

template <int NC, int BN, int BK, int STAGES>
struct Lab {
    static constexpr int BM = 64 * NC;
    static constexpr int THREADS = 128 * NC + 32;
    static constexpr int ROW_BYTES = BK * 2;
    static constexpr int SWIZZLE = ROW_BYTES == 128 ? 1 : ROW_BYTES == 64 ? 2 : 3;
    static constexpr int A_BYTES = BM * ROW_BYTES;
    static constexpr int B_BYTES = BN * ROW_BYTES;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int NN_SBO = (BN / 64) * 1024;
    static constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;  // + the barriers
    static_assert(SHARED_BYTES <= 42 * 1024, "stay well under the 48 KiB a block NVX launches allow");
    static_assert(STAGE_BYTES % 1024 == 0, "stages start on the swizzle's period");
};

// Operands pre-tiled by gemm_wgmma.cu's pack_tiles (the bulk tiles' layout).

template <int NC, int BN, int BK, int STAGES, bool NN>
__device__ __forceinline__ void lab_gemm(const GemmParams& p, const char* a, const char* b, float* c, char* shared) {
    typedef Lab<NC, BN, BK, STAGES> T;
    const u32 tid = threadIdx.x;
    const u32 tiles_m = (p.m + T::BM - 1) / T::BM;
    const u32 tiles_n = (p.n + BN - 1) / BN;
    const u32 tiles = tiles_m * tiles_n;
    const u32 l = blockIdx.x + blockIdx.y * p.grid_x;
    if (l >= tiles) {
        return;
    }
    const u32 tm = l % tiles_m, tn = l / tiles_m;
    const u32 steps = (p.k + BK - 1) / BK;
    const u32 base = smem_addr(shared);
    const u32 bars = base + STAGES * T::STAGE_BYTES;  // full[s] at 8s, empty[s] at 8 (STAGES + s)
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            bar_init(bars + 8 * s, 1);
            bar_init(bars + 8 * (STAGES + s), NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (tid >= 128 * NC) {
        // The producer: one lane issues every copy.
        if (tid == 128 * NC) {
            const char* a_src = a + (u64)tm * steps * T::A_BYTES;
            const char* b_src = b + (u64)tn * steps * T::B_BYTES;
            for (u32 s = 0; s < steps; s++) {
                const u32 st = s % STAGES;
                if (s >= STAGES) {
                    bar_wait(bars + 8 * (STAGES + st), ((s / STAGES) - 1) & 1);
                }
                const u32 full = bars + 8 * st;
                bar_expect(full, T::STAGE_BYTES);
                const u32 sa = base + st * T::STAGE_BYTES;
                bulk_copy(sa, a_src + (u64)s * T::A_BYTES, T::A_BYTES, full);
                bulk_copy(sa + T::A_BYTES, b_src + (u64)s * T::B_BYTES, T::B_BYTES, full);
            }
        }
        return;
    }

    const u32 warpgroup = tid / 128;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) {
        d[i] = 0.0f;
    }
    for (u32 s = 0; s < steps; s++) {
        const u32 st = s % STAGES;
        bar_wait(bars + 8 * st, (s / STAGES) & 1);
        const u32 sa = base + st * T::STAGE_BYTES;
        const u32 sb = sa + T::A_BYTES;
        fence_registers(d);
        wgmma_fence();
#pragma unroll
        for (u32 q = 0; q < BK / 16; q++) {
            const u64 da = descriptor(sa + warpgroup * 64 * T::ROW_BYTES + q * 32, 16, 8 * T::ROW_BYTES, T::SWIZZLE);
            if (NN) {
                Mma<BN, 1>::run(d, da, descriptor(sb + q * 2 * T::NN_SBO, 1024, T::NN_SBO, 1));
            } else {
                Mma<BN, 0>::run(d, da, descriptor(sb + q * 32, 16, 8 * T::ROW_BYTES, T::SWIZZLE));
            }
        }
        wgmma_commit();
        // Step s - 1's multiply-adds are done: its stage is free.
        wgmma_wait<1>();
        fence_registers(d);
        if (s > 0 && tid % 128 == 0) {
            bar_arrive(bars + 8 * (STAGES + (s - 1) % STAGES));
        }
    }
    wgmma_wait<0>();
    fence_registers(d);
    epilogue<BN, NN>(p, c, d, tid, tm * T::BM, tn * BN, p.c_offset);
}

// solo, the winner, is gemm_wgmma.cu's bulk tile now (bulk_gemm,
// wgmma_bulk_*); gather (dx reading the logits' head layout) lost at 248
// TFLOP/s and is gone (docs/PERFORMANCE.md, row 53).

// NC warpgroups and no producer warp: thread 0 refills a stage once every
// warpgroup has arrived on its "empty" barrier (one block an SM at 128 x 256).
template <int NC, int BN, int BK, int STAGES, bool NN>
__device__ __forceinline__ void duo_gemm(const GemmParams& p, const char* a, const char* b, float* c, char* shared) {
    typedef Lab<NC, BN, BK, STAGES> T;
    const u32 tid = threadIdx.x;
    const u32 tiles_m = (p.m + T::BM - 1) / T::BM;
    const u32 tiles_n = (p.n + BN - 1) / BN;
    const u32 l = blockIdx.x + blockIdx.y * p.grid_x;
    if (l >= tiles_m * tiles_n) {
        return;
    }
    const u32 tm = l % tiles_m, tn = l / tiles_m;
    const u32 steps = (p.k + BK - 1) / BK;
    const u32 base = smem_addr(shared);
    const u32 bars = base + STAGES * T::STAGE_BYTES;
    const char* a_src = a + (u64)tm * steps * T::A_BYTES;
    const char* b_src = b + (u64)tn * steps * T::B_BYTES;
    auto load = [&](u32 s) {
        const u32 st = s % STAGES;
        const u32 full = bars + 8 * st;
        const u32 sa = base + st * T::STAGE_BYTES;
        bar_expect(full, T::STAGE_BYTES);
        bulk_copy(sa, a_src + (u64)s * T::A_BYTES, T::A_BYTES, full);
        bulk_copy(sa + T::A_BYTES, b_src + (u64)s * T::B_BYTES, T::B_BYTES, full);
    };
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            bar_init(bars + 8 * s, 1);
            bar_init(bars + 8 * (STAGES + s), NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (u32 s = 0; s < STAGES && s < steps; s++) {
            load(s);
        }
    }
    __syncthreads();
    const u32 warpgroup = tid / 128;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) {
        d[i] = 0.0f;
    }
    for (u32 s = 0; s < steps; s++) {
        const u32 st = s % STAGES;
        bar_wait(bars + 8 * st, (s / STAGES) & 1);
        const u32 sa = base + st * T::STAGE_BYTES;
        const u32 sb = sa + T::A_BYTES;
        fence_registers(d);
        wgmma_fence();
#pragma unroll
        for (u32 q = 0; q < BK / 16; q++) {
            const u64 da = descriptor(sa + warpgroup * 64 * T::ROW_BYTES + q * 32, 16, 8 * T::ROW_BYTES, T::SWIZZLE);
            if (NN) {
                Mma<BN, 1>::run(d, da, descriptor(sb + q * 2 * T::NN_SBO, 1024, T::NN_SBO, 1));
            } else {
                Mma<BN, 0>::run(d, da, descriptor(sb + q * 32, 16, 8 * T::ROW_BYTES, T::SWIZZLE));
            }
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_registers(d);
        if (s > 0) {
            const u32 prev = (s - 1) % STAGES;
            if (tid % 128 == 0) {
                bar_arrive(bars + 8 * (STAGES + prev));
            }
            if (tid == 0 && s - 1 + STAGES < steps) {
                bar_wait(bars + 8 * (STAGES + prev), ((s - 1) / STAGES) & 1);
                load(s - 1 + STAGES);
            }
        }
    }
    wgmma_wait<0>();
    fence_registers(d);
    epilogue<BN, NN>(p, c, d, tid, tm * T::BM, tn * BN, p.c_offset);
}

#define DUO_ENTRY(NAME, NN, NC, BN, BK, STAGES, MIN_BLOCKS)                                                \
    extern "C" __global__ void __launch_bounds__(128 * NC, MIN_BLOCKS)                                     \
        NAME(const GemmParams p, const char* a, const char* b, float* c) {                                 \
        __shared__ __align__(1024) char shared[Lab<NC, BN, BK, STAGES>::SHARED_BYTES];                     \
        duo_gemm<NC, BN, BK, STAGES, NN>(p, a, b, c, shared);                                              \
    }
#define DUO_TILE(NAME, NC, BN, BK, STAGES, MIN_BLOCKS)                   \
    DUO_ENTRY(lab_logits_##NAME, false, NC, BN, BK, STAGES, MIN_BLOCKS) \
    DUO_ENTRY(lab_dx_##NAME, true, NC, BN, BK, STAGES, MIN_BLOCKS)

DUO_TILE(duo_m128n256k16s3, 2, 256, 16, 3, 1)
DUO_TILE(duo_m128n128k16s5, 2, 128, 16, 5, 2)
DUO_TILE(duo_m128n128k32s2, 2, 128, 32, 2, 2)

// The solo pipeline on the head as it is stored today (row-major, no
// pre-tiling): every thread copies its 16-byte chunks with cp.async, as the
// shipped tiles do, and `cp.async.mbarrier.arrive.noinc` signals the stage's
// "full" barrier (128 arrivals) when its copies land: no __syncthreads, one
// group of multiply-adds in flight, three 64 x 256 blocks an SM.
__device__ __forceinline__ void copy_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

template <int BN, int BK, int STAGES, bool NN>
__device__ __forceinline__ void async_gemm(const GemmParams& p, const char* a, const char* b, float* c, char* shared) {
    typedef Lab<1, BN, BK, STAGES> T;
    const u32 tid = threadIdx.x;
    const u32 tiles_m = (p.m + 63) / 64;
    const u32 tiles_n = (p.n + BN - 1) / BN;
    const u32 l = blockIdx.x + blockIdx.y * p.grid_x;
    if (l >= tiles_m * tiles_n) {
        return;
    }
    const u32 row0 = (l % tiles_m) * 64, col0 = (l / tiles_m) * BN;
    const u32 kp = p.k;
    const u32 steps = (kp + BK - 1) / BK;
    const u32 base = smem_addr(shared);
    const u32 bars = base + STAGES * T::STAGE_BYTES;
    constexpr u32 KCHUNKS = BK / 8;
    constexpr u32 A_COPIES = 64 * KCHUNKS / 128;
    constexpr u32 B_COPIES = BN * KCHUNKS / 128;
    const char* a_src[A_COPIES];
    u32 a_dst[A_COPIES], a_k[A_COPIES];
#pragma unroll
    for (u32 i = 0; i < A_COPIES; i++) {
        const u32 e = tid + i * 128;
        const u32 r = e / KCHUNKS, q = e % KCHUNKS;
        a_src[i] = a + 2 * ((u64)min(row0 + r, p.m - 1) * p.lda + q * 8);
        a_dst[i] = kmajor_offset<T::ROW_BYTES>(r, q);
        a_k[i] = q * 8;
    }
    const char* b_src[B_COPIES];
    u32 b_dst[B_COPIES], b_k[B_COPIES];
#pragma unroll
    for (u32 i = 0; i < B_COPIES; i++) {
        const u32 e = tid + i * 128;
        if (NN) {
            const u32 kr = e / (BN / 8), q = e % (BN / 8);
            b_src[i] = b + 2 * ((u64)kr * p.ldb + min(col0 + q * 8, p.n - 8));
            b_dst[i] = nmajor_offset(kr, q, T::NN_SBO);
            b_k[i] = kr;
        } else {
            const u32 r = e / KCHUNKS, q = e % KCHUNKS;
            b_src[i] = b + 2 * ((u64)min(col0 + r, p.n - 1) * p.ldb + q * 8);
            b_dst[i] = kmajor_offset<T::ROW_BYTES>(r, q);
            b_k[i] = q * 8;
        }
    }
    auto load = [&](u32 s) {
        const u32 st = s % STAGES;
        const u32 kk = s * BK;
        const u32 sa = base + st * T::STAGE_BYTES;
        const u32 sb = sa + T::A_BYTES;
#pragma unroll
        for (u32 i = 0; i < A_COPIES; i++) {
            const bool in = kk + a_k[i] < kp;
            copy16(sa + a_dst[i], in ? a_src[i] + 2 * kk : a, in ? 16 : 0);
        }
        const u64 b_step = NN ? 2 * (u64)kk * p.ldb : 2 * (u64)kk;
#pragma unroll
        for (u32 i = 0; i < B_COPIES; i++) {
            const bool in = kk + b_k[i] < kp;
            copy16(sb + b_dst[i], in ? b_src[i] + b_step : b, in ? 16 : 0);
        }
        copy_arrive(bars + 8 * st);
    };
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            bar_init(bars + 8 * s, 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    for (u32 s = 0; s < STAGES && s < steps; s++) {
        load(s);
    }
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) {
        d[i] = 0.0f;
    }
    for (u32 s = 0; s < steps; s++) {
        const u32 st = s % STAGES;
        bar_wait(bars + 8 * st, (s / STAGES) & 1);
        // The copies landed through the generic proxy; wgmma reads through
        // the async one.
        fence_proxy_async();
        const u32 sa = base + st * T::STAGE_BYTES;
        const u32 sb = sa + T::A_BYTES;
        fence_registers(d);
        wgmma_fence();
#pragma unroll
        for (u32 q = 0; q < BK / 16; q++) {
            const u64 da = descriptor(sa + q * 32, 16, 8 * T::ROW_BYTES, T::SWIZZLE);
            if (NN) {
                Mma<BN, 1>::run(d, da, descriptor(sb + q * 2 * T::NN_SBO, 1024, T::NN_SBO, 1));
            } else {
                Mma<BN, 0>::run(d, da, descriptor(sb + q * 32, 16, 8 * T::ROW_BYTES, T::SWIZZLE));
            }
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_registers(d);
        if (s > 0 && s - 1 + STAGES < steps) {
            load(s - 1 + STAGES);
        }
    }
    wgmma_wait<0>();
    fence_registers(d);
    epilogue<BN, NN>(p, c, d, tid, row0, col0, p.c_offset);
}

#define ASYNC_ENTRY(NAME, NN, BN, BK, STAGES, MIN_BLOCKS)                                                  \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS)                                          \
        NAME(const GemmParams p, const char* a, const char* b, float* c) {                                 \
        __shared__ __align__(1024) char shared[Lab<1, BN, BK, STAGES>::SHARED_BYTES];                      \
        async_gemm<BN, BK, STAGES, NN>(p, a, b, c, shared);                                                \
    }
#define ASYNC_TILE(NAME, BN, BK, STAGES, MIN_BLOCKS)                   \
    ASYNC_ENTRY(lab_logits_##NAME, false, BN, BK, STAGES, MIN_BLOCKS) \
    ASYNC_ENTRY(lab_dx_##NAME, true, BN, BK, STAGES, MIN_BLOCKS)

ASYNC_TILE(async_m64n256k16s4, 256, 16, 4, 3)
ASYNC_TILE(async_m64n256k32s2, 256, 32, 2, 3)
ASYNC_TILE(async_m64n128k32s3, 128, 32, 3, 4)

// The solo tile made persistent: each block walks tiles gridDim apart and
// issues the next tile's first stages before its epilogue, so the copies'
// latency hides behind the stores (what short K, shape S, needs).
template <int BN, int BK, int STAGES, bool NN>
__device__ __forceinline__ void persist_gemm(const GemmParams& p, const char* a, const char* b, float* c,
                                             char* shared) {
    typedef Lab<1, BN, BK, STAGES> T;
    const u32 tid = threadIdx.x;
    const u32 tiles_m = (p.m + 63) / 64;
    const u32 tiles_n = (p.n + BN - 1) / BN;
    const u32 tiles = tiles_m * tiles_n;
    const u32 steps = (p.k + BK - 1) / BK;
    const u32 base = smem_addr(shared);
    const u32 bars = base + STAGES * T::STAGE_BYTES;
    // g: the block's step count over all its tiles (stage g % STAGES, its
    // barrier's phase g / STAGES).
    auto load = [&](u32 tile, u32 s, u32 g) {
        const u32 st = g % STAGES;
        const u32 full = bars + 8 * st;
        const u32 sa = base + st * T::STAGE_BYTES;
        const u32 tm = tile % tiles_m, tn = tile / tiles_m;
        bar_expect(full, T::STAGE_BYTES);
        bulk_copy(sa, a + ((u64)tm * steps + s) * T::A_BYTES, T::A_BYTES, full);
        bulk_copy(sa + T::A_BYTES, b + ((u64)tn * steps + s) * T::B_BYTES, T::B_BYTES, full);
    };
    u32 tile = blockIdx.x;
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            bar_init(bars + 8 * s, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        if (tile < tiles) {
            for (u32 s = 0; s < STAGES && s < steps; s++) {
                load(tile, s, s);
            }
        }
    }
    __syncthreads();
    u32 g0 = 0;
    for (; tile < tiles; tile += gridDim.x) {
        float d[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++) {
            d[i] = 0.0f;
        }
        for (u32 s = 0; s < steps; s++) {
            const u32 g = g0 + s;
            const u32 st = g % STAGES;
            bar_wait(bars + 8 * st, (g / STAGES) & 1);
            const u32 sa = base + st * T::STAGE_BYTES;
            const u32 sb = sa + T::A_BYTES;
            fence_registers(d);
            wgmma_fence();
#pragma unroll
            for (u32 q = 0; q < BK / 16; q++) {
                const u64 da = descriptor(sa + q * 32, 16, 8 * T::ROW_BYTES, T::SWIZZLE);
                if (NN) {
                    Mma<BN, 1>::run(d, da, descriptor(sb + q * 2 * T::NN_SBO, 1024, T::NN_SBO, 1));
                } else {
                    Mma<BN, 0>::run(d, da, descriptor(sb + q * 32, 16, 8 * T::ROW_BYTES, T::SWIZZLE));
                }
            }
            wgmma_commit();
            wgmma_wait<1>();
            fence_registers(d);
            if (tid == 0 && s > 0 && s - 1 + STAGES < steps) {
                load(tile, s - 1 + STAGES, g - 1 + STAGES);
            }
        }
        wgmma_wait<0>();
        fence_registers(d);
        g0 += steps;
        // Every stage is free: the next tile's first steps go in now.
        const u32 next = tile + gridDim.x;
        if (tid == 0 && next < tiles) {
            // The last step's stage was read by this warpgroup's final
            // multiply-adds, which the wait above finished.
            for (u32 s = 0; s < STAGES && s < steps; s++) {
                load(next, s, g0 + s);
            }
        }
        epilogue<BN, NN>(p, c, d, tid, (tile % tiles_m) * 64, (tile / tiles_m) * BN, p.c_offset);
    }
}

#define PERSIST_ENTRY(NAME, NN, BN, BK, STAGES, MIN_BLOCKS)                                                \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS)                                          \
        NAME(const GemmParams p, const char* a, const char* b, float* c) {                                 \
        __shared__ __align__(1024) char shared[Lab<1, BN, BK, STAGES>::SHARED_BYTES];                      \
        persist_gemm<BN, BK, STAGES, NN>(p, a, b, c, shared);                                              \
    }
#define PERSIST_TILE(NAME, BN, BK, STAGES, MIN_BLOCKS)                   \
    PERSIST_ENTRY(lab_logits_##NAME, false, BN, BK, STAGES, MIN_BLOCKS) \
    PERSIST_ENTRY(lab_dx_##NAME, true, BN, BK, STAGES, MIN_BLOCKS)

PERSIST_TILE(persist_m64n256k16s4, 256, 16, 4, 3)
PERSIST_TILE(persist_m64n256k16s3, 256, 16, 3, 3)
PERSIST_TILE(persist_m64n128k32s3, 128, 32, 3, 4)

// Operands "blocked": every matrix stored as 8 x 8 core matrices (128
// contiguous bytes: 8 rows of 8 consecutive columns), row-major over the
// blocks. wgmma reads core matrices without a swizzle, and the one stored
// head W serves both GEMMs: the logits read it K-major (a stage: BN / 8
// copies of BK * 16 bytes), dx N-major (BK / 8 copies of BN * 16 bytes).
// Warp 0's lanes issue a stage's copies. flags (p.mask_rows): bit 0 swaps
// the K-major descriptor's two strides, bit 1 the N-major one's (to learn
// which field is which without a swizzle).
template <int BN, int BK, int STAGES, bool NN>
__device__ __forceinline__ void blocked_gemm(const GemmParams& p, const char* a, const char* b, float* c,
                                             char* shared) {
    typedef Lab<1, BN, BK, STAGES> T;
    const u32 tid = threadIdx.x;
    const u32 tiles_m = (p.m + 63) / 64;
    const u32 tiles_n = (p.n + BN - 1) / BN;
    const u32 l = blockIdx.x + blockIdx.y * p.grid_x;
    if (l >= tiles_m * tiles_n) {
        return;
    }
    const u32 tm = l % tiles_m, tn = l / tiles_m;
    const u32 steps = (p.k + BK - 1) / BK;
    const u64 k8 = (u64)steps * BK / 8;          // core matrices along K (padded)
    const u64 n8 = (u64)tiles_n * BN / 8;         // along N, for the N-major B
    const u32 base = smem_addr(shared);
    const u32 bars = base + STAGES * T::STAGE_BYTES;
    const u32 lane = tid % 32;
    auto load = [&](u32 s) {
        const u32 st = s % STAGES;
        const u32 full = bars + 8 * st;
        const u32 sa = base + st * T::STAGE_BYTES;
        const u32 sb = sa + T::A_BYTES;
        if (lane == 0) {
            bar_expect(full, T::STAGE_BYTES);
        }
        __syncwarp();
        // A: 8 row blocks, BK / 8 core matrices each.
        if (lane < 8) {
            bulk_copy(sa + lane * BK * 16, a + (((u64)tm * 8 + lane) * k8 + (u64)s * BK / 8) * 128, BK * 16, full);
        }
        if (NN) {
            if (lane < BK / 8) {
                bulk_copy(sb + lane * BN * 16, b + (((u64)s * BK / 8 + lane) * n8 + (u64)tn * BN / 8) * 128, BN * 16,
                          full);
            }
        } else {
#pragma unroll
            for (u32 j = lane; j < BN / 8; j += 32) {
                bulk_copy(sb + j * BK * 16, b + (((u64)tn * BN / 8 + j) * k8 + (u64)s * BK / 8) * 128, BK * 16, full);
            }
        }
    };
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            bar_init(bars + 8 * s, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid < 32) {
        for (u32 s = 0; s < STAGES && s < steps; s++) {
            load(s);
        }
    }
    const bool swap_k = (p.mask_rows & 1) != 0, swap_n = (p.mask_rows & 2) != 0;
    // K-major (A, the logits' B): K stride 128, row-block stride BK * 16.
    const u32 k_lbo = swap_k ? BK * 16 : 128, k_sbo = swap_k ? 128 : BK * 16;
    // N-major (the dx B): N stride 128, K-row-block stride BN * 16.
    const u32 n_lbo = swap_n ? BN * 16 : 128, n_sbo = swap_n ? 128 : BN * 16;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) {
        d[i] = 0.0f;
    }
    for (u32 s = 0; s < steps; s++) {
        const u32 st = s % STAGES;
        bar_wait(bars + 8 * st, (s / STAGES) & 1);
        const u32 sa = base + st * T::STAGE_BYTES;
        const u32 sb = sa + T::A_BYTES;
        fence_registers(d);
        wgmma_fence();
#pragma unroll
        for (u32 q = 0; q < BK / 16; q++) {
            const u64 da = descriptor(sa + q * 256, k_lbo, k_sbo, 0);
            if (NN) {
                Mma<BN, 1>::run(d, da, descriptor(sb + q * 2 * BN * 16, n_lbo, n_sbo, 0));
            } else {
                Mma<BN, 0>::run(d, da, descriptor(sb + q * 256, k_lbo, k_sbo, 0));
            }
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_registers(d);
        if (tid < 32 && s > 0 && s - 1 + STAGES < steps) {
            load(s - 1 + STAGES);
        }
    }
    wgmma_wait<0>();
    fence_registers(d);
    epilogue<BN, NN>(p, c, d, tid, tm * 64, tn * BN, p.c_offset);
}

#define BLOCKED_ENTRY(NAME, NN, BN, BK, STAGES, MIN_BLOCKS)                                                \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS)                                          \
        NAME(const GemmParams p, const char* a, const char* b, float* c) {                                 \
        __shared__ __align__(1024) char shared[Lab<1, BN, BK, STAGES>::SHARED_BYTES];                      \
        blocked_gemm<BN, BK, STAGES, NN>(p, a, b, c, shared);                                              \
    }
#define BLOCKED_TILE(NAME, BN, BK, STAGES, MIN_BLOCKS)                   \
    BLOCKED_ENTRY(lab_logits_##NAME, false, BN, BK, STAGES, MIN_BLOCKS) \
    BLOCKED_ENTRY(lab_dx_##NAME, true, BN, BK, STAGES, MIN_BLOCKS)

BLOCKED_TILE(blocked_m64n256k16s4, 256, 16, 4, 3)
BLOCKED_TILE(blocked_m64n256k16s3, 256, 16, 3, 3)
BLOCKED_TILE(blocked_m64n256k32s2, 256, 32, 2, 3)

// src [rows][cols] (ld apart) -> blocked, rows padded to prows and cols to
// pcols with zeros. One thread a 16-byte chunk.
extern "C" __global__ void pretile_blocked(const unsigned short* src, char* dst, u32 rows, u32 cols, u32 ld,
                                           u32 prows, u32 pcols) {
    const u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 c8 = pcols / 8;
    if (e >= (u64)prows * c8) {
        return;
    }
    const u32 r = (u32)(e / c8), cb = (u32)(e % c8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows && cb * 8 < cols) {
        v = *(const uint4*)(src + (u64)r * ld + cb * 8);
    }
    *(uint4*)(dst + (((u64)(r / 8) * c8 + cb) * 128 + (r % 8) * 16)) = v;
}

#define LAB_ENTRY(NAME, NN, NC, BN, BK, STAGES, MIN_BLOCKS)                                                    \
    extern "C" __global__ void __launch_bounds__(Lab<NC, BN, BK, STAGES>::THREADS, MIN_BLOCKS)                 \
        NAME(const GemmParams p, const char* a, const char* b, float* c) {                                     \
        __shared__ __align__(1024) char shared[Lab<NC, BN, BK, STAGES>::SHARED_BYTES];                         \
        lab_gemm<NC, BN, BK, STAGES, NN>(p, a, b, c, shared);                                                  \
    }
#define LAB_TILE(NAME, NC, BN, BK, STAGES, MIN_BLOCKS)                   \
    LAB_ENTRY(lab_logits_##NAME, false, NC, BN, BK, STAGES, MIN_BLOCKS) \
    LAB_ENTRY(lab_dx_##NAME, true, NC, BN, BK, STAGES, MIN_BLOCKS)

// name: m<BM>n<BN>k<BK>s<STAGES>
LAB_TILE(m128n256k16s3, 2, 256, 16, 3, 1)
LAB_TILE(m128n128k32s2, 2, 128, 32, 2, 2)
LAB_TILE(m128n128k16s5, 2, 128, 16, 5, 2)
LAB_TILE(m64n256k16s4, 1, 256, 16, 4, 2)
LAB_TILE(m64n128k32s3, 1, 128, 32, 3, 4)
LAB_TILE(m64n128k16s6, 1, 128, 16, 6, 4)

#define PRETILE(ROWS, BK, NMAJOR)                                                                           \
    extern "C" __global__ void pretile_r##ROWS##_k##BK##_##NMAJOR(const unsigned short* src, char* dst,     \
                                                                  u32 rows, u32 kdim, u32 ld, u32 tiles,    \
                                                                  u32 steps) {                              \
        pack_tiles<ROWS, BK, NMAJOR>(PackParams{rows, kdim, ld, tiles, steps, gridDim.x, 0, 0}, src, dst);                                \
    }
PRETILE(64, 16, false)
PRETILE(64, 16, true)
PRETILE(64, 32, false)
PRETILE(64, 32, true)
PRETILE(128, 16, false)
PRETILE(128, 16, true)
PRETILE(128, 32, false)
PRETILE(128, 32, true)
PRETILE(256, 16, false)
PRETILE(256, 16, true)
PRETILE(256, 32, false)
PRETILE(256, 32, true)
