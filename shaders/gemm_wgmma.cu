// The matrix-unit GEMM for NVIDIA Hopper (sm_90a): wgmma from shared memory,
// in two kinds of tile. The copy tiles read the operands where they are,
// through 16-byte cp.async copies; the bulk tiles read operands the pack
// kernels below first laid out in global memory in the order a stage
// holds, so that one bulk copy per operand fills a stage. Both keep the
// GLSL tiles' contract
// (gemm_khr_body.glsl) in CUDA C, with the same parameter block
// (headkl_core::params::GemmParams, byte for byte) and the same layouts:
//
//   logits (NT): C (+)= alpha * A * B^T, A [m][k] (lda), B stored [n][k] (ldb)
//   dx     (NN): C (+)= alpha * A * B,   A [m][k] (lda), B stored [k][n] (ldb)
//
// f16 operands, f32 accumulators and C; split-K parts (k_parts, k_part,
// c_part_stride), the logits GEMM's row statistics (stats_*), accumulate.
//
// scripts/ptx.sh compiles this file with NVRTC (the Python registry's
// nvidia-cuda-nvrtc-cu12, pinned there) into gemm_wgmma.ptx, which the
// Vulkan backend hands to the driver through VK_NVX_binary_import: no CUDA
// toolkit is needed to build or run headkl. The PTX's first line records
// this file's hash, and a test checks it (crates/core/src/toolkit/wgmma_tile.rs).
//
// Shared memory is at most 48 KiB a block there (docs/DESIGN.md), so a
// tile keeps a few small stages and several blocks share an SM to hide the
// copies.

typedef unsigned int u32;
typedef unsigned long long u64;

struct GemmParams {
    u32 m, n, k, a_offset, lda, ldb, c_offset, ldc;
    float alpha;
    u32 accumulate, grid_x, k_parts, k_part, c_part_stride;
    u32 stats_offset, stats_ld, stats_first, stats_cols;
    u32 mask_rows, mask_ld;
};

// ---- PTX wrappers -------------------------------------------------------

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// One 16-byte copy global -> shared; `bytes` 0 fills the 16 bytes with zeros.
__device__ __forceinline__ void copy16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void copy_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// The copies landed through the generic proxy; wgmma reads through the
// async proxy.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of the accumulators
// across the asynchronous multiply-adds.
template <int R>
__device__ __forceinline__ void fence_registers(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) {
        asm volatile("" : "+f"(d[i])::"memory");
    }
}

// A shared-memory matrix descriptor: start, leading and stride byte
// offsets (in 16 bytes), swizzle mode (1: 128 B, 2: 64 B, 3: 32 B).
__device__ __forceinline__ u64 descriptor(u32 start, u32 lbo, u32 sbo, u32 swizzle) {
    return (u64)((start & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
           ((u64)((sbo >> 4) & 0x3FFF) << 32) | ((u64)swizzle << 62);
}

#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
              "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// d (the warpgroup's 64 x BN f32) += A (64 x 16) * B (16 x BN); B K-major
// (TB 0, the logits layout) or N-major (TB 1, the dx layout). scale-d is a
// predicate: 1 adds the product to d.
template <int BN, int TB>
struct Mma;

template <int TB>
struct Mma<128, TB> {
    static __device__ __forceinline__ void run(float (&d)[64], u64 da, u64 db) {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "setp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
            "}, %64, %65, p, 1, 1, 0, %67;\n"
            "}\n"
            : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56)
            : "l"(da), "l"(db), "r"(1), "n"(TB));
    }
};

template <int TB>
struct Mma<256, TB> {
    static __device__ __forceinline__ void run(float (&d)[128], u64 da, u64 db) {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "setp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
            "}, %128, %129, p, 1, 1, 0, %131;\n"
            "}\n"
            : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56),
              D8(64), D8(72), D8(80), D8(88), D8(96), D8(104), D8(112), D8(120)
            : "l"(da), "l"(db), "r"(1), "n"(TB));
    }
};

// ---- the tile -----------------------------------------------------------

