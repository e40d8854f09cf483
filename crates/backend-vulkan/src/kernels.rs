//! The shared WGSL kernels (`shaders/`), their override values and
//! dispatch grids (shaders/README.md).

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
/// C tile columns of the staged cooperative-matrix GEMM's workgroup (its
/// rows are `64 · rows`).
pub(crate) const COOP_TILE_N: u64 = 128;
/// Default rows of subgroups in the staged GEMM's workgroup (`SG_ROWS`).
pub(crate) const COOP_ROWS: u32 = 2;
/// C tile of the direct cooperative-matrix GEMM's workgroup (rows, columns).
pub(crate) const COOP_DIRECT_TILE: (u64, u64) = (64, 64);
/// Default K staged per step by the staged cooperative-matrix GEMM (`BK`):
/// on the H200, 16 ran the logits GEMM 1.6× faster than 32.
pub(crate) const COOP_BK: u32 = 16;

/// Workgroup memory of the staged cooperative-matrix GEMM at `bk`: two
/// `(64·rows) × (bk + 8)` and `128 × (bk + 8)` f16 tiles.
pub(crate) fn coop_shared_bytes(bk: u32, rows: u32) -> u32 {
    (64 * rows + 128) * (bk + 8) * 2
}

/// Which cooperative-matrix GEMM runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CoopKernel {
    /// `gemm_coop.wgsl`, staging `bk` of K per step in workgroup memory.
    Staged { bk: u32, rows: u32 },
    /// `gemm_coop_direct.wgsl`, fragments straight from storage.
    Direct,
    /// Staged for the logits (`gemm_nt`), direct for dx (`gemm_nn`): the
    /// faster of the two for each on the H200 (the dx GEMM's long K and
    /// short m, n leave the staged kernel's 128 × 128 tiles too few).
    Mixed { bk: u32, rows: u32 },
}

impl CoopKernel {
    /// The kernel that runs for the head layout `layout`.
    pub(crate) fn for_layout(self, layout: headkl_core::HeadLayout) -> Self {
        match (self, layout) {
            (Self::Mixed { bk, rows }, headkl_core::HeadLayout::RowsAreOutputs) => Self::Staged { bk, rows },
            (Self::Mixed { .. }, headkl_core::HeadLayout::RowsAreReduction) => Self::Direct,
            (other, _) => other,
        }
    }
}

/// How the cooperative-matrix GEMM runs on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CoopPlan {
    /// The `SG_SIZE` override: the subgroup size the pipeline runs with.
    pub(crate) subgroup_size: u32,
    /// Pin it with `VK_EXT_subgroup_size_control` (the device's size varies).
    pub(crate) require_size: bool,
    pub(crate) kernel: CoopKernel,
}

/// Whether (and how) the cooperative-matrix GEMM `kernel` can run on
/// `caps`: the 16×16×16 f16→f32 shape, subgroup builtins in compute (the
/// staged kernel's `subgroup_id`), enough workgroup memory, and a fixed
/// subgroup size (reported fixed, or pinned).
pub(crate) fn coop_plan(caps: &Caps, kernel: CoopKernel) -> Option<CoopPlan> {
    use ash::vk::SubgroupFeatureFlags as S;
    if !caps.coop_capable() {
        return None;
    }
    if let CoopKernel::Staged { bk, rows } | CoopKernel::Mixed { bk, rows } = kernel {
        if !caps.subgroup_ops.contains(S::BASIC) || caps.max_shared_memory < coop_shared_bytes(bk, rows) {
            return None;
        }
    }
    let size = caps.subgroup_size;
    if size == 0 || !size.is_power_of_two() {
        return None;
    }
    if caps.min_subgroup_size == size && caps.max_subgroup_size == size {
        return Some(CoopPlan {
            subgroup_size: size,
            require_size: false,
            kernel,
        });
    }
    let pinnable = caps.features.subgroup_size_control
        && caps.required_subgroup_size_compute
        && (caps.min_subgroup_size..=caps.max_subgroup_size).contains(&size);
    pinnable.then_some(CoopPlan {
        subgroup_size: size,
        require_size: true,
        kernel,
    })
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
            matrix_shapes: vec![(16, 8, 8), (16, 8, 16), (16, 16, 16)],
            ..Caps::default()
        };
        c.features.cooperative_matrix = true;
        c.features.vulkan_memory_model = true;
        c.features.vulkan_memory_model_device_scope = true;
        c
    }

    const STAGED: CoopKernel = CoopKernel::Staged {
        bk: COOP_BK,
        rows: COOP_ROWS,
    };

    #[test]
    fn coop_plan_follows_the_device() {
        let plan = coop_plan(&h200(), STAGED).unwrap();
        assert_eq!((plan.subgroup_size, plan.require_size), (32, false));
        assert_eq!(
            coop_plan(&h200(), CoopKernel::Direct).unwrap().kernel,
            CoopKernel::Direct
        );

        // No 16×16×16 f16→f32 shape, or no memory model: fallback.
        let mut c = h200();
        c.matrix_shapes = vec![(16, 8, 16)];
        assert_eq!(coop_plan(&c, STAGED), None);
        let mut c = h200();
        c.features.vulkan_memory_model_device_scope = false;
        assert_eq!(coop_plan(&c, CoopKernel::Direct), None);

        // A varying subgroup size needs pinning (size control for compute).
        let mut c = h200();
        (c.subgroup_size, c.min_subgroup_size, c.max_subgroup_size) = (64, 32, 64);
        assert_eq!(coop_plan(&c, STAGED), None);
        c.features.subgroup_size_control = true;
        c.required_subgroup_size_compute = true;
        let plan = coop_plan(&c, STAGED).unwrap();
        assert_eq!((plan.subgroup_size, plan.require_size), (64, true));

        // The staged kernel needs workgroup memory and subgroup builtins;
        // the direct one neither.
        let mut c = h200();
        c.max_shared_memory = 16 << 10;
        assert_eq!(coop_plan(&c, CoopKernel::Staged { bk: 32, rows: 2 }), None);
        assert_eq!(
            coop_plan(&c, CoopKernel::Mixed { bk: 32, rows: 2 }),
            None,
            "mixed stages the logits GEMM"
        );
        assert!(
            coop_plan(&c, CoopKernel::Staged { bk: 16, rows: 2 }).is_some(),
            "12 KiB at BK = 16"
        );
        c.subgroup_ops = vk::SubgroupFeatureFlags::empty();
        assert_eq!(coop_plan(&c, CoopKernel::Staged { bk: 16, rows: 2 }), None);
        assert!(coop_plan(&c, CoopKernel::Direct).is_some());
        assert_eq!(coop_shared_bytes(32, 2), 20 << 10);
        assert_eq!(coop_shared_bytes(16, 4), 18 << 10);

        // Mixed: staged for the logits, direct for dx.
        let mixed = CoopKernel::Mixed { bk: 16, rows: 2 };
        assert_eq!(
            mixed.for_layout(headkl_core::HeadLayout::RowsAreOutputs),
            CoopKernel::Staged { bk: 16, rows: 2 }
        );
        assert_eq!(
            mixed.for_layout(headkl_core::HeadLayout::RowsAreReduction),
            CoopKernel::Direct
        );
        assert_eq!(
            CoopKernel::Direct.for_layout(headkl_core::HeadLayout::RowsAreOutputs),
            CoopKernel::Direct
        );
    }
}
