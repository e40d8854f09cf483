//! Adapters: listing them with what they offer, choosing one, and opening a
//! device with the features and limits headkl needs.

use headkl_core::{ChoiceSource, DeviceInfo, Error, GemmChoice, QueueChoice, Result};

use headkl_core::toolkit::KernelLimits;

use crate::BACKEND;

/// The backends headkl uses: native APIs only (GL lacks what the kernels
/// need).
const BACKENDS: wgpu::Backends = wgpu::Backends::VULKAN
    .union(wgpu::Backends::METAL)
    .union(wgpu::Backends::DX12);

/// An adapter with what headkl needs to know about it.
pub(crate) struct Candidate {
    pub adapter: wgpu::Adapter,
    pub info: DeviceInfo,
    /// The matrix-unit GEMM can run (before `HEADKL_NO_COOPMAT`).
    pub coop: Result<u32, String>,
}

/// The process's one wgpu instance (made on first use, shared by every
/// backend opened after). A fresh instance per backend would let the
/// Vulkan loader unload the driver each time the last one is dropped, and
/// NVIDIA's driver cannot be loaded again and again: on the H200 the 29th
/// backend of a `headkl tune` run found "no compatible Vulkan driver".
pub(crate) fn instance() -> wgpu::Instance {
    static INSTANCE: std::sync::OnceLock<wgpu::Instance> = std::sync::OnceLock::new();
    INSTANCE
        .get_or_init(|| {
            let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
            desc.backends = BACKENDS;
            wgpu::Instance::new(desc)
        })
        .clone()
}

/// Every adapter of the native backends, in the instance's order.
pub(crate) fn candidates(instance: &wgpu::Instance) -> Vec<Candidate> {
    let adapters = pollster::block_on(instance.enumerate_adapters(BACKENDS));
    adapters.into_iter().map(describe).collect()
}

/// The adapter [`crate::WgpuBackend::open`] would open, on headkl's one
/// instance: `index` in [`enumerate`]'s list, else the best usable one
/// (discrete, then integrated, then the rest). For a caller that opens the
/// device itself (a trainer sharing it with headkl) and needs the instance
/// the adapter came from.
pub fn choose_adapter(index: Option<usize>) -> Result<(wgpu::Instance, wgpu::Adapter)> {
    let instance = instance();
    let candidate = choose(candidates(&instance), index)?;
    Ok((instance, candidate.adapter))
}

/// One [`DeviceInfo`] per adapter (Vulkan, Metal and DX12), in the order
/// [`crate::WgpuBackend::open`] indexes; `unusable` says why an adapter
/// cannot run headkl.
pub fn enumerate() -> Result<Vec<DeviceInfo>> {
    let instance = instance();
    Ok(candidates(&instance).into_iter().map(|c| c.info).collect())
}

fn device_type(t: wgpu::DeviceType) -> &'static str {
    match t {
        wgpu::DeviceType::DiscreteGpu => "discrete",
        wgpu::DeviceType::IntegratedGpu => "integrated",
        wgpu::DeviceType::Cpu => "cpu",
        wgpu::DeviceType::VirtualGpu => "virtual",
        wgpu::DeviceType::Other => "other",
    }
}

/// Preference of `open(None)`: discrete, then integrated, then the rest.
fn type_rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

fn is_f16_f32(p: &wgpu::CooperativeMatrixProperties) -> bool {
    p.ab_type == wgpu::CooperativeScalarType::F16 && p.cr_type == wgpu::CooperativeScalarType::F32
}

/// Whether the cooperative GEMM can run; `Ok(subgroup size)` or why not.
fn coop_support(adapter: &wgpu::Adapter, shapes: &[(u32, u32, u32)]) -> Result<u32, String> {
    let features = adapter.features();
    let info = adapter.get_info();
    if !features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        return Err("no cooperative matrices".into());
    }
    if !shapes.contains(&(16, 16, 16)) {
        return Err("no 16x16x16 f16xf16->f32 cooperative matrix".into());
    }
    if !features.contains(wgpu::Features::SUBGROUP) {
        return Err("no subgroup feature".into());
    }
    let (min, max) = (info.subgroup_min_size, info.subgroup_max_size);
    if min != max || min == 0 {
        return Err(format!(
            "subgroup size varies ({min}..{max}); the kernel needs a fixed one"
        ));
    }
    Ok(min)
}

