//! The PTX GEMM tiles of `shaders/gemm_wgmma.cu` (NVIDIA Hopper `wgmma`),
//! which the Vulkan backend launches in its own command buffers through
//! `VK_NVX_binary_import`: each tile's shape, workgroup size and shared
//! memory, and its entry points. The PTX text itself, and the checks that
//! it holds these entry points and comes from the committed source, are
//! the `headkl-ptx` crate's: only a backend that launches the tiles
//! carries it.

use std::fmt;

use crate::toolkit::backend::HeadLayout;

/// How a PTX tile's stages are filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WgmmaFeed {
    /// Every thread's 16-byte `cp.async` copies from the operands where
    /// they are (`gemm` in the source): `bm / 64` warpgroups by 128
    /// columns.
    Copies,
    /// One bulk copy per operand and stage, from operands the pack kernels
    /// first lay out in the order a stage holds (`bulk_gemm`): one
    /// warpgroup by 256 columns, three blocks an SM. The Vulkan backend
    /// packs and launches in pieces of at most [`BULK_PACK_BYTES`] an
    /// operand.
    Bulk,
}

/// The most bytes one packed operand of a bulk tile takes: the Vulkan
/// backend's two pack buffers (A's and B's), made on the first bulk
/// launch, and the pieces a larger GEMM is packed and launched in.
pub const BULK_PACK_BYTES: u64 = 128 << 20;

/// One tile of `gemm_wgmma.cu`: 64-row warpgroups owning [`Self::bn`]
/// columns of C each, K in steps of `bk` through `stages` stages of shared
/// memory, filled as `feed` says. Named `bm<BM>.bk<BK>.s<STAGES>` (copies)
/// or `bulk.bm<BM>.bn<BN>.bk<BK>.s<STAGES>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WgmmaTile {
    /// C tile rows: 64 or 128 (copies), 64 (bulk).
    pub bm: u32,
    /// K per step: 16 (32-byte swizzle, bulk), 32 (64-byte) or 64 (128-byte).
    pub bk: u32,
    /// Shared-memory stages: with one, a step is copied, waited for and
    /// multiplied in turn (other blocks on the SM fill the gaps).
    pub stages: u32,
    /// How the stages are filled.
    pub feed: WgmmaFeed,
}

/// `wgmma:bm64.bk32.s3`: 64 × 128, K steps of 32 in three stages; the
/// dx GEMM's default where the PTX tiles run.
pub const WGMMA_BM64_BK32_S3: WgmmaTile = WgmmaTile {
    bm: 64,
    bk: 32,
    stages: 3,
    feed: WgmmaFeed::Copies,
};

/// `wgmma:bm64.bk64.s1`: 64 × 128, K steps of 64 in one stage; the logits
/// GEMM's default where the PTX tiles run.
pub const WGMMA_BM64_BK64_S1: WgmmaTile = WgmmaTile {
    bm: 64,
    bk: 64,
    stages: 1,
    feed: WgmmaFeed::Copies,
};

/// Every PTX tile (both layouts each), which `HEADKL_GEMM` can name and
/// `headkl tune` times; the source's `TILE` lines, in their order, then
/// its `BULK_ENTRY` lines.
pub const WGMMA_TILES: [WgmmaTile; 4] = [
    WGMMA_BM64_BK32_S3,
    WGMMA_BM64_BK64_S1,
    WgmmaTile {
        bm: 128,
        bk: 32,
        stages: 2,
        feed: WgmmaFeed::Copies,
    },
    WgmmaTile {
        bm: 64,
        bk: 16,
        stages: 4,
        feed: WgmmaFeed::Bulk,
    },
];

/// The pack kernels of the bulk tiles, one per operand layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackKind {
    /// A of either GEMM (`[m][k]`): K-major tiles of 64 rows.
    A,
    /// The logits GEMM's B (`[n][k]`): K-major tiles of 256 rows.
    LogitsB,
    /// The dx GEMM's B (`[k][n]`): N-major tiles of 256 columns.
    DxB,
}

