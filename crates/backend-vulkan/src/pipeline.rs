//! WGSL → SPIR-V through naga, and the compute pipelines built from it,
//! cached by (file, entry point, override values, checks).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use ash::vk;
use headkl_core::Result;
use naga::back::spv;
use naga::valid::{Capabilities, ModuleInfo, ShaderStages, SubgroupOperationSet, ValidationFlags, Validator};

use crate::conv::{backend_error, driver_error, vk_error};
use crate::device::Device;

/// A WGSL file: its name (for errors and the cache) and its text.
pub(crate) type ShaderSource = headkl_core::toolkit::kernels::Shader;

/// What the generated SPIR-V may use on the target device.
#[derive(Clone, Debug)]
pub(crate) struct ShaderTarget {
    /// SPIR-V version.
    pub(crate) lang_version: (u8, u8),
    /// Subgroup operations available in compute shaders.
    pub(crate) subgroup_ops: vk::SubgroupFeatureFlags,
    /// Cooperative matrices (and the Vulkan memory model) are enabled.
    pub(crate) cooperative_matrix: bool,
    /// Workgroup memory is zeroed by the driver (else by naga's polyfill).
    pub(crate) zero_init_native: bool,
}

/// Whether workgroup memory is zeroed at kernel start. The shared kernels
/// write their workgroup memory before reading it (shaders/README.md), as
/// the wgpu backend relies on too, so they skip WGSL's zeroing.
const ZERO_INIT_WORKGROUP_MEMORY: bool = false;

/// Each subgroup operation the device reports: the naga operations it lets
/// the validator accept, and the SPIR-V capability the writer may declare.
const SUBGROUP_OPS: [(vk::SubgroupFeatureFlags, SubgroupOperationSet, spv::Capability); 7] = {
    use spv::Capability as C;
    use vk::SubgroupFeatureFlags as F;
    use SubgroupOperationSet as S;
    [
        (F::BASIC, S::BASIC, C::GroupNonUniform),
        (F::VOTE, S::VOTE, C::GroupNonUniformVote),
        (F::ARITHMETIC, S::ARITHMETIC, C::GroupNonUniformArithmetic),
        (F::BALLOT, S::BALLOT, C::GroupNonUniformBallot),
        (F::SHUFFLE, S::SHUFFLE, C::GroupNonUniformShuffle),
        (
            F::SHUFFLE_RELATIVE,
            S::SHUFFLE_RELATIVE,
            C::GroupNonUniformShuffleRelative,
        ),
        (F::QUAD, S::QUAD_FRAGMENT_COMPUTE, C::GroupNonUniformQuad),
    ]
};

impl ShaderTarget {
    /// The target for an opened device.
    pub(crate) fn for_device(device: &Device) -> Self {
        let api = device.caps.api_version;
        Self {
            lang_version: spirv_version(api),
            subgroup_ops: device.caps.subgroup_ops,
            cooperative_matrix: device.enabled.cooperative_matrix,
            zero_init_native: device.enabled.zero_initialize_workgroup_memory,
        }
    }

    /// A Vulkan 1.3 device with every feature headkl can use (what the
    /// H200 offers): the target of the compile-everything test.
    #[cfg(test)]
    pub(crate) fn everything() -> Self {
        Self {
            lang_version: (1, 6),
            subgroup_ops: vk::SubgroupFeatureFlags::BASIC
                | vk::SubgroupFeatureFlags::VOTE
                | vk::SubgroupFeatureFlags::ARITHMETIC
                | vk::SubgroupFeatureFlags::BALLOT
                | vk::SubgroupFeatureFlags::SHUFFLE
                | vk::SubgroupFeatureFlags::SHUFFLE_RELATIVE
                | vk::SubgroupFeatureFlags::QUAD,
            cooperative_matrix: true,
            zero_init_native: true,
        }
    }

