// The matrix-unit GEMM: C (+)= alpha * A * op(B) on cooperative matrices
// (16x16x16 f16 x f16 -> f32), staged through workgroup memory.
// See shaders/README.md for the interface.
enable f16;
enable wgpu_cooperative_matrix;
// Cooperative ops sit under per-subgroup guards (uniform within a subgroup,
// not across the workgroup).
diagnostic(off, derivative_uniformity);

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

// f16 buffers read 8 halves (16 bytes) at a time.
@group(0) @binding(1) var<storage, read> a: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> b: array<vec4<u32>>;
// C (binding 3): shaders/gemm_common.wgsl.

// The device's (fixed) subgroup size: the workgroup is SG_ROWS x 2 subgroups.
override SG_SIZE: u32 = 32u;
// K staged per step: 16, 32 or 64.
override BK: u32 = 32u;

// Rows of subgroups: the workgroup is SG_ROWS x 2 subgroups, each owning
// 64 x 64 of a (64 * SG_ROWS) x 128 C tile. 2 or 4.
override SG_ROWS: u32 = 2u;
// Workgroup-memory stages, 1 or 2. With 2, the global loads of step s + 1
// are issued into registers before step s multiplies (their latency hides
// behind the matrix units) and land in the other buffer: one barrier a step.
override STAGES: u32 = 2u;
// With one stage: load step s + 1 into registers before step s multiplies
// (as two stages do), then store it between two barriers.
override PREFETCH: bool = false;
// C tile per workgroup.
override BM: u32 = 64u * SG_ROWS;
const BN: u32 = 128u;
override THREADS: u32 = 2u * SG_ROWS * SG_SIZE;
// Row padding of the staged tiles, in halves, against bank conflicts; keeps
// every staged row 16-byte aligned.
const PAD: u32 = 8u;
// Halves per stage: A [BM][BK + PAD]; B [BN][BK + PAD] (nt) or
// [BK][BN + PAD] (nn, never larger since BN >= BK).
override SA_STAGE: u32 = BM * (BK + PAD);
override SB_STAGE: u32 = BN * (BK + PAD);
// 16-byte words each invocation loads per step: A's are BM * BK / 8 over
// THREADS = 64 * SG_ROWS invocations, B's 128 * BK / 8 over the same.
override A_WORDS: u32 = BK / 8u;
override B_WORDS: u32 = BK / (4u * SG_ROWS);

var<workgroup> sa: array<f16, STAGES * SA_STAGE>;
var<workgroup> sb: array<f16, STAGES * SB_STAGE>;

// `Tile` and `tile_of`: shaders/gemm_common.wgsl.

// One invocation's share of a step's A and B tiles, held in registers
// between the global load and the workgroup store (at most 8 words each:
// BK <= 64).
struct Words {
    a0: vec4<u32>,
    a1: vec4<u32>,
    a2: vec4<u32>,
    a3: vec4<u32>,
    a4: vec4<u32>,
    a5: vec4<u32>,
    a6: vec4<u32>,
    a7: vec4<u32>,
    b0: vec4<u32>,
    b1: vec4<u32>,
    b2: vec4<u32>,
    b3: vec4<u32>,
    b4: vec4<u32>,
    b5: vec4<u32>,
    b6: vec4<u32>,
    b7: vec4<u32>,
}

// Word `e` of a K-contiguous tile (BK wide) for K step k0 of the part: A's
// (is_a) rows, or B's stored [n][k] (nt) columns. Rows past m (columns past
// n) repeat the last one: their products only reach C that is never stored.
// K past the part's end reads zeros. (`is_a` is a constant at every call:
// the driver folds the selects away.)
fn load_k_rows(is_a: bool, t: Tile, k0: u32, e: u32) -> vec4<u32> {
    let chunks = BK / 8u;
    let kk = k0 + (e % chunks) * 8u;
    if kk >= t.k {
        return vec4<u32>(0u);
    }
    let row = min(select(t.col0, t.row0, is_a) + e / chunks, select(params.n, params.m, is_a) - 1u);
    let o = select(t.b_off + row * params.ldb, t.a_off + row * params.lda, is_a) + kk;
    if is_a {
        return a[o / 8u];
    }
    return b[o / 8u];
}

// Word `e` of A's tile for K step k0.
fn load_a(t: Tile, k0: u32, e: u32) -> vec4<u32> {
    return load_k_rows(true, t, k0, e);
}

