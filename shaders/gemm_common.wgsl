
// ---- shaders/gemm_common.wgsl: appended to every WGSL GEMM shader by
// headkl_core::kernels (WGSL has no include; it goes after the file, whose
// `enable` directives must come first).

// One workgroup's output tile and reduction part (split-K: workgroup l is
// part l / tiles of tile l % tiles): the part's length and its first
// elements of A, B and C.
struct Tile {
    valid: bool,
    row0: u32,
    col0: u32,
    k: u32,
    a_off: u32,
    b_off: u32,
    c_off: u32,
}

// The tile and part of workgroup `wg` for C tiles of `rows` x `cols`, tiles
// numbered m fastest; `nn`: B stored [k][n].
fn tile_of(wg: vec3<u32>, nn: bool, rows: u32, cols: u32) -> Tile {
    let tiles_m = (params.m + rows - 1u) / rows;
    let tiles_n = (params.n + cols - 1u) / cols;
    let tiles = tiles_m * tiles_n;
    let l = wg.x + wg.y * params.grid_x;
    let part = l / max(tiles, 1u);
    let t = l % max(tiles, 1u);
    // The part's reduction range [k0, k1): K past k1 is the next part's.
    let k0 = min(part * params.k_part, params.k);
    let k1 = min(k0 + params.k_part, params.k);
    // B stored [n][k] (nt) starts the part k0 columns in; [k][n] (nn), k0 rows.
    var b_off = k0;
    if nn {
        b_off = k0 * params.ldb;
    }
    return Tile(l < tiles * params.k_parts, (t % tiles_m) * rows, (t / tiles_m) * cols, k1 - k0,
        params.a_offset + k0, b_off, params.c_offset + part * params.c_part_stride);
}
