//! The CUDA backend's kernels: the text of `shaders/cuda/kernels.ptx`,
//! which `scripts/ptx.sh` generates from `shaders/cuda/kernels.cu` and the
//! headers beside it (NVRTC from the Python registry, pinned; `compute_80`).
//! Its first line records the FNV-1a hash of those sources (the `.cu`, then
//! the `.cuh` files in name order), which [`source_matches`] checks.

use headkl_core::toolkit::KernelId;

use crate::fnv1a64;

/// The PTX text of every kernel (`shaders/cuda/kernels.ptx`).
pub const PTX: &str = include_str!("../../../shaders/cuda/kernels.ptx");

/// The sources it is generated from, in the order `scripts/ptx.py` hashes
/// them: `kernels.cu`, then every `.cuh` of `shaders/cuda` by name (a test
/// holds this list to the folder).
pub const SOURCES: [(&str, &[u8]); 7] = [
    ("kernels.cu", include_bytes!("../../../shaders/cuda/kernels.cu")),
    ("common.cuh", include_bytes!("../../../shaders/cuda/common.cuh")),
    ("generated.cuh", include_bytes!("../../../shaders/cuda/generated.cuh")),
    ("kl_rows.cuh", include_bytes!("../../../shaders/cuda/kl_rows.cuh")),
    ("resident.cuh", include_bytes!("../../../shaders/cuda/resident.cuh")),
    ("small.cuh", include_bytes!("../../../shaders/cuda/small.cuh")),
    ("topk_rows.cuh", include_bytes!("../../../shaders/cuda/topk_rows.cuh")),
];

/// Whether [`PTX`]'s header records the hash of the sources it sits beside.
pub fn source_matches() -> bool {
    let all: Vec<u8> = SOURCES.iter().flat_map(|(_, bytes)| bytes.iter().copied()).collect();
    crate::recorded_hash(PTX) == Some(fnv1a64(&all))
}

/// The kernels the CUDA backend launches from this PTX: every catalogue
/// kernel but the GEMMs (cuBLASLt runs those).
pub fn catalogue_kernels() -> impl Iterator<Item = KernelId> {
    KernelId::ALL.into_iter().filter(|id| id.gemm_layout().is_none())
}

/// Checks that `entry` is in [`PTX`] with a parameter block of
/// `block_bytes` first and `buffers` pointers after it.
pub fn check_entry(entry: &str, block_bytes: usize, buffers: usize) -> Result<(), String> {
    let opening = format!(".visible .entry {entry}(");
    let start = PTX
        .find(&opening)
        .ok_or_else(|| format!("no entry {entry} in kernels.ptx"))?
        + opening.len();
    let end = start
        + PTX[start..]
            .find(')')
            .ok_or_else(|| format!("{entry}: no end to its parameters"))?;
    let params: Vec<&str> = PTX[start..end]
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    let block = format!(".param .align 4 .b8 {entry}_param_0[{block_bytes}]");
    if params.first() != Some(&block.as_str()) {
        return Err(format!("{entry}: first parameter {:?}, want {block:?}", params.first()));
    }
    if params.len() != 1 + buffers {
        return Err(format!(
            "{entry}: {} parameters, want the block and {buffers} buffers",
            params.len()
        ));
    }
    for (i, p) in params.iter().enumerate().skip(1) {
        if !p.starts_with(".param .u64") {
            return Err(format!("{entry}: parameter {i} is {p:?}, not a buffer's address"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ptx_is_generated_from_the_committed_sources() {
        assert!(
            source_matches(),
            "shaders/cuda/kernels.ptx was not generated from the current shaders/cuda sources: run scripts/ptx.sh"
        );
    }

    #[test]
    fn the_source_list_is_the_folder() {
        let folder = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shaders/cuda");
        let mut headers: Vec<String> = std::fs::read_dir(&folder)
            .expect("shaders/cuda")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cuh"))
            .collect();
        headers.sort();
        let listed: Vec<&str> = SOURCES[1..].iter().map(|(n, _)| *n).collect();
        assert_eq!(
            headers, listed,
            "update kernels::SOURCES (scripts/ptx.py hashes every .cuh)"
        );
        let main = std::str::from_utf8(SOURCES[0].1).expect("UTF-8");
        for name in &listed {
            if *name != "generated.cuh" && *name != "common.cuh" {
                assert!(
                    main.contains(&format!("#include \"{name}\"")),
                    "kernels.cu includes {name}"
                );
            }
        }
    }

    /// Each kernel's entry takes core's parameter block by value and one
    /// address per binding: what the backend's launch passes.
    #[test]
    fn every_kernel_takes_cores_block_and_its_bindings() {
        for id in catalogue_kernels() {
            check_entry(id.name(), id.params().bytes, id.bindings().len()).unwrap();
        }
        let gemm = headkl_core::toolkit::params::GemmParams::BLOCK.bytes;
        check_entry("gemm_row_stats", gemm, 1).unwrap();
        // AlphaWordParams (16 bytes), the status buffer and the alpha word.
        check_entry("gemm_alpha_word", 16, 2).unwrap();
        assert!(check_entry("nonexistent", 16, 1).is_err());
        assert!(check_entry("sum_parts", 16, 2).is_err(), "a wrong block size is caught");
        assert!(
            check_entry("sum_parts", 32, 3).is_err(),
            "a wrong buffer count is caught"
        );
    }

    /// Every kernel's block size in the PTX is the catalogue's.
    #[test]
    fn block_sizes_are_the_catalogues() {
        use headkl_core::toolkit::GemmKernel;
        for id in catalogue_kernels() {
            let build = id.build(GemmKernel::Tiled);
            let entry = format!(".visible .entry {}(", id.name());
            let start = PTX.find(&entry).expect("entry");
            let body = &PTX[start..];
            let wanted = format!(".maxntid {}, 1, 1", build.invocations);
            let next = body[1..].find(".visible .entry").map_or(body.len(), |i| i + 1);
            assert!(body[..next].contains(&wanted), "{}: no `{wanted}`", id.name());
        }
    }
}