// BM rows of C (BM / 64 warpgroups, 64 rows each) by BN columns, K in steps
// of BK through STAGES stages of shared memory, the copies STAGES - 1 steps
// ahead of the multiply-adds; a step's multiply-adds finish before the next
// step's start. One stage: copy, wait, multiply, in turn.
template <int BM, int BN, int BK, int STAGES>
struct Tile {
    static constexpr int THREADS = BM * 2;  // BM / 64 warpgroups of 128
    // A (and the logits layout's B) K-major: rows of BK halves, swizzled in
    // the mode of that width (64 bytes: mode 2, 32 bytes: mode 3), 8-row
    // groups 8 rows apart.
    static constexpr int ROW_BYTES = BK * 2;
    static constexpr int SWIZZLE = ROW_BYTES == 128 ? 1 : ROW_BYTES == 64 ? 2 : 3;
    static constexpr int A_BYTES = BM * ROW_BYTES;
    // The dx layout's B N-major: 128-byte swizzle atoms of 8 K-rows x 64
    // columns, the atoms along N 1024 bytes apart, 8-row groups
    // (BN / 64) * 1024 apart. Both layouts' B take BN * BK * 2 bytes.
    static constexpr int B_BYTES = BN * ROW_BYTES;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int SHARED_BYTES = STAGES * STAGE_BYTES;
    static constexpr int NN_SBO = (BN / 64) * 1024;
    // Steps the copies run ahead of the multiply-adds.
    static constexpr int AHEAD = STAGES - 1;
    static_assert(BK == 16 || BK == 32 || BK == 64, "BK: 16, 32 or 64");
    static_assert(BN == 128 || BN == 256, "BN: 128 or 256");
    static_assert(SHARED_BYTES <= 42 * 1024, "stay well under the 48 KiB a block NVX launches allow");
    static_assert(STAGE_BYTES % 1024 == 0, "stages start on the swizzle's 1024-byte period");
};

// The 16-byte chunk `chunk` of K-major row `row` (`row_bytes` a row),
// swizzled as the matching mode reads it: the chunk index XORed with the
// bits of the row's offset above the 128-byte line.
template <int ROW_BYTES>
__device__ __forceinline__ u32 kmajor_offset(u32 row, u32 chunk) {
    return row * ROW_BYTES + ((chunk ^ ((row * ROW_BYTES >> 7) & (ROW_BYTES / 16 - 1))) << 4);
}

// Chunk `chunk` (8 columns) of K-row `krow` of an N-major tile, as the
// 128-byte mode reads it.
__device__ __forceinline__ u32 nmajor_offset(u32 krow, u32 chunk, u32 sbo) {
    u32 r = krow & 7;
    return (krow >> 3) * sbo + (chunk >> 3) * 1024 + r * 128 + (((chunk & 7) ^ r) << 4);
}

// One stage's multiply-adds, committed as one group: d (64 x BN) += A * B
// for A's 64 K-major rows at `sa` (BK wide, swizzled in the mode of that
// width) and B at `sb`, K-major (the logits layout, as A) or N-major (the
// dx layout: 128-byte atoms of 8 K-rows x 64 columns, 1024 bytes apart
// along N, 8-row groups (BN / 64) * 1024 apart).
template <int BN, int BK, bool NN>
__device__ __forceinline__ void multiply_stage(float (&d)[BN / 2], u32 sa, u32 sb) {
    constexpr u32 ROW_BYTES = BK * 2;
    constexpr u32 SWIZZLE = ROW_BYTES == 128 ? 1 : ROW_BYTES == 64 ? 2 : 3;
    constexpr u32 NN_SBO = (BN / 64) * 1024;
    fence_registers(d);
    wgmma_fence();
#pragma unroll
    for (u32 q = 0; q < BK / 16; q++) {
        // 16 K (32 bytes) into A's rows.
        const u64 da = descriptor(sa + q * 32, 16, 8 * ROW_BYTES, SWIZZLE);
        if (NN) {
            Mma<BN, 1>::run(d, da, descriptor(sb + q * 2 * NN_SBO, 1024, NN_SBO, 1));
        } else {
            Mma<BN, 0>::run(d, da, descriptor(sb + q * 32, 16, 8 * ROW_BYTES, SWIZZLE));
        }
    }
    wgmma_commit();
}

