//! The GEMM tiles of `shaders/gemm_khr.comp` (GLSL, KHR cooperative
//! matrices): each tile's workgroup size, workgroup memory and name, and
//! the list of tiles the build compiles (each variant's defines are
//! `headkl_glsl::GlslVariant::defines`).
//!
//! This one file is the tile table: `crates/glsl/build.rs` compiles it in
//! (`#[path]`) and builds exactly [`GLSL_TILES`] (with the ceiling report's
//! diagnostic variants of each when its `ceiling` feature is on), so it uses nothing outside `core`/`std`.

use std::fmt;

/// C tile columns of every GLSL tile (`BN` in the shader).
pub const GLSL_BN: u32 = 128;

/// The subgroup size the GLSL kernels are written for (`MATH_THREADS`
/// counts subgroups of 32).
pub const GLSL_SUBGROUP: u32 = 32;

/// One tile configuration of `gemm_khr.comp`: its defines other than `MODE`,
/// `NN` and the ceiling report's levers. Named `bm<BM>.bk<BK>.s<STAGES>[.i][.ws][.c<SG_COLS>]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GlslTile {
    /// C tile rows (`BM`: 64, 128 or 256; the columns are [`GLSL_BN`]).
    pub bm: u32,
    /// K staged per step (`BK`: 16, 32 or 64).
    pub bk: u32,
    /// Workgroup-memory stages (`STAGES`).
    pub stages: u32,
    /// With two stages, the next step's stores go after the first 16-deep
    /// slice of multiply-adds rather than after all of them (`INTERLEAVE`).
    pub interleave: bool,
    /// Warp-specialised (`WS`): 4 more subgroups only copy, `stages − 1`
    /// steps ahead, while the others only multiply.
    pub ws: bool,
    /// Math subgroups across the 128 columns (`SG_COLS`): 2 (64 each) or 4
    /// (32 each).
    pub sg_cols: u32,
}

const fn tile(bm: u32, bk: u32, stages: u32, interleave: bool, ws: bool, sg_cols: u32) -> GlslTile {
    GlslTile {
        bm,
        bk,
        stages,
        interleave,
        ws,
        sg_cols,
    }
}

/// `glsl:bm128.bk64.s1`: 128 × 128, K steps of 64, one stage, 2 × 2
/// subgroups; the default where the GLSL tiles run, and the filter tile.
pub const GLSL_BM128_BK64_S1: GlslTile = tile(128, 64, 1, false, false, 2);

/// Every GEMM tile the build compiles (both layouts each), which
/// `HEADKL_GEMM` can name and `headkl tune` times.
pub const GLSL_TILES: [GlslTile; 13] = [
    tile(64, 32, 2, false, false, 2),
    tile(64, 32, 1, false, false, 2),
    tile(64, 16, 2, false, false, 2),
    tile(128, 32, 2, false, false, 2),
    tile(128, 32, 2, true, false, 2),
    tile(128, 32, 2, false, true, 2),
    tile(128, 16, 4, false, true, 2),
    GLSL_BM128_BK64_S1,
    tile(256, 32, 1, false, false, 2),
    tile(256, 16, 2, false, false, 2),
    tile(128, 32, 2, false, false, 4),
    tile(128, 32, 2, false, true, 4),
    tile(128, 64, 1, false, false, 4),
];

impl GlslTile {
    /// Invocations per workgroup: BM / 64 × `sg_cols` math subgroups of 32,
    /// and 4 copying subgroups more with `ws`.
    pub const fn invocations(self) -> u32 {
        self.bm / 64 * self.sg_cols * GLSL_SUBGROUP + if self.ws { 4 * GLSL_SUBGROUP } else { 0 }
    }

    /// Workgroup memory in bytes for the layout (`nn`: `A·B`, B stored
    /// `[k][n]`): per stage, A `[BM][BK/8 + 1]` and B `[128][BK/8 + 1]`
    /// (`[BK][128/8 + 1]` with `nn`) 16-byte words.
    pub const fn layout_shared_bytes(self, nn: bool) -> u32 {
        let (a, b) = self.stage_bytes(nn, self.bm, GLSL_BN);
        self.stages * (a + b)
    }