impl PackKind {
    /// Its entry point in the PTX text (`headkl_ptx::PTX`).
    pub const fn entry(self) -> &'static str {
        match self {
            Self::A => "wgmma_pack_a_bk16",
            Self::LogitsB => "wgmma_pack_logits_b_bn256_bk16",
            Self::DxB => "wgmma_pack_dx_b_bn256_bk16",
        }
    }

    /// Rows (M of A, N of B) a packed tile holds.
    pub const fn tile_rows(self) -> u32 {
        match self {
            Self::A => 64,
            Self::LogitsB | Self::DxB => 256,
        }
    }

    /// Threads per block of its launches (the source's `PACK` bound).
    pub const THREADS: u32 = 256;

    /// Bytes `rows` rows by `kdim` of K take packed: whole tiles of whole
    /// 16-wide K steps.
    pub const fn packed_bytes(self, rows: u32, kdim: u32) -> u64 {
        let tiles = rows.div_ceil(self.tile_rows()) as u64;
        tiles * self.tile_rows() as u64 * (kdim.div_ceil(16) as u64 * 16) * 2
    }

    /// Its parameter block for `rows` by `kdim` at `ld`.
    pub fn params(self, rows: u32, kdim: u32, ld: u32) -> crate::toolkit::params::PackParams {
        crate::toolkit::params::PackParams {
            rows,
            kdim,
            ld,
            tiles: rows.div_ceil(self.tile_rows()),
            steps: kdim.div_ceil(16),
            ..Default::default()
        }
    }

    /// Blocks of [`Self::THREADS`] its launch takes: one thread a 16-byte
    /// chunk of the packed operand.
    pub fn blocks(self, rows: u32, kdim: u32) -> u64 {
        (self.packed_bytes(rows, kdim) / 16).div_ceil(u64::from(Self::THREADS))
    }
}

/// One launch of a bulk tile's GEMM, as [`bulk_plan`] lays it out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BulkStep {
    /// Pack `params`' rows from element `src_offset` of the GEMM's A (to
    /// the backend's A pack buffer) or B (to its B pack buffer).
    Pack {
        /// Which operand, and so which kernel and pack buffer.
        kind: PackKind,
        /// First element of the source, in the GEMM's A or B buffer.
        src_offset: u64,
        /// The pack kernel's block.
        params: crate::toolkit::params::PackParams,
    },
    /// The bulk GEMM on the packed operands (its `grid_x` still to fill).
    Gemm(crate::toolkit::params::GemmParams),
}