// C (+)= alpha * d for the 64 x BN block of warpgroup tid / 128 (and the
// row statistics), d in wgmma's accumulator layout: warp w of the warpgroup
// holds rows 16w + lane / 4 (+ 8), columns 8j + 2 (lane % 4) (+ 1).
template <int BN, bool NN>
__device__ __forceinline__ void epilogue(const GemmParams& p, float* c, const float (&d)[BN / 2], u32 tid,
                                         u32 row0, u32 col0, u32 c_off) {
    const u32 warpgroup = tid / 128;
    const u32 lane = tid % 32;
    const u32 rl = warpgroup * 64 + ((tid % 128) / 32) * 16 + lane / 4;
    const u32 cl = (lane % 4) * 2;
#pragma unroll
    for (u32 h = 0; h < 2; h++) {
        const u32 row = row0 + rl + 8 * h;
        if (row >= p.m) {
            continue;
        }
#pragma unroll
        for (u32 j = 0; j < BN / 8; j++) {
            const u32 col = col0 + 8 * j + cl;
            if (col < p.n) {
                float* o = c + c_off + (u64)row * p.ldc + col;
                float x0 = d[4 * j + 2 * h] * p.alpha;
                float x1 = d[4 * j + 2 * h + 1] * p.alpha;
                if (p.accumulate != 0) {
                    x0 += o[0];
                    x1 += o[1];
                }
                o[0] = x0;
                o[1] = x1;
            }
        }
    }

    // The logits GEMM's row statistics (headkl_core::RowStats): per row and
    // 32-column group, (max, sum of exp(x - max)) over the real columns, a
    // NaN sum where one is not finite. The four lanes of a row hold its
    // group's 32 values between them.
    if (!NN && p.stats_offset != 0) {
#pragma unroll
        for (u32 h = 0; h < 2; h++) {
            const u32 row = row0 + rl + 8 * h;
#pragma unroll
            for (u32 g = 0; g < BN / 32; g++) {
                const u32 gcol = col0 + g * 32;
                float m = -3.0e38f;
                bool bad = false;
#pragma unroll
                for (u32 j = 4 * g; j < 4 * g + 4; j++) {
#pragma unroll
                    for (u32 e = 0; e < 2; e++) {
                        const float x = d[4 * j + 2 * h + e] * p.alpha;
                        if (col0 + 8 * j + cl + e < p.stats_cols) {
                            if (isnan(x) || isinf(x)) {
                                bad = true;
                            } else {
                                m = fmaxf(m, x);
                            }
                        }
                    }
                }
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                float s = 0.0f;
#pragma unroll
                for (u32 j = 4 * g; j < 4 * g + 4; j++) {
#pragma unroll
                    for (u32 e = 0; e < 2; e++) {
                        const float x = d[4 * j + 2 * h + e] * p.alpha;
                        const bool real = col0 + 8 * j + cl + e < p.stats_cols && !(isnan(x) || isinf(x));
                        s += real ? expf(x - m) : 0.0f;
                    }
                }
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                u32 flag = bad ? 1u : 0u;
                flag |= __shfl_xor_sync(0xffffffffu, flag, 1);
                flag |= __shfl_xor_sync(0xffffffffu, flag, 2);
                if (lane % 4 == 0 && row < p.m && gcol < p.n) {
                    float* o = c + p.stats_offset + (u64)row * 2 * p.stats_ld + 2 * (p.stats_first + gcol / 32);
                    o[0] = m;
                    o[1] = flag != 0 ? __int_as_float(0x7fc00000) : s;
                }
            }
        }
    }
}

