//! Physical devices: what each offers (features, limits, matrix-unit
//! shapes), whether headkl can run on it, and which one to pick.

use std::ffi::CStr;

use ash::{ext, khr, vk};
use headkl_core::toolkit::QueueFamily;
use headkl_core::{DeviceInfo, QueueChoice, Result};

use crate::conv::{device_type_name, device_type_rank, no_device, version_string, vk_error, BACKEND};
use crate::instance::Instance;

/// Largest buffer assumed when the device does not report one
/// (`VK_KHR_maintenance4` absent): 2 GiB, which every desktop driver allows.
const DEFAULT_MAX_BUFFER_BYTES: u64 = 1 << 31;

/// Where a feature or property struct comes from on a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Source {
    /// Core at the device's API version.
    Core,
    /// From an extension that must be enabled.
    Extension(&'static CStr),
    /// Not available.
    #[default]
    Absent,
}

impl Source {
    fn new(api: u32, promoted: u32, extension: &'static CStr, extensions: &[vk::ExtensionProperties]) -> Self {
        if api >= promoted {
            Source::Core
        } else if extensions.iter().any(|e| e.extension_name_as_c_str() == Ok(extension)) {
            Source::Extension(extension)
        } else {
            Source::Absent
        }
    }

    /// Whether the struct may be chained.
    pub(crate) fn available(self) -> bool {
        self != Source::Absent
    }
}

/// The optional features headkl enables, as the device reports them.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Features {
    pub(crate) shader_float16: bool,
    pub(crate) storage_buffer_16bit: bool,
    pub(crate) uniform_and_storage_buffer_16bit: bool,
    pub(crate) vulkan_memory_model: bool,
    pub(crate) vulkan_memory_model_device_scope: bool,
    pub(crate) subgroup_size_control: bool,
    pub(crate) compute_full_subgroups: bool,
    pub(crate) maintenance4: bool,
    pub(crate) cooperative_matrix: bool,
    pub(crate) zero_initialize_workgroup_memory: bool,
    /// `VK_KHR_pipeline_executable_properties`: register and memory
    /// statistics per compiled pipeline (`HEADKL_PIPELINE_STATS`).
    pub(crate) pipeline_executable_info: bool,
    /// `robustBufferAccess2` (`VK_EXT_robustness2`), which wgpu turns on;
    /// `VulkanOptions::robust_access` turns it on here to compare.
    pub(crate) robust_buffer_access2: bool,
    /// `bufferDeviceAddress` (Vulkan 1.2 core): the PTX tiles take their
    /// buffers as device addresses.
    pub(crate) buffer_device_address: bool,
}

/// Where each feature struct comes from.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Sources {
    pub(crate) float16_int8: Source,
    pub(crate) memory_model: Source,
    pub(crate) subgroup_size_control: Source,
    pub(crate) maintenance4: Source,
    pub(crate) cooperative_matrix: Source,
    pub(crate) zero_initialize_workgroup_memory: Source,
    pub(crate) driver_properties: Source,
    pub(crate) pipeline_executable_properties: Source,
    pub(crate) robustness2: Source,
}

