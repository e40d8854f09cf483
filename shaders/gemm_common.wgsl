
// ---- shaders/gemm_common.wgsl: appended to every WGSL GEMM shader by
// headkl_core::toolkit::kernels (WGSL has no include; it goes after the file, whose
// `enable` directives must come first).

// C, f32: every WGSL GEMM's output (row_stats below writes it too).
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

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

// The row statistics of the C tile just stored (headkl_core::toolkit::RowStats),
// when params.stats_offset is not 0: for each of the tile's `rows` rows and
// 32-column groups (`cols` / 32 of them), the pair (m, sum of exp(x - m))
// over the real columns (< params.stats_cols), with a NaN sum where one is
// not finite. Invocation `lid` of `threads` takes every threads-th pair;
// call it from uniform control flow.
fn row_stats(t: Tile, rows: u32, cols: u32, lid: u32, threads: u32) {
    if params.stats_offset == 0u {
        return;
    }
    storageBarrier();
    workgroupBarrier();
    let groups = cols / 32u;
    for (var pr = lid; pr < rows * groups; pr += threads) {
        let row = t.row0 + pr / groups;
        let g = t.col0 / 32u + pr % groups;
        if row >= params.m || g * 32u >= params.n {
            continue;
        }
        var m = -3.0e38;
        var s = 0.0;
        var bad = false;
        let end = min(g * 32u + 32u, params.stats_cols);
        for (var col = g * 32u; col < end; col++) {
            let x = c[t.c_off + row * params.ldc + col];
            if (bitcast<u32>(x) & 0x7fffffffu) >= 0x7f800000u {
                bad = true;
            } else if x > m {
                s = s * exp(m - x) + 1.0;
                m = x;
            } else {
                s += exp(x - m);
            }
        }
        let o = params.stats_offset + row * 2u * params.stats_ld + 2u * (params.stats_first + g);
        c[o] = m;
        c[o + 1u] = select(s, bitcast<f32>(0x7fc00000u), bad);
    }
}

// The dx GEMM's block filter (headkl_core::problem::filter; the gemm_dx_filtered
// entry points): word `w` of row `row`'s block mask, stored in A's buffer
// after A's m rows as four halves of 8 bits each (`a_half`: each shader's
// own read of A's half `i`).
fn mask_word(row: u32, w: u32) -> u32 {
    let at = params.m * params.lda + 4u * (row * params.mask_ld + w);
    return u32(a_half(at)) | (u32(a_half(at + 1u)) << 8u) | (u32(a_half(at + 2u)) << 16u)
        | (u32(a_half(at + 3u)) << 24u);
}

// The OR of mask word `w` over the tile's rows [row0, row0 + rows) that
// have a mask (below params.mask_rows). Every invocation computes it from
// the same words, so a branch on it is uniform in fact.
fn tile_mask(row0: u32, rows: u32, w: u32) -> u32 {
    var o = 0u;
    let end = min(row0 + rows, params.mask_rows);
    for (var r = row0; r < end; r++) {
        o |= mask_word(r, w);
    }
    return o;
}

// The filter's cursor over one tile's K steps: the 2048-column window of
// mask bits last read.
struct MaskCursor {
    window: u32,
    bits: u32,
}

fn mask_cursor() -> MaskCursor {
    return MaskCursor(0xffffffffu, 0u);
}

// The first K step at or after `s` (of `steps`, `bk` deep) whose 64-column
// block is set in some row of the tile (`steps` when none is left); `s`
// itself when `filtered` is false. A starts in row 0 (a_offset < lda), so
// step s covers columns t.a_off + s·bk onward; bk <= 64 keeps a step in
// one block.
fn next_live(filtered: bool, cur: ptr<function, MaskCursor>, t: Tile, rows: u32, s: u32, steps: u32, bk: u32) -> u32 {
    if !filtered {
        return s;
    }
    var q = s;
    for (; q < steps; q++) {
        let col = t.a_off + q * bk;
        let win = col / 2048u;
        if win != (*cur).window {
            (*cur).window = win;
            (*cur).bits = tile_mask(t.row0, rows, win);
        }
        if (((*cur).bits >> ((col / 64u) % 32u)) & 1u) != 0u {
            return q;
        }
    }
    return steps;
}