    fn validator(&self) -> Validator {
        // pack/unpack2x16float are GLSL.std.450 instructions every Vulkan
        // device has.
        let mut caps = Capabilities::SHADER_FLOAT16 | Capabilities::SHADER_FLOAT16_IN_FLOAT32;
        let mut ops = SubgroupOperationSet::empty();
        let vk_ops = self.subgroup_ops;
        for (flag, set, _) in SUBGROUP_OPS {
            if vk_ops.contains(flag) {
                ops |= set;
            }
        }
        if vk_ops.contains(vk::SubgroupFeatureFlags::BASIC) {
            caps |= Capabilities::SUBGROUP | Capabilities::SUBGROUP_BARRIER;
        }
        if self.cooperative_matrix {
            caps |= Capabilities::COOPERATIVE_MATRIX;
        }
        let mut v = Validator::new(ValidationFlags::all(), caps);
        v.subgroup_stages(if ops.is_empty() {
            ShaderStages::empty()
        } else {
            ShaderStages::COMPUTE
        })
        .subgroup_operations(ops);
        v
    }

    fn spirv_capabilities(&self) -> naga::FastHashSet<spv::Capability> {
        use spv::Capability as C;
        let mut caps = vec![
            C::Shader,
            C::Float16,
            C::StorageBuffer16BitAccess,
            C::UniformAndStorageBuffer16BitAccess,
        ];
        let ops = self.subgroup_ops;
        for (flag, _, capability) in SUBGROUP_OPS {
            if ops.contains(flag) {
                caps.push(capability);
            }
        }
        if self.cooperative_matrix {
            caps.push(C::CooperativeMatrixKHR);
            caps.push(C::VulkanMemoryModel);
            caps.push(C::VulkanMemoryModelDeviceScope);
        }
        caps.into_iter().collect()
    }
}

/// SPIR-V version for a Vulkan API version.
pub(crate) fn spirv_version(api: u32) -> (u8, u8) {
    if api >= vk::API_VERSION_1_3 {
        (1, 6)
    } else if api >= vk::API_VERSION_1_2 {
        (1, 5)
    } else {
        (1, 3)
    }
}

/// A parsed and validated WGSL module.
pub(crate) struct Parsed {
    module: naga::Module,
    info: ModuleInfo,
}

/// Parses and validates `source` for `target`.
pub(crate) fn parse(source: &ShaderSource, target: &ShaderTarget) -> Result<Parsed> {
    let text = source.source();
    let module = naga::front::wgsl::parse_str(&text).map_err(|e| {
        backend_error(format!(
            "{}: WGSL parse error:\n{}",
            source.file,
            e.emit_to_string_with_path(&text, source.file)
        ))
    })?;
    let info = target.validator().validate(&module).map_err(|e| {
        backend_error(format!(
            "{}: naga validation error:\n{}",
            source.file,
            e.emit_to_string_with_path(&text, source.file)
        ))
    })?;
    Ok(Parsed { module, info })
}

/// SPIR-V for one entry point, and its workgroup size after overrides.
pub(crate) struct Compiled {
    pub(crate) words: Vec<u32>,
    pub(crate) workgroup_size: [u32; 3],
}

