// The matrix-unit GEMM's shared body in GLSL (KHR cooperative matrices,
// 16x16x16 f16 x f16 -> f32): its configuration, operands, staging,
// multiply-adds and C store. crates/glsl/build.rs compiles each variant as
// this file followed by gemm_khr.comp (the GEMM) or gemm_ceiling.comp (the
// ceiling report's diagnostic parts), with the defines of its typed
// description (crates/glsl/src/variant.rs, GlslVariant::defines);
// shaders/README.md lists them.
//
//   NN      0: C = A * B^T, B stored [n][k]; 1: C = A * B, B stored [k][n]
//   BM      C tile rows per workgroup: 64, 128 or 256; BN is 128
//   SG_COLS 2 or 4: BM / 64 x SG_COLS math subgroups, each owning 64 rows
//           and 128 / SG_COLS columns of C (4 x TN accumulators)
//   BK      K staged per step: 16, 32 or 64
//   STAGES  1: step s + 1's words go to registers before step s multiplies
//           and are stored between two barriers; 2: they go to the other
//           stage, one barrier a step
//   INTERLEAVE  with STAGES 2: store step s + 1's words after the first
//           16-deep slice of step s's multiply-adds instead of after all
//   WS      1: warp-specialised GEMM (MODE 0 only): 4 more subgroups only
//           copy, running STAGES - 1 steps ahead through a ring of STAGES
//           stages, while the BM / 64 x 2 math subgroups only multiply;
//           one barrier a step
//   MODE    0 the GEMM (gemm_khr.comp); 1-4 the ceiling report's parts
//           (gemm_ceiling.comp)
//   FILTER  1: the dx GEMM's block filter (gemm_dx_filtered, NN only):
//           the main loop runs only the K steps whose 64-column block
//           some row of the tile keeps (next_live); 0: the code is the
//           GEMM's without it, line for line
// Ceiling-report levers (the production GEMMs take the first value):
//   A_READ, B_READ  0 staged from row-major memory; 1 staged, read as if
//           each K step's tile were one contiguous run ([tile][step][BM or
//           BN rows][BK]: a timing, not the GEMM; m, n, k must divide the
//           tile); 2 straight into fragment registers, not staged, as if
//           stored in fragment order (each 16 x 16 fragment one 512-byte
//           run, invocation i's elements its 16 bytes i): one 16-byte load
//           per invocation and fragment, a step ahead (a timing)
//   TALL    1: the C tile is 2 x BM rows by 64 columns (below; a timing)
//   BARRIERS  0: no barriers in the main loop (a race, timed only to price
//           the barriers)
//   LOAD_KIND  0 plain; 1 the operands' buffers coherent (the driver may
//           not keep their lines in the SM's L1, which is not coherent);
//           2 (STAGES >= 2) each word stored to workgroup memory as soon as
//           it is loaded, STAGES - 1 steps ahead, nothing held in
//           registers across the math. Both still compute the GEMM
//   FN      16, or 8 for 16 x 8 x 16 tiles (B fragments and accumulators 8
//           columns wide, twice as many per subgroup); also the GEMM
//   ACC16   1: f16 accumulators, half the accumulator registers, to time
//           what occupancy alone buys; the sums lose precision, so it is
//           timed, never checked or used
#version 460
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require
#if FILTER
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif

// TALL (ceiling report only): the workgroup's C tile is 2 x BM rows by 64
// columns, one column of BM / 32 subgroups, each 64 x 64: as many tiles as
// BM x 128, but no two subgroups share rows of A.
#if TALL
const uint TM = 2 * BM;
const uint BN = 64;
const uint SGC = 1;
#else
const uint TM = BM;
const uint BN = 128;
const uint SGC = SG_COLS;
#endif
const uint SG_ROWS = TM / 64;
// FN: columns of a B fragment and an accumulator.
#if FN == 8 && B_READ == 2
#error "B read straight into fragments needs 16-column fragments"
#endif
// Fragments per subgroup along n.
const uint TN = BN / SGC / FN;
// The kernel requires subgroups of exactly 32 (the backend checks).
const uint MATH_THREADS = SG_ROWS * SGC * 32;
#if WS
// The copying subgroups follow the math ones.
const uint STAGERS = 128;
const uint THREADS = MATH_THREADS + STAGERS;
#else
const uint STAGERS = MATH_THREADS;
const uint THREADS = MATH_THREADS;
#endif
layout(local_size_x = THREADS, local_size_y = 1, local_size_z = 1) in;

