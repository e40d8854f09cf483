// The CUDA twin of headkl's default GLSL GEMM tile, `glsl:bm128.bk64.s1`
// (shaders/gemm_khr.comp with BM 128, BK 64, STAGES 1, SG_COLS 2; the tile
// table is crates/core/src/toolkit/glsl_tile.rs), written with the instructions the
// Vulkan driver is expected to lower cooperative matrices to (ldmatrix,
// mma.sync m16n8k16), so that its time on the same H200 says how much of the
// Vulkan GEMM's plateau belongs to the design and how much to the SPIR-V's
// compilation. Not shipped; scripts/cuda_twin/run.py
// compiles it (nvcc, or NVRTC from PyTorch's CUDA wheel), checks and times
// it beside cuBLAS.
//
// Device code only, no includes: it compiles the same under nvcc and NVRTC,
// and the host side is Python (ctypes, the CUDA driver API).
//
// Structure of the twin (`twin_{nt,nn}_s1`), as the GLSL tile:
//   - one 128 x 128 C tile per CTA of 128 threads: 4 warps in 2 x 2, each
//     warp 64 x 64 (4 x 8 mma tiles of 16 x 8, 128 f32 accumulators);
//   - K in steps of 64; the next step's 16 words (16 bytes each: 8 of A, 8
//     of B) go from global memory to registers before this step's math, and
//     are stored to shared memory between two barriers (one stage);
//   - shared tiles of 16-byte words with every row skewed by one word (A
//     [128][9], B [128][9] for nt, [64][17] for nn: 36 / 35 KiB, static,
//     under 48 KiB), so the eight row addresses of an ldmatrix phase fall in
//     distinct banks;
//   - fragments by ldmatrix.x4 (B of the nn layout by ldmatrix.x4.trans);
//   - __launch_bounds__(128, 2): two CTAs an SM, as the Vulkan tile runs.
// The variants:
//   - `async_{nt,nn}_s{2,3}`: the same tile and fragments, but the global ->
//     shared copy by cp.async (16 bytes, .cg) into a ring of 2 or 3 stages,
//     issued STAGES - 1 steps ahead, one barrier a step; their shared memory
//     (72 / 108 KiB) is dynamic, above the 48 KiB a Vulkan workgroup may
//     have: the launcher raises the limit with
//     CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
//   - `twin8_{nt,nn}_s1`, `twin8x2_{nt,nn}_s1`: the twin with 8 warps of
//     64 x 32 (256 threads; docs/PERFORMANCE.md row 16 in Vulkan), with
//     ptxas free to use 255 registers (one CTA an SM) or held to 128 (two).
// Layouts (headkl's two GEMMs; f16 operands, f32 C, row-major, C = A * op(B)):
//   nt (logits): C[m][n] = A[m][k] * B[n][k]^T
//   nn (dx):     C[m][n] = A[m][k] * B[k][n]
// Requires m % 128 == 0, n % 128 == 0, k % 64 == 0, lda, ldb % 8 == 0 and
// ldc % 2 == 0 (the driver checks; headkl's kernel clamps edge tiles, which
// the timed shapes never have).

typedef unsigned int u32;
typedef unsigned long long u64;

struct alignas(16) Word {
    u32 x, y, z, w;
};

struct alignas(8) Float2 {
    float x, y;
};

constexpr int BM = 128;
constexpr int BN = 128;
constexpr int BK = 64;
// 16-byte words in a row of a K step (A, and B of the nt layout).
constexpr int KW = BK / 8;
// Skewed row strides, in words.
constexpr int A_STRIDE = KW + 1;
constexpr int A_STAGE = BM * A_STRIDE;
constexpr int NT_B_STRIDE = KW + 1;
constexpr int NN_B_STRIDE = BN / 8 + 1;
constexpr int B_STAGE_NT = BN * NT_B_STRIDE;
constexpr int B_STAGE_NN = BK * NN_B_STRIDE;

