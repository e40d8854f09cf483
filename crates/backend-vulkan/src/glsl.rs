//! The GLSL kernels of `shaders/gemm_khr.comp` (SPIR-V from `headkl-glsl`)
//! on this backend: the GEMM tiles of core's catalogue run through
//! [`headkl_core::Backend::gemm`] like the WGSL kernels (`lib.rs`), and the
//! ceiling report (`headkl tune --ceiling`) times every variant, its
//! diagnostic kernels included, through [`VulkanBackend::dispatch_glsl`].

use headkl_core::toolkit::glsl_tile::GLSL_BN;
use headkl_core::toolkit::params::GemmParams;
use headkl_core::toolkit::{CoopGemm, GemmDesc, GlslTile, HeadLayout};
use headkl_core::Result;
use headkl_glsl::{CeilingPart, GlslKernel, GlslVariant, KERNELS};

use crate::command::Binding;
use crate::conv::backend_error;
use crate::memory::VulkanBuffer;
use crate::pipeline::PipelineKey;
use crate::VulkanBackend;

/// A variant the ceiling report can time on this device.
#[derive(Clone, Debug)]
pub struct CeilingKernel {
    /// The label its timings carry ([`GlslVariant::name`]).
    pub name: &'static str,
    /// What it is: its part, layout, tile and levers.
    pub variant: GlslVariant,
    /// The build it describes.
    kernel: &'static GlslKernel,
}

impl CeilingKernel {
    /// What it runs.
    pub fn part(&self) -> CeilingPart {
        self.variant.part
    }

    /// Which GEMM it mimics.
    pub fn layout(&self) -> HeadLayout {
        self.kernel.layout()
    }

    /// Its tile configuration.
    pub fn tile(&self) -> GlslTile {
        self.variant.tile
    }

    /// Whether its result is the GEMM of the operands (then it is checked).
    pub fn exact(&self) -> bool {
        self.kernel.exact()
    }

    /// Whether it is the GEMM headkl runs for its tile.
    pub fn is_tile_gemm(&self) -> bool {
        self.kernel.is_tile_gemm()
    }

    /// Its tile, and what it does differently from the GEMM headkl can run.
    pub fn label(&self) -> String {
        self.variant.label()
    }
}

impl VulkanBackend {
    /// Why the GLSL kernels cannot run here, or `None` when they can: the
    /// GEMM must run on the matrix units, and the tiles' own needs
    /// ([`CoopGemm::misfit`]: subgroups of 32, Vulkan 1.3).
    pub fn glsl_unavailable(&self) -> Option<String> {
        let Some(_) = &self.coop else {
            return Some(format!(
                "{} has no usable matrix units (VK_KHR_cooperative_matrix 16×16×16 f16→f32), or HEADKL_NO_COOPMAT is set",
                self.device.caps.name
            ));
        };
        let smallest = headkl_core::toolkit::glsl_tile::GLSL_TILES
            .iter()
            .copied()
            .min_by_key(|t| t.shared_bytes())?;
        CoopGemm::Glsl(smallest).misfit(&crate::kernels::kernel_limits(&self.device.caps))
    }

    /// The GLSL variants that fit this device's workgroup limits; empty
    /// where [`Self::glsl_unavailable`] says why.
    pub fn ceiling_kernels(&self) -> Vec<CeilingKernel> {
        if self.glsl_unavailable().is_some() {
            return Vec::new();
        }
        let caps = &self.device.caps;
        KERNELS
            .iter()
            .filter(|k| k.shared_bytes() <= caps.max_shared_memory && k.invocations() <= caps.max_invocations)
            .filter(|k| caps.matrix_shapes.contains(&k.matrix_shape()))
            .map(|k| CeilingKernel {
                name: k.name,
                variant: k.variant,
                kernel: k,
            })
            .collect()
    }

    /// Records GLSL variant `name` on a GEMM described by `desc` (its layout
    /// must be the variant's), timed under `label`. Diagnostic variants
    /// leave `c` as it was, except possibly its first element.
    pub fn dispatch_glsl(
        &self,
        name: &str,
        a: &VulkanBuffer,
        b: &VulkanBuffer,
        c: &VulkanBuffer,
        desc: &GemmDesc,
        label: &'static str,
    ) -> Result<()> {
        let Some(kernel) = headkl_glsl::by_name(name) else {
            return Err(backend_error(format!("no GLSL kernel named {name}")));
        };
        if let Some(why) = self.glsl_unavailable() {
            return Err(backend_error(why));
        }
        let params = desc.check([a, b, c], self.max_binding())?;
        if kernel.timing_layout() {
            // Its reads stay inside the operands only when the tiles divide them.
            let (bm, bk, bn) = (kernel.tile().bm as usize, kernel.tile().bk as usize, GLSL_BN as usize);
            let whole = desc.m.is_multiple_of(bm) && desc.n.is_multiple_of(bn) && desc.k.is_multiple_of(bk);
            if !whole || desc.a_offset != 0 || desc.lda != desc.k {
                return Err(backend_error(format!(
                    "{name}: pre-tiled timing needs dense operands with m, n, k multiples of {bm}, {bn}, {bk}; got {}:{}:{}",
                    desc.m, desc.n, desc.k
                )));
            }
        }
        self.glsl_kernel_dispatch(kernel, a, b, c, desc, params, label)
    }

    /// Records `kernel` (the GEMM's catalogue build where a GLSL tile is
    /// chosen, or a ceiling variant); `params` are core's checked block for
    /// `desc`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the GEMM's buffers, descriptor, block and label"
    )]
    pub(crate) fn glsl_kernel_dispatch(
        &self,
        kernel: &GlslKernel,
        a: &VulkanBuffer,
        b: &VulkanBuffer,
        c: &VulkanBuffer,
        desc: &GemmDesc,
        params: GemmParams,
        label: &'static str,
    ) -> Result<()> {
        if desc.b_layout != kernel.layout() {
            return Err(backend_error(format!(
                "{}: built for {:?}, asked for {:?}",
                kernel.name,
                kernel.layout(),
                desc.b_layout
            )));
        }
        for buffer in [a, b, c] {
            self.check_device(buffer, kernel.name)?;
        }
        if desc.m == 0 || desc.n == 0 {
            return Ok(());
        }
        let plan = self.coop.as_ref().ok_or_else(|| backend_error("no matrix-unit plan"))?;
        let key = PipelineKey {
            file: kernel.name,
            entry: "main",
            overrides: Vec::new(),
            checked: false,
            full_subgroups: true,
            required_subgroup_size: plan.require_size.then_some(plan.subgroup_size),
        };
        // One workgroup per tile and split-K part (the diagnostic modes
        // skip the parts past the first).
        let count = desc.workgroups_for_tile(CoopGemm::Glsl(kernel.tile()).tile());
        let grid = headkl_core::toolkit::fold_workgroups(count);
        let pipeline = self
            .pipelines
            .lock()
            .map_err(|_| backend_error("the pipeline cache's lock was poisoned by a panic"))?
            .get_spirv(&kernel.words(), [kernel.invocations(), 1, 1], &key, 3)?;
        let params = params.with_grid(grid.0);
        let bindings: [Binding; 3] = [a.into(), b.into(), c.into()];
        self.stream()?
            .dispatch(&pipeline, bytemuck::bytes_of(&params), &bindings, grid, label)
    }
}
