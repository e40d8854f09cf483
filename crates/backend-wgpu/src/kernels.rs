//! The WGSL kernels: sources, bind-group layouts, and the compute pipelines,
//! built once per backend on first use.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Mutex;

use headkl_core::params::{ConvertParams, GemmParams, RowParams};
use headkl_core::Result;

use crate::buffer::{lock, LayoutKind};
use crate::{backend_error, env_flag};

const CONVERT_WGSL: &str = include_str!("../../../shaders/convert.wgsl");
const KL_WGSL: &str = include_str!("../../../shaders/kl_rows.wgsl");
const TOPK_WGSL: &str = include_str!("../../../shaders/topk_rows.wgsl");
const GEMM_TILED_WGSL: &str = include_str!("../../../shaders/gemm_tiled.wgsl");
const GEMM_COOP_WGSL: &str = include_str!("../../../shaders/gemm_coop.wgsl");
const GEMM_COOP_DIRECT_WGSL: &str = include_str!("../../../shaders/gemm_coop_direct.wgsl");

/// Workgroup memory the row kernels need (`topk_rows.wgsl`'s, the larger).
pub(crate) const ROW_WORKGROUP_BYTES: u32 = 26 * 1024;

/// Output tile (rows, columns) per workgroup of the tiled GEMM.
const TILED_TILE: (usize, usize) = (64, 64);
/// Output tile per workgroup of the staged cooperative GEMM.
/// Output tile columns per workgroup of the staged cooperative GEMM (its
/// rows are `64 · coop_rows()`).
const COOP_TILE_N: usize = 128;
/// Output tile per workgroup of the direct cooperative GEMM.
const COOP_DIRECT_TILE: (usize, usize) = (64, 64);
/// Invocations per workgroup of the row kernels and the conversion.
pub(crate) const ROW_WORKGROUP: usize = 256;

/// Rows of subgroups in the staged cooperative GEMM's workgroup
/// (`HEADKL_COOP_ROWS`, 2 or 4; default 2): its C tile is `(64 · rows) × 128`.
pub(crate) fn coop_rows() -> u32 {
    match std::env::var("HEADKL_COOP_ROWS").ok().as_deref().map(str::trim) {
        Some("4") => 4,
        _ => 2,
    }
}

/// K staged per step by the cooperative GEMM (`HEADKL_COOP_BK`, 16 or 32;
/// 16 by default: on the H200 it ran the logits GEMM 1.6× faster than 32).
pub(crate) fn coop_bk() -> u32 {
    match std::env::var("HEADKL_COOP_BK").ok().as_deref().map(str::trim) {
        Some("32") => 32,
        _ => 16,
    }
}

/// Which cooperative GEMM runs for each head layout (`HEADKL_COOP_KERNEL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CoopKernel {
    /// `gemm_coop.wgsl` (staged through workgroup memory) for both layouts.
    Staged,
    /// `gemm_coop_direct.wgsl` (fragments straight from storage) for both.
    Direct,
    /// Staged for the logits (`gemm_nt`), direct for dx (`gemm_nn`): the
    /// faster of the two for each on the H200 (the dx GEMM's long K and
    /// short m, n leave the staged kernel's 128 × 128 tiles too few).
    Mixed,
}

impl CoopKernel {
    /// `HEADKL_COOP_KERNEL=staged|direct|mixed` (default `mixed`).
    pub(crate) fn from_env() -> Self {
        match std::env::var("HEADKL_COOP_KERNEL").ok().as_deref().map(str::trim) {
            Some(v) if v.eq_ignore_ascii_case("direct") => Self::Direct,
            Some(v) if v.eq_ignore_ascii_case("staged") => Self::Staged,
            _ => Self::Mixed,
        }
    }

    /// Whether `kernel` (a GEMM entry) runs the direct variant.
    fn direct_for(self, kernel: Kernel) -> bool {
        match self {
            Self::Staged => false,
            Self::Direct => true,
            Self::Mixed => kernel == Kernel::GemmNn,
        }
    }

    /// Whether the staged kernel (and its subgroup and workgroup-memory
    /// needs) is used at all.
    pub(crate) fn uses_staged(self) -> bool {
        self != Self::Direct
    }
}