/// Everything headkl needs to know about one physical device.
#[derive(Clone, Debug, Default)]
pub(crate) struct Caps {
    /// The API version headkl drives it at (min of the device's and ours).
    pub(crate) api_version: u32,
    pub(crate) name: String,
    pub(crate) driver: String,
    pub(crate) device_type: vk::PhysicalDeviceType,
    /// The device's queue families, in the driver's order
    /// (`headkl_core::QueueChoice::pick` chooses among them).
    pub(crate) queue_families: Vec<QueueFamily>,
    /// The family `QueueChoice::Auto` opens (a compute-only one where there
    /// is one), for the listing.
    pub(crate) compute_family: Option<u32>,
    /// The first family with transfer and neither compute nor graphics
    /// (a copy engine's), and its queue count: where the stream's copy
    /// lanes run.
    pub(crate) transfer_family: Option<(u32, u32)>,
    /// Timeline semaphores (Vulkan 1.2 core), which the copy lanes need.
    pub(crate) timeline_semaphore: bool,
    pub(crate) timestamp_period_ns: f32,
    pub(crate) max_storage_buffer_range: u64,
    pub(crate) min_uniform_offset_alignment: u64,
    pub(crate) max_workgroup_count: [u32; 3],
    pub(crate) max_shared_memory: u32,
    /// Invocations one workgroup may have (the smaller of the total and x limits).
    pub(crate) max_invocations: u32,
    pub(crate) max_buffer_bytes: u64,
    pub(crate) max_allocation_bytes: u64,
    pub(crate) subgroup_size: u32,
    /// Subgroup operations in compute shaders.
    pub(crate) subgroup_ops: vk::SubgroupFeatureFlags,
    pub(crate) min_subgroup_size: u32,
    pub(crate) max_subgroup_size: u32,
    /// Compute shaders may pin their subgroup size.
    pub(crate) required_subgroup_size_compute: bool,
    pub(crate) features: Features,
    pub(crate) sources: Sources,
    /// Subgroup-scope f16×f16→f32 cooperative-matrix shapes `(m, n, k)`.
    pub(crate) matrix_shapes: Vec<(u32, u32, u32)>,
    pub(crate) memory_bytes: u64,
    /// `VK_NVX_binary_import`: CUDA modules (PTX) launched in Vulkan
    /// command buffers, which the PTX GEMM tiles need.
    pub(crate) nvx_binary_import: bool,
    /// `VK_KHR_external_memory_fd` and `VK_KHR_external_semaphore_fd`:
    /// memory and timeline semaphores another API (CUDA) can import.
    pub(crate) external_fd: bool,
    /// `VkPhysicalDeviceIDProperties::deviceUUID`: what CUDA's
    /// `cuDeviceGetUuid` gives for the same GPU.
    pub(crate) device_uuid: [u8; 16],
    pub(crate) unusable: Option<String>,
}

impl Caps {
    /// Whether the device can launch the PTX GEMM tiles
    /// (`VK_NVX_binary_import` and buffer device addresses).
    pub(crate) fn ptx_capable(&self) -> bool {
        self.nvx_binary_import && self.features.buffer_device_address && self.api_version >= vk::API_VERSION_1_2
    }

    /// Whether the device can run the cooperative-matrix GEMM
    /// (`VK_KHR_cooperative_matrix`, the Vulkan memory model at device scope,
    /// and the 16×16×16 f16→f32 shape).
    pub(crate) fn coop_capable(&self) -> bool {
        let f = &self.features;
        f.cooperative_matrix
            && f.vulkan_memory_model
            && f.vulkan_memory_model_device_scope
            && self.matrix_shapes.contains(&(16, 16, 16))
    }

    /// The device as [`DeviceInfo`] reports it; `matrix_units` says whether
    /// the GEMM runs on them.
    pub(crate) fn device_info(&self, matrix_units: bool) -> DeviceInfo {
        DeviceInfo {
            backend: BACKEND,
            device_name: self.name.clone(),
            driver: self.driver.clone(),
            device_type: device_type_name(self.device_type).to_string(),
            matrix_units,
            gemm: None,
            queue: None,
            matrix_shapes: self.matrix_shapes.clone(),
            shader_f16: self.features.shader_float16 && self.features.storage_buffer_16bit,
            subgroup_size: (self.subgroup_size > 0).then_some(self.subgroup_size),
            max_binding_bytes: self.max_storage_buffer_range,
            max_buffer_bytes: self.max_buffer_bytes,
            memory_bytes: (self.memory_bytes > 0).then_some(self.memory_bytes),
            unusable: self.unusable.clone(),
        }
    }
}

/// A physical device and its capabilities.
#[derive(Clone, Debug)]
pub(crate) struct Adapter {
    pub(crate) raw: vk::PhysicalDevice,
    pub(crate) caps: Caps,
}