// One configuration: the layout (NN: B stored [k][n]) and the warps across
// the tile's 128 columns (WN: 2 as the GLSL tile, each warp 64 x 64; 4 for
// the 8-warp variant, each warp 64 x 32); the warps are 2 x WN.
template <bool NN_, int WN>
struct Cfg {
    static constexpr bool NN = NN_;
    static constexpr int THREADS = 2 * WN * 32;
    // Columns of C per warp and 16 x 8 mma tiles along them.
    static constexpr int WARP_N = BN / WN;
    static constexpr int NT = WARP_N / 8;
    // Words each thread moves per step, per operand.
    static constexpr int A_WORDS = BM * KW / THREADS;
    static constexpr int B_WORDS = BN * KW / THREADS;
    static constexpr int B_STRIDE = NN ? NN_B_STRIDE : NT_B_STRIDE;
    static constexpr int B_STAGE = NN ? B_STAGE_NN : B_STAGE_NT;
    // One stage of A then B, in words.
    static constexpr int STAGE = A_STAGE + B_STAGE;
    // Rows of the staged tile between a thread's consecutive words.
    static constexpr int A_ROWS_PER_I = THREADS / KW;
    static constexpr int B_ROW_WORDS = NN ? BN / 8 : KW;
    static constexpr int B_ROWS_PER_I = THREADS / B_ROW_WORDS;
    static_assert(A_WORDS * THREADS == BM * KW && B_WORDS * THREADS == BN * KW, "whole words a thread");
    static_assert(NT % 2 == 0, "B fragments come two n-tiles an ldmatrix.x4");
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// d += a * b for one 16 x 8 x 16 tile, f16 operands, f32 accumulators.
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async_16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Per-thread addressing of one CTA, shared by all variants.
template <class C>
struct Tile {
    static constexpr bool NN = C::NN;
    // This thread's first word of A and of B at step 0 (as the GLSL's
    // a_first / b_first): every other word it moves is a uniform stride on.
    const Word* a_first;
    const Word* b_first;
    u32 ldaw, ldbw;
    int row0, col0, wr, wc, lane;

    __device__ __forceinline__ Tile(const Word* a, const Word* b, int m, int lda, int ldb) {
        const int tid = threadIdx.x;
        const int tiles_m = m / BM;
        // Consecutive CTAs run down m for one column tile (headkl's order:
        // the B tile is shared through L2 by the tiles_m CTAs of a column).
        const int tile = blockIdx.x;
        row0 = (tile % tiles_m) * BM;
        col0 = (tile / tiles_m) * BN;
        const int warp = tid / 32;
        lane = tid % 32;
        wr = (warp / (C::THREADS / 64)) * 64;
        wc = (warp % (C::THREADS / 64)) * C::WARP_N;
        ldaw = lda / 8;
        ldbw = ldb / 8;
        a_first = a + (u64)(row0 + tid / KW) * ldaw + tid % KW;
        if (NN) {
            b_first = b + (u64)(tid / (BN / 8)) * ldbw + col0 / 8 + tid % (BN / 8);
        } else {
            b_first = b + (u64)(col0 + tid / KW) * ldbw + tid % KW;
        }
    }

    // Global word i of A / B of step s for this thread.
    __device__ __forceinline__ const Word* a_word(int s, int i) const {
        return a_first + (u64)s * KW + (u64)(i * C::A_ROWS_PER_I) * ldaw;
    }
    __device__ __forceinline__ const Word* b_word(int s, int i) const {
        if (NN) {
            return b_first + ((u64)s * BK + i * C::B_ROWS_PER_I) * ldbw;
        }
        return b_first + (u64)s * KW + (u64)(i * C::B_ROWS_PER_I) * ldbw;
    }

    // Shared word index (within a stage's A / B part) of the thread's word i.
    __device__ __forceinline__ static int sa_index(int i) {
        const int e = threadIdx.x + i * C::THREADS;
        return (e / KW) * A_STRIDE + e % KW;
    }
    __device__ __forceinline__ static int sb_index(int i) {
        const int e = threadIdx.x + i * C::THREADS;
        constexpr int RW = C::B_ROW_WORDS;
        return (e / RW) * C::B_STRIDE + e % RW;
    }

