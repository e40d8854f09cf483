// The portable GEMM: C (+)= alpha * A * op(B), f16 operands, f32
// accumulation, tiled through workgroup memory. Runs on every device
// (lavapipe included). See shaders/README.md.
enable f16;

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

@group(0) @binding(1) var<storage, read> a: array<f16>;
@group(0) @binding(2) var<storage, read> b: array<f16>;
// C (binding 3): shaders/gemm_common.wgsl.

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;

// Staged tiles, K-major: as_[kk][i], bs_[kk][j].
var<workgroup> as_: array<f32, TK * TM>;
var<workgroup> bs_: array<f32, TK * TN>;

// `Tile` and `tile_of`: shaders/gemm_common.wgsl.

// A's half `i` (the block filter's mask words: gemm_common.wgsl).
fn a_half(i: u32) -> f32 {
    return f32(a[i]);
}

// Stages A's 64 x 16 tile at K offset k0: 1024 elements, 4 per invocation.
fn stage_a(t: Tile, k0: u32, lid: u32) {
    for (var e = lid; e < TM * TK; e += 256u) {
        let i = e / TK;
        let kk = e % TK;
        let row = t.row0 + i;
        var v = 0.0;
        if row < params.m {
            v = f32(a[t.a_off + row * params.lda + k0 + kk]);
        }
        as_[kk * TM + i] = v;
    }
}

// Inner product of the staged tiles into 4 x 4 accumulators: invocation
// (tx, ty) owns rows ty + 16 r and columns tx + 16 s.
fn multiply(acc: ptr<function, array<vec4<f32>, 4>>, tx: u32, ty: u32) {
    for (var kk = 0u; kk < TK; kk++) {
        let av = vec4<f32>(as_[kk * TM + ty], as_[kk * TM + ty + 16u], as_[kk * TM + ty + 32u], as_[kk * TM + ty + 48u]);
        let bv = vec4<f32>(bs_[kk * TN + tx], bs_[kk * TN + tx + 16u], bs_[kk * TN + tx + 32u], bs_[kk * TN + tx + 48u]);
        (*acc)[0] += av.x * bv;
        (*acc)[1] += av.y * bv;
        (*acc)[2] += av.z * bv;
        (*acc)[3] += av.w * bv;
    }
}

fn store(t: Tile, acc: array<vec4<f32>, 4>, tx: u32, ty: u32) {
    for (var r = 0u; r < 4u; r++) {
        let row = t.row0 + ty + 16u * r;
        if row >= params.m {
            continue;
        }
        for (var s = 0u; s < 4u; s++) {
            let col = t.col0 + tx + 16u * s;
            if col < params.n {
                let o = t.c_off + row * params.ldc + col;
                var v = params.alpha * acc[r][s];
                if params.accumulate != 0u {
                    v += c[o];
                }
                c[o] = v;
            }
        }
    }
}

// Stages B's 16 x 64 tile at K offset k0 as [TK][TN]: B stored [n][k] (nt)
// or [k][n] (nn). Each index order reads B's rows contiguously.
fn stage_b(t: Tile, k0: u32, lid: u32, nn: bool) {
    for (var e = lid; e < TN * TK; e += 256u) {
        var j = e / TK;
        var kk = e % TK;
        if nn {
            kk = e / TN;
            j = e % TN;
        }
        let col = t.col0 + j;
        var v = 0.0;
        if col < params.n {
            var src = t.b_off + col * params.ldb + k0 + kk;
            if nn {
                src = t.b_off + (k0 + kk) * params.ldb + col;
            }
            v = f32(b[src]);
        }
        bs_[kk * TN + j] = v;
    }
}

// The whole kernel for either layout of B, with or without the block
// filter (`nn` and `filtered` are constants at each entry point, so the
// driver folds their branches away: without the filter the loop is the
// unfiltered GEMM's).
fn gemm(wg: vec3<u32>, li: vec3<u32>, lid: u32, nn: bool, filtered: bool) {
    let t = tile_of(wg, nn, TM, TN);
    if !t.valid {
        return;
    }
    var acc: array<vec4<f32>, 4>;
    if filtered {
        // Only the K steps whose 64-column block some row of the tile
        // keeps (gemm_common.wgsl's next_live), by the whole workgroup.
        let steps = (t.k + TK - 1u) / TK;
        var cur = mask_cursor();
        var s = next_live(true, &cur, t, TM, 0u, steps, TK);
        while s < steps {
            stage_a(t, s * TK, lid);
            stage_b(t, s * TK, lid, nn);
            workgroupBarrier();
            multiply(&acc, li.x, li.y);
            workgroupBarrier();
            s = next_live(true, &cur, t, TM, s + 1u, steps, TK);
        }
        store(t, acc, li.x, li.y);
        return;
    }
    for (var k0 = 0u; k0 < t.k; k0 += TK) {
        stage_a(t, k0, lid);
        stage_b(t, k0, lid, nn);
        workgroupBarrier();
        multiply(&acc, li.x, li.y);
        workgroupBarrier();
    }
    store(t, acc, li.x, li.y);
    row_stats(t, TM, TN, lid, 256u);
}

// C = A * B^T with B stored [n][k].
@compute @workgroup_size(16, 16)
fn gemm_logits(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) li: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    gemm(wg, li, lid, false, false);
}

// C = A * B with B stored [k][n].
@compute @workgroup_size(16, 16)
fn gemm_dx(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) li: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    gemm(wg, li, lid, true, false);
}

// gemm_dx with the block filter (headkl_core::problem::filter): skips the K steps
// whose block is clear in every row of the tile.
@compute @workgroup_size(16, 16)
fn gemm_dx_filtered(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) li: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    gemm(wg, li, lid, true, true);
}