// Word `e` of B's tile for K step k0: nt as A's (load_k_rows); nn reads B
// stored [k][n] along n (the last 8 columns repeat past n; K past the
// part's end reads zeros).
fn load_b(nn: bool, t: Tile, k0: u32, e: u32) -> vec4<u32> {
    if !nn {
        return load_k_rows(false, t, k0, e);
    }
    let chunks = BN / 8u;
    let kk = k0 + e / chunks;
    let col = min(t.col0 + (e % chunks) * 8u, params.n - 8u);
    if kk >= t.k {
        return vec4<u32>(0u);
    }
    return b[(t.b_off + kk * params.ldb + col) / 8u];
}

// This invocation's words of the step at k0 (word i is element lid + i * THREADS).
fn load_words(nn: bool, t: Tile, k0: u32, lid: u32) -> Words {
    var w: Words;
    w.a0 = load_a(t, k0, lid);
    w.b0 = load_b(nn, t, k0, lid);
    if A_WORDS > 1u {
        w.a1 = load_a(t, k0, lid + THREADS);
    }
    if B_WORDS > 1u {
        w.b1 = load_b(nn, t, k0, lid + THREADS);
    }
    if A_WORDS > 2u {
        w.a2 = load_a(t, k0, lid + 2u * THREADS);
        w.a3 = load_a(t, k0, lid + 3u * THREADS);
    }
    if B_WORDS > 2u {
        w.b2 = load_b(nn, t, k0, lid + 2u * THREADS);
        w.b3 = load_b(nn, t, k0, lid + 3u * THREADS);
    }
    if A_WORDS > 4u {
        w.a4 = load_a(t, k0, lid + 4u * THREADS);
        w.a5 = load_a(t, k0, lid + 5u * THREADS);
        w.a6 = load_a(t, k0, lid + 6u * THREADS);
        w.a7 = load_a(t, k0, lid + 7u * THREADS);
    }
    if B_WORDS > 4u {
        w.b4 = load_b(nn, t, k0, lid + 4u * THREADS);
        w.b5 = load_b(nn, t, k0, lid + 5u * THREADS);
        w.b6 = load_b(nn, t, k0, lid + 6u * THREADS);
        w.b7 = load_b(nn, t, k0, lid + 7u * THREADS);
    }
    return w;
}

// Writes half `h` to `sa` (is_a) or `sb` at `o` (`is_a` is a constant at
// every call: the driver folds the branch away).
fn put1(is_a: bool, o: u32, h: f16) {
    if is_a {
        sa[o] = h;
    } else {
        sb[o] = h;
    }
}

// Writes the 8 halves packed in `w` to `sa` (is_a) or `sb` at [o, o + 8).
// (naga's bitcast cannot change the width, hence the exact f16 -> f32 -> f16
// trip.)
fn put8(is_a: bool, o: u32, w: vec4<u32>) {
    let h0 = vec2<f16>(unpack2x16float(w.x));
    let h1 = vec2<f16>(unpack2x16float(w.y));
    let h2 = vec2<f16>(unpack2x16float(w.z));
    let h3 = vec2<f16>(unpack2x16float(w.w));
    put1(is_a, o, h0.x);
    put1(is_a, o + 1u, h0.y);
    put1(is_a, o + 2u, h1.x);
    put1(is_a, o + 3u, h1.y);
    put1(is_a, o + 4u, h2.x);
    put1(is_a, o + 5u, h2.y);
    put1(is_a, o + 6u, h3.x);
    put1(is_a, o + 7u, h3.y);
}

// Where word e of A lands in its stage.
fn put_a(stage: u32, e: u32, w: vec4<u32>) {
    let chunks = BK / 8u;
    put8(true, stage * SA_STAGE + (e / chunks) * (BK + PAD) + (e % chunks) * 8u, w);
}

// Where word e of B lands in its stage: nt [BN][BK + PAD], nn [BK][BN + PAD].
fn put_b(nn: bool, stage: u32, e: u32, w: vec4<u32>) {
    if nn {
        let chunks = BN / 8u;
        put8(false, stage * SB_STAGE + (e / chunks) * (BN + PAD) + (e % chunks) * 8u, w);
    } else {
        let chunks = BK / 8u;
        put8(false, stage * SB_STAGE + (e / chunks) * (BK + PAD) + (e % chunks) * 8u, w);
    }
}