template <int BM, int BN, int BK, int STAGES, bool NN>
__device__ __forceinline__ void gemm(const GemmParams& p, const char* a, const char* b, float* c,
                                     char* shared) {
    typedef Tile<BM, BN, BK, STAGES> T;
    const u32 tid = threadIdx.x;

    // The workgroup's tile and split-K part, as the GLSL tiles place them.
    const u32 tiles_m = (p.m + BM - 1) / BM;
    const u32 tiles_n = (p.n + BN - 1) / BN;
    const u32 tiles = tiles_m * tiles_n;
    const u32 l = blockIdx.x + blockIdx.y * p.grid_x;
    if (l >= tiles * p.k_parts) {
        return;
    }
    const u32 part = l / tiles;
    const u32 tile = l % tiles;
    const u32 row0 = (tile % tiles_m) * BM;
    const u32 col0 = (tile / tiles_m) * BN;
    const u32 k0 = min(part * p.k_part, p.k);
    const u32 kp = min(k0 + p.k_part, p.k) - k0;
    const u32 a_off = p.a_offset + k0;
    const u32 c_off = p.c_offset + part * p.c_part_stride;
    const u32 steps = (kp + BK - 1) / BK;
    const u32 base = smem_addr(shared);

    // Each thread's copies: A_COPIES chunks of A and B_COPIES of B a step,
    // their sources at step 0 and their places in a stage worked out once
    // (per-step address arithmetic cost the GLSL tiles 10-30%). Rows past
    // m (columns past n) repeat the last one: their products reach only C
    // that is never stored. K past the part's end reads zeros (kp is a
    // multiple of 16, so a chunk of 8 is wholly in or out).
    constexpr u32 KCHUNKS = BK / 8;
    constexpr u32 A_COPIES = BM * KCHUNKS / T::THREADS;
    constexpr u32 B_COPIES = BN * KCHUNKS / T::THREADS;
    const char* a_src[A_COPIES];
    u32 a_dst[A_COPIES], a_k[A_COPIES];
#pragma unroll
    for (u32 i = 0; i < A_COPIES; i++) {
        const u32 e = tid + i * T::THREADS;
        const u32 r = e / KCHUNKS, q = e % KCHUNKS;
        a_src[i] = a + 2 * ((u64)a_off + (u64)min(row0 + r, p.m - 1) * p.lda + q * 8);
        a_dst[i] = kmajor_offset<T::ROW_BYTES>(r, q);
        a_k[i] = q * 8;
    }
    const char* b_src[B_COPIES];
    u32 b_dst[B_COPIES], b_k[B_COPIES];
#pragma unroll
    for (u32 i = 0; i < B_COPIES; i++) {
        const u32 e = tid + i * T::THREADS;
        if (NN) {
            const u32 kr = e / (BN / 8), q = e % (BN / 8);
            b_src[i] = b + 2 * ((u64)(k0 + kr) * p.ldb + min(col0 + q * 8, p.n - 8));
            b_dst[i] = nmajor_offset(kr, q, T::NN_SBO);
            b_k[i] = kr;
        } else {
            const u32 r = e / KCHUNKS, q = e % KCHUNKS;
            b_src[i] = b + 2 * ((u64)k0 + (u64)min(col0 + r, p.n - 1) * p.ldb + q * 8);
            b_dst[i] = kmajor_offset<T::ROW_BYTES>(r, q);
            b_k[i] = q * 8;
        }
    }
    // Step s's operands into stage `st`.
    auto load = [&](u32 s, u32 st) {
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
    };

    const u32 warpgroup = tid / 128;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) {
        d[i] = 0.0f;
    }

    // One copy group is committed per step, empty or not, so the counts
    // below hold at the end of the reduction too.
#pragma unroll
    for (int t = 0; t < T::AHEAD; t++) {
        if ((u32)t < steps) {
            load(t, t);
        }
        copy_commit();
    }
    for (u32 s = 0; s < steps; s++) {
        if constexpr (T::AHEAD == 0) {
            // One stage: every warpgroup is done with it (the barrier after
            // their waits), then step s is copied in and waited for.
            __syncthreads();
            load(s, 0);
            copy_commit();
            copy_wait<0>();
            fence_proxy_async();
            __syncthreads();
        } else {
            // Step s landed, is visible to the async proxy, and every
            // warpgroup is done with step s - 1's stage (its wait below),
            // which step s + AHEAD now overwrites.
            copy_wait<T::AHEAD - 1>();
            fence_proxy_async();
            __syncthreads();
            const u32 next = s + T::AHEAD;
            if (next < steps) {
                load(next, next % STAGES);
            }
            copy_commit();
        }

        const u32 sa = base + (s % STAGES) * T::STAGE_BYTES;
        // A: this warpgroup's 64 rows.
        multiply_stage<BN, BK, NN>(d, sa + warpgroup * 64 * T::ROW_BYTES, sa + T::A_BYTES);
        wgmma_wait<0>();
        fence_registers(d);
    }
    wgmma_wait<0>();
    fence_registers(d);
    epilogue<BN, NN>(p, c, d, tid, row0, col0, c_off);
}