/// Compiles `entry` of `parsed` with the given override values. `checked`
/// keeps naga's bounds checks, loop bounding and division checks; without
/// it every index must be in range by construction.
pub(crate) fn compile(
    parsed: &Parsed,
    file: &str,
    entry: &str,
    overrides: &[(&'static str, u32)],
    target: &ShaderTarget,
    checked: bool,
) -> Result<Compiled> {
    let mut constants = naga::back::PipelineConstants::default();
    for &(name, value) in overrides {
        constants.insert(name.to_string(), f64::from(value));
    }
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &parsed.module,
        &parsed.info,
        Some((naga::ShaderStage::Compute, entry)),
        &constants,
    )
    .map_err(|e| driver_error(format!("{file}:{entry}: override values {overrides:?}: {e}"), e))?;
    let Some(ep) = module
        .entry_points
        .iter()
        .find(|ep| ep.name == entry && ep.stage == naga::ShaderStage::Compute)
    else {
        return Err(backend_error(format!("{file}: no compute entry point `{entry}`")));
    };
    let workgroup_size = ep.workgroup_size;

    let policy = if checked {
        naga::proc::BoundsCheckPolicy::Restrict
    } else {
        naga::proc::BoundsCheckPolicy::Unchecked
    };
    let options = spv::Options {
        lang_version: target.lang_version,
        flags: spv::WriterFlags::empty(),
        // Identity mapping: the WGSL group/binding numbers are the descriptor set/binding.
        fake_missing_bindings: true,
        capabilities: Some(target.spirv_capabilities()),
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: policy,
            buffer: policy,
            image_load: policy,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        zero_initialize_workgroup_memory: if !ZERO_INIT_WORKGROUP_MEMORY {
            spv::ZeroInitializeWorkgroupMemoryMode::None
        } else if target.zero_init_native {
            spv::ZeroInitializeWorkgroupMemoryMode::Native
        } else {
            spv::ZeroInitializeWorkgroupMemoryMode::Polyfill
        },
        force_loop_bounding: checked,
        ray_query_initialization_tracking: false,
        trace_ray_argument_validation: false,
        use_storage_input_output_16: false,
        emit_int_div_checks: checked,
        ..spv::Options::default()
    };
    let pipeline_options = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: entry.to_string(),
    };
    // naga's writer has panicked on some constructs (an inline coopStore
    // index); report that as an error naming the shader, not a crash.
    let written = catch_unwind(AssertUnwindSafe(|| {
        spv::write_vec(&module, &info, &options, Some(&pipeline_options))
    }));
    let words = match written {
        Ok(Ok(words)) => words,
        Ok(Err(e)) => {
            return Err(driver_error(
                format!("{file}:{entry}: SPIR-V generation failed: {e}"),
                e,
            ))
        }
        Err(panic) => {
            let message = headkl_core::toolkit::panic_message(&*panic);
            return Err(backend_error(format!(
                "{file}:{entry}: naga's SPIR-V writer panicked: {message}"
            )));
        }
    };
    Ok(Compiled { words, workgroup_size })
}

/// Identifies a pipeline in the cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PipelineKey {
    pub(crate) file: &'static str,
    pub(crate) entry: &'static str,
    pub(crate) overrides: Vec<(&'static str, u32)>,
    pub(crate) checked: bool,
    /// Require full subgroups (cooperative-matrix kernels).
    pub(crate) full_subgroups: bool,
    /// Pin the subgroup size (`VK_EXT_subgroup_size_control`).
    pub(crate) required_subgroup_size: Option<u32>,
}

/// A compute pipeline with its layout.
pub(crate) struct Pipeline {
    pub(crate) raw: vk::Pipeline,
    pub(crate) layout: vk::PipelineLayout,
    pub(crate) set_layout: vk::DescriptorSetLayout,
    /// Storage buffers at bindings `1..=storage_bindings`.
    pub(crate) storage_bindings: u32,
}

/// Parsed modules, layouts and pipelines, built on first use.
pub(crate) struct PipelineCache {
    device: Arc<Device>,
    target: ShaderTarget,
    parsed: HashMap<&'static str, Parsed>,
    /// `(set layout, pipeline layout)` per number of storage bindings.
    layouts: HashMap<u32, (vk::DescriptorSetLayout, vk::PipelineLayout)>,
    pipelines: HashMap<PipelineKey, Arc<Pipeline>>,
}

impl PipelineCache {
    pub(crate) fn new(device: Arc<Device>) -> Self {
        let target = ShaderTarget::for_device(&device);
        Self {
            device,
            target,
            parsed: HashMap::new(),
            layouts: HashMap::new(),
            pipelines: HashMap::new(),
        }
    }