/// Workgroup memory of the staged cooperative GEMM at `bk` and `rows`
/// (`(64·rows) × (bk + 8)` and `128 × (bk + 8)` f16 tiles).
pub(crate) fn coop_workgroup_bytes(bk: u32, rows: u32) -> u32 {
    (64 * rows + 128) * (bk + 8) * 2
}

/// A kernel entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kernel {
    Convert,
    Kl,
    Topk,
    GemmNt,
    GemmNn,
}

impl Kernel {
    pub fn layout(self) -> LayoutKind {
        match self {
            Kernel::Convert => LayoutKind::Convert,
            Kernel::Kl => LayoutKind::Kl,
            Kernel::Topk => LayoutKind::Topk,
            Kernel::GemmNt | Kernel::GemmNn => LayoutKind::Gemm,
        }
    }

    fn entry(self) -> &'static str {
        match self {
            Kernel::Convert => "convert_f16",
            Kernel::Kl => "kl_rows",
            Kernel::Topk => "topk_rows",
            Kernel::GemmNt => "gemm_nt",
            Kernel::GemmNn => "gemm_nn",
        }
    }
}

/// Size of the uniform block of a layout.
pub(crate) fn params_size(kind: LayoutKind) -> u64 {
    (match kind {
        LayoutKind::Convert => size_of::<ConvertParams>(),
        LayoutKind::Kl | LayoutKind::Topk => size_of::<RowParams>(),
        LayoutKind::Gemm => size_of::<GemmParams>(),
    }) as u64
}

/// Storage bindings 1.. of a layout: `true` where read-write.
fn storage_bindings(kind: LayoutKind) -> &'static [bool] {
    match kind {
        LayoutKind::Convert => &[false, true],
        LayoutKind::Kl => &[false, false, false, false, true, true],
        LayoutKind::Topk => &[false, true, true],
        LayoutKind::Gemm => &[false, false, true],
    }
}

/// How the GEMM is built.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmBuild {
    /// Cooperative matrices with this subgroup size, else the tiled kernel.
    pub coop_subgroup: Option<u32>,
    /// Which cooperative kernel runs for each layout.
    pub coop_kernel: CoopKernel,
    /// Build the GEMM with runtime bounds checks.
    pub checked: bool,
}