// headkl_core::toolkit::params::GemmParams, byte for byte.
layout(set = 0, binding = 0, std140) uniform Params {
    uint m;
    uint n;
    uint k;
    uint a_offset;
    uint lda;
    uint ldb;
    uint c_offset;
    uint ldc;
    float alpha;
    uint accumulate;
    uint grid_x;
    uint k_parts;
    uint k_part;
    uint c_part_stride;
    uint stats_offset;
    uint stats_ld;
    uint stats_first;
    uint stats_cols;
    uint mask_rows;
    uint mask_ld;
} p;
// f16 operands, 8 halves (16 bytes) a word: a_offset, lda and ldb are
// multiples of 8 (core pads them to 16).
#if LOAD_KIND == 1
#define OPERAND coherent readonly
#else
#define OPERAND readonly
#endif
layout(set = 0, binding = 1, std430) OPERAND buffer ABuf { uvec4 a[]; };
layout(set = 0, binding = 2, std430) OPERAND buffer BBuf { uvec4 b[]; };
layout(set = 0, binding = 3, std430) buffer CBuf { float c[]; };

// Staged tiles in 16-byte words; each row is skewed by one word so that
// the eight rows a fragment load reads at once fall in distinct banks.
const uint KW = BK / 8;
const uint SA_STRIDE = KW + 1;
const uint SA_STAGE = TM * SA_STRIDE;
#if NN
const uint SB_STRIDE = BN / 8 + 1;
const uint SB_STAGE = BK * SB_STRIDE;
#else
const uint SB_STRIDE = KW + 1;
const uint SB_STAGE = BN * SB_STRIDE;
#endif
#define A_DIRECT (A_READ == 2)
#define B_DIRECT (B_READ == 2)
#if A_DIRECT
shared uvec4 sa[1];
#else
shared uvec4 sa[STAGES * SA_STAGE];
#endif
#if B_DIRECT
shared uvec4 sb[1];
#else
shared uvec4 sb[STAGES * SB_STAGE];
#endif

// With both operands read straight into fragments nothing is staged, so
// the subgroups need not wait for each other. BARRIERS 0 (ceiling report
// only) drops the loop's barriers anyway: the subgroups then read
// stages other subgroups may be rewriting, so the result is garbage, but
// the time says what the barriers cost.
#if (A_DIRECT && B_DIRECT) || !BARRIERS
#define STAGE_BARRIER()
#else
#define STAGE_BARRIER() barrier()
#endif

// Words each staging invocation moves per step.
const uint A_WORDS = TM * KW / STAGERS;
const uint B_WORDS = BN * KW / STAGERS;

// The C tile as stored.
#define OUT coopmat<float, gl_ScopeSubgroup, 16, FN, gl_MatrixUseAccumulator>
#if ACC16
#define ACC coopmat<float16_t, gl_ScopeSubgroup, 16, FN, gl_MatrixUseAccumulator>
#else
#define ACC OUT
#endif
#define FRAG_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define FRAG_B coopmat<float16_t, gl_ScopeSubgroup, 16, FN, gl_MatrixUseB>

uvec4 ra[A_WORDS];
uvec4 rb[B_WORDS];
// Fragments read straight from memory (A_DIRECT, B_DIRECT): this step's
// and the next step's 16-byte words, one per fragment and invocation.
const uint KF = BK / 16;
uvec4 fa_cur[4 * KF];
uvec4 fa_nxt[4 * KF];
uvec4 fb_cur[TN * KF];
uvec4 fb_nxt[TN * KF];
uint fa_first, fb_first;
ACC acc[4 * TN];
uint row0, col0, wr, wc;
// Split-K: this workgroup's part of the reduction, its length and its first
// elements of A, B and C (MODE 0; the diagnostic modes run part 0 only).
uint kp, a_off, b_off, c_off;
// This invocation's index among the staging invocations.
uint sidx;
// Whether the workgroup's C tile lies inside m x n (then no row or column
// is clamped), and the word indices of this invocation's first staged word
// of A and of B at step 0: inside such a tile, every word it loads is a
// compile-time or uniform stride from these (set_addresses). Computing each
// address afresh (row clamp, K test, multiply, divide) cost the K-64 tile
// 10% (logits) and 30% (dx): docs/PERFORMANCE.md, row 24.
bool whole_tile;
uint a_first, b_first;