/// Every physical device, in the driver's order.
pub(crate) fn enumerate_adapters(instance: &Instance) -> Result<Vec<Adapter>> {
    // SAFETY: valid instance; returns plain handles.
    let devices = unsafe { instance.raw.enumerate_physical_devices() }
        .map_err(|e| no_device(format!("vkEnumeratePhysicalDevices failed: {e}")))?;
    devices
        .into_iter()
        .map(|raw| {
            Ok(Adapter {
                raw,
                caps: query_caps(instance, raw)?,
            })
        })
        .collect()
}

/// Picks the device to open: `index` into [`enumerate_adapters`]'s order
/// when given, else the first usable one by type (discrete, integrated,
/// virtual, cpu).
pub(crate) fn pick(adapters: &[Adapter], index: Option<usize>) -> Result<&Adapter> {
    if adapters.is_empty() {
        return Err(no_device(
            "the Vulkan loader found no physical device (no driver installed?)",
        ));
    }
    if let Some(i) = index {
        let Some(a) = adapters.get(i) else {
            return Err(no_device(format!(
                "device {i} was asked for, but there are only {} Vulkan device(s)",
                adapters.len()
            )));
        };
        if let Some(why) = &a.caps.unusable {
            return Err(no_device(format!(
                "device {i} ({}) cannot run headkl: {why}",
                a.caps.name
            )));
        }
        return Ok(a);
    }
    adapters
        .iter()
        .filter(|a| a.caps.unusable.is_none())
        .min_by_key(|a| device_type_rank(a.caps.device_type))
        .ok_or_else(|| {
            let why: Vec<String> = adapters
                .iter()
                .map(|a| format!("{}: {}", a.caps.name, a.caps.unusable.as_deref().unwrap_or("?")))
                .collect();
            no_device(format!("no Vulkan device can run headkl ({})", why.join("; ")))
        })
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Queries one device's properties, features, queues and matrix shapes.
pub(crate) fn query_caps(instance: &Instance, phd: vk::PhysicalDevice) -> Result<Caps> {
    let vi = &instance.raw;
    // SAFETY: valid instance and physical device; plain data back.
    let props = unsafe { vi.get_physical_device_properties(phd) };
    let name = props
        .device_name_as_c_str()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unnamed device".into());
    let api = props.api_version.min(instance.api_version);
    // SAFETY: as above.
    let extensions = unsafe { vi.enumerate_device_extension_properties(phd) }
        .map_err(|e| vk_error(e, "vkEnumerateDeviceExtensionProperties"))?;
    let has_ext = |n: &CStr| extensions.iter().any(|e| e.extension_name_as_c_str() == Ok(n));

    let sources = Sources {
        float16_int8: Source::new(api, vk::API_VERSION_1_2, khr::shader_float16_int8::NAME, &extensions),
        memory_model: Source::new(api, vk::API_VERSION_1_2, khr::vulkan_memory_model::NAME, &extensions),
        subgroup_size_control: Source::new(api, vk::API_VERSION_1_3, ext::subgroup_size_control::NAME, &extensions),
        maintenance4: Source::new(api, vk::API_VERSION_1_3, khr::maintenance4::NAME, &extensions),
        cooperative_matrix: Source::new(api, u32::MAX, khr::cooperative_matrix::NAME, &extensions),
        zero_initialize_workgroup_memory: Source::new(
            api,
            vk::API_VERSION_1_3,
            khr::zero_initialize_workgroup_memory::NAME,
            &extensions,
        ),
        driver_properties: Source::new(api, vk::API_VERSION_1_2, khr::driver_properties::NAME, &extensions),
        pipeline_executable_properties: Source::new(
            api,
            u32::MAX,
            khr::pipeline_executable_properties::NAME,
            &extensions,
        ),
        robustness2: Source::new(api, u32::MAX, ext::robustness2::NAME, &extensions),
    };

    let mut caps = Caps {
        api_version: api,
        name,
        driver: format!(
            "vendor 0x{:04x}, driver version 0x{:x}",
            props.vendor_id, props.driver_version
        ),
        device_type: props.device_type,
        queue_families: Vec::new(),
        compute_family: None,
        transfer_family: None,
        timeline_semaphore: false,
        timestamp_period_ns: props.limits.timestamp_period,
        max_storage_buffer_range: u64::from(props.limits.max_storage_buffer_range),
        min_uniform_offset_alignment: props.limits.min_uniform_buffer_offset_alignment.max(16),
        max_workgroup_count: props.limits.max_compute_work_group_count,
        max_shared_memory: props.limits.max_compute_shared_memory_size,
        max_invocations: props
            .limits
            .max_compute_work_group_invocations
            .min(props.limits.max_compute_work_group_size[0]),
        max_buffer_bytes: DEFAULT_MAX_BUFFER_BYTES,
        max_allocation_bytes: DEFAULT_MAX_BUFFER_BYTES,
        subgroup_size: 0,
        subgroup_ops: vk::SubgroupFeatureFlags::empty(),
        min_subgroup_size: 0,
        max_subgroup_size: 0,
        required_subgroup_size_compute: false,
        features: Features::default(),
        sources,
        matrix_shapes: Vec::new(),
        memory_bytes: 0,
        nvx_binary_import: has_ext(ash::nvx::binary_import::NAME),
        external_fd: has_ext(khr::external_memory_fd::NAME) && has_ext(khr::external_semaphore_fd::NAME),
        device_uuid: [0; 16],
        unusable: None,
    };
    if props.api_version < vk::API_VERSION_1_1 {
        caps.unusable = Some(format!(
            "Vulkan {} device; headkl needs 1.1 or newer",
            version_string(props.api_version)
        ));
        return Ok(caps);
    }

    read_properties(vi, phd, &mut caps);
    read_features(vi, phd, &mut caps);
    read_queues(vi, phd, &mut caps);
    read_memory(vi, phd, &mut caps);
    if has_ext(khr::cooperative_matrix::NAME) {
        read_matrix_shapes(instance, phd, &mut caps);
    }
    caps.unusable = unusable_reason(&caps);
    Ok(caps)
}

/// The properties headkl reads through `vkGetPhysicalDeviceProperties2`:
/// buffer limits, subgroups, the driver's name and the device's UUID.
fn read_properties(vi: &ash::Instance, phd: vk::PhysicalDevice, caps: &mut Caps) {
    let sources = caps.sources;
    let mut subgroup = vk::PhysicalDeviceSubgroupProperties::default();
    let mut maintenance3 = vk::PhysicalDeviceMaintenance3Properties::default();
    let mut maintenance4 = vk::PhysicalDeviceMaintenance4Properties::default();
    let mut size_control = vk::PhysicalDeviceSubgroupSizeControlProperties::default();
    let mut driver = vk::PhysicalDeviceDriverProperties::default();
    let mut id = vk::PhysicalDeviceIDProperties::default();
    {
        let mut props2 = vk::PhysicalDeviceProperties2::default()
            .push_next(&mut subgroup)
            .push_next(&mut maintenance3)
            .push_next(&mut id);
        if sources.maintenance4.available() {
            props2 = props2.push_next(&mut maintenance4);
        }
        if sources.subgroup_size_control.available() {
            props2 = props2.push_next(&mut size_control);
        }
        if sources.driver_properties.available() {
            props2 = props2.push_next(&mut driver);
        }
        // SAFETY: every chained struct is core at `api` or its extension is
        // supported; the chain outlives the call.
        unsafe { vi.get_physical_device_properties2(phd, &mut props2) };
    }
    if sources.maintenance4.available() && maintenance4.max_buffer_size > 0 {
        caps.max_buffer_bytes = maintenance4.max_buffer_size;
    }
    if maintenance3.max_memory_allocation_size > 0 {
        caps.max_allocation_bytes = maintenance3.max_memory_allocation_size;
    }
    caps.max_buffer_bytes = caps.max_buffer_bytes.min(caps.max_allocation_bytes);
    caps.device_uuid = id.device_uuid;
    caps.subgroup_size = subgroup.subgroup_size;
    if subgroup.supported_stages.contains(vk::ShaderStageFlags::COMPUTE) {
        caps.subgroup_ops = subgroup.supported_operations;
    }
    if sources.subgroup_size_control.available() {
        caps.min_subgroup_size = size_control.min_subgroup_size;
        caps.max_subgroup_size = size_control.max_subgroup_size;
        caps.required_subgroup_size_compute = size_control
            .required_subgroup_size_stages
            .contains(vk::ShaderStageFlags::COMPUTE);
    }
    if sources.driver_properties.available() {
        let name = c_chars_to_string(&driver.driver_name);
        let info = c_chars_to_string(&driver.driver_info);
        caps.driver = if info.is_empty() {
            name
        } else {
            format!("{name} ({info})")
        };
    }
}

/// The features headkl needs or uses (`vkGetPhysicalDeviceFeatures2`).
fn read_features(vi: &ash::Instance, phd: vk::PhysicalDevice, caps: &mut Caps) {
    let (api, sources) = (caps.api_version, caps.sources);
    let mut storage16 = vk::PhysicalDevice16BitStorageFeatures::default();
    let mut float16 = vk::PhysicalDeviceShaderFloat16Int8Features::default();
    let mut memory_model = vk::PhysicalDeviceVulkanMemoryModelFeatures::default();
    let mut size_control_f = vk::PhysicalDeviceSubgroupSizeControlFeatures::default();
    let mut maintenance4_f = vk::PhysicalDeviceMaintenance4Features::default();
    let mut coop = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
    let mut zero_init = vk::PhysicalDeviceZeroInitializeWorkgroupMemoryFeatures::default();
    let mut executable = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
    let mut robustness2 = vk::PhysicalDeviceRobustness2FeaturesEXT::default();
    let mut timeline = vk::PhysicalDeviceTimelineSemaphoreFeatures::default();
    let mut device_address = vk::PhysicalDeviceBufferDeviceAddressFeatures::default();
    {
        let mut features2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut storage16);
        if api >= vk::API_VERSION_1_2 {
            features2 = features2.push_next(&mut timeline).push_next(&mut device_address);
        }
        if sources.float16_int8.available() {
            features2 = features2.push_next(&mut float16);
        }
        if sources.memory_model.available() {
            features2 = features2.push_next(&mut memory_model);
        }
        if sources.subgroup_size_control.available() {
            features2 = features2.push_next(&mut size_control_f);
        }
        if sources.maintenance4.available() {
            features2 = features2.push_next(&mut maintenance4_f);
        }
        if sources.cooperative_matrix.available() {
            features2 = features2.push_next(&mut coop);
        }
        if sources.zero_initialize_workgroup_memory.available() {
            features2 = features2.push_next(&mut zero_init);
        }
        if sources.pipeline_executable_properties.available() {
            features2 = features2.push_next(&mut executable);
        }
        if sources.robustness2.available() {
            features2 = features2.push_next(&mut robustness2);
        }
        // SAFETY: as for the properties chain.
        unsafe { vi.get_physical_device_features2(phd, &mut features2) };
    }
    caps.features = Features {
        shader_float16: float16.shader_float16 == vk::TRUE,
        storage_buffer_16bit: storage16.storage_buffer16_bit_access == vk::TRUE,
        uniform_and_storage_buffer_16bit: storage16.uniform_and_storage_buffer16_bit_access == vk::TRUE,
        vulkan_memory_model: memory_model.vulkan_memory_model == vk::TRUE,
        vulkan_memory_model_device_scope: memory_model.vulkan_memory_model_device_scope == vk::TRUE,
        subgroup_size_control: size_control_f.subgroup_size_control == vk::TRUE,
        compute_full_subgroups: size_control_f.compute_full_subgroups == vk::TRUE,
        maintenance4: maintenance4_f.maintenance4 == vk::TRUE,
        cooperative_matrix: coop.cooperative_matrix == vk::TRUE,
        zero_initialize_workgroup_memory: zero_init.shader_zero_initialize_workgroup_memory == vk::TRUE,
        pipeline_executable_info: executable.pipeline_executable_info == vk::TRUE,
        robust_buffer_access2: robustness2.robust_buffer_access2 == vk::TRUE,
        buffer_device_address: api >= vk::API_VERSION_1_2 && device_address.buffer_device_address == vk::TRUE,
    };
    caps.timeline_semaphore = api >= vk::API_VERSION_1_2 && timeline.timeline_semaphore == vk::TRUE;
}