/// Layouts, modules and pipelines of one device.
pub(crate) struct Kernels {
    layouts: HashMap<LayoutKind, (wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    modules: Mutex<HashMap<&'static str, wgpu::ShaderModule>>,
    pipelines: Mutex<HashMap<Kernel, wgpu::ComputePipeline>>,
    gemm: GemmBuild,
}

impl Kernels {
    pub fn new(device: &wgpu::Device, gemm: GemmBuild) -> Self {
        let mut layouts = HashMap::new();
        for kind in [LayoutKind::Convert, LayoutKind::Kl, LayoutKind::Topk, LayoutKind::Gemm] {
            let mut entries = vec![wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: true,
                    min_binding_size: NonZeroU64::new(params_size(kind)),
                },
                count: None,
            }];
            for (i, &rw) in storage_bindings(kind).iter().enumerate() {
                entries.push(wgpu::BindGroupLayoutEntry {
                    binding: i as u32 + 1,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Storage { read_only: !rw },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                });
            }
            let bgl = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("headkl"),
                entries: &entries,
            });
            let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("headkl"),
                bind_group_layouts: &[Some(&bgl)],
                immediate_size: 0,
            });
            layouts.insert(kind, (bgl, pl));
        }
        Self {
            layouts,
            modules: Mutex::new(HashMap::new()),
            pipelines: Mutex::new(HashMap::new()),
            gemm,
        }
    }

    pub fn bind_group_layout(&self, kind: LayoutKind) -> Result<&wgpu::BindGroupLayout> {
        self.layouts
            .get(&kind)
            .map(|(bgl, _)| bgl)
            .ok_or_else(|| backend_error(format!("no bind-group layout for {kind:?}")))
    }

    fn source(&self, kernel: Kernel) -> (&'static str, &'static str) {
        match kernel {
            Kernel::Convert => ("convert.wgsl", CONVERT_WGSL),
            Kernel::Kl => ("kl_rows.wgsl", KL_WGSL),
            Kernel::Topk => ("topk_rows.wgsl", TOPK_WGSL),
            Kernel::GemmNt | Kernel::GemmNn => {
                if self.gemm.coop_subgroup.is_some() && self.gemm.coop_kernel.direct_for(kernel) {
                    ("gemm_coop_direct.wgsl", GEMM_COOP_DIRECT_WGSL)
                } else if self.gemm.coop_subgroup.is_some() {
                    ("gemm_coop.wgsl", GEMM_COOP_WGSL)
                } else {
                    ("gemm_tiled.wgsl", GEMM_TILED_WGSL)
                }
            }
        }
    }

    fn module(&self, device: &wgpu::Device, kernel: Kernel) -> wgpu::ShaderModule {
        let (name, source) = self.source(kernel);
        let mut modules = lock(&self.modules);
        modules
            .entry(name)
            .or_insert_with(|| {
                let desc = wgpu::ShaderModuleDescriptor {
                    label: Some(name),
                    source: wgpu::ShaderSource::Wgsl(source.into()),
                };
                let gemm = matches!(kernel, Kernel::GemmNt | Kernel::GemmNn);
                if gemm && !self.gemm.checked && !env_flag("HEADKL_CHECKED") {
                    // SAFETY: the GEMM kernels index only inside the extents
                    // of a GemmDesc, which core validated against the buffer
                    // sizes (see shaders/README.md): runtime bounds checks
                    // would only cost time.
                    unsafe { device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
                } else {
                    device.create_shader_module(desc)
                }
            })
            .clone()
    }

    /// The pipeline of `kernel`, built on first use. Build errors (WGSL,
    /// driver compile) come back as `Error::Backend`.
    pub fn pipeline(&self, device: &wgpu::Device, kernel: Kernel) -> Result<wgpu::ComputePipeline> {
        if let Some(p) = lock(&self.pipelines).get(&kernel) {
            return Ok(p.clone());
        }
        let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
        let module = self.module(device, kernel);
        let (name, _) = self.source(kernel);
        let layout = self
            .layouts
            .get(&kernel.layout())
            .map(|(_, pl)| pl)
            .ok_or_else(|| backend_error(format!("no pipeline layout for {kernel:?}")))?;
        let mut constants: Vec<(&str, f64)> = Vec::new();
        if let Some(sg) = self.gemm.coop_subgroup {
            match name {
                "gemm_coop.wgsl" => {
                    constants.push(("SG_SIZE", f64::from(sg)));
                    constants.push(("BK", f64::from(coop_bk())));
                    constants.push(("SG_ROWS", f64::from(coop_rows())));
                }
                "gemm_coop_direct.wgsl" => constants.push(("SG_SIZE", f64::from(sg))),
                _ => {}
            }
        }
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kernel.entry()),
            layout: Some(layout),
            module: &module,
            entry_point: Some(kernel.entry()),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &constants,
                // Every kernel writes its workgroup memory before reading it.
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        let internal_err = pollster::block_on(internal.pop());
        let validation_err = pollster::block_on(validation.pop());
        if let Some(e) = validation_err.or(internal_err) {
            // Forget the module too, so a retry rebuilds it.
            lock(&self.modules).remove(name);
            let hint = if name.starts_with("gemm_coop") {
                " (HEADKL_NO_COOPMAT=1 selects the tiled GEMM)"
            } else {
                ""
            };
            return Err(backend_error(format!("building {name}:{}: {e}{hint}", kernel.entry())));
        }
        lock(&self.pipelines).insert(kernel, pipeline.clone());
        Ok(pipeline)
    }

    /// Output tile (rows, columns) per workgroup of the GEMM `kernel` runs.
    pub fn gemm_tile(&self, kernel: Kernel) -> (usize, usize) {
        match self.gemm.coop_subgroup {
            Some(_) if self.gemm.coop_kernel.direct_for(kernel) => COOP_DIRECT_TILE,
            Some(_) => (64 * coop_rows() as usize, COOP_TILE_N),
            None => TILED_TILE,
        }
    }
}