void set_addresses() {
    whole_tile = row0 + TM <= p.m && col0 + BN <= p.n;
    // a_offset, lda and ldb are multiples of 8, col0 of 128, and the
    // part's offsets a_off and b_off of 8 (k_part is a multiple of 64).
    a_first = (a_off + (row0 + sidx / KW) * p.lda) / 8 + sidx % KW;
#if NN
    b_first = (b_off + (sidx / (BN / 8)) * p.ldb + col0) / 8 + sidx % (BN / 8);
#else
    b_first = (b_off + (col0 + sidx / KW) * p.ldb) / 8 + sidx % KW;
#endif
}

// Staged words of invocation sidx at index i are i * STAGERS further on:
// that many whole rows of the tile (every configuration has STAGERS a
// multiple of the words in a row, KW or BN / 8).
const uint A_ROWS_PER_I = STAGERS / KW;
#if NN
const uint B_ROWS_PER_I = STAGERS / (BN / 8);
#else
const uint B_ROWS_PER_I = STAGERS / KW;
#endif

// The 16-byte word of operand BUF stored K-contiguous (A; B stored [n][k])
// at line LINE, clamped to LAST, and K offset KK of the part that starts
// at element OFF, lines LD halves apart; zeros at or past the part's end
// (KK >= kp). A macro: GLSL cannot pass a buffer.
#define K_ROWS_WORD(BUF, OFF, LINE, LAST, LD, KK) \
    ((KK) < kp ? BUF[((OFF) + min(LINE, LAST) * (LD) + (KK)) / 8] : uvec4(0))

// Step s's words into registers. Rows past m (columns past n) repeat the
// last one: their products only reach C tiles that are never stored. K past
// the part's end reads zeros.
void load_step(uint s) {
    uint k0 = s * BK;
    uint steps = p.k / BK;
#if A_READ != 1 && B_READ != 1
    // The common case: a whole tile and a whole K step of the part. One add
    // per word from a per-invocation base; no clamps, no K test.
    if (whole_tile && k0 + BK <= kp) {
#if !A_DIRECT
        [[unroll]] for (uint i = 0; i < A_WORDS; i++) {
            ra[i] = a[a_first + s * KW + i * A_ROWS_PER_I * (p.lda / 8)];
        }
#endif
#if !B_DIRECT
        [[unroll]] for (uint i = 0; i < B_WORDS; i++) {
#if NN
            rb[i] = b[b_first + s * BK * (p.ldb / 8) + i * B_ROWS_PER_I * (p.ldb / 8)];
#else
            rb[i] = b[b_first + s * KW + i * B_ROWS_PER_I * (p.ldb / 8)];
#endif
        }
#endif
        return;
    }
#endif
#if !A_DIRECT
    [[unroll]] for (uint i = 0; i < A_WORDS; i++) {
        uint e = sidx + i * STAGERS;
#if A_READ == 1
        ra[i] = a[((row0 / TM) * steps + s) * (TM * KW) + e];
#else
        ra[i] = K_ROWS_WORD(a, a_off, row0 + e / KW, p.m - 1, p.lda, k0 + (e % KW) * 8);
#endif
    }
#endif
#if !B_DIRECT
    [[unroll]] for (uint i = 0; i < B_WORDS; i++) {
        uint e = sidx + i * STAGERS;
#if B_READ == 1
        rb[i] = b[((col0 / BN) * steps + s) * (BN * KW) + e];
#elif NN
        uint kk = k0 + e / (BN / 8);
        uint col = min(col0 + (e % (BN / 8)) * 8, p.n - 8);
        rb[i] = kk < kp ? b[(b_off + kk * p.ldb + col) / 8] : uvec4(0);
#else
        rb[i] = K_ROWS_WORD(b, b_off, col0 + e / KW, p.n - 1, p.ldb, k0 + (e % KW) * 8);
#endif
    }
#endif
}

