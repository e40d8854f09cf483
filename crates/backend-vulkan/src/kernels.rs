//! The shared WGSL kernels (`shaders/`), their override values and
//! dispatch grids (shaders/README.md).

use headkl_core::tuning::{self, KernelLimits};
use headkl_core::{ChoiceSource, CoopGemm, GemmChoice, Result};

use crate::adapter::Caps;
use crate::pipeline::ShaderSource;

/// `convert.wgsl`: f32 → f16 hidden rows.
pub(crate) const CONVERT: ShaderSource = ShaderSource {
    file: "convert.wgsl",
    text: include_str!("../../../shaders/convert.wgsl"),
};
/// `kl_rows.wgsl`: the KL row kernel.
pub(crate) const KL_ROWS: ShaderSource = ShaderSource {
    file: "kl_rows.wgsl",
    text: include_str!("../../../shaders/kl_rows.wgsl"),
};
/// `topk_rows.wgsl`: the exact top-k row kernel.
pub(crate) const TOPK_ROWS: ShaderSource = ShaderSource {
    file: "topk_rows.wgsl",
    text: include_str!("../../../shaders/topk_rows.wgsl"),
};
/// `gemm_tiled.wgsl`: the portable GEMM.
pub(crate) const GEMM_TILED: ShaderSource = ShaderSource {
    file: "gemm_tiled.wgsl",
    text: include_str!("../../../shaders/gemm_tiled.wgsl"),
};
/// `gemm_coop.wgsl`: the matrix-unit GEMM.
pub(crate) const GEMM_COOP: ShaderSource = ShaderSource {
    file: "gemm_coop.wgsl",
    text: include_str!("../../../shaders/gemm_coop.wgsl"),
};

/// `gemm_coop_direct.wgsl`: the matrix-unit GEMM without workgroup memory.
pub(crate) const GEMM_COOP_DIRECT: ShaderSource = ShaderSource {
    file: "gemm_coop_direct.wgsl",
    text: include_str!("../../../shaders/gemm_coop_direct.wgsl"),
};

/// Every shared shader with its entry points.
#[cfg(test)]
pub(crate) const ALL: [(ShaderSource, &[&str]); 6] = [
    (CONVERT, &["convert_f16"]),
    (KL_ROWS, &["kl_rows"]),
    (TOPK_ROWS, &["topk_rows"]),
    (GEMM_TILED, &["gemm_nt", "gemm_nn"]),
    (GEMM_COOP, &["gemm_nt", "gemm_nn"]),
    (GEMM_COOP_DIRECT, &["gemm_nt", "gemm_nn"]),
];

/// Elements per workgroup of the convert kernel.
pub(crate) const CONVERT_WG: u64 = 256;
/// C tile edge of the tiled GEMM's workgroup.
pub(crate) const TILED_TILE: u64 = 64;

/// How the cooperative-matrix GEMM runs on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CoopPlan {
    /// The `SG_SIZE` override: the subgroup size the pipeline runs with.
    pub(crate) subgroup_size: u32,
    /// Pin it with `VK_EXT_subgroup_size_control` (the device's size varies).
    pub(crate) require_size: bool,
    /// The kernel for each head layout.
    pub(crate) choice: GemmChoice,
    /// Where the choice came from.
    pub(crate) source: ChoiceSource,
}

/// What `caps` allows a GEMM workgroup.
pub(crate) fn kernel_limits(caps: &Caps) -> KernelLimits {
    KernelLimits {
        shared_bytes: caps.max_shared_memory,
        invocations: caps.max_invocations,
        subgroup_size: caps.subgroup_size,
        subgroup_builtins: caps.subgroup_ops.contains(ash::vk::SubgroupFeatureFlags::BASIC),
    }
}

/// Whether (and how) the cooperative-matrix GEMM can run on `caps`: the
/// 16×16×16 f16→f32 shape and a fixed subgroup size (reported fixed, or
/// pinned). `choice` is fitted to the device's limits
/// ([`tuning::fit_choice`]).
pub(crate) fn coop_plan(caps: &Caps, choice: GemmChoice, source: ChoiceSource) -> Result<Option<CoopPlan>> {
    if !caps.coop_capable() {
        return Ok(None);
    }
    let size = caps.subgroup_size;
    if size == 0 || !size.is_power_of_two() {
        return Ok(None);
    }
    let require_size = !(caps.min_subgroup_size == size && caps.max_subgroup_size == size);
    let pinnable = caps.features.subgroup_size_control
        && caps.required_subgroup_size_compute
        && (caps.min_subgroup_size..=caps.max_subgroup_size).contains(&size);
    if require_size && !pinnable {
        return Ok(None);
    }
    let (choice, source) = tuning::fit_choice(crate::conv::BACKEND, choice, source, &kernel_limits(caps))?;
    Ok(Some(CoopPlan {
        subgroup_size: size,
        require_size,
        choice,
        source,
    }))
}