// ---- entry points: one per layout and tile (headkl_core::WgmmaTile) ----

#define ENTRY(NAME, NN, BM, BN, BK, STAGES, MIN_BLOCKS)                                                   \
    extern "C" __global__ void __launch_bounds__(BM * 2, MIN_BLOCKS)                                      \
        NAME(const GemmParams p, const char* a, const char* b, float* c) {                                \
        __shared__ __align__(1024) char shared[Tile<BM, BN, BK, STAGES>::SHARED_BYTES];                   \
        gemm<BM, BN, BK, STAGES, NN>(p, a, b, c, shared);                                                 \
    }
#define TILE(NAME, BM, BN, BK, STAGES, MIN_BLOCKS)                                                        \
    ENTRY(wgmma_logits_##NAME, false, BM, BN, BK, STAGES, MIN_BLOCKS)                                     \
    ENTRY(wgmma_dx_##NAME, true, BM, BN, BK, STAGES, MIN_BLOCKS)

// headkl_core::wgmma_tile::WGMMA_TILES, in its order. Four 64-row blocks
// share an SM (their registers); BK 16 steps, two warpgroups a block, 256
// columns, a producer warp and a second group of multiply-adds in flight
// all measured slower (docs/PERFORMANCE.md, row 52).
TILE(bm64_bk32_s3, 64, 128, 32, 3, 4)
TILE(bm64_bk64_s1, 64, 128, 64, 1, 4)
TILE(bm128_bk32_s2, 128, 128, 32, 2, 2)

// ---- the bulk tiles -----------------------------------------------------

__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrives on `bar`, expecting `bytes` of copies to complete on it.
__device__ __forceinline__ void bar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// One 1-D bulk copy global -> shared, completing `bytes` on `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// What a pack kernel lays out: `rows` rows (M of A, N of B) by `kdim` of
// K from `src`, `ld` elements between rows (K-major) or between K-rows
// (N-major), into `tiles` tiles of TILE_ROWS rows by `steps` K steps of
// BK, on a grid folded `grid_x` wide (headkl_core::params::PackParams).
struct PackParams {
    u32 rows, kdim, ld, tiles, steps, grid_x, pad0, pad1;
};

// Packed operands: tile t's K step s is the contiguous block
// (t * steps + s) * TILE_ROWS * BK * 2 bytes in, in the swizzled order a
// stage holds (kmajor_offset, nmajor_offset). Rows and K past the source
// are zeros, so a tile never reads past what was packed. One thread a
// 16-byte chunk (rows, kdim and ld are multiples of 8, so a chunk is
// wholly in or out); consecutive threads read consecutive source bytes,
// which measured faster than writing the packed operand in order
// (docs/PERFORMANCE.md, row 54).
template <int TILE_ROWS, int BK, bool NMAJOR>
__device__ __forceinline__ void pack_tiles(const PackParams& p, const unsigned short* src, char* dst) {
    const u64 e = ((u64)blockIdx.y * p.grid_x + blockIdx.x) * blockDim.x + threadIdx.x;
    const u64 chunks_per_row = (u64)p.steps * BK / 8;
    if (e >= (u64)p.tiles * TILE_ROWS * chunks_per_row) {
        return;
    }
    u32 r, k;
    if (NMAJOR) {
        const u64 row_chunks = (u64)p.tiles * TILE_ROWS / 8;
        k = (u32)(e / row_chunks);
        r = (u32)(e % row_chunks) * 8;
    } else {
        r = (u32)(e / chunks_per_row);
        k = (u32)(e % chunks_per_row) * 8;
    }
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < p.rows && k < p.kdim) {
        v = NMAJOR ? *(const uint4*)(src + (u64)k * p.ld + r) : *(const uint4*)(src + (u64)r * p.ld + k);
    }
    const u64 block = ((u64)(r / TILE_ROWS) * p.steps + k / BK) * TILE_ROWS * BK * 2;
    const u32 inner = NMAJOR ? nmajor_offset(k % BK, (r % TILE_ROWS) / 8, (TILE_ROWS / 64) * 1024)
                             : kmajor_offset<BK * 2>(r % TILE_ROWS, (k % BK) / 8);
    *(uint4*)(dst + block + inner) = v;
}

template <int BN, int BK, int STAGES>
struct BulkTile {
    static constexpr int A_BYTES = 64 * BK * 2;
    static constexpr int B_BYTES = BN * BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    // The stages, then a "full" barrier (8 bytes) a stage.
    static constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;
    static_assert(SHARED_BYTES <= 42 * 1024, "stay well under the 48 KiB a block NVX launches allow");
    static_assert(STAGE_BYTES % 1024 == 0, "stages start on the swizzle's 1024-byte period");
};

// C (+)= alpha * A * B over packed A (64-row tiles) and packed B (BN-row
// tiles, K-major for the logits, N-major for dx), p.k the packed K. One
// warpgroup a block and no producer warp: thread 0 issues a stage's two
// bulk copies, each stage's "full" barrier says they landed, and a stage
// is refilled as soon as the warpgroup's own wait shows the multiply-adds
// that read it done (one group stays in flight), so no "empty" barrier and
// no __syncthreads in the loop. 128 threads let three blocks share an SM.
// Split-K and the row or column offsets are the host's: it packs and
// launches each piece (crates/backend-vulkan/src/nvx.rs).
template <int BN, int BK, int STAGES, bool NN>
__device__ __forceinline__ void bulk_gemm(const GemmParams& p, const char* a, const char* b, float* c, char* shared) {
    typedef BulkTile<BN, BK, STAGES> T;
    const u32 tid = threadIdx.x;
    const u32 tiles_m = (p.m + 63) / 64;
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
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid == 0) {
        for (u32 s = 0; s < STAGES && s < steps; s++) {
            load(s);
        }
    }
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) {
        d[i] = 0.0f;
    }
    for (u32 s = 0; s < steps; s++) {
        const u32 st = s % STAGES;
        bar_wait(bars + 8 * st, (s / STAGES) & 1);
        const u32 sa = base + st * T::STAGE_BYTES;
        multiply_stage<BN, BK, NN>(d, sa, sa + T::A_BYTES);
        wgmma_wait<1>();
        fence_registers(d);
        // Step s - 1's stage is free: step s - 1 + STAGES goes there.
        if (tid == 0 && s > 0 && s - 1 + STAGES < steps) {
            load(s - 1 + STAGES);
        }
    }
    wgmma_wait<0>();
    fence_registers(d);
    epilogue<BN, NN>(p, c, d, tid, tm * 64, tn * BN, p.c_offset);
}