// Step s's directly read fragments (timing layout: fragment (r, q) of the
// m / 16 x k / 16 (n / 16 x k / 16 for B) grid at word (r * k / 16 + q) *
// 32 + invocation) into the *_nxt registers.
void load_direct(uint s) {
#if A_DIRECT
    [[unroll]] for (uint i = 0; i < 4; i++) {
        [[unroll]] for (uint q = 0; q < KF; q++) {
            fa_nxt[i * KF + q] = a[fa_first + i * (p.k / 16) * 32 + (s * KF + q) * 32];
        }
    }
#endif
#if B_DIRECT
    [[unroll]] for (uint j = 0; j < TN; j++) {
        [[unroll]] for (uint q = 0; q < KF; q++) {
            fb_nxt[j * KF + q] = b[fb_first + j * (p.k / 16) * 32 + (s * KF + q) * 32];
        }
    }
#endif
}

void advance_direct() {
#if A_DIRECT
    fa_cur = fa_nxt;
#endif
#if B_DIRECT
    fb_cur = fb_nxt;
#endif
}

// A fragment of type T from this invocation's 16 bytes: its 8 elements in
// the device's own order (GLSL has no generics, hence the macro).
#define FRAGMENT_FROM_WORDS(T, NAME)                       \
    T NAME(uvec4 w) {                                      \
        T f;                                               \
        [[unroll]] for (uint e = 0; e < 4; e++) {          \
            f16vec2 h = unpackFloat2x16(w[e]);             \
            f[2 * e] = h.x;                                \
            f[2 * e + 1] = h.y;                            \
        }                                                  \
        return f;                                          \
    }
FRAGMENT_FROM_WORDS(FRAG_A, frag_a)
#if FN == 16
FRAGMENT_FROM_WORDS(FRAG_B, frag_b)
#endif

// The registers into workgroup stage `st`.
void store_step(uint st) {
#if !A_DIRECT
    [[unroll]] for (uint i = 0; i < A_WORDS; i++) {
        uint e = sidx + i * STAGERS;
        sa[st * SA_STAGE + (e / KW) * SA_STRIDE + e % KW] = ra[i];
    }
#endif
#if !B_DIRECT
    [[unroll]] for (uint i = 0; i < B_WORDS; i++) {
        uint e = sidx + i * STAGERS;
#if NN
        sb[st * SB_STAGE + (e / (BN / 8)) * SB_STRIDE + e % (BN / 8)] = rb[i];
#else
        sb[st * SB_STAGE + (e / KW) * SB_STRIDE + e % KW] = rb[i];
#endif
    }
#endif
}

// One 16-deep slice (kk, in halves) of stage `st`: 4 A and TN B
// fragments, 4 x TN multiply-adds.
void math_slice(uint st, uint kk) {
    FRAG_A fa[4];
    FRAG_B fb[TN];
    [[unroll]] for (uint i = 0; i < 4; i++) {
#if A_DIRECT
        fa[i] = frag_a(fa_cur[i * KF + kk / 16]);
#else
        coopMatLoad(fa[i], sa, st * SA_STAGE + (wr + i * 16) * SA_STRIDE + kk / 8, SA_STRIDE,
                    gl_CooperativeMatrixLayoutRowMajor);
#endif
    }
    [[unroll]] for (uint j = 0; j < TN; j++) {
#if B_DIRECT
        fb[j] = frag_b(fb_cur[j * KF + kk / 16]);
#elif NN
        coopMatLoad(fb[j], sb, st * SB_STAGE + kk * SB_STRIDE + (wc + j * FN) / 8, SB_STRIDE,
                    gl_CooperativeMatrixLayoutRowMajor);
#else
        coopMatLoad(fb[j], sb, st * SB_STAGE + (wc + j * FN) * SB_STRIDE + kk / 8, SB_STRIDE,
                    gl_CooperativeMatrixLayoutColumnMajor);
#endif
    }
    [[unroll]] for (uint i = 0; i < 4; i++) {
        [[unroll]] for (uint j = 0; j < TN; j++) {
            acc[i * TN + j] = coopMatMulAdd(fa[i], fb[j], acc[i * TN + j]);
        }
    }
}

void math_step(uint st) {
    [[unroll]] for (uint kk = 0; kk < BK; kk += 16) {
        math_slice(st, kk);
    }
}