/// Every queue family, and the compute and copy-only ones headkl opens.
fn read_queues(vi: &ash::Instance, phd: vk::PhysicalDevice, caps: &mut Caps) {
    // The listing shows the one `HEADKL_QUEUE=auto` opens (a compute-only
    // family where there is one).
    // SAFETY: valid instance and device; plain data back.
    let families = unsafe { vi.get_physical_device_queue_family_properties(phd) };
    caps.queue_families = families
        .iter()
        .map(|f| QueueFamily::from_vulkan(f.queue_flags.as_raw(), f.timestamp_valid_bits, f.queue_count))
        .collect();
    // Speed before kernel timing: a compute-only family without timestamps
    // still wins (the backend then reports wall time only).
    caps.compute_family = QueueChoice::Auto.pick(&caps.queue_families, false).ok();
    let copy_only = |f: &vk::QueueFamilyProperties| {
        f.queue_flags.contains(vk::QueueFlags::TRANSFER)
            && !f
                .queue_flags
                .intersects(vk::QueueFlags::COMPUTE | vk::QueueFlags::GRAPHICS)
            && f.queue_count > 0
    };
    caps.transfer_family = families
        .iter()
        .position(copy_only)
        .map(|i| (i as u32, families[i].queue_count));
}

/// The device-local heaps' bytes.
fn read_memory(vi: &ash::Instance, phd: vk::PhysicalDevice, caps: &mut Caps) {
    // SAFETY: valid instance and device; plain data back.
    let memory = unsafe { vi.get_physical_device_memory_properties(phd) };
    caps.memory_bytes = memory
        .memory_heaps_as_slice()
        .iter()
        .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
        .map(|h| h.size)
        .sum();
}