    /// Pipelines built so far.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.pipelines.len()
    }

    /// The pipeline for `key`, built from `source` on first use, with a
    /// uniform block at binding 0 and `storage_bindings` storage buffers.
    pub(crate) fn get(
        &mut self,
        source: &ShaderSource,
        key: &PipelineKey,
        storage_bindings: u32,
    ) -> Result<Arc<Pipeline>> {
        if let Some(p) = self.pipelines.get(key) {
            return Ok(Arc::clone(p));
        }
        if !self.parsed.contains_key(source.file) {
            let parsed = parse(source, &self.target)?;
            self.parsed.insert(source.file, parsed);
        }
        let Some(parsed) = self.parsed.get(source.file) else {
            return Err(backend_error("parsed module missing from the cache"));
        };
        let compiled = compile(
            parsed,
            source.file,
            key.entry,
            &key.overrides,
            &self.target,
            key.checked,
        )?;
        self.insert(&compiled, key, storage_bindings)
    }

    /// The pipeline for `key` from SPIR-V compiled at build time (the GLSL
    /// kernels, entry `main`), built on first use.
    pub(crate) fn get_spirv(
        &mut self,
        words: &[u32],
        workgroup_size: [u32; 3],
        key: &PipelineKey,
        storage_bindings: u32,
    ) -> Result<Arc<Pipeline>> {
        if let Some(p) = self.pipelines.get(key) {
            return Ok(Arc::clone(p));
        }
        let compiled = Compiled {
            words: words.to_vec(),
            workgroup_size,
        };
        self.insert(&compiled, key, storage_bindings)
    }

    fn insert(&mut self, compiled: &Compiled, key: &PipelineKey, storage_bindings: u32) -> Result<Arc<Pipeline>> {
        let (set_layout, layout) = self.layout(storage_bindings)?;
        let raw = self.create_pipeline(compiled, key, layout)?;
        let pipeline = Arc::new(Pipeline {
            raw,
            layout,
            set_layout,
            storage_bindings,
        });
        self.pipelines.insert(key.clone(), Arc::clone(&pipeline));
        Ok(pipeline)
    }

    fn layout(&mut self, storage_bindings: u32) -> Result<(vk::DescriptorSetLayout, vk::PipelineLayout)> {
        if let Some(&l) = self.layouts.get(&storage_bindings) {
            return Ok(l);
        }
        let dev = &self.device.raw;
        let bindings: Vec<vk::DescriptorSetLayoutBinding> = (0..=storage_bindings)
            .map(|b| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(b)
                    .descriptor_type(if b == 0 {
                        vk::DescriptorType::UNIFORM_BUFFER
                    } else {
                        vk::DescriptorType::STORAGE_BUFFER
                    })
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let info = vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings);
        // SAFETY: valid device and create info.
        let set_layout = unsafe { dev.create_descriptor_set_layout(&info, None) }
            .map_err(|e| vk_error(e, "vkCreateDescriptorSetLayout"))?;
        let set_layouts = [set_layout];
        let info = vk::PipelineLayoutCreateInfo::default().set_layouts(&set_layouts);
        // SAFETY: valid device; the set layout was just created.
        let layout = match unsafe { dev.create_pipeline_layout(&info, None) } {
            Ok(l) => l,
            Err(e) => {
                // SAFETY: unused set layout.
                unsafe { dev.destroy_descriptor_set_layout(set_layout, None) };
                return Err(vk_error(e, "vkCreatePipelineLayout"));
            }
        };
        self.layouts.insert(storage_bindings, (set_layout, layout));
        Ok((set_layout, layout))
    }

    fn create_pipeline(
        &self,
        compiled: &Compiled,
        key: &PipelineKey,
        layout: vk::PipelineLayout,
    ) -> Result<vk::Pipeline> {
        let dev = &self.device.raw;
        let info = vk::ShaderModuleCreateInfo::default().code(&compiled.words);
        // SAFETY: valid device; the words are a complete SPIR-V module.
        let module =
            unsafe { dev.create_shader_module(&info, None) }.map_err(|e| vk_error(e, "vkCreateShaderModule"))?;
        let entry = std::ffi::CString::new(key.entry)
            .map_err(|_| backend_error(format!("entry point name {:?} contains NUL", key.entry)))?;
        let mut flags = vk::PipelineShaderStageCreateFlags::empty();
        let pinned = key
            .required_subgroup_size
            .filter(|_| self.device.enabled.subgroup_size_control);
        // Full subgroups need the workgroup's x size to be a multiple of the
        // pinned size, or of the largest size the device may pick.
        let unit = pinned.unwrap_or(self.device.caps.max_subgroup_size);
        if key.full_subgroups
            && self.device.enabled.full_subgroups
            && unit > 0
            && compiled.workgroup_size[0].is_multiple_of(unit)
        {
            flags |= vk::PipelineShaderStageCreateFlags::REQUIRE_FULL_SUBGROUPS;
        }
        let mut required = vk::PipelineShaderStageRequiredSubgroupSizeCreateInfo::default()
            .required_subgroup_size(pinned.unwrap_or(0));
        let mut stage = vk::PipelineShaderStageCreateInfo::default()
            .flags(flags)
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(&entry);
        if pinned.is_some() {
            stage = stage.push_next(&mut required);
        }
        let create_flags = if self.device.enabled.pipeline_stats {
            vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR
        } else {
            vk::PipelineCreateFlags::empty()
        };
        let info = [vk::ComputePipelineCreateInfo::default()
            .flags(create_flags)
            .stage(stage)
            .layout(layout)];
        // SAFETY: valid device, module and layout; the name outlives the call.
        let result = unsafe { dev.create_compute_pipelines(vk::PipelineCache::null(), &info, None) };
        // SAFETY: the module is no longer needed once the pipeline exists.
        unsafe { dev.destroy_shader_module(module, None) };
        match result {
            Ok(p) => {
                let pipeline = p
                    .into_iter()
                    .next()
                    .ok_or_else(|| backend_error("vkCreateComputePipelines returned no pipeline"))?;
                if self.device.enabled.pipeline_stats {
                    log::info!(
                        target: headkl_core::DIAGNOSTICS_LOG_TARGET,
                        "headkl-vulkan: pipeline {}:{} {:?}: {}",
                        key.file,
                        key.entry,
                        key.overrides,
                        self.statistics(pipeline)
                    );
                }
                Ok(pipeline)
            }
            Err((_, e)) => Err(vk_error(
                e,
                &format!("vkCreateComputePipelines({}:{})", key.file, key.entry),
            )),
        }
    }
}