    // The 64-deep step staged at sa / sb (shared byte addresses of the
    // stage's A and B parts) into the warp's 4 x 8 accumulator tiles.
    __device__ __forceinline__ void math_step(float (&acc)[4][C::NT][4], u32 sa, u32 sb) const {
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            // A fragment i: rows wr + 16 i .. + 15, K 16 kk .. + 15. Lane l
            // addresses row l % 16, K half l / 16 (8 halves = one word):
            // matrices 0..3 = (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
            // (8-15, 8-15) = mma's a0..a3.
            u32 fa[4][4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = wr + i * 16 + (lane % 16);
                const int word = kk * 2 + lane / 16;
                ldmatrix_x4(fa[i], sa + (u32)(row * A_STRIDE + word) * 16u);
            }
            // B fragments, 16 columns (two mma n-tiles) per ldmatrix.x4:
            // matrices 0..3 = (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
            // (n 8-15, k 8-15), so r0, r1 are n-tile 2 jj's b0, b1 and r2, r3
            // n-tile 2 jj + 1's. Lane l addresses matrix q = l / 8, its row
            // l % 8.
            u32 fb[C::NT / 2][4];
#pragma unroll
            for (int jj = 0; jj < C::NT / 2; jj++) {
                const int q = lane / 8;
                if (NN) {
                    // B staged [k][n]: the matrix rows are k; .trans hands
                    // each lane (k 2t, 2t + 1; n g), mma's b layout.
                    const int krow = kk * 16 + (q % 2) * 8 + lane % 8;
                    const int word = (wc + jj * 16) / 8 + q / 2;
                    ldmatrix_x4_trans(fb[jj], sb + (u32)(krow * C::B_STRIDE + word) * 16u);
                } else {
                    // B staged [n][k]: the matrix rows are n.
                    const int nrow = wc + jj * 16 + (q / 2) * 8 + lane % 8;
                    const int word = kk * 2 + q % 2;
                    ldmatrix_x4(fb[jj], sb + (u32)(nrow * C::B_STRIDE + word) * 16u);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
#pragma unroll
                for (int j = 0; j < C::NT; j++) {
                    mma_16816(acc[i][j], fa[i], fb[j / 2][(j % 2) * 2], fb[j / 2][(j % 2) * 2 + 1]);
                }
            }
        }
    }

    // C = acc: lane (g = l / 4, t = l % 4) holds rows g and g + 8, columns
    // 2 t and 2 t + 1 of each 16 x 8 tile.
    __device__ __forceinline__ void epilogue(const float (&acc)[4][C::NT][4], float* c, int ldc) const {
        const int g = lane / 4;
        const int t = lane % 4;
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int j = 0; j < C::NT; j++) {
                const u64 row = row0 + wr + i * 16 + g;
                const u64 col = col0 + wc + j * 8 + t * 2;
                *reinterpret_cast<Float2*>(c + row * ldc + col) = Float2{acc[i][j][0], acc[i][j][1]};
                *reinterpret_cast<Float2*>(c + (row + 8) * ldc + col) = Float2{acc[i][j][2], acc[i][j][3]};
            }
        }
    }
};

