//! The PTX GEMM tiles of `shaders/gemm_wgmma.cu` (NVIDIA Hopper `wgmma`),
//! which the Vulkan backend launches in its own command buffers through
//! `VK_NVX_binary_import`: each tile's shape, workgroup size and shared
//! memory, its entry points, and the PTX text itself.
//!
//! The PTX is generated from the CUDA C by `scripts/ptx.sh` (NVRTC from
//! the Python registry, pinned) and committed beside it; the driver
//! assembles it, so neither building nor running headkl needs a CUDA
//! toolkit. Its first line records the source's FNV-1a hash, which
//! [`source_matches`] checks (a test does, on every build).

use std::fmt;

use crate::backend::HeadLayout;

/// C tile columns of every PTX tile (`BN` in the source).
pub const WGMMA_BN: u32 = 128;

/// The PTX text of every tile's entry points (`shaders/gemm_wgmma.ptx`).
pub const PTX: &str = include_str!("../../../shaders/gemm_wgmma.ptx");

/// The CUDA C it is generated from (`shaders/gemm_wgmma.cu`), for the check
/// that the two agree.
const SOURCE: &[u8] = include_bytes!("../../../shaders/gemm_wgmma.cu");

/// One tile of `gemm_wgmma.cu`: `bm / 64` warpgroups, each owning 64 rows
/// by 128 columns of C, K in steps of `bk` through `stages` stages of
/// shared memory filled by 16-byte `cp.async` copies. Named
/// `bm<BM>.bk<BK>.s<STAGES>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WgmmaTile {
    /// C tile rows: 64 or 128.
    pub bm: u32,
    /// K per step: 32 (64-byte swizzle) or 64 (128-byte swizzle).
    pub bk: u32,
    /// Shared-memory stages: with one, a step is copied, waited for and
    /// multiplied in turn (other blocks on the SM fill the gaps).
    pub stages: u32,
}

/// Every PTX tile (both layouts each), which `HEADKL_GEMM` can name and
/// `headkl tune` times; the source's `TILE` lines, in their order.
pub const WGMMA_TILES: [WgmmaTile; 3] = [
    WgmmaTile {
        bm: 64,
        bk: 32,
        stages: 3,
    },
    WgmmaTile {
        bm: 64,
        bk: 64,
        stages: 1,
    },
    WgmmaTile {
        bm: 128,
        bk: 32,
        stages: 2,
    },
];

impl WgmmaTile {
    /// Threads per block: a warpgroup of 128 per 64 rows.
    pub const fn invocations(self) -> u32 {
        self.bm * 2
    }

    /// Shared memory in bytes: per stage, A `[bm][bk]` and B `[128][bk]`
    /// f16 (`Tile::SHARED_BYTES` in the source).
    pub const fn shared_bytes(self) -> u32 {
        self.stages * (self.bm + WGMMA_BN) * self.bk * 2
    }

    /// Its entry point for `layout` in [`PTX`] (empty for a tile the
    /// source does not build, which [`WGMMA_TILES`] never holds).
    pub const fn entry(self, layout: HeadLayout) -> &'static str {
        match (self.bm, self.bk, self.stages, layout) {
            (64, 32, 3, HeadLayout::Logits) => "wgmma_logits_bm64_bk32_s3",
            (64, 32, 3, HeadLayout::Dx) => "wgmma_dx_bm64_bk32_s3",
            (64, 64, 1, HeadLayout::Logits) => "wgmma_logits_bm64_bk64_s1",
            (64, 64, 1, HeadLayout::Dx) => "wgmma_dx_bm64_bk64_s1",
            (128, 32, 2, HeadLayout::Logits) => "wgmma_logits_bm128_bk32_s2",
            (128, 32, 2, HeadLayout::Dx) => "wgmma_dx_bm128_bk32_s2",
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
        write!(f, "bm{}.bk{}.s{}", self.bm, self.bk, self.stages)
    }
}

