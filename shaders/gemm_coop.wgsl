// The matrix-unit GEMM: C (+)= alpha * A * op(B) on cooperative matrices
// (16x16x16 f16 x f16 -> f32), staged through workgroup memory.
// See shaders/README.md for the interface.
enable f16;
enable wgpu_cooperative_matrix;
// Cooperative ops sit under per-subgroup guards (uniform within a subgroup,
// not across the workgroup).
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
// f16 buffers read 8 halves (16 bytes) at a time.
@group(0) @binding(1) var<storage, read> a: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> b: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

// The device's (fixed) subgroup size: the workgroup is SG_ROWS x 2 subgroups.
override SG_SIZE: u32 = 32u;
// K staged per step: 16 or 32.
override BK: u32 = 32u;

// Rows of subgroups: the workgroup is SG_ROWS x 2 subgroups, each owning
// 64 x 64 of a (64 * SG_ROWS) x 128 C tile. 2 or 4.
override SG_ROWS: u32 = 2u;
// C tile per workgroup.
override BM: u32 = 64u * SG_ROWS;
const BN: u32 = 128u;
// Row padding of the staged tiles, in halves, against bank conflicts; keeps
// every staged row 16-byte aligned.
const PAD: u32 = 8u;

// A staged [BM][BK + PAD]; B staged [BN][BK + PAD] (nt) or [BK][BN + PAD] (nn).
var<workgroup> sa: array<f16, BM * (BK + PAD)>;
var<workgroup> sb: array<f16, BN * (BK + PAD)>;

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

// Writes the 8 halves packed in `w` to `sa` or `sb` at [o, o + 8). (naga's
// bitcast cannot change the width, hence the exact f16 -> f32 -> f16 trip.)
fn put8(is_a: bool, o: u32, w: vec4<u32>) {
    let h0 = vec2<f16>(unpack2x16float(w.x));
    let h1 = vec2<f16>(unpack2x16float(w.y));
    let h2 = vec2<f16>(unpack2x16float(w.z));
    let h3 = vec2<f16>(unpack2x16float(w.w));
    if is_a {
        sa[o] = h0.x;
        sa[o + 1u] = h0.y;
        sa[o + 2u] = h1.x;
        sa[o + 3u] = h1.y;
        sa[o + 4u] = h2.x;
        sa[o + 5u] = h2.y;
        sa[o + 6u] = h3.x;
        sa[o + 7u] = h3.y;
    } else {
        sb[o] = h0.x;
        sb[o + 1u] = h0.y;
        sb[o + 2u] = h1.x;
        sb[o + 3u] = h1.y;
        sb[o + 4u] = h2.x;
        sb[o + 5u] = h2.y;
        sb[o + 6u] = h3.x;
        sb[o + 7u] = h3.y;
    }
}

// Stages rows [row0, row0 + nrows) x K [k0, k0 + BK) of a row-major f16
// operand (A: nrows = BM, or B stored [n][k]: nrows = BN) into `sa` or `sb`
// as [nrows][BK + PAD].
// Rows past `rows` repeat row `rows - 1` (their products only reach C tiles
// that are never stored); K past `k` reads zeros.
fn stage_rows(is_a: bool, row0: u32, nrows: u32, rows: u32, offset: u32, ld: u32, k0: u32, lid: u32) {
    let chunks = BK / 8u;
    for (var e = lid; e < nrows * chunks; e += 2u * SG_ROWS * SG_SIZE) {
        let r = e / chunks;
        let ch = e % chunks;
        let row = min(row0 + r, rows - 1u);
        let kk = k0 + ch * 8u;
        let src = (offset + row * ld + kk) / 8u;
        var w = vec4<u32>(0u);
        if kk < params.k {
            if is_a {
                w = a[src];
            } else {
                w = b[src];
            }
        }
        put8(is_a, r * (BK + PAD) + ch * 8u, w);
    }
}