// The twin: global -> registers a step ahead -> shared (one stage, two
// barriers a step) -> ldmatrix -> mma.sync.
template <class C>
__device__ __forceinline__ void twin_s1(const Word* __restrict__ a, const Word* __restrict__ b, float* __restrict__ c,
                                        int m, int n, int k, int lda, int ldb, int ldc) {
    __shared__ Word sa[A_STAGE];
    __shared__ Word sb[C::B_STAGE];
    const Tile<C> tile(a, b, m, lda, ldb);
    float acc[4][C::NT][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < C::NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    const int steps = k / BK;
    Word ra[C::A_WORDS];
    Word rb[C::B_WORDS];
#pragma unroll
    for (int i = 0; i < C::A_WORDS; i++) ra[i] = *tile.a_word(0, i);
#pragma unroll
    for (int i = 0; i < C::B_WORDS; i++) rb[i] = *tile.b_word(0, i);
    const u32 sa_base = smem_addr(sa);
    const u32 sb_base = smem_addr(sb);
    for (int s = 0; s < steps; s++) {
#pragma unroll
        for (int i = 0; i < C::A_WORDS; i++) sa[Tile<C>::sa_index(i)] = ra[i];
#pragma unroll
        for (int i = 0; i < C::B_WORDS; i++) sb[Tile<C>::sb_index(i)] = rb[i];
        __syncthreads();
        if (s + 1 < steps) {
#pragma unroll
            for (int i = 0; i < C::A_WORDS; i++) ra[i] = *tile.a_word(s + 1, i);
#pragma unroll
            for (int i = 0; i < C::B_WORDS; i++) rb[i] = *tile.b_word(s + 1, i);
        }
        tile.math_step(acc, sa_base, sb_base);
        __syncthreads();
    }
    tile.epilogue(acc, c, ldc);
}

// The same tile with cp.async into a ring of STAGES stages (dynamic shared
// memory), STAGES - 1 steps ahead, one barrier a step.
template <class C, int STAGES>
__device__ __forceinline__ void async_ring(const Word* __restrict__ a, const Word* __restrict__ b,
                                           float* __restrict__ c, int m, int n, int k, int lda, int ldb, int ldc) {
    static_assert(STAGES >= 2, "a ring needs two stages");
    extern __shared__ Word ring[];
    const Tile<C> tile(a, b, m, lda, ldb);
    float acc[4][C::NT][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < C::NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    const int steps = k / BK;
    const u32 base = smem_addr(ring);
    constexpr u32 STAGE_BYTES = C::STAGE * 16u;
    constexpr u32 B_PART = A_STAGE * 16u;
    // Copies of step s into stage st: one commit group per step, empty past
    // the last step so that the group count stays one a step.
    auto issue = [&](int s, int st) {
        if (s < steps) {
            const u32 sa = base + st * STAGE_BYTES;
            const u32 sb = sa + B_PART;
#pragma unroll
            for (int i = 0; i < C::A_WORDS; i++) cp_async_16(sa + Tile<C>::sa_index(i) * 16u, tile.a_word(s, i));
#pragma unroll
            for (int i = 0; i < C::B_WORDS; i++) cp_async_16(sb + Tile<C>::sb_index(i) * 16u, tile.b_word(s, i));
        }
        cp_async_commit();
    };
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) issue(st, st);
    for (int s = 0; s < steps; s++) {
        // Step s's group is complete once at most STAGES - 2 newer ones are
        // pending; the barrier makes every thread's copies visible and says
        // that every warp has finished step s - 1, whose stage the copies of
        // step s + STAGES - 1 now overwrite.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        issue(s + STAGES - 1, (s + STAGES - 1) % STAGES);
        const u32 sa = base + (s % STAGES) * STAGE_BYTES;
        tile.math_step(acc, sa, sa + B_PART);
    }
    cp_async_wait<0>();
    tile.epilogue(acc, c, ldc);
}

#define TWIN_ARGS                                                                                              \
    const Word *__restrict__ a, const Word *__restrict__ b, float *__restrict__ c, int m, int n, int k, int lda, \
        int ldb, int ldc
#define TWIN_PASS a, b, c, m, n, k, lda, ldb, ldc

// The GLSL tile: 4 warps of 64 x 64.
using NT4 = Cfg<false, 2>;
using NN4 = Cfg<true, 2>;
// 8 warps of 64 x 32 (PERFORMANCE row 16's arrangement in Vulkan).
using NT8 = Cfg<false, 4>;
using NN8 = Cfg<true, 4>;

extern "C" __global__ void __launch_bounds__(128, 2) twin_nt_s1(TWIN_ARGS) { twin_s1<NT4>(TWIN_PASS); }
extern "C" __global__ void __launch_bounds__(128, 2) twin_nn_s1(TWIN_ARGS) { twin_s1<NN4>(TWIN_PASS); }
extern "C" __global__ void __launch_bounds__(128, 2) async_nt_s2(TWIN_ARGS) { async_ring<NT4, 2>(TWIN_PASS); }
extern "C" __global__ void __launch_bounds__(128, 2) async_nn_s2(TWIN_ARGS) { async_ring<NN4, 2>(TWIN_PASS); }
extern "C" __global__ void __launch_bounds__(128, 2) async_nt_s3(TWIN_ARGS) { async_ring<NT4, 3>(TWIN_PASS); }
extern "C" __global__ void __launch_bounds__(128, 2) async_nn_s3(TWIN_ARGS) { async_ring<NN4, 3>(TWIN_PASS); }
// ptxas free to use up to 255 registers (one CTA an SM, as row 16 ran)...
extern "C" __global__ void __launch_bounds__(256, 1) twin8_nt_s1(TWIN_ARGS) { twin_s1<NT8>(TWIN_PASS); }
extern "C" __global__ void __launch_bounds__(256, 1) twin8_nn_s1(TWIN_ARGS) { twin_s1<NN8>(TWIN_PASS); }
// ... or held to 128 so that two CTAs (16 warps) fit an SM.
extern "C" __global__ void __launch_bounds__(256, 2) twin8x2_nt_s1(TWIN_ARGS) { twin_s1<NT8>(TWIN_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) twin8x2_nn_s1(TWIN_ARGS) { twin_s1<NN8>(TWIN_PASS); }