/// The 64-bit FNV-1a hash `scripts/ptx.py` records of the source.
pub fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Whether [`PTX`]'s header records the hash of the source it sits beside,
/// i.e. whether it was regenerated after the source last changed.
pub fn source_matches() -> bool {
    let recorded = PTX
        .lines()
        .next()
        .and_then(|line| line.split("fnv1a64 ").nth(1))
        .and_then(|rest| rest.get(..16))
        .and_then(|hex| u64::from_str_radix(hex, 16).ok());
    recorded == Some(fnv1a64(SOURCE))
}

/// Checks a catalogue build of a PTX tile against [`PTX`]: its entry point
/// is there, with the parameter block's size and the shared memory the
/// catalogue states. `Ok(None)` for a build of another source.
pub fn check_build(build: &crate::KernelBuild) -> Result<Option<&'static str>, String> {
    let crate::KernelSource::Ptx { tile, layout } = build.source else {
        return Ok(None);
    };
    let entry = tile.entry(layout);
    let params = crate::params::GemmParams::BLOCK.bytes;
    let wanted = [
        format!(".visible .entry {entry}("),
        format!(".param .align 4 .b8 {entry}_param_0[{params}]"),
        format!("_ZZ{}{entry}E6shared[{}]", entry.len(), build.workgroup_bytes),
    ];
    if entry.is_empty() || entry != build.entry {
        return Err(format!("{tile}: entry {:?} for a build of {:?}", entry, build.entry));
    }
    match wanted.iter().find(|w| !PTX.contains(w.as_str())) {
        Some(missing) => Err(format!("{entry}: no `{missing}` in gemm_wgmma.ptx")),
        None => Ok(Some(entry)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ptx_is_generated_from_the_committed_source() {
        assert!(
            source_matches(),
            "shaders/gemm_wgmma.ptx was not generated from the current shaders/gemm_wgmma.cu: run scripts/ptx.sh"
        );
    }

    #[test]
    fn every_tile_has_both_entry_points_in_the_ptx() {
        use crate::{CoopGemm, GemmKernel, KernelId};
        for tile in WGMMA_TILES {
            let gemm = GemmKernel::Coop {
                kernel: CoopGemm::Wgmma(tile),
                subgroup: 32,
            };
            // Entry point, parameter block and declared shared memory.
            for id in [KernelId::GemmLogits, KernelId::GemmDx] {
                assert!(matches!(check_build(&id.build(gemm)), Ok(Some(_))), "{tile} {id:?}");
            }
            assert_eq!(WgmmaTile::from_name(&tile.to_string()), Some(tile));
            // The source's own bound: well under NVX's 48 KiB a block.
            assert!(tile.shared_bytes() <= 42 * 1024, "{tile}");
        }
        assert_eq!(WgmmaTile::from_name("bm96.bk32.s2"), None);
        assert_eq!(WgmmaTile::from_name("bm64.bk32.s3"), Some(WGMMA_TILES[0]));
    }

    /// The source's `GemmParams` is core's, field for field (its size in
    /// each entry point is `check_build`'s).
    #[test]
    fn the_parameter_block_is_cores() {
        let text = std::str::from_utf8(SOURCE).expect("UTF-8 source");
        let start = text.find("struct GemmParams {").expect("GemmParams in the source") + "struct GemmParams {".len();
        let end = start + text[start..].find("};").expect("end of GemmParams");
        let names: Vec<&str> = text[start..end]
            .split(';')
            .filter_map(|statement| statement.trim().split_once(char::is_whitespace))
            .flat_map(|(_, names)| names.split(',').map(str::trim))
            .collect();
        let core: Vec<&str> = crate::params::GemmParams::BLOCK.fields.iter().map(|f| f.0).collect();
        assert_eq!(names, core);
    }

    #[test]
    fn the_hash_is_fnv1a() {
        // The published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
