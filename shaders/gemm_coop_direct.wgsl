// The matrix-unit GEMM without workgroup memory: C (+)= alpha * A * op(B) on
// cooperative matrices (16x16x16 f16 x f16 -> f32), every operand fragment
// loaded straight from storage. One subgroup per workgroup owns a 32 x 64
// block of C as 2 x 4 accumulators. See shaders/README.md.
enable f16;
enable wgpu_cooperative_matrix;
// The store guard in store_tile branches on its arguments, which naga's
// uniformity analysis cannot see are workgroup-uniform.
diagnostic(off, derivative_uniformity);

struct GemmParams {
    m: u32,
    n: u32,
    k: u32,
    a_offset: u32,
    lda: u32,
    ldb: u32,
    c_offset: u32,
    ldc: u32,
    alpha: f32,
    accumulate: u32,
    grid_x: u32,
    pad0: u32,
}

@group(0) @binding(0) var<uniform> params: GemmParams;
@group(0) @binding(1) var<storage, read> a: array<f16>;
@group(0) @binding(2) var<storage, read> b: array<f16>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

// The device's (fixed) subgroup size: the workgroup is one subgroup.
override SG_SIZE: u32 = 32u;

// C block per workgroup.
const BM: u32 = 32u;
const BN: u32 = 64u;

struct Tile {
    valid: bool,
    row0: u32,
    col0: u32,
}

fn tile_of(wg: vec3<u32>) -> Tile {
    let tiles_m = (params.m + BM - 1u) / BM;
    let tiles_n = (params.n + BN - 1u) / BN;
    let l = wg.x + wg.y * params.grid_x;
    return Tile(l < tiles_m * tiles_n, (l % tiles_m) * BM, (l / tiles_m) * BN);
}

// Row (or column) of a 16-wide fragment at `start`, moved back inside
// `extent` (a multiple of 16): a fragment past m or n reads a valid one and
// is never stored.
fn inside(start: u32, extent: u32) -> u32 {
    return min(start, extent - 16u);
}

// alpha * acc (+ C) into C's 16 x 16 tile at (row, col), when inside m x n.
fn store_tile(acc: coop_mat16x16<f32, C>, row: u32, col: u32) {
    if row >= params.m || col >= params.n {
        return;
    }
    let o = params.c_offset + row * params.ldc + col;
    let ldc = params.ldc;
    var r = params.alpha * acc;
    if params.accumulate != 0u {
        let prev = coopLoadT<coop_mat16x16<f32, C>>(&c[o], ldc);
        r = r + prev;
    }
    coopStoreT(r, &c[o], ldc);
}

// C = A * B^T with B stored [n][k].
@compute @workgroup_size(SG_SIZE)
fn gemm_nt(@builtin(workgroup_id) wg: vec3<u32>) {
    let t = tile_of(wg);
    if !t.valid {
        return;
    }
    let lda = params.lda;
    let ldb = params.ldb;
    let ra0 = params.a_offset + inside(t.row0 + 0u, params.m) * lda;
    let ra1 = params.a_offset + inside(t.row0 + 16u, params.m) * lda;
    let cb0 = inside(t.col0 + 0u, params.n);
    let cb1 = inside(t.col0 + 16u, params.n);
    let cb2 = inside(t.col0 + 32u, params.n);
    let cb3 = inside(t.col0 + 48u, params.n);
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c02 = coop_mat16x16<f32, C>();
    var c03 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c12 = coop_mat16x16<f32, C>();
    var c13 = coop_mat16x16<f32, C>();
    for (var k0 = 0u; k0 < params.k; k0 += 16u) {
        let oa0 = ra0 + k0;
        let a0 = coopLoadT<coop_mat16x16<f16, A>>(&a[oa0], lda);
        let oa1 = ra1 + k0;
        let a1 = coopLoadT<coop_mat16x16<f16, A>>(&a[oa1], lda);
        let ob0 = cb0 * ldb + k0;
        let b0 = coopLoad<coop_mat16x16<f16, B>>(&b[ob0], ldb);
        c00 = coopMultiplyAdd(a0, b0, c00);
        c10 = coopMultiplyAdd(a1, b0, c10);
        let ob1 = cb1 * ldb + k0;
        let b1 = coopLoad<coop_mat16x16<f16, B>>(&b[ob1], ldb);
        c01 = coopMultiplyAdd(a0, b1, c01);
        c11 = coopMultiplyAdd(a1, b1, c11);
        let ob2 = cb2 * ldb + k0;
        let b2 = coopLoad<coop_mat16x16<f16, B>>(&b[ob2], ldb);
        c02 = coopMultiplyAdd(a0, b2, c02);
        c12 = coopMultiplyAdd(a1, b2, c12);
        let ob3 = cb3 * ldb + k0;
        let b3 = coopLoad<coop_mat16x16<f16, B>>(&b[ob3], ldb);
        c03 = coopMultiplyAdd(a0, b3, c03);
        c13 = coopMultiplyAdd(a1, b3, c13);
    }
    store_tile(c00, t.row0 + 0u, t.col0 + 0u);
    store_tile(c01, t.row0 + 0u, t.col0 + 16u);
    store_tile(c02, t.row0 + 0u, t.col0 + 32u);
    store_tile(c03, t.row0 + 0u, t.col0 + 48u);
    store_tile(c10, t.row0 + 16u, t.col0 + 0u);
    store_tile(c11, t.row0 + 16u, t.col0 + 16u);
    store_tile(c12, t.row0 + 16u, t.col0 + 32u);
    store_tile(c13, t.row0 + 16u, t.col0 + 48u);
}