// Stages K rows [k0, k0 + BK) x columns [col0, col0 + 128) of B stored
// [k][n] into `sb` as [BK][BN + PAD]. Columns past n repeat the last 8.
fn stage_b_nn(col0: u32, k0: u32, lid: u32) {
    let chunks = BN / 8u;
    for (var e = lid; e < BK * chunks; e += 2u * SG_ROWS * SG_SIZE) {
        let kr = e / chunks;
        let ch = e % chunks;
        let col = min(col0 + ch * 8u, params.n - 8u);
        let kk = k0 + kr;
        var w = vec4<u32>(0u);
        if kk < params.k {
            w = b[(kk * params.ldb + col) / 8u];
        }
        put8(false, kr * (BN + PAD) + ch * 8u, w);
    }
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

// Fragment of the staged B tile for output columns [col, col + 16) and K
// rows [ks, ks + 16): staged [BN][BK + PAD] (nt: a column-major fragment) or
// [BK][BN + PAD] (nn: row-major).
fn load_b(nn: bool, col: u32, ks: u32) -> coop_mat16x16<f16, B> {
    if nn {
        let ld = BN + PAD;
        let o = ks * ld + col;
        return coopLoadT<coop_mat16x16<f16, B>>(&sb[o], ld);
    }
    let ld = BK + PAD;
    let o = col * ld + ks;
    return coopLoad<coop_mat16x16<f16, B>>(&sb[o], ld);
}

// The whole kernel for either layout of B (`nn` is a constant at each entry
// point, so the driver folds its branches away).
fn gemm(wg: vec3<u32>, lid: u32, sg: u32, nn: bool) {
    let t = tile_of(wg);
    if !t.valid {
        return;
    }
    // This subgroup's 64 x 64 block of the workgroup tile.
    let sm = (sg / 2u) * 64u;
    let sn = (sg % 2u) * 64u;
    let lda_s = BK + PAD;
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c02 = coop_mat16x16<f32, C>();
    var c03 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c12 = coop_mat16x16<f32, C>();
    var c13 = coop_mat16x16<f32, C>();
    var c20 = coop_mat16x16<f32, C>();
    var c21 = coop_mat16x16<f32, C>();
    var c22 = coop_mat16x16<f32, C>();
    var c23 = coop_mat16x16<f32, C>();
    var c30 = coop_mat16x16<f32, C>();
    var c31 = coop_mat16x16<f32, C>();
    var c32 = coop_mat16x16<f32, C>();
    var c33 = coop_mat16x16<f32, C>();
    for (var k0 = 0u; k0 < params.k; k0 += BK) {
        stage_rows(true, t.row0, BM, params.m, params.a_offset, params.lda, k0, lid);
        if nn {
            stage_b_nn(t.col0, k0, lid);
        } else {
            stage_rows(false, t.col0, BN, params.n, 0u, params.ldb, k0, lid);
        }
        workgroupBarrier();
        for (var ks = 0u; ks < BK; ks += 16u) {
            let oa0 = (sm + 0u) * lda_s + ks;
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&sa[oa0], lda_s);
            let oa1 = (sm + 16u) * lda_s + ks;
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&sa[oa1], lda_s);
            let oa2 = (sm + 32u) * lda_s + ks;
            let a2 = coopLoadT<coop_mat16x16<f16, A>>(&sa[oa2], lda_s);
            let oa3 = (sm + 48u) * lda_s + ks;
            let a3 = coopLoadT<coop_mat16x16<f16, A>>(&sa[oa3], lda_s);
            let b0 = load_b(nn, sn + 0u, ks);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c20 = coopMultiplyAdd(a2, b0, c20);
            c30 = coopMultiplyAdd(a3, b0, c30);
            let b1 = load_b(nn, sn + 16u, ks);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c21 = coopMultiplyAdd(a2, b1, c21);
            c31 = coopMultiplyAdd(a3, b1, c31);
            let b2 = load_b(nn, sn + 32u, ks);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c22 = coopMultiplyAdd(a2, b2, c22);
            c32 = coopMultiplyAdd(a3, b2, c32);
            let b3 = load_b(nn, sn + 48u, ks);
            c03 = coopMultiplyAdd(a0, b3, c03);
            c13 = coopMultiplyAdd(a1, b3, c13);
            c23 = coopMultiplyAdd(a2, b3, c23);
            c33 = coopMultiplyAdd(a3, b3, c33);
        }
        workgroupBarrier();
    }
    store_tile(c00, t.row0 + sm + 0u, t.col0 + sn + 0u);
    store_tile(c01, t.row0 + sm + 0u, t.col0 + sn + 16u);
    store_tile(c02, t.row0 + sm + 0u, t.col0 + sn + 32u);
    store_tile(c03, t.row0 + sm + 0u, t.col0 + sn + 48u);
    store_tile(c10, t.row0 + sm + 16u, t.col0 + sn + 0u);
    store_tile(c11, t.row0 + sm + 16u, t.col0 + sn + 16u);
    store_tile(c12, t.row0 + sm + 16u, t.col0 + sn + 32u);
    store_tile(c13, t.row0 + sm + 16u, t.col0 + sn + 48u);
    store_tile(c20, t.row0 + sm + 32u, t.col0 + sn + 0u);
    store_tile(c21, t.row0 + sm + 32u, t.col0 + sn + 16u);
    store_tile(c22, t.row0 + sm + 32u, t.col0 + sn + 32u);
    store_tile(c23, t.row0 + sm + 32u, t.col0 + sn + 48u);
    store_tile(c30, t.row0 + sm + 48u, t.col0 + sn + 0u);
    store_tile(c31, t.row0 + sm + 48u, t.col0 + sn + 16u);
    store_tile(c32, t.row0 + sm + 48u, t.col0 + sn + 32u);
    store_tile(c33, t.row0 + sm + 48u, t.col0 + sn + 48u);
}

// C = A * B^T with B stored [n][k].
@compute @workgroup_size(2u * SG_ROWS * SG_SIZE)
fn gemm_nt(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_id) sg: u32) {
    gemm(wg, lid, sg, false);
}

// C = A * B with B stored [k][n].
@compute @workgroup_size(2u * SG_ROWS * SG_SIZE)
fn gemm_nn(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_id) sg: u32) {
    gemm(wg, lid, sg, true);
}