/// Why an adapter cannot run headkl at all, if it cannot.
fn unusable_reason(adapter: &wgpu::Adapter) -> Option<String> {
    let features = adapter.features();
    let mut missing = Vec::new();
    if !features.contains(wgpu::Features::SHADER_F16) {
        missing.push("SHADER_F16 (f16 arithmetic and 16-bit storage)".to_string());
    }
    if let Some(why) = headkl_core::toolkit::kernels::device_misfit(&kernel_limits(adapter, adapter.features(), 0)) {
        missing.push(why);
    }
    if missing.is_empty() {
        None
    } else {
        Some(format!("lacks {}", missing.join(", ")))
    }
}

pub(crate) fn describe(adapter: wgpu::Adapter) -> Candidate {
    let ai = adapter.get_info();
    let limits = adapter.limits();
    let features = adapter.features();
    let mut shapes: Vec<(u32, u32, u32)> = if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        adapter
            .cooperative_matrix_properties()
            .iter()
            .filter(|p| is_f16_f32(p))
            .map(|p| (p.m_size, p.n_size, p.k_size))
            .collect()
    } else {
        Vec::new()
    };
    shapes.sort_unstable();
    shapes.dedup();
    let coop = coop_support(&adapter, &shapes);
    let unusable = unusable_reason(&adapter);
    let subgroup_size = (ai.subgroup_max_size > 0).then_some(ai.subgroup_max_size);
    let info = DeviceInfo {
        backend: BACKEND,
        device_name: ai.name.clone(),
        driver: format!("{} {} ({:?})", ai.driver, ai.driver_info, ai.backend)
            .trim()
            .to_string(),
        device_type: device_type(ai.device_type).to_string(),
        // What `open` would use; the opened backend's info says what it does.
        // What `open` would use with default options; the opened backend's
        // info says what it does.
        matrix_units: coop.is_ok(),
        gemm: None,
        queue: None,
        matrix_shapes: shapes,
        shader_f16: features.contains(wgpu::Features::SHADER_F16),
        subgroup_size,
        max_binding_bytes: limits.max_storage_buffer_binding_size,
        max_buffer_bytes: limits.max_buffer_size,
        memory_bytes: None,
        unusable,
    };
    Candidate { adapter, info, coop }
}

/// The adapter `open(index)` means: `index`, else the best usable one by
/// device type.
pub(crate) fn choose(mut list: Vec<Candidate>, index: Option<usize>) -> Result<Candidate> {
    if list.is_empty() {
        return Err(Error::NoDevice {
            backend: BACKEND,
            reason: "no Vulkan, Metal or DX12 adapter found".into(),
        });
    }
    if let Some(i) = index {
        if i >= list.len() {
            return Err(Error::NoDevice {
                backend: BACKEND,
                reason: format!("adapter index {i} out of range ({} adapters)", list.len()),
            });
        }
        let c = list.swap_remove(i);
        if let Some(why) = &c.info.unusable {
            return Err(Error::NoDevice {
                backend: BACKEND,
                reason: format!("adapter {i} ({}) {why}", c.info.device_name),
            });
        }
        return Ok(c);
    }
    let reasons: Vec<String> = list
        .iter()
        .filter_map(|c| {
            c.info
                .unusable
                .as_ref()
                .map(|why| format!("{} {why}", c.info.device_name))
        })
        .collect();
    let best = list
        .into_iter()
        .filter(|c| c.info.unusable.is_none())
        .min_by_key(|c| type_rank(c.adapter.get_info().device_type));
    best.ok_or_else(|| Error::NoDevice {
        backend: BACKEND,
        reason: reasons.join("; "),
    })
}