// The logits GEMM's row statistics (headkl_core::toolkit::RowStats), when
// p.stats_offset is not 0: for each row and 32-column group of the
// subgroup's block, (m, sum of exp(x - m)) over the real columns
// (< p.stats_cols), a NaN sum where one is not finite. Computed from the
// accumulators, 16 rows x 32 columns at a time through the subgroup's own
// part of sa (free since the main loop's last barrier), so C is never read
// back. The logits layout with A staged only (the production tiles).
#define ROW_STATS (!NN && !A_DIRECT)
#if ROW_STATS
const uint STATS_STRIDE = 9;
void row_stats() {
    uint base = gl_SubgroupID * 16 * STATS_STRIDE;
    uint lane = gl_SubgroupInvocationID;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        [[unroll]] for (uint g = 0; g < BN / SGC / 32; g++) {
            [[unroll]] for (uint j = 0; j < 32 / FN; j++) {
                OUT r = OUT(acc[i * TN + g * (32 / FN) + j]) * p.alpha;
                coopMatStore(r, sa, base + j * (FN / 4), STATS_STRIDE, gl_CooperativeMatrixLayoutRowMajor);
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            // Two lanes a row, 16 columns each: the max, then 16
            // independent exponentials (a running fold would chain them).
            uint r16 = lane / 2;
            uint half_col = (lane % 2) * 16;
            uint row = row0 + wr + i * 16 + r16;
            uint col = col0 + wc + g * 32;
            uint at = base + r16 * STATS_STRIDE + (lane % 2) * 4;
            float m4[4] = float[4](-3.0e38, -3.0e38, -3.0e38, -3.0e38);
            bool bad = false;
            [[unroll]] for (uint w = 0; w < 4; w++) {
                vec4 x4 = uintBitsToFloat(sa[at + w]);
                [[unroll]] for (uint e = 0; e < 4; e++) {
                    float x = x4[e];
                    if (col + half_col + w * 4 + e < p.stats_cols) {
                        if (isnan(x) || isinf(x)) {
                            bad = true;
                        } else {
                            m4[e] = max(m4[e], x);
                        }
                    }
                }
            }
            float m = max(max(m4[0], m4[1]), max(m4[2], m4[3]));
            m = max(m, subgroupShuffleXor(m, 1));
            vec4 s4 = vec4(0.0);
            [[unroll]] for (uint w = 0; w < 4; w++) {
                vec4 x4 = uintBitsToFloat(sa[at + w]);
                [[unroll]] for (uint e = 0; e < 4; e++) {
                    float x = x4[e];
                    bool real = col + half_col + w * 4 + e < p.stats_cols && !(isnan(x) || isinf(x));
                    s4[e] += real ? exp(x - m) : 0.0;
                }
            }
            float s = (s4.x + s4.y) + (s4.z + s4.w);
            s += subgroupShuffleXor(s, 1);
            bad = bad || subgroupShuffleXor(uint(bad), 1) != 0;
            if (lane % 2 == 0 && row < p.m && col < p.n) {
                uint o = p.stats_offset + row * 2 * p.stats_ld + 2 * (p.stats_first + col / 32);
                c[o] = m;
                c[o + 1] = bad ? uintBitsToFloat(0x7fc00000u) : s;
            }
            subgroupBarrier();
        }
    }
}
#endif

// C (+)= alpha * acc for the subgroup's 16 x 16 tiles inside m x n.
void epilogue() {
    [[unroll]] for (uint i = 0; i < 4; i++) {
        [[unroll]] for (uint j = 0; j < TN; j++) {
            uint row = row0 + wr + i * 16;
            uint col = col0 + wc + j * FN;
            if (row < p.m && col < p.n) {
                uint o = c_off + row * p.ldc + col;
                OUT r = OUT(acc[i * TN + j]) * p.alpha;
                if (p.accumulate != 0) {
                    OUT prev;
                    coopMatLoad(prev, c, o, p.ldc, gl_CooperativeMatrixLayoutRowMajor);
                    r = r + prev;
                }
                coopMatStore(r, c, o, p.ldc, gl_CooperativeMatrixLayoutRowMajor);
            }
        }
    }
#if ROW_STATS
    if (p.stats_offset != 0) {
        row_stats();
    }
#endif
}

