// The matrix-unit GEMM without workgroup memory: C (+)= alpha * A * op(B) on
// cooperative matrices (16x16x16 f16 x f16 -> f32), every operand fragment
// loaded straight from storage. One subgroup per workgroup owns a 64 x 64
// block of C as 4 x 4 accumulators. See shaders/README.md.
enable f16;
enable wgpu_cooperative_matrix;
// The store guard in store_tile branches on its arguments, which naga's
// uniformity analysis cannot see are workgroup-uniform.
diagnostic(off, derivative_uniformity);

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

@group(0) @binding(1) var<storage, read> a: array<f16>;
@group(0) @binding(2) var<storage, read> b: array<f16>;
// C (binding 3): shaders/gemm_common.wgsl.

// The device's (fixed) subgroup size: the workgroup is one subgroup.
override SG_SIZE: u32 = 32u;

// C block per workgroup.
const BM: u32 = 64u;
const BN: u32 = 64u;

// `Tile` and `tile_of`: shaders/gemm_common.wgsl.

// Row (or column) of a 16-wide fragment at `start`, moved back inside
// `extent` (a multiple of 16): a fragment past m or n reads a valid one and
// is never stored.
fn inside(start: u32, extent: u32) -> u32 {
    return min(start, extent - 16u);
}

// `Acc` (the accumulators), `store_tile` and `store_block`: shaders/gemm_coop_common.wgsl.

// Fragment of B for output columns [col, col + 16) and K rows [kk, kk + 16)
// of the part whose B starts at element b_off:
// B stored [n][k] (nt: a column-major fragment) or [k][n] (nn: row-major).
fn load_b(nn: bool, b_off: u32, col: u32, kk: u32) -> coop_mat16x16<f16, B> {
    let ldb = params.ldb;
    if nn {
        let o = b_off + kk * ldb + col;
        return coopLoadT<coop_mat16x16<f16, B>>(&b[o], ldb);
    }
    let o = b_off + col * ldb + kk;
    return coopLoad<coop_mat16x16<f16, B>>(&b[o], ldb);
}

// A's half `i` (the block filter's mask words: gemm_common.wgsl).
fn a_half(i: u32) -> f32 {
    return f32(a[i]);
}

// The whole kernel for either layout of B, with or without the block
// filter (`nn` and `filtered` are constants at each entry point, so the
// driver folds their branches away, the one in load_b too).
fn gemm(wg: vec3<u32>, lid: u32, nn: bool, filtered: bool) {
    let blk = tile_of(wg, nn, BM, BN);
    if !blk.valid {
        return;
    }
    let lda = params.lda;
    let ra0 = blk.a_off + inside(blk.row0 + 0u, params.m) * lda;
    let ra1 = blk.a_off + inside(blk.row0 + 16u, params.m) * lda;
    let ra2 = blk.a_off + inside(blk.row0 + 32u, params.m) * lda;
    let ra3 = blk.a_off + inside(blk.row0 + 48u, params.m) * lda;
    let cb0 = inside(blk.col0 + 0u, params.n);
    let cb1 = inside(blk.col0 + 16u, params.n);
    let cb2 = inside(blk.col0 + 32u, params.n);
    let cb3 = inside(blk.col0 + 48u, params.n);
    var acc = Acc();
    // The block filter (gemm_common.wgsl's next_live): only the 16-deep
    // steps whose 64-column block some row of the tile keeps. Without it
    // next_live returns its step, so the loop runs every step.
    let steps = (blk.k + 15u) / 16u;
    var cur = mask_cursor();
    var s = next_live(filtered, &cur, blk, BM, 0u, steps, 16u);
    while s < steps {
        let kk = s * 16u;
        let oa0 = ra0 + kk;
        let a0 = coopLoadT<coop_mat16x16<f16, A>>(&a[oa0], lda);
        let oa1 = ra1 + kk;
        let a1 = coopLoadT<coop_mat16x16<f16, A>>(&a[oa1], lda);
        let oa2 = ra2 + kk;
        let a2 = coopLoadT<coop_mat16x16<f16, A>>(&a[oa2], lda);
        let oa3 = ra3 + kk;
        let a3 = coopLoadT<coop_mat16x16<f16, A>>(&a[oa3], lda);
        let b0 = load_b(nn, blk.b_off, cb0, kk);
        let b1 = load_b(nn, blk.b_off, cb1, kk);
        let b2 = load_b(nn, blk.b_off, cb2, kk);
        let b3 = load_b(nn, blk.b_off, cb3, kk);
        acc.c00 = coopMultiplyAdd(a0, b0, acc.c00);
        acc.c01 = coopMultiplyAdd(a0, b1, acc.c01);
        acc.c02 = coopMultiplyAdd(a0, b2, acc.c02);
        acc.c03 = coopMultiplyAdd(a0, b3, acc.c03);
        acc.c10 = coopMultiplyAdd(a1, b0, acc.c10);
        acc.c11 = coopMultiplyAdd(a1, b1, acc.c11);
        acc.c12 = coopMultiplyAdd(a1, b2, acc.c12);
        acc.c13 = coopMultiplyAdd(a1, b3, acc.c13);
        acc.c20 = coopMultiplyAdd(a2, b0, acc.c20);
        acc.c21 = coopMultiplyAdd(a2, b1, acc.c21);
        acc.c22 = coopMultiplyAdd(a2, b2, acc.c22);
        acc.c23 = coopMultiplyAdd(a2, b3, acc.c23);
        acc.c30 = coopMultiplyAdd(a3, b0, acc.c30);
        acc.c31 = coopMultiplyAdd(a3, b1, acc.c31);
        acc.c32 = coopMultiplyAdd(a3, b2, acc.c32);
        acc.c33 = coopMultiplyAdd(a3, b3, acc.c33);
        s = next_live(filtered, &cur, blk, BM, s + 1u, steps, 16u);
    }
    store_block(blk, blk.row0, blk.col0, acc);
    row_stats(blk, BM, BN, lid, SG_SIZE);
}

// C = A * B^T with B stored [n][k].
@compute @workgroup_size(SG_SIZE)
fn gemm_logits(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    gemm(wg, lid, false, false);
}

// C = A * B with B stored [k][n].
@compute @workgroup_size(SG_SIZE)
fn gemm_dx(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    gemm(wg, lid, true, false);
}

// gemm_dx with the block filter (headkl_core::problem::filter).
@compute @workgroup_size(SG_SIZE)
fn gemm_dx_filtered(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    gemm(wg, lid, true, true);
}