fn store_words(nn: bool, stage: u32, lid: u32, w: Words) {
    put_a(stage, lid, w.a0);
    put_b(nn, stage, lid, w.b0);
    if A_WORDS > 1u {
        put_a(stage, lid + THREADS, w.a1);
    }
    if B_WORDS > 1u {
        put_b(nn, stage, lid + THREADS, w.b1);
    }
    if A_WORDS > 2u {
        put_a(stage, lid + 2u * THREADS, w.a2);
        put_a(stage, lid + 3u * THREADS, w.a3);
    }
    if B_WORDS > 2u {
        put_b(nn, stage, lid + 2u * THREADS, w.b2);
        put_b(nn, stage, lid + 3u * THREADS, w.b3);
    }
    if A_WORDS > 4u {
        put_a(stage, lid + 4u * THREADS, w.a4);
        put_a(stage, lid + 5u * THREADS, w.a5);
        put_a(stage, lid + 6u * THREADS, w.a6);
        put_a(stage, lid + 7u * THREADS, w.a7);
    }
    if B_WORDS > 4u {
        put_b(nn, stage, lid + 4u * THREADS, w.b4);
        put_b(nn, stage, lid + 5u * THREADS, w.b5);
        put_b(nn, stage, lid + 6u * THREADS, w.b6);
        put_b(nn, stage, lid + 7u * THREADS, w.b7);
    }
}

// `Acc` (the accumulators), `store_tile` and `store_block`: shaders/gemm_coop_common.wgsl.

// Fragment of stage `base`'s B tile for output columns [col, col + 16) and K
// rows [ks, ks + 16): staged [BN][BK + PAD] (nt: a column-major fragment) or
// [BK][BN + PAD] (nn: row-major).
fn frag_b(nn: bool, base: u32, col: u32, ks: u32) -> coop_mat16x16<f16, B> {
    if nn {
        let ld = BN + PAD;
        let o = base + ks * ld + col;
        return coopLoadT<coop_mat16x16<f16, B>>(&sb[o], ld);
    }
    let ld = BK + PAD;
    let o = base + col * ld + ks;
    return coopLoad<coop_mat16x16<f16, B>>(&sb[o], ld);
}

// One K step of the stage at (base_a, base_b) into the subgroup's 4 x 4
// accumulators (cIJ: rows sm + 16·I, columns sn + 16·J of the tile), 16
// deep at a time: its 4 A fragments, then each B fragment and its 4
// multiply-adds.
fn mma_step(nn: bool, base_a: u32, base_b: u32, sm: u32, sn: u32, acc: ptr<function, Acc>) {
    let lda_s = BK + PAD;
    for (var ks = 0u; ks < BK; ks += 16u) {
        let oa0 = base_a + (sm + 0u) * lda_s + ks;
        let a0 = coopLoadT<coop_mat16x16<f16, A>>(&sa[oa0], lda_s);
        let oa1 = base_a + (sm + 16u) * lda_s + ks;
        let a1 = coopLoadT<coop_mat16x16<f16, A>>(&sa[oa1], lda_s);
        let oa2 = base_a + (sm + 32u) * lda_s + ks;
        let a2 = coopLoadT<coop_mat16x16<f16, A>>(&sa[oa2], lda_s);
        let oa3 = base_a + (sm + 48u) * lda_s + ks;
        let a3 = coopLoadT<coop_mat16x16<f16, A>>(&sa[oa3], lda_s);
        let b0 = frag_b(nn, base_b, sn + 0u, ks);
        (*acc).c00 = coopMultiplyAdd(a0, b0, (*acc).c00);
        (*acc).c10 = coopMultiplyAdd(a1, b0, (*acc).c10);
        (*acc).c20 = coopMultiplyAdd(a2, b0, (*acc).c20);
        (*acc).c30 = coopMultiplyAdd(a3, b0, (*acc).c30);
        let b1 = frag_b(nn, base_b, sn + 16u, ks);
        (*acc).c01 = coopMultiplyAdd(a0, b1, (*acc).c01);
        (*acc).c11 = coopMultiplyAdd(a1, b1, (*acc).c11);
        (*acc).c21 = coopMultiplyAdd(a2, b1, (*acc).c21);
        (*acc).c31 = coopMultiplyAdd(a3, b1, (*acc).c31);
        let b2 = frag_b(nn, base_b, sn + 32u, ks);
        (*acc).c02 = coopMultiplyAdd(a0, b2, (*acc).c02);
        (*acc).c12 = coopMultiplyAdd(a1, b2, (*acc).c12);
        (*acc).c22 = coopMultiplyAdd(a2, b2, (*acc).c22);
        (*acc).c32 = coopMultiplyAdd(a3, b2, (*acc).c32);
        let b3 = frag_b(nn, base_b, sn + 48u, ks);
        (*acc).c03 = coopMultiplyAdd(a0, b3, (*acc).c03);
        (*acc).c13 = coopMultiplyAdd(a1, b3, (*acc).c13);
        (*acc).c23 = coopMultiplyAdd(a2, b3, (*acc).c23);
        (*acc).c33 = coopMultiplyAdd(a3, b3, (*acc).c33);
    }
}