    /// Bytes of one stage of A and of B for a C tile of `rows` × `cols`
    /// (`nn`: B staged `[BK][cols/8 + 1]`, else `[cols][BK/8 + 1]`; A
    /// `[rows][BK/8 + 1]`), in skewed 16-byte words.
    pub const fn stage_bytes(self, nn: bool, rows: u32, cols: u32) -> (u32, u32) {
        let kw = self.bk / 8;
        let a = rows * (kw + 1);
        let b = if nn { self.bk * (cols / 8 + 1) } else { cols * (kw + 1) };
        (a * 16, b * 16)
    }

    /// Workgroup memory in bytes of the larger of its two layouts.
    pub const fn shared_bytes(self) -> u32 {
        let (nt, nn) = (self.layout_shared_bytes(false), self.layout_shared_bytes(true));
        if nt > nn {
            nt
        } else {
            nn
        }
    }

    /// The same tile without the interleaving or copying subgroups: the
    /// configuration the diagnostic modes are built for.
    pub const fn plain(self) -> GlslTile {
        tile(self.bm, self.bk, self.stages, false, false, self.sg_cols)
    }

    /// The name of a variant of this tile that runs `part` (`gemm`, or a
    /// ceiling-report part) in a layout (`nn`: the dx layout): its timing
    /// label, pipeline key and SPIR-V file, before the variant's own tags
    /// (`headkl_glsl::GlslVariant::name`). `gemm_nt_bm128_bk64_s1`,
    /// `smem_nn_bm128_bk32_s2_c4`.
    pub fn kernel_name(self, part: &str, nn: bool) -> String {
        let layout = if nn { "nn" } else { "nt" };
        let mut name = format!("{part}_{layout}_bm{}_bk{}_s{}", self.bm, self.bk, self.stages);
        if self.interleave {
            name.push_str("_i");
        }
        if self.ws {
            name.push_str("_ws");
        }
        if self.sg_cols != 2 {
            name.push_str(&format!("_c{}", self.sg_cols));
        }
        name
    }

    /// The tile of [`GLSL_TILES`] named `name` (as [`fmt::Display`] writes it).
    pub fn from_name(name: &str) -> Option<GlslTile> {
        GLSL_TILES.iter().copied().find(|t| t.to_string() == name.trim())
    }
}

impl fmt::Display for GlslTile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bm{}.bk{}.s{}", self.bm, self.bk, self.stages)?;
        if self.interleave {
            f.write_str(".i")?;
        }
        if self.ws {
            f.write_str(".ws")?;
        }
        if self.sg_cols != 2 {
            write!(f, ".c{}", self.sg_cols)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_round_trip() {
        let names: std::collections::BTreeSet<String> = GLSL_TILES.iter().map(|t| t.to_string()).collect();
        assert_eq!(names.len(), GLSL_TILES.len());
        for t in GLSL_TILES {
            assert_eq!(GlslTile::from_name(&t.to_string()), Some(t));
        }
        assert_eq!(GlslTile::from_name("bm96.bk32.s2"), None);
        let ws4 = tile(128, 32, 2, false, true, 4);
        assert_eq!(ws4.to_string(), "bm128.bk32.s2.ws.c4");
        assert_eq!(ws4.kernel_name("gemm", true), "gemm_nn_bm128_bk32_s2_ws_c4");
        assert_eq!(ws4.plain().kernel_name("smem", false), "smem_nt_bm128_bk32_s2_c4");
    }

    #[test]
    fn workgroups_and_memory_follow_the_defines() {
        // The production tiles: 128 × 128, K 64 one stage; K 32 two stages.
        let logits = GlslTile::from_name("bm128.bk64.s1").unwrap();
        assert_eq!(logits.invocations(), 128);
        // (128 + 128) rows of 9 words, one stage.
        assert_eq!(logits.layout_shared_bytes(false), 256 * 9 * 16);
        assert_eq!(logits.layout_shared_bytes(true), (128 * 9 + 64 * 17) * 16);
        assert_eq!(logits.shared_bytes(), logits.layout_shared_bytes(false));
        let ws = GlslTile::from_name("bm128.bk32.s2.ws").unwrap();
        assert_eq!(ws.invocations(), 256);
        for t in GLSL_TILES {
            assert!(t.shared_bytes() <= 48 << 10, "{t}: {} bytes", t.shared_bytes());
            assert_eq!(t.invocations() % GLSL_SUBGROUP, 0, "{t}");
            assert!(matches!(t.bm, 64 | 128 | 256) && matches!(t.bk, 16 | 32 | 64), "{t}");
        }
    }
}
