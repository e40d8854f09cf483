//! How the catalogue's kernels (`headkl_core::toolkit::kernels`) run on a device:
//! the device's limits and its matrix-unit GEMM plan.

use headkl_core::toolkit::gemm_choice::fit_choice;
use headkl_core::toolkit::KernelLimits;
use headkl_core::{ChoiceSource, GemmChoice, Result};

use crate::adapter::Caps;

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
        // The GLSL tiles' SPIR-V 1.6 needs a Vulkan 1.3 device.
        spirv: caps.api_version >= ash::vk::API_VERSION_1_3,
        ptx: caps.ptx_capable(),
    }
}

/// Whether (and how) the cooperative-matrix GEMM can run on `caps`: the
/// 16×16×16 f16→f32 shape and a fixed subgroup size (reported fixed, or
/// pinned). `choice` is fitted to the device's limits
/// ([`fit_choice`]).
pub(crate) fn coop_plan(caps: &Caps, choice: GemmChoice, source: ChoiceSource) -> Result<Option<CoopPlan>> {
    coop_plan_within(caps, choice, source, &kernel_limits(caps))
}

/// [`coop_plan`] within `limits` (the device's, less the PTX tiles where
/// they failed there before: `crate::tile_faults`).
pub(crate) fn coop_plan_within(
    caps: &Caps,
    choice: GemmChoice,
    source: ChoiceSource,
    limits: &KernelLimits,
) -> Result<Option<CoopPlan>> {
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
    let (choice, source) = fit_choice(crate::DEFAULT_GEMM, choice, source, limits)?;
    Ok(Some(CoopPlan {
        subgroup_size: size,
        require_size,
        choice,
        source,
    }))
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
            api_version: vk::API_VERSION_1_3,
            ..Caps::default()
        };
        c.features.cooperative_matrix = true;
        c.features.vulkan_memory_model = true;
        c.features.vulkan_memory_model_device_scope = true;
        c
    }

    fn plan(caps: &Caps, choice: &str, source: ChoiceSource) -> Result<Option<CoopPlan>> {
        coop_plan(caps, GemmChoice::parse(choice, crate::DEFAULT_GEMM).unwrap(), source)
    }

    #[test]
    fn coop_plan_follows_the_device() {
        let p = plan(&h200(), "staged:bk32:r2:s2", ChoiceSource::Options)
            .unwrap()
            .unwrap();
        assert_eq!((p.subgroup_size, p.require_size), (32, false));
        assert_eq!(
            p.choice,
            GemmChoice::parse("staged:bk32:r2:s2", crate::DEFAULT_GEMM).unwrap()
        );
        // With nothing chosen, the GLSL tiles where they run.
        let p = plan(&h200(), &crate::DEFAULT_GEMM.to_string(), ChoiceSource::Default)
            .unwrap()
            .unwrap();
        assert_eq!(p.choice, GemmChoice::GLSL_DEFAULT);

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
        assert_eq!(p.choice, GemmChoice::GLSL_DEFAULT);
        let mut c = h200();
        c.subgroup_ops = vk::SubgroupFeatureFlags::empty();
        assert!(!kernel_limits(&c).subgroup_builtins);
    }

    #[test]
    fn the_glsl_tiles_need_vulkan_1_3_and_subgroups_of_32() {
        let glsl = "logits=glsl:bm128.bk64.s1,dx=glsl:bm128.bk32.s2";
        let p = plan(&h200(), glsl, ChoiceSource::Environment).unwrap().unwrap();
        assert_eq!(p.choice.to_string(), glsl);
        let mut old = h200();
        old.api_version = vk::API_VERSION_1_2;
        let mut wide = h200();
        (wide.subgroup_size, wide.min_subgroup_size, wide.max_subgroup_size) = (64, 64, 64);
        for (caps, says) in [(old, "SPIR-V 1.6"), (wide, "subgroups of 32")] {
            match plan(&caps, glsl, ChoiceSource::Environment) {
                Err(headkl_core::Error::InvalidSetting { name, reason, .. }) => {
                    assert_eq!(name, "HEADKL_GEMM");
                    assert!(reason.contains(says), "{reason}");
                }
                other => panic!("{other:?}"),
            }
            // From the tune cache: the default, quietly.
            let p = plan(&caps, glsl, ChoiceSource::Cache("x".into())).unwrap().unwrap();
            assert_eq!(p.choice, crate::DEFAULT_GEMM);
        }
    }

    #[test]
    fn a_device_too_small_for_the_row_kernels_is_unusable_at_listing() {
        // The catalogue's check the adapter listing applies (adapter.rs).
        assert_eq!(
            headkl_core::toolkit::kernels::device_misfit(&kernel_limits(&h200())),
            None
        );
        let mut c = h200();
        c.max_shared_memory = 16 << 10;
        let why = headkl_core::toolkit::kernels::device_misfit(&kernel_limits(&c)).unwrap();
        assert!(why.contains("topk_rows"), "{why}");
        c.max_shared_memory = 48 << 10;
        c.max_invocations = 128;
        assert!(headkl_core::toolkit::kernels::device_misfit(&kernel_limits(&c)).is_some());
    }
}