/// A bulk tile's GEMM as pack and GEMM launches over pieces whose packed
/// operands each fit in `pack_bytes` ([`BULK_PACK_BYTES`] in the Vulkan
/// backend), per split-K part: the logits GEMM in pieces of rows (A packed
/// once a piece) by columns (B packed a piece each, C's columns and the row
/// statistics' groups shifted to match); dx in pieces of K that add into
/// the part's C block after the first. `params` is the checked
/// block of the whole GEMM ([`crate::toolkit::GemmDesc::check`]: m, n, k multiples
/// of 16, offsets and strides of 8). The block filter is not a bulk
/// tile's (it runs the GLSL filter tile).
pub fn bulk_plan(
    layout: HeadLayout,
    params: &crate::toolkit::params::GemmParams,
    pack_bytes: u64,
) -> Result<Vec<BulkStep>, String> {
    let p = *params;
    if p.mask_rows != 0 {
        return Err("the bulk tiles do not run the block filter".into());
    }
    let (m, n, k) = (u64::from(p.m), u64::from(p.n), u64::from(p.k));
    let k16 = k.div_ceil(16) * 16;
    let index = |what: &str, v: u64| u32::try_from(v).map_err(|_| format!("{what} = {v} does not fit 32 bits"));
    let whole = |value: u64, unit: u64| value / unit * unit;
    let mut steps = Vec::new();
    let gemm = |m: u64, n: u64, k: u64| crate::toolkit::params::GemmParams {
        m: m as u32,
        n: n as u32,
        k: k as u32,
        a_offset: 0,
        lda: 0,
        ldb: 0,
        k_parts: 1,
        k_part: k as u32,
        c_part_stride: 0,
        grid_x: 0,
        ..p
    };
    for part in 0..u64::from(p.k_parts) {
        // The part's K range and C block, as the copy tiles place them.
        let k0 = (part * u64::from(p.k_part)).min(k);
        let kp = (k0 + u64::from(p.k_part)).min(k) - k0;
        let c_part = u64::from(p.c_offset) + part * u64::from(p.c_part_stride);
        match layout {
            HeadLayout::Logits => {
                let rows_a = whole(pack_bytes / (2 * k16.max(16)), 64);
                let rows_b = whole(pack_bytes / (2 * k16.max(16)), 256);
                if rows_a == 0 || rows_b == 0 {
                    return Err(format!(
                        "k = {k}: one packed tile is over the {pack_bytes}-byte pack buffers"
                    ));
                }
                for r0 in (0..m).step_by(rows_a as usize) {
                    let mr = rows_a.min(m - r0);
                    if kp > 0 {
                        steps.push(BulkStep::Pack {
                            kind: PackKind::A,
                            src_offset: u64::from(p.a_offset) + r0 * u64::from(p.lda) + k0,
                            params: PackKind::A.params(mr as u32, kp as u32, p.lda),
                        });
                    }
                    for c0 in (0..n).step_by(rows_b as usize) {
                        let nc = rows_b.min(n - c0);
                        if kp > 0 {
                            steps.push(BulkStep::Pack {
                                kind: PackKind::LogitsB,
                                src_offset: c0 * u64::from(p.ldb) + k0,
                                params: PackKind::LogitsB.params(nc as u32, kp as u32, p.ldb),
                            });
                        }
                        let mut piece = gemm(mr, nc, kp);
                        piece.c_offset = index("c_offset", c_part + r0 * u64::from(p.ldc) + c0)?;
                        if p.stats_offset != 0 {
                            piece.stats_offset = index(
                                "stats_offset",
                                u64::from(p.stats_offset) + r0 * 2 * u64::from(p.stats_ld),
                            )?;
                            // c0 is a multiple of 256: whole groups of 32.
                            piece.stats_first = index("stats_first", u64::from(p.stats_first) + c0 / 32)?;
                            piece.stats_cols = p.stats_cols.saturating_sub(c0 as u32);
                        }
                        steps.push(BulkStep::Gemm(piece));
                    }
                }
            }
            HeadLayout::Dx => {
                let rows = m.div_ceil(64).max(1) * 64;
                let cols = n.div_ceil(256).max(1) * 256;
                let k_piece = whole(pack_bytes / (2 * rows.max(cols)), 16);
                if k_piece == 0 {
                    return Err(format!(
                        "m = {m}, n = {n}: one K step is over the {pack_bytes}-byte pack buffers"
                    ));
                }
                let c_offset = index("c_offset", c_part)?;
                let mut done = 0;
                loop {
                    let len = k_piece.min(kp - done);
                    if len > 0 {
                        steps.push(BulkStep::Pack {
                            kind: PackKind::A,
                            src_offset: u64::from(p.a_offset) + k0 + done,
                            params: PackKind::A.params(p.m, len as u32, p.lda),
                        });
                        steps.push(BulkStep::Pack {
                            kind: PackKind::DxB,
                            src_offset: (k0 + done) * u64::from(p.ldb),
                            params: PackKind::DxB.params(p.n, len as u32, p.ldb),
                        });
                    }
                    // K pieces after the first add into the part's block;
                    // an empty part still writes its block (zeros), which
                    // sum_parts reads.
                    let mut piece = gemm(m, n, len);
                    piece.c_offset = c_offset;
                    piece.accumulate = u32::from(p.accumulate != 0 || done > 0);
                    steps.push(BulkStep::Gemm(piece));
                    done += len;
                    if done >= kp {
                        break;
                    }
                }
            }
        }
    }
    Ok(steps)
}

