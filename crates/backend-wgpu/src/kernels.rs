//! The WGSL kernels: sources, bind-group layouts, and the compute pipelines,
//! built once per backend on first use.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Mutex;

use headkl_core::params::ResidentParams;
use headkl_core::params::{ConvertParams, GemmParams, RowParams};
use headkl_core::resident::Access;
use headkl_core::{CoopGemm, GemmChoice, HeadLayout, ResidentKernel, Result};

use crate::buffer::{lock, LayoutKind};
use crate::{backend_error, env_flag};

const CONVERT_WGSL: &str = include_str!("../../../shaders/convert.wgsl");
const KL_WGSL: &str = include_str!("../../../shaders/kl_rows.wgsl");
const TOPK_WGSL: &str = include_str!("../../../shaders/topk_rows.wgsl");
const GEMM_TILED_WGSL: &str = include_str!("../../../shaders/gemm_tiled.wgsl");
const GEMM_COOP_WGSL: &str = include_str!("../../../shaders/gemm_coop.wgsl");
const GEMM_COOP_DIRECT_WGSL: &str = include_str!("../../../shaders/gemm_coop_direct.wgsl");

/// The device-resident kernels' source: `resident_common.wgsl`, then the
/// kernel's own file.
pub(crate) fn resident_source(kernel: ResidentKernel) -> &'static str {
    macro_rules! with_common {
        ($file:literal) => {
            concat!(
                include_str!("../../../shaders/resident_common.wgsl"),
                include_str!(concat!("../../../shaders/", $file))
            )
        };
    }
    match kernel {
        ResidentKernel::WeightStats => with_common!("resident_stats.wgsl"),
        ResidentKernel::TeacherRows => with_common!("resident_teacher.wgsl"),
        ResidentKernel::HiddenIn => with_common!("resident_hidden.wgsl"),
        ResidentKernel::LossOut => with_common!("resident_loss_out.wgsl"),
        ResidentKernel::TopkOut => with_common!("resident_topk_out.wgsl"),
        ResidentKernel::StatusDetail => with_common!("resident_status.wgsl"),
    }
}

/// Workgroup memory the row kernels need (`topk_rows.wgsl`'s, the larger).
pub(crate) const ROW_WORKGROUP_BYTES: u32 = 26 * 1024;

/// Output tile (rows, columns) per workgroup of the tiled GEMM.
const TILED_TILE: (usize, usize) = (64, 64);
/// Invocations per workgroup of the row kernels and the conversion.
pub(crate) const ROW_WORKGROUP: usize = 256;

/// A kernel entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kernel {
    Convert,
    Kl,
    Topk,
    GemmNt,
    GemmNn,
    Resident(ResidentKernel),
}

impl Kernel {
    pub fn layout(self) -> LayoutKind {
        match self {
            Kernel::Resident(r) => LayoutKind::Resident(r),
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
            Kernel::Resident(r) => r.entry(),
        }
    }
}

/// Size of the uniform block of a layout.
pub(crate) fn params_size(kind: LayoutKind) -> u64 {
    (match kind {
        LayoutKind::Convert => size_of::<ConvertParams>(),
        LayoutKind::Kl | LayoutKind::Topk => size_of::<RowParams>(),
        LayoutKind::Gemm => size_of::<GemmParams>(),
        LayoutKind::Resident(_) => size_of::<ResidentParams>(),
    }) as u64
}

/// Storage bindings 1.. of a layout: `true` where read-write.
fn storage_bindings(kind: LayoutKind) -> Vec<bool> {
    let shared: &[bool] = match kind {
        LayoutKind::Resident(r) => return r.bindings().iter().map(|a| *a == Access::ReadWrite).collect(),
        LayoutKind::Convert => &[false, true],
        LayoutKind::Kl => &[false, false, false, false, true, true],
        LayoutKind::Topk => &[false, true, true],
        LayoutKind::Gemm => &[false, false, true],
    };
    shared.to_vec()
}

/// How the GEMM is built.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmBuild {
    /// Cooperative matrices with this subgroup size and these kernels, else
    /// the tiled kernel.
    pub coop: Option<(u32, GemmChoice)>,
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
        let resident = ResidentKernel::ALL.map(LayoutKind::Resident);
        let shared = [LayoutKind::Convert, LayoutKind::Kl, LayoutKind::Topk, LayoutKind::Gemm];
        for kind in shared.into_iter().chain(resident) {
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

    /// The matrix-unit kernel a GEMM entry runs, if it runs on matrix units.
    fn coop_kernel(&self, kernel: Kernel) -> Option<CoopGemm> {
        let layout = match kernel {
            Kernel::GemmNt => HeadLayout::RowsAreOutputs,
            Kernel::GemmNn => HeadLayout::RowsAreReduction,
            _ => return None,
        };
        self.gemm.coop.map(|(_, choice)| choice.for_layout(layout))
    }

    fn source(&self, kernel: Kernel) -> (&'static str, &'static str) {
        match kernel {
            Kernel::Convert => ("convert.wgsl", CONVERT_WGSL),
            Kernel::Kl => ("kl_rows.wgsl", KL_WGSL),
            Kernel::Topk => ("topk_rows.wgsl", TOPK_WGSL),
            Kernel::Resident(r) => (r.file(), resident_source(r)),
            Kernel::GemmNt | Kernel::GemmNn => match self.coop_kernel(kernel) {
                Some(CoopGemm::Direct) => ("gemm_coop_direct.wgsl", GEMM_COOP_DIRECT_WGSL),
                Some(CoopGemm::Staged(_)) => ("gemm_coop.wgsl", GEMM_COOP_WGSL),
                None => ("gemm_tiled.wgsl", GEMM_TILED_WGSL),
            },
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
        if let (Some((sg, _)), Some(coop)) = (self.gemm.coop, self.coop_kernel(kernel)) {
            constants.extend(coop.overrides(sg).into_iter().map(|(name, v)| (name, f64::from(v))));
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
        match self.coop_kernel(kernel) {
            Some(coop) => {
                let (rows, cols) = coop.tile();
                (rows as usize, cols as usize)
            }
            None => TILED_TILE,
        }
    }
}