// A's half `i` (the block filter's mask words: gemm_common.wgsl).
fn a_half(i: u32) -> f32 {
    let w = a[i / 8u];
    return unpack2x16float(w[(i % 8u) / 2u])[i % 2u];
}

// The whole kernel for either layout of B, with or without the block
// filter (`nn` and `filtered` are constants at each entry point, so the
// driver folds their branches away: without the filter the loop is the
// unfiltered GEMM's).
fn gemm(wg: vec3<u32>, lid: u32, sg: u32, nn: bool, filtered: bool) {
    let t = tile_of(wg, nn, BM, BN);
    if !t.valid {
        return;
    }
    // This subgroup's 64 x 64 block of the workgroup tile.
    let sm = (sg / 2u) * 64u;
    let sn = (sg % 2u) * 64u;
    var acc = Acc();
    let steps = (t.k + BK - 1u) / BK;
    if filtered {
        // The block filter (gemm_common.wgsl's next_live): only the K steps
        // whose 64-column block some row of the tile keeps, each loaded,
        // stored to stage 0 and multiplied between two barriers.
        var cur = mask_cursor();
        var s = next_live(true, &cur, t, BM, 0u, steps, BK);
        while s < steps {
            let w = load_words(nn, t, s * BK, lid);
            store_words(nn, 0u, lid, w);
            workgroupBarrier();
            mma_step(nn, 0u, 0u, sm, sn, &acc);
            workgroupBarrier();
            s = next_live(true, &cur, t, BM, s + 1u, steps, BK);
        }
    } else {
        var words = load_words(nn, t, 0u, lid);
        store_words(nn, 0u, lid, words);
        workgroupBarrier();
        for (var kstep = 0u; kstep < steps; kstep++) {
            let stage = kstep % STAGES;
            if STAGES == 2u || PREFETCH {
                // The last step reloads its own tiles (in range, never stored)
                // so the loads stay unconditional.
                words = load_words(nn, t, min(kstep + 1u, steps - 1u) * BK, lid);
            }
            mma_step(nn, stage * SA_STAGE, stage * SB_STAGE, sm, sn, &acc);
            if kstep + 1u < steps {
                if STAGES == 2u {
                    // The other stage was last read in step - 1, before the
                    // barrier that ended it.
                    store_words(nn, (kstep + 1u) % 2u, lid, words);
                } else {
                    workgroupBarrier();
                    if !PREFETCH {
                        words = load_words(nn, t, (kstep + 1u) * BK, lid);
                    }
                    store_words(nn, 0u, lid, words);
                }
            }
            workgroupBarrier();
        }
    }
    store_block(t, t.row0 + sm, t.col0 + sn, acc);
    row_stats(t, BM, BN, lid, 2u * SG_ROWS * SG_SIZE);
}

// C = A * B^T with B stored [n][k].
@compute @workgroup_size(2u * SG_ROWS * SG_SIZE)
fn gemm_logits(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_id) sg: u32) {
    gemm(wg, lid, sg, false, false);
}

// C = A * B with B stored [k][n].
@compute @workgroup_size(2u * SG_ROWS * SG_SIZE)
fn gemm_dx(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_id) sg: u32) {
    gemm(wg, lid, sg, true, false);
}

// gemm_dx with the block filter (headkl_core::problem::filter).
@compute @workgroup_size(2u * SG_ROWS * SG_SIZE)
fn gemm_dx_filtered(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_id) sg: u32) {
    gemm(wg, lid, sg, true, true);
}