/// The matrix units' f16 × f16 → f32 subgroup shapes (the device has
/// `VK_KHR_cooperative_matrix`).
fn read_matrix_shapes(instance: &Instance, phd: vk::PhysicalDevice, caps: &mut Caps) {
    let vi = &instance.raw;
    let loader = khr::cooperative_matrix::Instance::new(&instance.entry, vi);
    // SAFETY: the extension is supported by this device; plain data back.
    // A failed query leaves the set empty (the fallback GEMM runs).
    if let Ok(list) = unsafe { loader.get_physical_device_cooperative_matrix_properties(phd) } {
        let mut shapes: Vec<(u32, u32, u32)> = list
            .iter()
            .filter(|p| {
                p.scope == vk::ScopeKHR::SUBGROUP
                    && p.a_type == vk::ComponentTypeKHR::FLOAT16
                    && p.b_type == vk::ComponentTypeKHR::FLOAT16
                    && p.c_type == vk::ComponentTypeKHR::FLOAT32
                    && p.result_type == vk::ComponentTypeKHR::FLOAT32
                    && p.saturating_accumulation == vk::FALSE
            })
            .map(|p| (p.m_size, p.n_size, p.k_size))
            .collect();
        shapes.sort_unstable();
        shapes.dedup();
        caps.matrix_shapes = shapes;
    }
}

/// Why the device cannot run headkl, or `None`.
fn unusable_reason(caps: &Caps) -> Option<String> {
    if caps.compute_family.is_none() {
        Some("no queue family with compute".into())
    } else if !caps.features.shader_float16 {
        Some("no f16 shader arithmetic (shaderFloat16)".into())
    } else if !caps.features.storage_buffer_16bit {
        Some("no 16-bit storage buffers (storageBuffer16BitAccess)".into())
    } else if !caps.features.uniform_and_storage_buffer_16bit {
        Some("no 16-bit uniform and storage buffers (uniformAndStorageBuffer16BitAccess)".into())
    } else {
        headkl_core::toolkit::kernels::device_misfit(&crate::kernels::kernel_limits(caps))
            .map(|why| format!("lacks {why}"))
    }
}