/// The shader, C tile and override values of `kernel` at subgroup size `sg`.
pub(crate) fn coop_pipeline(
    kernel: CoopGemm,
    sg: u32,
) -> (&'static ShaderSource, (u64, u64), Vec<(&'static str, u32)>) {
    let (rows, cols) = kernel.tile();
    let tile = (u64::from(rows), u64::from(cols));
    let source = match kernel {
        CoopGemm::Staged(_) => &GEMM_COOP,
        CoopGemm::Direct => &GEMM_COOP_DIRECT,
    };
    (source, tile, kernel.overrides(sg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ash::vk;

    /// A device like the H200: matrix units, subgroups of exactly 32.
    fn h200() -> Caps {
        let mut c = Caps {
            subgroup_size: 32,
            min_subgroup_size: 32,
            max_subgroup_size: 32,
            subgroup_ops: vk::SubgroupFeatureFlags::BASIC | vk::SubgroupFeatureFlags::ARITHMETIC,
            max_shared_memory: 48 << 10,
            max_invocations: 1024,
            matrix_shapes: vec![(16, 8, 8), (16, 8, 16), (16, 16, 16)],
            ..Caps::default()
        };
        c.features.cooperative_matrix = true;
        c.features.vulkan_memory_model = true;
        c.features.vulkan_memory_model_device_scope = true;
        c
    }

    fn plan(caps: &Caps, choice: &str, source: ChoiceSource) -> Result<Option<CoopPlan>> {
        coop_plan(caps, GemmChoice::parse(choice).unwrap(), source)
    }

    #[test]
    fn coop_plan_follows_the_device() {
        let p = plan(&h200(), "staged:bk32:r2:s2", ChoiceSource::Default)
            .unwrap()
            .unwrap();
        assert_eq!((p.subgroup_size, p.require_size), (32, false));
        assert_eq!(p.choice, GemmChoice::parse("staged:bk32:r2:s2").unwrap());

        // No 16×16×16 f16→f32 shape, or no memory model: fallback.
        let mut c = h200();
        c.matrix_shapes = vec![(16, 8, 16)];
        assert_eq!(plan(&c, "direct", ChoiceSource::Default).unwrap(), None);
        let mut c = h200();
        c.features.vulkan_memory_model_device_scope = false;
        assert_eq!(plan(&c, "direct", ChoiceSource::Default).unwrap(), None);

        // A varying subgroup size needs pinning (size control for compute).
        let mut c = h200();
        (c.subgroup_size, c.min_subgroup_size, c.max_subgroup_size) = (64, 32, 64);
        assert_eq!(plan(&c, "direct", ChoiceSource::Default).unwrap(), None);
        c.features.subgroup_size_control = true;
        c.required_subgroup_size_compute = true;
        let p = plan(&c, "direct", ChoiceSource::Default).unwrap().unwrap();
        assert_eq!((p.subgroup_size, p.require_size), (64, true));
    }

    #[test]
    fn the_choice_is_fitted_to_the_device() {
        let limits = kernel_limits(&h200());
        assert_eq!(
            (limits.shared_bytes, limits.subgroup_size, limits.subgroup_builtins),
            (48 << 10, 32, true)
        );
        // 60 KiB of workgroup memory on a 48 KiB device: an error when asked
        // for, the default otherwise.
        let big = "logits=staged:bk32:r4:s2,dx=direct";
        assert!(matches!(
            plan(&h200(), big, ChoiceSource::Environment),
            Err(headkl_core::Error::InvalidSetting { .. })
        ));
        let p = plan(&h200(), big, ChoiceSource::Default).unwrap().unwrap();
        assert_eq!(p.choice, GemmChoice::DEFAULT);
        let mut c = h200();
        c.subgroup_ops = vk::SubgroupFeatureFlags::empty();
        assert!(!kernel_limits(&c).subgroup_builtins);
    }

    #[test]
    fn pipelines_carry_the_tile_overrides() {
        let (src, tile, overrides) = coop_pipeline(CoopGemm::parse("staged:bk32:r4:s1:pf").unwrap(), 32);
        assert_eq!((src.file, tile), ("gemm_coop.wgsl", (256, 128)));
        assert_eq!(
            overrides,
            vec![
                ("SG_SIZE", 32),
                ("BK", 32),
                ("SG_ROWS", 4),
                ("STAGES", 1),
                ("PREFETCH", 1)
            ]
        );
        let (src, tile, _) = coop_pipeline(CoopGemm::Direct, 32);
        assert_eq!((src.file, tile), ("gemm_coop_direct.wgsl", (64, 64)));
    }
}