impl PipelineCache {
    /// The driver's statistics of `pipeline` (register count, spills,
    /// workgroup memory…) in one line, or why there are none.
    fn statistics(&self, pipeline: vk::Pipeline) -> String {
        let loader = ash::khr::pipeline_executable_properties::Device::new(&self.device.instance.raw, &self.device.raw);
        let info = vk::PipelineInfoKHR::default().pipeline(pipeline);
        // SAFETY: the extension and feature are enabled (pipeline_stats) and
        // the pipeline was created with CAPTURE_STATISTICS.
        let executables = match unsafe { loader.get_pipeline_executable_properties(&info) } {
            Ok(e) => e.len(),
            Err(e) => return format!("no statistics ({e})"),
        };
        let mut parts = Vec::new();
        for index in 0..executables as u32 {
            let exe = vk::PipelineExecutableInfoKHR::default()
                .pipeline(pipeline)
                .executable_index(index);
            // SAFETY: as above; `index` is below the executable count.
            let Ok(stats) = (unsafe { loader.get_pipeline_executable_statistics(&exe) }) else {
                continue;
            };
            for stat in stats {
                let name = stat
                    .name_as_c_str()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                // SAFETY: `format` says which member of the union is set.
                let value = unsafe {
                    match stat.format {
                        vk::PipelineExecutableStatisticFormatKHR::BOOL32 => (stat.value.b32 != 0).to_string(),
                        vk::PipelineExecutableStatisticFormatKHR::INT64 => stat.value.i64.to_string(),
                        vk::PipelineExecutableStatisticFormatKHR::UINT64 => stat.value.u64.to_string(),
                        vk::PipelineExecutableStatisticFormatKHR::FLOAT64 => format!("{:.3}", stat.value.f64),
                        _ => "?".to_string(),
                    }
                };
                parts.push(format!("{name} {value}"));
            }
        }
        parts.join(", ")
    }
}

impl Drop for PipelineCache {
    fn drop(&mut self) {
        let dev = &self.device.raw;
        // SAFETY: the backend waited for the device to be idle before
        // dropping the cache; nothing else references these objects.
        unsafe {
            for (_, p) in self.pipelines.drain() {
                dev.destroy_pipeline(p.raw, None);
            }
            for (_, (set_layout, layout)) in self.layouts.drain() {
                dev.destroy_pipeline_layout(layout, None);
                dev.destroy_descriptor_set_layout(set_layout, None);
            }
        }
    }
}
