
// ---- shaders/gemm_coop_common.wgsl: appended (after gemm_common.wgsl) to
// the two matrix-unit WGSL GEMMs by headkl_core::toolkit::kernels.

// alpha * acc (+ C) into C's 16 x 16 tile at (row, col), when inside m x n.
fn store_tile(t: Tile, acc: coop_mat16x16<f32, C>, row: u32, col: u32) {
    if row >= params.m || col >= params.n {
        return;
    }
    let o = t.c_off + row * params.ldc + col;
    let ldc = params.ldc;
    var r = params.alpha * acc;
    if params.accumulate != 0u {
        let prev = coopLoadT<coop_mat16x16<f32, C>>(&c[o], ldc);
        r = r + prev;
    }
    coopStoreT(r, &c[o], ldc);
}

// A subgroup's 4 x 4 accumulators, 16 x 16 each, for its 64 x 64 block of
// C: cIJ is the tile at (row + 16·I, col + 16·J). One struct, since WGSL
// has no array of cooperative matrices; `Acc()` is all zeros.
struct Acc {
    c00: coop_mat16x16<f32, C>,
    c01: coop_mat16x16<f32, C>,
    c02: coop_mat16x16<f32, C>,
    c03: coop_mat16x16<f32, C>,
    c10: coop_mat16x16<f32, C>,
    c11: coop_mat16x16<f32, C>,
    c12: coop_mat16x16<f32, C>,
    c13: coop_mat16x16<f32, C>,
    c20: coop_mat16x16<f32, C>,
    c21: coop_mat16x16<f32, C>,
    c22: coop_mat16x16<f32, C>,
    c23: coop_mat16x16<f32, C>,
    c30: coop_mat16x16<f32, C>,
    c31: coop_mat16x16<f32, C>,
    c32: coop_mat16x16<f32, C>,
    c33: coop_mat16x16<f32, C>,
}

// The accumulators into C's 64 x 64 block at (row, col) (store_tile:
// alpha, accumulate, tiles outside m x n skipped).
fn store_block(t: Tile, row: u32, col: u32, acc: Acc) {
    store_tile(t, acc.c00, row + 0u, col + 0u);
    store_tile(t, acc.c01, row + 0u, col + 16u);
    store_tile(t, acc.c02, row + 0u, col + 32u);
    store_tile(t, acc.c03, row + 0u, col + 48u);
    store_tile(t, acc.c10, row + 16u, col + 0u);
    store_tile(t, acc.c11, row + 16u, col + 16u);
    store_tile(t, acc.c12, row + 16u, col + 32u);
    store_tile(t, acc.c13, row + 16u, col + 48u);
    store_tile(t, acc.c20, row + 32u, col + 0u);
    store_tile(t, acc.c21, row + 32u, col + 16u);
    store_tile(t, acc.c22, row + 32u, col + 32u);
    store_tile(t, acc.c23, row + 32u, col + 48u);
    store_tile(t, acc.c30, row + 48u, col + 0u);
    store_tile(t, acc.c31, row + 48u, col + 16u);
    store_tile(t, acc.c32, row + 48u, col + 32u);
    store_tile(t, acc.c33, row + 48u, col + 48u);
}