#if FILTER
#if !NN || MODE != 0 || TALL || A_READ != 0 || B_READ != 0 || LOAD_KIND != 0
#error "FILTER is the production dx GEMM's (NN, MODE 0, staged operands)"
#endif
// The dx GEMM's block filter (headkl_core::problem::filter): mask word `w` of A's
// row `row`, stored after A's m rows as four halves of 8 bits each (8
// bytes: half of a 16-byte word).
uint mask_word(uint row, uint w) {
    uint at = p.m * p.lda + 4 * (row * p.mask_ld + w);
    uvec4 v = a[at / 8];
    bool low = (at % 8) == 0;
    vec2 l = unpackHalf2x16(low ? v.x : v.z);
    vec2 h = unpackHalf2x16(low ? v.y : v.w);
    return uint(l.x) | (uint(l.y) << 8) | (uint(h.x) << 16) | (uint(h.y) << 24);
}

// The first step at or after `s` whose 64-column block is set in some row
// of the tile that has a mask (`steps` when none is left). `cur` caches
// (window, bits): the OR of the tile's rows' mask words for the
// 2048-column window last read. Each subgroup ORs the rows on its own (no
// barrier, no workgroup memory), so every invocation gets the same answer
// and the loops that use it stay uniform. A starts in row 0 (a_offset <
// lda), so step s covers columns a_off + s * BK onward; BK <= 64 keeps a
// step in one block.
uint next_live(uint s, uint steps, inout uvec2 cur) {
    for (; s < steps; s++) {
        uint col = a_off + s * BK;
        uint win = col / 2048;
        if (win != cur.x) {
            cur.x = win;
            uint w = 0;
            for (uint r = gl_SubgroupInvocationID; r < TM; r += 32) {
                if (row0 + r < p.mask_rows) {
                    w |= mask_word(row0 + r, win);
                }
            }
            cur.y = subgroupOr(w);
        }
        if (((cur.y >> ((col / 64) % 32)) & 1) != 0) {
            return s;
        }
    }
    return steps;
}
#endif

// Start of part k0 of the reduction in B, and this invocation's index among
// the staging invocations.
#if NN
#define PART_B_OFFSET(k0) k0 * p.ldb
#else
#define PART_B_OFFSET(k0) k0
#endif
#if WS
#define STAGER_INDEX gl_LocalInvocationIndex - MATH_THREADS
#else
#define STAGER_INDEX gl_LocalInvocationIndex
#endif

// Opens main(): places the workgroup on its C tile and split-K part (or
// returns when the grid's rounding left it none), sets the invocation's
// roles and first addresses, declares `steps` (BK-deep steps of its part)
// and zeroes the accumulators. PARTS: the split-K parts the kernel runs;
// PART_LEN: the length of this part's reduction, which starts at k0.
#define ENTER_TILE(PARTS, PART_LEN) \
    uint tiles_m = (p.m + TM - 1) / TM;                                           \
    uint tiles_n = (p.n + BN - 1) / BN;                                           \
    uint tiles = tiles_m * tiles_n;                                               \
    uint l = gl_WorkGroupID.x + gl_WorkGroupID.y * p.grid_x;                      \
    uint parts = PARTS;                                                           \
    if (l >= tiles * parts) {                                                     \
        return;                                                                   \
    }                                                                             \
    uint part = l / tiles;                                                        \
    uint tile = l % tiles;                                                        \
    row0 = (tile % tiles_m) * TM;                                                 \
    col0 = (tile / tiles_m) * BN;                                                 \
    uint k0 = min(part * p.k_part, p.k);                                          \
    kp = PART_LEN;                                                                \
    a_off = p.a_offset + k0;                                                      \
    b_off = PART_B_OFFSET(k0);                                                    \
    c_off = p.c_offset + part * p.c_part_stride;                                  \
    wr = (gl_SubgroupID / SGC) * 64;                                              \
    wc = (gl_SubgroupID % SGC) * (BN / SGC);                                      \
    sidx = STAGER_INDEX;                                                          \
    set_addresses();                                                              \
    fa_first = ((row0 + wr) / 16) * (p.k / 16) * 32 + gl_SubgroupInvocationID;    \
    fb_first = ((col0 + wc) / 16) * (p.k / 16) * 32 + gl_SubgroupInvocationID;    \
    uint steps = (kp + BK - 1) / BK;                                              \
    [[unroll]] for (uint t = 0; t < 4 * TN; t++) {                                \
        acc[t] = ACC(0.0);                                                        \
    }