// ---- entry points of the bulk tiles (headkl_core::WgmmaTile, bulk) -----

#define PACK(NAME, TILE_ROWS, BK, NMAJOR)                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                     \
        NAME(const PackParams p, const unsigned short* src, char* dst, const char* unused) {              \
        pack_tiles<TILE_ROWS, BK, NMAJOR>(p, src, dst);                                                   \
    }
#define BULK_ENTRY(NAME, NN, BN, BK, STAGES, MIN_BLOCKS)                                                  \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS)                                         \
        NAME(const GemmParams p, const char* a, const char* b, float* c) {                                \
        __shared__ __align__(1024) char shared[BulkTile<BN, BK, STAGES>::SHARED_BYTES];                   \
        bulk_gemm<BN, BK, STAGES, NN>(p, a, b, c, shared);                                                \
    }

// A (both GEMMs), the logits' B ([n][k]) and dx's B ([k][n]), K steps of 16.
PACK(wgmma_pack_a_bk16, 64, 16, false)
PACK(wgmma_pack_logits_b_bn256_bk16, 256, 16, false)
PACK(wgmma_pack_dx_b_bn256_bk16, 256, 16, true)
// 64 x 256 tiles, K 16 a step, four stages (41 KiB), three blocks an SM:
// 536-567 TFLOP/s at shape A's GEMMs in the research harness, against
// 351-404 for the copy tiles (docs/PERFORMANCE.md, row 53).
BULK_ENTRY(wgmma_bulk_logits_bn256_bk16_s4, false, 256, 16, 4, 3)
BULK_ENTRY(wgmma_bulk_dx_bn256_bk16_s4, true, 256, 16, 4, 3)
