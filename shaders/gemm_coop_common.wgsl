
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
