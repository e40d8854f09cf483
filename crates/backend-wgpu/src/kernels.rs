//! The catalogue's kernels (`headkl_core::toolkit::kernels`) as wgpu objects:
//! bind-group layouts, shader modules and compute pipelines, built once per
//! backend on first use. WGSL goes through naga; the GLSL GEMM tiles'
//! SPIR-V (`headkl-glsl`) goes to the driver as is, through
//! `PASSTHROUGH_SHADERS`, with the same explicit pipeline layout.

use std::borrow::Cow;
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Mutex;

use headkl_core::toolkit::kernels::Access;
use headkl_core::toolkit::{GemmKernel, KernelBuild, KernelId, KernelSource};
use headkl_core::{GemmChoice, Result};

use crate::backend_error;
use crate::buffer::lock;

/// How the GEMM is built.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmBuild {
    /// Cooperative matrices with this subgroup size and these kernels, else
    /// the tiled kernel.
    pub coop: Option<(u32, GemmChoice)>,
    /// Build the GEMM with runtime bounds checks.
    pub checked: bool,
}

/// A pipeline's key: its entry and the launch's override values
/// (`Checked::specialization`: the KL rows' term set).
type PipelineKey = (KernelId, Vec<(&'static str, u32)>);

/// Layouts, modules and pipelines of one device.
pub(crate) struct Kernels {
    layouts: HashMap<KernelId, (wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    /// By [`KernelSource::name`].
    modules: Mutex<HashMap<String, wgpu::ShaderModule>>,
    pipelines: Mutex<HashMap<PipelineKey, wgpu::ComputePipeline>>,
    gemm: GemmBuild,
}

impl Kernels {
    pub fn new(device: &wgpu::Device, gemm: GemmBuild) -> Self {
        let mut layouts = HashMap::new();
        for kernel in KernelId::ALL {
            let mut entries = vec![wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: true,
                    min_binding_size: NonZeroU64::new(kernel.params_bytes()),
                },
                count: None,
            }];
            for (binding, &access) in (1..).zip(kernel.bindings()) {
                entries.push(wgpu::BindGroupLayoutEntry {
                    binding,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Storage {
                            read_only: access == Access::Read,
                        },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                });
            }
            let bgl = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(kernel.name()),
                entries: &entries,
            });
            let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(kernel.name()),
                bind_group_layouts: &[Some(&bgl)],
                immediate_size: 0,
            });
            layouts.insert(kernel, (bgl, pl));
        }
        Self {
            layouts,
            modules: Mutex::new(HashMap::new()),
            pipelines: Mutex::new(HashMap::new()),
            gemm,
        }
    }

    pub fn bind_group_layout(&self, kernel: KernelId) -> Result<&wgpu::BindGroupLayout> {
        self.layouts
            .get(&kernel)
            .map(|(bgl, _)| bgl)
            .ok_or_else(|| backend_error(format!("no bind-group layout for {kernel:?}")))
    }

    /// The GEMM implementation this device runs for `kernel` (the tiled one
    /// for the kernels that are not GEMMs, which ignore it).
    pub fn gemm_kernel(&self, kernel: KernelId) -> GemmKernel {
        match (self.gemm.coop, kernel.gemm_layout()) {
            (Some((subgroup, choice)), Some(layout)) => GemmKernel::Coop {
                kernel: choice.for_layout(layout),
                subgroup,
            },
            _ => GemmKernel::Tiled,
        }
    }

    /// The matrix-unit GEMM's kernels, where it runs.
    pub fn gemm_choice(&self) -> Option<GemmChoice> {
        self.gemm.coop.map(|(_, choice)| choice)
    }

    /// The matrix-unit GEMM's subgroup size, where it runs.
    pub fn coop_subgroup(&self) -> Option<u32> {
        self.gemm.coop.map(|(subgroup, _)| subgroup)
    }

    /// Runs `choice` on the matrix units from now on (the caller fitted
    /// it); the GEMM pipelines are rebuilt on next use.
    pub fn set_gemm_choice(&mut self, choice: GemmChoice) {
        if let Some((_, current)) = &mut self.gemm.coop {
            *current = choice;
            let mut pipelines = lock(&self.pipelines);
            pipelines.retain(|(id, _), _| id.gemm_layout().is_none());
        }
    }

    fn build(&self, kernel: KernelId) -> KernelBuild {
        kernel.build(self.gemm_kernel(kernel))
    }

    fn module(&self, device: &wgpu::Device, build: &KernelBuild) -> Result<wgpu::ShaderModule> {
        let mut modules = lock(&self.modules);
        if let Some(module) = modules.get(&build.source.name()) {
            return Ok(module.clone());
        }
        let module = match build.source {
            // Refused at open (KernelLimits::ptx is false here); a PTX tile
            // needs raw Vulkan command buffers.
            KernelSource::Ptx { tile, .. } => {
                return Err(backend_error(format!(
                    "wgmma:{tile} runs on the Vulkan backend only (VK_NVX_binary_import launches)"
                )));
            }
            KernelSource::Wgsl(shader) => {
                let desc = wgpu::ShaderModuleDescriptor {
                    label: Some(shader.file),
                    source: wgpu::ShaderSource::Wgsl(shader.source().into()),
                };
                if build.id.gemm_layout().is_some() && !self.gemm.checked {
                    // SAFETY: the GEMM kernels index only inside the extents
                    // of a GemmDesc, which core's checks (GemmDesc::check)
                    // validated against the buffer sizes before every
                    // dispatch (see shaders/README.md): runtime bounds checks
                    // would only cost time.
                    unsafe { device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
                } else {
                    device.create_shader_module(desc)
                }
            }
            KernelSource::Glsl { tile, layout, filter } => {
                let Some(kernel) = headkl_glsl::gemm(tile, layout, filter) else {
                    return Err(backend_error(format!(
                        "headkl-glsl did not build glsl:{tile} for {layout:?}"
                    )));
                };
                if !device.features().contains(wgpu::Features::PASSTHROUGH_SHADERS) {
                    return Err(backend_error(format!(
                        "glsl:{tile} needs PASSTHROUGH_SHADERS, which this device was opened without"
                    )));
                }
                let desc = wgpu::ShaderModuleDescriptorPassthrough {
                    label: Some(kernel.name),
                    entry_points: Cow::Owned(vec![wgpu::PassthroughShaderEntryPoint {
                        name: Cow::Borrowed(build.entry),
                        workgroup_size: (build.invocations, 1, 1),
                    }]),
                    spirv: Some(Cow::Owned(kernel.words())),
                    ..Default::default()
                };
                // SAFETY: the words are SPIR-V 1.6 that glslang compiled at
                // build time from shaders/gemm_khr.comp (headkl-glsl's
                // build.rs fails on any GLSL error); the catalogue tests
                // (headkl_glsl::check_build, run by this crate's and the
                // Vulkan backend's) hold its entry point, workgroup size,
                // workgroup memory and bindings to the catalogue's, which
                // is the pipeline layout it gets here. It runs only where
                // the GEMM plan fitted it to the device (subgroups of 32,
                // cooperative matrices and the Vulkan memory model
                // enabled, CoopGemm::misfit), and indexes only inside the
                // extents of a GemmDesc that core's checks validated
                // against the buffer sizes before every dispatch.
                unsafe { device.create_shader_module_passthrough(desc) }
            }
        };
        modules.insert(build.source.name(), module.clone());
        Ok(module)
    }

    /// The pipeline of `kernel` with the override values `specialization`
    /// added to its build, built on first use. Build errors (WGSL, driver
    /// compile) come back as `Error::Driver`.
    pub fn pipeline(
        &self,
        device: &wgpu::Device,
        kernel: KernelId,
        specialization: &[(&'static str, u32)],
    ) -> Result<wgpu::ComputePipeline> {
        let key = (kernel, specialization.to_vec());
        if let Some(p) = lock(&self.pipelines).get(&key) {
            return Ok(p.clone());
        }
        let mut build = self.build(kernel);
        build.overrides.extend_from_slice(specialization);
        let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
        // An early return drops the scopes' guards, which pop them.
        let module = self.module(device, &build)?;
        let layout = self
            .layouts
            .get(&kernel)
            .map(|(_, pl)| pl)
            .ok_or_else(|| backend_error(format!("no pipeline layout for {kernel:?}")))?;
        let constants: Vec<(&str, f64)> = build
            .overrides
            .iter()
            .map(|&(name, value)| (name, f64::from(value)))
            .collect();
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(build.entry),
            layout: Some(layout),
            module: &module,
            entry_point: Some(build.entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &constants,
                // Every kernel writes its workgroup memory before reading it.
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        let internal_err = pollster::block_on(internal.pop());
        let validation_err = pollster::block_on(validation.pop());
        let file = build.source.name();
        if let Some(e) = validation_err.or(internal_err) {
            // Forget the module too, so a retry rebuilds it.
            lock(&self.modules).remove(&file);
            let hint = if build.matrix_units {
                " (HEADKL_NO_COOPMAT=1 selects the tiled GEMM)"
            } else {
                ""
            };
            return Err(crate::driver_error(
                format!("building {file}:{}: {e}{hint}", build.entry),
                e,
            ));
        }
        lock(&self.pipelines).insert(key, pipeline.clone());
        Ok(pipeline)
    }
}