impl WgmmaTile {
    /// C tile columns: 128 (copies) or 256 (bulk).
    pub const fn bn(self) -> u32 {
        match self.feed {
            WgmmaFeed::Copies => 128,
            WgmmaFeed::Bulk => 256,
        }
    }

    /// Threads per block: a warpgroup of 128 per 64 rows.
    pub const fn invocations(self) -> u32 {
        self.bm * 2
    }

    /// Shared memory in bytes: per stage, A `[bm][bk]` and B `[bn][bk]`
    /// f16 (`Tile::SHARED_BYTES` in the source), and for the bulk tiles
    /// 1 KiB for the stages' barriers (`BulkTile::SHARED_BYTES`).
    pub const fn shared_bytes(self) -> u32 {
        let stages = self.stages * (self.bm + self.bn()) * self.bk * 2;
        match self.feed {
            WgmmaFeed::Copies => stages,
            WgmmaFeed::Bulk => stages + 1024,
        }
    }

    /// Its entry point for `layout` in the PTX text (empty for a tile the
    /// source does not build, which [`WGMMA_TILES`] never holds).
    pub const fn entry(self, layout: HeadLayout) -> &'static str {
        match (self.feed, self.bm, self.bk, self.stages, layout) {
            (WgmmaFeed::Copies, 64, 32, 3, HeadLayout::Logits) => "wgmma_logits_bm64_bk32_s3",
            (WgmmaFeed::Copies, 64, 32, 3, HeadLayout::Dx) => "wgmma_dx_bm64_bk32_s3",
            (WgmmaFeed::Copies, 64, 64, 1, HeadLayout::Logits) => "wgmma_logits_bm64_bk64_s1",
            (WgmmaFeed::Copies, 64, 64, 1, HeadLayout::Dx) => "wgmma_dx_bm64_bk64_s1",
            (WgmmaFeed::Copies, 128, 32, 2, HeadLayout::Logits) => "wgmma_logits_bm128_bk32_s2",
            (WgmmaFeed::Copies, 128, 32, 2, HeadLayout::Dx) => "wgmma_dx_bm128_bk32_s2",
            (WgmmaFeed::Bulk, 64, 16, 4, HeadLayout::Logits) => "wgmma_bulk_logits_bn256_bk16_s4",
            (WgmmaFeed::Bulk, 64, 16, 4, HeadLayout::Dx) => "wgmma_bulk_dx_bn256_bk16_s4",
            _ => "",
        }
    }

    /// The tile named `bm64.bk32.s3`, if it is one of [`WGMMA_TILES`].
    pub fn from_name(name: &str) -> Option<Self> {
        WGMMA_TILES.into_iter().find(|t| t.to_string() == name.trim())
    }
}

impl fmt::Display for WgmmaTile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.feed {
            WgmmaFeed::Copies => write!(f, "bm{}.bk{}.s{}", self.bm, self.bk, self.stages),
            WgmmaFeed::Bulk => write!(f, "bulk.bm{}.bn{}.bk{}.s{}", self.bm, self.bn(), self.bk, self.stages),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::toolkit::params::GemmParams;

    /// Packed sizes are whole tiles of whole K steps, so a bulk tile never
    /// reads past what its pack kernel wrote.
    #[test]
    fn packed_operands_are_whole_tiles() {
        assert_eq!(PackKind::A.packed_bytes(64, 16), 64 * 16 * 2);
        assert_eq!(PackKind::A.packed_bytes(65, 24), 128 * 32 * 2);
        assert_eq!(PackKind::DxB.packed_bytes(5120, 16), 5120 * 16 * 2);
        assert_eq!(PackKind::LogitsB.packed_bytes(8, 8), 256 * 16 * 2);
        let p = PackKind::LogitsB.params(300, 40, 48);
        assert_eq!((p.tiles, p.steps), (2, 3));
        assert_eq!(PackKind::A.blocks(64, 16), 1);
    }

