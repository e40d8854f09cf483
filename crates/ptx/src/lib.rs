//! headkl's PTX GEMM tiles: the text of `shaders/gemm_wgmma.ptx`, which
//! `scripts/ptx.sh` generates from the CUDA C `shaders/gemm_wgmma.cu`
//! (NVRTC from the Python registry, pinned) and which is committed beside
//! it. The driver assembles it, so neither building nor running headkl
//! needs a CUDA toolkit. Its first line records the source's FNV-1a hash,
//! which [`source_matches`] checks (a test does, on every build).
//!
//! The tiles' shapes and entry names are core's
//! (`headkl_core::toolkit::wgmma_tile`); this crate holds the text, so only
//! the backends that launch the tiles link it, not core, the CPU
//! reference or burn.

pub mod header;
pub mod kernels;

use headkl_core::toolkit::params::GemmParams;
use headkl_core::toolkit::{KernelBuild, KernelSource};

/// The PTX text of every tile's entry points (`shaders/gemm_wgmma.ptx`).
pub const PTX: &str = include_str!("../../../shaders/gemm_wgmma.ptx");

/// The CUDA C it is generated from (`shaders/gemm_wgmma.cu`), for the check
/// that the two agree.
const SOURCE: &[u8] = include_bytes!("../../../shaders/gemm_wgmma.cu");

/// The 64-bit FNV-1a hash `scripts/ptx.py` records of the source.
pub fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Whether [`PTX`]'s header records the hash of the source it sits beside,
/// i.e. whether it was regenerated after the source last changed.
pub fn source_matches() -> bool {
    recorded_hash(PTX) == Some(fnv1a64(SOURCE))
}

/// The source hash a generated PTX's first line records.
fn recorded_hash(ptx: &str) -> Option<u64> {
    ptx.lines()
        .next()
        .and_then(|line| line.split("fnv1a64 ").nth(1))
        .and_then(|rest| rest.get(..16))
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
}

/// Checks a catalogue build of a PTX tile against [`PTX`]: its entry point
/// is there, with the parameter block's size and the shared memory the
/// catalogue states. `Ok(None)` for a build of another source.
pub fn check_build(build: &KernelBuild) -> Result<Option<&'static str>, String> {
    let KernelSource::Ptx { tile, layout } = build.source else {
        return Ok(None);
    };
    let entry = tile.entry(layout);
    let params = GemmParams::BLOCK.bytes;
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
    use headkl_core::toolkit::params::PackParams;
    use headkl_core::toolkit::wgmma_tile::{PackKind, WgmmaTile, WGMMA_TILES};

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
        use headkl_core::toolkit::{CoopGemm, GemmKernel, KernelId};
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

    /// The source's `GemmParams` and `PackParams` are core's, field for
    /// field (the GEMMs' block size in each entry point is `check_build`'s).
    #[test]
    fn the_parameter_blocks_are_cores() {
        let text = std::str::from_utf8(SOURCE).expect("UTF-8 source");
        for block in [GemmParams::BLOCK, PackParams::BLOCK] {
            let opening = format!("struct {} {{", block.name);
            let start = text.find(&opening).expect("the struct in the source") + opening.len();
            let end = start + text[start..].find("};").expect("its end");
            let names: Vec<&str> = text[start..end]
                .split(';')
                .filter_map(|statement| statement.trim().split_once(char::is_whitespace))
                .flat_map(|(_, names)| names.split(',').map(str::trim))
                .collect();
            let core: Vec<&str> = block.fields.iter().map(|f| f.0).collect();
            assert_eq!(names, core, "{}", block.name);
        }
        // The pack kernels take the block by value, at its size.
        for kind in [PackKind::A, PackKind::LogitsB, PackKind::DxB] {
            let param = format!(
                ".param .align 4 .b8 {}_param_0[{}]",
                kind.entry(),
                PackParams::BLOCK.bytes
            );
            assert!(PTX.contains(&param), "no `{param}` in gemm_wgmma.ptx");
        }
    }

    #[test]
    fn the_hash_is_fnv1a() {
        // The published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
