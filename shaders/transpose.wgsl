// f16 rows into columns (headkl_core::toolkit::TransposeDesc):
// dst[c * rows_padded + r] = src[r * ld_src + c] for r < rows, and 0 for
// rows <= r < rows_padded, for every c < cols. The head's gradient GEMM reads
// a chunk's logits gradient this way, with the tokens as its reduction.
// Each workgroup moves one 32 x 32 tile through workgroup memory, so both
// sides are read and written along their rows. See shaders/README.md.
enable f16;

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

@group(0) @binding(1) var<storage, read> src: array<f16>;
@group(0) @binding(2) var<storage, read_write> dst: array<f16>;

const TILE: u32 = 32u;
// One more column than the tile, so a column read walks the banks.
const TILE_LD: u32 = 33u;
var<workgroup> tile: array<f32, 1056>;

@compute @workgroup_size(WG)
fn transpose(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let tiles_c = (params.cols + TILE - 1u) / TILE;
    let tiles_r = (params.rows_padded + TILE - 1u) / TILE;
    let t = wg.x + wg.y * params.grid_x;
    if t >= tiles_c * tiles_r {
        return;
    }
    let c0 = (t % tiles_c) * TILE;
    let r0 = (t / tiles_c) * TILE;
    let lane = lid % TILE;
    let step = WG / TILE;
    for (var i = lid / TILE; i < TILE; i += step) {
        let r = r0 + i;
        let c = c0 + lane;
        var v = 0.0;
        if r < params.rows && c < params.cols {
            v = f32(src[r * params.ld_src + c]);
        }
        tile[i * TILE_LD + lane] = v;
    }
    workgroupBarrier();
    for (var i = lid / TILE; i < TILE; i += step) {
        let c = c0 + i;
        let r = r0 + lane;
        if c < params.cols && r < params.rows_padded {
            dst[c * params.rows_padded + r] = f16(tile[lane * TILE_LD + i]);
        }
    }
}