    /// A GEMM block as the tiles compute it, in f64: C (+)= alpha · A · op(B)
    /// per split-K part, and the logits' row statistics ((max, Σ exp) over
    /// each row's 32-column groups, real columns only).
    fn emulate(
        layout: HeadLayout,
        p: &GemmParams,
        a: impl Fn(u64, u64) -> f64,
        b: impl Fn(u64, u64) -> f64,
        c: &mut [f64],
    ) {
        let (m, n, k) = (u64::from(p.m), u64::from(p.n), u64::from(p.k));
        for part in 0..u64::from(p.k_parts) {
            let k0 = (part * u64::from(p.k_part)).min(k);
            let k1 = (k0 + u64::from(p.k_part)).min(k);
            let c_off = u64::from(p.c_offset) + part * u64::from(p.c_part_stride);
            for i in 0..m {
                let row: Vec<f64> = (0..n)
                    .map(|j| f64::from(p.alpha) * (k0..k1).map(|kk| a(i, kk) * b(j, kk)).sum::<f64>())
                    .collect();
                for (j, v) in row.iter().enumerate() {
                    let o = &mut c[(c_off + i * u64::from(p.ldc)) as usize + j];
                    *o = if p.accumulate != 0 { *o + v } else { *v };
                }
                if layout == HeadLayout::Logits && p.stats_offset != 0 {
                    for g in 0..n.div_ceil(32) {
                        let real: Vec<f64> = (g * 32..(g * 32 + 32).min(n))
                            .filter(|&j| j < u64::from(p.stats_cols))
                            .map(|j| row[j as usize])
                            .collect();
                        let max = real.iter().copied().fold(-3.0e38, f64::max);
                        let at = (u64::from(p.stats_offset)
                            + i * 2 * u64::from(p.stats_ld)
                            + 2 * (u64::from(p.stats_first) + g)) as usize;
                        c[at] = max;
                        c[at + 1] = real.iter().map(|x| (x - max).exp()).sum();
                    }
                }
            }
        }
        let _ = layout;
    }

    /// The steps of [`bulk_plan`], emulated: each pack a zero-filled
    /// [tiles · rows][steps · 16] matrix of its source, each GEMM on the
    /// last two packs.
    fn emulate_plan(layout: HeadLayout, steps: &[BulkStep], a: &[f64], b: &[f64], c: &mut [f64]) {
        let pack = |kind: PackKind, src: &[f64], at: u64, q: &crate::toolkit::params::PackParams| {
            let (rows, ks) = (u64::from(q.tiles * kind.tile_rows()), u64::from(q.steps) * 16);
            let mut out = vec![0.0; (rows * ks) as usize];
            for r in 0..u64::from(q.rows) {
                for kk in 0..u64::from(q.kdim) {
                    let src_at = match kind {
                        PackKind::DxB => at + kk * u64::from(q.ld) + r,
                        PackKind::A | PackKind::LogitsB => at + r * u64::from(q.ld) + kk,
                    };
                    out[(r * ks + kk) as usize] = src[src_at as usize];
                }
            }
            (out, ks)
        };
        let (mut packed_a, mut packed_b) = ((Vec::new(), 16), (Vec::new(), 16));
        for step in steps {
            match *step {
                BulkStep::Pack {
                    kind: PackKind::A,
                    src_offset,
                    params,
                } => packed_a = pack(PackKind::A, a, src_offset, &params),
                BulkStep::Pack {
                    kind,
                    src_offset,
                    params,
                } => packed_b = pack(kind, b, src_offset, &params),
                BulkStep::Gemm(g) => {
                    assert_eq!((g.k_parts, g.mask_rows), (1, 0));
                    let ((pa, lda), (pb, ldb)) = (&packed_a, &packed_b);
                    emulate(
                        layout,
                        &g,
                        |i, kk| pa[(i * lda + kk) as usize],
                        |j, kk| pb[(j * ldb + kk) as usize],
                        c,
                    );
                }
            }
        }
    }