// C = A * B with B stored [k][n].
@compute @workgroup_size(SG_SIZE)
fn gemm_nn(@builtin(workgroup_id) wg: vec3<u32>) {
    let t = tile_of(wg);
    if !t.valid {
        return;
    }
    let lda = params.lda;
    let ldb = params.ldb;
    let ra0 = params.a_offset + inside(t.row0 + 0u, params.m) * lda;
    let ra1 = params.a_offset + inside(t.row0 + 16u, params.m) * lda;
    let cb0 = inside(t.col0 + 0u, params.n);
    let cb1 = inside(t.col0 + 16u, params.n);
    let cb2 = inside(t.col0 + 32u, params.n);
    let cb3 = inside(t.col0 + 48u, params.n);
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c02 = coop_mat16x16<f32, C>();
    var c03 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c12 = coop_mat16x16<f32, C>();
    var c13 = coop_mat16x16<f32, C>();
    for (var k0 = 0u; k0 < params.k; k0 += 16u) {
        let oa0 = ra0 + k0;
        let a0 = coopLoadT<coop_mat16x16<f16, A>>(&a[oa0], lda);
        let oa1 = ra1 + k0;
        let a1 = coopLoadT<coop_mat16x16<f16, A>>(&a[oa1], lda);
        let ob0 = k0 * ldb + cb0;
        let b0 = coopLoadT<coop_mat16x16<f16, B>>(&b[ob0], ldb);
        c00 = coopMultiplyAdd(a0, b0, c00);
        c10 = coopMultiplyAdd(a1, b0, c10);
        let ob1 = k0 * ldb + cb1;
        let b1 = coopLoadT<coop_mat16x16<f16, B>>(&b[ob1], ldb);
        c01 = coopMultiplyAdd(a0, b1, c01);
        c11 = coopMultiplyAdd(a1, b1, c11);
        let ob2 = k0 * ldb + cb2;
        let b2 = coopLoadT<coop_mat16x16<f16, B>>(&b[ob2], ldb);
        c02 = coopMultiplyAdd(a0, b2, c02);
        c12 = coopMultiplyAdd(a1, b2, c12);
        let ob3 = k0 * ldb + cb3;
        let b3 = coopLoadT<coop_mat16x16<f16, B>>(&b[ob3], ldb);
        c03 = coopMultiplyAdd(a0, b3, c03);
        c13 = coopMultiplyAdd(a1, b3, c13);
    }
    store_tile(c00, t.row0 + 0u, t.col0 + 0u);
    store_tile(c01, t.row0 + 0u, t.col0 + 16u);
    store_tile(c02, t.row0 + 0u, t.col0 + 32u);
    store_tile(c03, t.row0 + 0u, t.col0 + 48u);
    store_tile(c10, t.row0 + 16u, t.col0 + 0u);
    store_tile(c11, t.row0 + 16u, t.col0 + 16u);
    store_tile(c12, t.row0 + 16u, t.col0 + 32u);
    store_tile(c13, t.row0 + 16u, t.col0 + 48u);
}