/// Features to request: f16 always, the rest where the adapter has them.
pub(crate) fn features_for(c: &Candidate, use_coop: bool) -> wgpu::Features {
    let have = c.adapter.features();
    let mut f = wgpu::Features::SHADER_F16;
    for optional in [wgpu::Features::SUBGROUP, wgpu::Features::TIMESTAMP_QUERY] {
        if have.contains(optional) {
            f |= optional;
        }
    }
    if use_coop {
        f |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        // For the GLSL GEMM tiles' SPIR-V (headkl-glsl).
        if spirv_passthrough(&c.adapter, have) {
            f |= wgpu::Features::PASSTHROUGH_SHADERS;
        }
    }
    f
}

/// Whether the GLSL tiles' SPIR-V can go to the driver with `features`
/// (the adapter's, or a device's enabled ones): a Vulkan adapter with
/// `PASSTHROUGH_SHADERS`. (The tiles' other needs, subgroups of 32, are
/// `CoopGemm::misfit`'s.)
pub(crate) fn spirv_passthrough(adapter: &wgpu::Adapter, features: wgpu::Features) -> bool {
    adapter.get_info().backend == wgpu::Backend::Vulkan && features.contains(wgpu::Features::PASSTHROUGH_SHADERS)
}

/// wgpu's opt-in for experimental features, which `features` needs when it
/// holds `EXPERIMENTAL_COOPERATIVE_MATRIX` (wgpu refuses the device
/// otherwise).
pub(crate) fn experimental_for(features: wgpu::Features) -> wgpu::ExperimentalFeatures {
    if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        // SAFETY: the only experimental feature headkl requests is
        // cooperative matrices; the kernel using them takes its shapes from
        // the adapter's own list and its indices are in range for the
        // extents core validated.
        unsafe { wgpu::ExperimentalFeatures::enabled() }
    } else {
        wgpu::ExperimentalFeatures::disabled()
    }
}

/// Opens the device with the adapter's own limits (largest bindings and
/// buffers, all its workgroup memory), on the queue family `queue` picks.
pub(crate) fn open_device(
    c: &Candidate,
    features: wgpu::Features,
    queue: QueueChoice,
) -> Result<crate::queue::OpenedDevice> {
    let desc = wgpu::DeviceDescriptor {
        label: Some("headkl"),
        required_features: features,
        required_limits: c.adapter.limits(),
        experimental_features: experimental_for(features),
        memory_hints: wgpu::MemoryHints::Performance,
        trace: wgpu::Trace::Off,
    };
    crate::queue::open(&c.adapter, &desc, queue)
}

/// A short description of the GEMM path, for logs and `headkl devices`.
pub(crate) fn gemm_path(
    coop: &Result<u32, String>,
    plan: Option<&(GemmChoice, ChoiceSource)>,
    force_tiled: bool,
) -> String {
    match (coop, plan) {
        (Ok(sg), Some((choice, source))) => format!("cooperative {choice} (subgroup {sg}; from {source})"),
        (Ok(_), None) if force_tiled => "tiled (forced: CommonOptions::force_fallback, from HEADKL_NO_COOPMAT)".into(),
        (Ok(_), None) => "tiled".into(),
        (Err(why), _) => format!("tiled ({why})"),
    }
}

/// What the adapter allows a GEMM workgroup at subgroup size `sg`, on a
/// device opened with `features`.
pub(crate) fn kernel_limits(adapter: &wgpu::Adapter, features: wgpu::Features, sg: u32) -> KernelLimits {
    let limits = adapter.limits();
    KernelLimits {
        shared_bytes: limits.max_compute_workgroup_storage_size,
        invocations: limits
            .max_compute_invocations_per_workgroup
            .min(limits.max_compute_workgroup_size_x),
        subgroup_size: sg,
        subgroup_builtins: adapter.features().contains(wgpu::Features::SUBGROUP),
        spirv: spirv_passthrough(adapter, features),
        // The PTX tiles need raw Vulkan command buffers (NVX launches).
        ptx: false,
    }
}