    /// Exact small integers, C poisoned with NaN: the planned pieces write
    /// what the whole GEMM writes, element for element, with pack buffers
    /// small enough to force pieces of rows, columns and K, and an empty
    /// split-K part.
    #[test]
    fn the_bulk_plan_computes_the_whole_gemm() {
        let value = |i: usize, salt: usize| ((i * 7 + salt * 13) % 9) as f64 - 4.0;
        let logits = GemmParams {
            m: 288,
            n: 528,
            k: 48,
            a_offset: 8,
            lda: 64,
            ldb: 56,
            c_offset: 16,
            ldc: 544,
            alpha: 0.5,
            k_parts: 1,
            k_part: 48,
            stats_offset: 16 + 288 * 544 + 8,
            stats_ld: 18,
            stats_first: 1,
            stats_cols: 500,
            ..Default::default()
        };
        let dx = GemmParams {
            m: 80,
            n: 48,
            k: 400,
            a_offset: 24,
            lda: 432,
            ldb: 64,
            c_offset: 8,
            ldc: 56,
            alpha: 2.0,
            k_parts: 3,
            k_part: 256,
            c_part_stride: 80 * 56,
            ..Default::default()
        };
        let cases = [
            (HeadLayout::Logits, logits, 2 * 48 * 256, 6),
            (HeadLayout::Dx, dx, 2 * 256 * 48, 6 + 3 + 1),
            (
                HeadLayout::Dx,
                GemmParams { accumulate: 1, ..dx },
                2 * 256 * 48,
                6 + 3 + 1,
            ),
            (HeadLayout::Logits, logits, BULK_PACK_BYTES, 1),
            // Split-K parts of the logits GEMM (the suite's kernel cases),
            // the last one empty.
            (
                HeadLayout::Logits,
                GemmParams {
                    k_parts: 3,
                    k_part: 64,
                    k: 112,
                    lda: 120,
                    ldb: 128,
                    c_part_stride: 288 * 544,
                    stats_offset: 0,
                    accumulate: 1,
                    ..logits
                },
                2 * 128 * 256,
                3 * 2 * 3,
            ),
        ];
        for (layout, p, pack_bytes, gemms) in cases {
            let a: Vec<f64> = (0..128 * 1024).map(|i| value(i, 1)).collect();
            let b: Vec<f64> = (0..128 * 1024).map(|i| value(i, 2)).collect();
            let c_len = 500_000;
            let start: Vec<f64> = (0..c_len)
                .map(|i| if p.accumulate != 0 { value(i, 3) } else { f64::NAN })
                .collect();
            let mut want = start.clone();
            emulate(
                layout,
                &p,
                |i, kk| a[(u64::from(p.a_offset) + i * u64::from(p.lda) + kk) as usize],
                |j, kk| match layout {
                    HeadLayout::Logits => b[(j * u64::from(p.ldb) + kk) as usize],
                    HeadLayout::Dx => b[(kk * u64::from(p.ldb) + j) as usize],
                },
                &mut want,
            );
            let steps = bulk_plan(layout, &p, pack_bytes).expect("a plan");
            let launched = steps.iter().filter(|s| matches!(s, BulkStep::Gemm(_))).count();
            assert_eq!(launched, gemms, "{layout:?} {pack_bytes}");
            for step in &steps {
                if let BulkStep::Pack { kind, params, .. } = step {
                    assert!(kind.packed_bytes(params.rows, params.kdim) <= pack_bytes, "{step:?}");
                }
            }
            let mut got = start;
            emulate_plan(layout, &steps, &a, &b, &mut got);
            let written = want.iter().filter(|x| !x.is_nan()).count();
            assert!(written > 10_000, "{layout:?}: {written} elements written");
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert!(
                    w.to_bits() == g.to_bits(),
                    "{layout:?} {pack_bytes}: element {i}: {g}, want {w}"
                );
            }
        }
        let filtered = GemmParams { mask_rows: 16, ..dx };
        assert!(bulk_plan(HeadLayout::Dx, &filtered, BULK_PACK_BYTES).is_err());
        assert!(bulk_plan(HeadLayout::Logits, &logits, 1024).is_err());
    }
}
