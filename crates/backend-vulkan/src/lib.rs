//! headkl-vulkan: headkl's raw Vulkan backend through `ash`.
//!
//! The Vulkan loader is found at run time (a machine without one gets
//! [`headkl_core::Error::NoDevice`], not a crash). Kernels are the shared
//! WGSL in `shaders/`, translated to SPIR-V by naga with per-pipeline
//! override values. The GEMM runs on the matrix units
//! (`VK_KHR_cooperative_matrix`, 16×16×16 f16→f32) where the device has
//! them, else on the tiled fallback; [`VulkanOptions`] can force the
//! fallback and pick the matrix-unit kernels (from `HEADKL_*` settings
//! through [`VulkanOptions::from_env`]; this crate reads no
//! environment). With validation on, the Khronos validation layer's errors are
//! collected and returned by [`Backend::take_diagnostics`].
//!
//! Module map: `instance` (loader, layer, debug messenger), `adapter`
//! (physical devices and their capabilities), `device` (logical device and
//! deferred frees), `memory` (buffers), `command` (recording, submission,
//! staging, timestamps, copy lanes on a transfer queue), `pipeline` (naga and compute pipelines), `kernels`
//! (the device's limits and matrix-unit GEMM plan), `glsl` (the GLSL
//! kernels, SPIR-V from `headkl-glsl`: GEMM tiles and the ceiling report's
//! diagnostics), `conv` (errors). What each kernel is (shader, entry,
//! bindings, workgroup) comes from the catalogue, `headkl_core::toolkit::kernels`.

#![warn(missing_docs)]

mod adapter;
mod bulk;
mod command;
mod conv;
mod device;
mod external;
mod glsl;
mod instance;
mod interop;
mod kernels;
mod memory;
mod nvx;
mod pipeline;
mod tile_faults;

#[cfg(test)]
mod tests;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};

use headkl_core::toolkit::gemm_choice::resolve_choice;
use headkl_core::toolkit::settings::{self, CommonOptions, Env};
use headkl_core::toolkit::{
    fold_workgroups, CoopGemm, GemmKernel, HeadLayout, KernelBuild, KernelId, KernelSource, Launch, PendingDownload,
    StagedTile,
};
use headkl_core::{Backend, ChoiceSource, DeviceInfo, GemmChoice, KernelTime, MemoryStats, Result};

use crate::command::{Binding, Stream};
use crate::conv::{backend_error, BACKEND};
use crate::device::Device;
use crate::instance::Instance;
use crate::kernels::CoopPlan;
use crate::pipeline::{PipelineCache, PipelineKey, ShaderSource};

pub use crate::external::ExternalVulkan;
pub use crate::glsl::CeilingKernel;
pub use crate::interop::ExportedBuffer;
pub use crate::memory::VulkanBuffer;
pub use headkl_core::toolkit::GlslTile;
pub use headkl_glsl::{CeilingPart, CEILING_BUILT};

/// The Vulkan backend's WGSL GEMM kernels without a tune cache or
/// `HEADKL_GEMM`, on a device that cannot run the GLSL tiles (subgroups
/// other than 32, or below Vulkan 1.3); where it can, the default is
/// [`GemmChoice::GLSL_DEFAULT`] (`headkl_core::toolkit::gemm_choice::fit_choice`).
/// The fastest WGSL pair on the H200 (`headkl tune`,
/// docs/PERFORMANCE.md): logits K 64 per step, one stage; dx the 256 × 128
/// tile, K 32 per step, one stage with register prefetch.
pub const DEFAULT_GEMM: GemmChoice = GemmChoice {
    logits: CoopGemm::Staged(StagedTile {
        bk: 64,
        rows: 2,
        stages: 1,
        prefetch: false,
    }),
    dx: CoopGemm::Staged(StagedTile {
        bk: 32,
        rows: 4,
        stages: 1,
        prefetch: true,
    }),
};

/// The GEMM kernels of `coop` (or the tiled fallback) in words.
pub(crate) fn describe_gemm(coop: Option<&CoopPlan>) -> String {
    match coop {
        Some(plan) => {
            let pinned = if plan.require_size { " (pinned)" } else { "" };
            format!(
                "cooperative {} (subgroup {}{pinned}; from {})",
                plan.choice, plan.subgroup_size, plan.source
            )
        }
        None => "tiled (gemm_tiled.wgsl)".to_string(),
    }
}

/// How to open the Vulkan backend.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VulkanOptions {
    /// What both GPU backends take, under the same names: the device's
    /// index in [`enumerate`]'s order (`None` picks the first usable one
    /// by type: discrete, integrated, virtual, cpu), the tiled fallback
    /// GEMM even where matrix units exist, naga's runtime bounds checks in
    /// the GEMM too, the GEMM kernels and the queue family.
    pub common: CommonOptions,
    /// Load the Khronos validation layer and collect its errors (opening
    /// fails if the layer is not installed; `HEADKL_VALIDATION`).
    pub validation: bool,
    /// Log each pipeline's register count and memory
    /// (`VK_KHR_pipeline_executable_properties`), for GEMM tuning work
    /// (`HEADKL_PIPELINE_STATS`).
    pub pipeline_stats: bool,
    /// Turn on the driver's robust buffer access (`robustBufferAccess`, and
    /// `robustBufferAccess2` where offered), as wgpu always does: to tell a
    /// speed difference between the backends from the cost of bounds checks.
    pub robust_access: bool,
    /// Where large uploads and downloads run (`HEADKL_COPY_QUEUE`).
    pub copy_queue: CopyQueue,
}

/// Where the stream runs the host path's large uploads and downloads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopyQueue {
    /// On a transfer-only queue family (a copy engine), beside the
    /// kernels, where the device has one and timeline semaphores; else
    /// [`CopyQueue::Off`].
    #[default]
    Auto,
    /// In line with the kernels, in their command buffers.
    Off,
    /// In submissions of their own on the kernels' queue, synchronized as
    /// on a copy queue: the copy path on a device without a transfer
    /// family (the tests' lavapipe), and a measure of whether the driver
    /// overlaps copies and kernels on one queue.
    Compute,
}

impl CopyQueue {
    /// Parses `auto`, `off` or `compute` (the setting `name`).
    pub fn parse(name: &'static str, value: &str) -> Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Off),
            "compute" => Ok(Self::Compute),
            _ => Err(settings::invalid(name, value, "expected auto, off or compute")),
        }
    }
}

impl VulkanOptions {
    /// Options from the environment: [`CommonOptions::from_env`], and this
    /// backend's own switches `HEADKL_VALIDATION` and
    /// `HEADKL_PIPELINE_STATS`; a value that does not parse is an error
    /// naming it.
    pub fn from_env(env: &Env) -> Result<Self> {
        Ok(Self {
            common: CommonOptions::from_env(env)?,
            validation: env.flag(settings::VALIDATION)?,
            pipeline_stats: env.flag(settings::PIPELINE_STATS)?,
            robust_access: false,
            copy_queue: match env.text(settings::COPY_QUEUE)? {
                Some(v) => CopyQueue::parse(settings::COPY_QUEUE, &v)?,
                None => CopyQueue::Auto,
            },
        })
    }
}

/// Every Vulkan physical device, in index order, with what it offers;
/// `unusable` says why headkl cannot run on one, and `matrix_units` what
/// [`VulkanBackend::open`] would use with default options (a caller that
/// forces the fallback, as `HEADKL_NO_COOPMAT` does, says so in its
/// listing). Fails with [`headkl_core::Error::NoDevice`] when there is no
/// Vulkan loader.
pub fn enumerate() -> Result<Vec<DeviceInfo>> {
    enumerate_with(&settings::GemmSources::default())
}

/// [`enumerate`], saying where the tune cache in `sources` marks the PTX
/// tiles failed on a device (so no default picks them there).
pub fn enumerate_with(sources: &settings::GemmSources) -> Result<Vec<DeviceInfo>> {
    let instance = Instance::new(false)?;
    let adapters = adapter::enumerate_adapters(&instance)?;
    Ok(adapters
        .iter()
        .map(|a| {
            let direct = GemmChoice {
                logits: CoopGemm::Direct,
                dx: CoopGemm::Direct,
            };
            let coop = kernels::coop_plan(&a.caps, direct, ChoiceSource::Default);
            let mut info = a.caps.device_info(matches!(coop, Ok(Some(_))));
            if info.matrix_units {
                let mut limits = kernels::kernel_limits(&a.caps);
                let default = GemmChoice::default_for(DEFAULT_GEMM, Some(&limits));
                let mark = tile_faults::marked(default, &ChoiceSource::Default, sources.tune_cache.as_deref(), &a.caps);
                let misfit = CoopGemm::Wgmma(headkl_core::toolkit::wgmma_tile::WGMMA_BM64_BK32_S3).misfit(&limits);
                limits.ptx &= misfit.is_none() && mark.is_none();
                let ptx = match (misfit, mark) {
                    (Some(why), _) => format!("PTX tiles (wgmma): no: {why}"),
                    (None, Some(m)) => format!(
                        "PTX tiles (wgmma): failed here before ({}: {}), so not the default until `headkl tune`",
                        m.tile, m.reason
                    ),
                    (None, None) => "PTX tiles (wgmma): yes, if the driver takes sm_90a".to_string(),
                };
                let default = GemmChoice::default_for(DEFAULT_GEMM, Some(&limits));
                info.gemm = Some(format!("default GEMM {default}; {ptx}"));
            }
            info
        })
        .collect())
}

/// The Vulkan backend: one device, one compute queue.
pub struct VulkanBackend {
    pub(crate) info: DeviceInfo,
    pub(crate) options: VulkanOptions,
    pub(crate) coop: Option<CoopPlan>,
    pub(crate) stream: Mutex<Stream>,
    pub(crate) pipelines: Mutex<PipelineCache>,
    /// The PTX tiles' module: made at open where the GEMM choice names a
    /// PTX tile, else on their first launch (after `use_gemm`).
    pub(crate) ptx: Mutex<Option<nvx::PtxModule>>,
    /// The bulk PTX tiles' pack buffers, made on their first launch.
    pub(crate) pack: Mutex<Option<bulk::PackBuffers>>,
    /// Whether a device loss was already blamed on the PTX tiles
    /// ([`VulkanBackend::watch`]).
    pub(crate) ptx_lost: AtomicBool,
    /// Declared last: dropped after the stream, pipelines and module.
    pub(crate) device: Arc<Device>,
}

impl VulkanBackend {
    /// Opens device `index` (or the best one) with default options.
    pub fn open(index: Option<usize>) -> Result<Self> {
        Self::open_with(&VulkanOptions {
            common: CommonOptions {
                device: index,
                ..CommonOptions::default()
            },
            ..VulkanOptions::default()
        })
    }

    /// Opens a device with explicit options.
    pub fn open_with(options: &VulkanOptions) -> Result<Self> {
        Self::open_inner(options, command::STAGING_BYTES)
    }

    /// Opens a device with a staging buffer of `staging_bytes` (tests use a
    /// small one to reach the piecewise transfers).
    pub(crate) fn open_inner(options: &VulkanOptions, staging_bytes: u64) -> Result<Self> {
        let instance = Instance::new(options.validation)?;
        let adapters = adapter::enumerate_adapters(&instance)?;
        let chosen = adapter::pick(&adapters, options.common.device)?;
        // Resolved (and a bad HEADKL_GEMM reported) even where the tiled
        // GEMM runs, so a typo never goes unnoticed.
        let caps = &chosen.caps;
        let mut limits = kernels::kernel_limits(caps);
        let (choice, source) = resolve_choice(
            options.common.gemm,
            GemmChoice::default_for(DEFAULT_GEMM, Some(&limits)),
            &options.common.gemm_sources,
            BACKEND,
            &caps.name,
            &caps.driver,
        )?;
        let tune_cache = options.common.gemm_sources.tune_cache.as_deref();
        if let Some(failed) = tile_faults::marked(choice, &source, tune_cache, caps) {
            log::info!(
                "{} failed on this device before ({}); the GEMM runs the GLSL tiles until `headkl tune` runs it again",
                failed.tile,
                failed.reason
            );
            limits.ptx = false;
        }
        let coop = if options.common.force_fallback {
            None
        } else {
            kernels::coop_plan_within(caps, choice, source, &limits)?
        };
        let device = Device::new(instance, chosen, coop.is_some(), options)?;
        let mut coop = coop.filter(|_| device.enabled.cooperative_matrix);
        // The PTX tiles' module is made now, so a driver that refuses it
        // (a GPU other than Hopper) is known before the first call: the
        // tiles are marked failed in the tune cache; an explicit choice
        // fails here, naming them; a default or cached one falls back to
        // the GLSL tiles.
        let mut ptx = None;
        if let Some(plan) = coop.as_mut().filter(|p| p.choice.uses_ptx()) {
            match nvx::PtxModule::new(&device, &plan.choice.to_string()) {
                Ok(module) => ptx = Some(module),
                Err(e) => {
                    let said = tile_faults::mark(tune_cache, &device.caps, plan.choice, &e.to_string());
                    let e = tile_faults::explained(e, &said);
                    if plan.source.is_explicit() {
                        return Err(e);
                    }
                    let mut limits = kernels::kernel_limits(&device.caps);
                    limits.ptx = false;
                    let fallback = GemmChoice::preferred(&limits).unwrap_or(DEFAULT_GEMM);
                    // A cached choice that no longer runs is news; the
                    // default's fallback on a GPU other than Hopper is not.
                    if plan.source == ChoiceSource::Default {
                        log::info!("{e}; the GEMM runs {fallback} instead");
                    } else {
                        log::warn!("{e}; the GEMM runs {fallback} instead (from {})", plan.source);
                    }
                    plan.choice = fallback;
                    plan.source = ChoiceSource::Default;
                }
            }
        }
        let queue = device.queue_description();
        Self::assemble(device, options, coop, ptx, queue, staging_bytes)
    }

    /// The backend on an opened device (`open_with` and the caller's
    /// device): its info (with `queue` as its queue's description), a
    /// stream with `staging_bytes` of staging, no pipelines yet.
    pub(crate) fn assemble(
        device: Arc<Device>,
        options: &VulkanOptions,
        coop: Option<CoopPlan>,
        ptx: Option<nvx::PtxModule>,
        queue: String,
        staging_bytes: u64,
    ) -> Result<Self> {
        let mut info = device.caps.device_info(coop.is_some());
        info.gemm = Some(describe_gemm(coop.as_ref()));
        info.queue = Some(queue);
        let stream = Stream::new(Arc::clone(&device), staging_bytes)?;
        let pipelines = PipelineCache::new(Arc::clone(&device));
        Ok(Self {
            info,
            options: options.clone(),
            coop,
            stream: Mutex::new(stream),
            pipelines: Mutex::new(pipelines),
            ptx: Mutex::new(ptx),
            pack: Mutex::new(None),
            ptx_lost: AtomicBool::new(false),
            device,
        })
    }

    /// The device's subgroup-scope f16×f16→f32 matrix-unit shapes
    /// `(m, n, k)` (empty without `VK_KHR_cooperative_matrix`).
    pub fn matrix_shapes(&self) -> &[(u32, u32, u32)] {
        &self.device.caps.matrix_shapes
    }

    /// Whether the GEMM runs on the matrix units.
    pub fn uses_matrix_units(&self) -> bool {
        self.coop.is_some()
    }

    /// Which GEMM kernels run, and where the choice came from, in words.
    pub fn gemm_kernel(&self) -> String {
        describe_gemm(self.coop.as_ref())
    }

    /// The matrix-unit GEMM kernels, when the GEMM runs on matrix units.
    pub fn gemm_choice(&self) -> Option<GemmChoice> {
        self.coop.as_ref().map(|p| p.choice)
    }

    /// Makes [`Backend::gemm`] run `choice` from now on, as if the open
    /// options had named it (the ceiling report's correctness gate runs
    /// each GLSL tile this way). Fails with
    /// [`headkl_core::Error::InvalidSetting`] where a kernel of `choice`
    /// cannot run here ([`CoopGemm::misfit`]), or where the GEMM does not
    /// run on matrix units at all.
    pub fn use_gemm(&mut self, choice: GemmChoice) -> Result<()> {
        let limits = kernels::kernel_limits(&self.device.caps);
        choice.check_use(&self.device.caps.name, self.coop.is_some().then_some(&limits))?;
        if let Some(plan) = &mut self.coop {
            plan.choice = choice;
            plan.source = ChoiceSource::Options;
            self.info.gemm = Some(describe_gemm(Some(plan)));
        }
        Ok(())
    }

    /// The options the backend was opened with.
    pub fn options(&self) -> &VulkanOptions {
        &self.options
    }

    /// The validation layer's name and version, when it is loaded.
    pub fn validation_layer(&self) -> Option<&str> {
        self.device.instance.validation_layer.as_deref()
    }

    /// The Vulkan API version the device is driven at, as `major.minor.patch`.
    pub fn api_version(&self) -> String {
        conv::version_string(self.device.caps.api_version)
    }

    /// `result`, where a device lost while the GEMM runs the PTX tiles
    /// marks them failed on this device in the tune cache (the first time)
    /// and says so in the error: they are the kernels with a known way to
    /// lose this driver's device (shared memory past 48 KiB a block).
    fn watch<T>(&self, result: Result<T>) -> Result<T> {
        tile_faults::blame_loss(
            result,
            self.coop.as_ref().map(|p| p.choice),
            &self.ptx_lost,
            self.options.common.gemm_sources.tune_cache.as_deref(),
            &self.device.caps,
        )
    }

    pub(crate) fn stream(&self) -> Result<MutexGuard<'_, Stream>> {
        self.stream
            .lock()
            .map_err(|_| backend_error("the command stream's lock was poisoned by a panic"))
    }

    /// Checks that `buffer` was made by this backend's device (its extents
    /// are core's checks).
    pub(crate) fn check_device(&self, buffer: &VulkanBuffer, what: &str) -> Result<()> {
        if !Arc::ptr_eq(&buffer.device, &self.device) {
            return Err(backend_error(format!(
                "{what}: buffer {} belongs to another Vulkan device",
                buffer.label()
            )));
        }
        Ok(())
    }

    /// The largest range one storage binding may span, in whole 16 bytes.
    fn max_binding(&self) -> u64 {
        self.device.caps.max_storage_buffer_range / 16 * 16
    }

    /// The GEMM implementation this device runs for `kernel` (the tiled one
    /// for the kernels that are not GEMMs, which ignore it).
    fn gemm_for(&self, kernel: KernelId) -> GemmKernel {
        match (&self.coop, kernel.gemm_layout()) {
            (Some(plan), Some(layout)) => GemmKernel::Coop {
                kernel: plan.choice.for_layout(layout),
                subgroup: plan.subgroup_size,
            },
            _ => GemmKernel::Tiled,
        }
    }

    /// Builds (or finds) `kernel`'s pipeline from the catalogue and records
    /// one dispatch of `count` workgroups, folded; `params` gets the grid
    /// width. `buffers` are at bindings 1.., as the catalogue lists them.
    fn dispatch_kernel(
        &self,
        build: KernelBuild,
        shader: ShaderSource,
        count: u64,
        params: impl FnOnce(u32) -> Vec<u8>,
        buffers: &[&VulkanBuffer],
    ) -> Result<()> {
        let kernel = build.id;
        for b in buffers {
            self.check_device(b, kernel.name())?;
        }
        if count == 0 {
            return Ok(());
        }
        let key = PipelineKey {
            file: shader.file,
            entry: build.entry,
            // The other kernels are memory-bound: checks cost little there.
            checked: self.options.common.checked || kernel.gemm_layout().is_none(),
            // Cooperative ops need whole subgroups, of the size SG_SIZE says.
            full_subgroups: build.matrix_units,
            required_subgroup_size: self
                .coop
                .as_ref()
                .filter(|p| p.require_size && build.matrix_units)
                .map(|p| p.subgroup_size),
            overrides: build.overrides,
        };
        self.dispatch(&shader, key, count, params, buffers, kernel.name())
    }

    /// Builds (or finds) the pipeline of `key` and records one dispatch of
    /// `count` workgroups, folded; `params` gets the grid width.
    pub(crate) fn dispatch(
        &self,
        source: &ShaderSource,
        key: PipelineKey,
        count: u64,
        params: impl FnOnce(u32) -> Vec<u8>,
        buffers: &[&VulkanBuffer],
        label: &'static str,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let grid = fold_workgroups(count);
        let pipeline = self
            .pipelines
            .lock()
            .map_err(|_| backend_error("the pipeline cache's lock was poisoned by a panic"))?
            .get(source, &key, buffers.len() as u32)?;
        let bindings: Vec<Binding> = buffers.iter().map(|&b| Binding::from(b)).collect();
        self.stream()?
            .dispatch(&pipeline, &params(grid.0), &bindings, grid, label)
    }
}

impl VulkanBackend {
    /// Records `launch` ([`Backend::dispatch`]).
    fn record_launch(&self, launch: Launch<'_, VulkanBuffer>) -> Result<()> {
        let checked = launch.check(self.max_binding())?;
        let id = checked.id();
        let gemm = self.gemm_for(id);
        let build = checked.build(gemm);
        // One arm per kind of kernel source: WGSL through naga, the GLSL
        // tiles' SPIR-V, the PTX tiles through NVX. The last two are GEMMs.
        let gemm_operands = match (launch, checked.gemm_params()) {
            (Launch::Gemm { a, b, c, desc }, Some(params)) => Some(([a, b, c], desc, params)),
            _ => None,
        };
        match (build.source, gemm_operands) {
            (KernelSource::Wgsl(shader), _) => self.dispatch_kernel(
                build,
                shader,
                launch.workgroups(gemm),
                |gx| checked.bytes(gx),
                &launch.buffers(),
            ),
            (KernelSource::Glsl { tile, layout, filter }, Some(([a, b, c], desc, params))) => {
                let Some(glsl) = headkl_glsl::gemm(tile, layout, filter) else {
                    return Err(backend_error(format!(
                        "headkl-glsl did not build glsl:{tile} for {layout:?}"
                    )));
                };
                self.glsl_kernel_dispatch(glsl, a, b, c, &desc, params, id.name())
            }
            (KernelSource::Ptx { tile, layout }, Some((buffers, desc, params))) => {
                self.ptx_dispatch(tile, layout, buffers, &desc, params, id.name())
            }
            (source, None) => Err(backend_error(format!(
                "{id}: {} is a GEMM's source, for a launch that is not a GEMM",
                source.name()
            ))),
        }
    }
}

impl Backend for VulkanBackend {
    type Buffer = VulkanBuffer;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: u64, label: &'static str) -> Result<VulkanBuffer> {
        VulkanBuffer::new(&self.device, bytes, label)
    }

    fn upload(&self, dst: &VulkanBuffer, offset: u64, data: &[u8]) -> Result<()> {
        self.check_device(dst, "upload")?;
        self.watch(self.stream()?.upload(dst, offset, data))
    }

    fn download(&self, src: &VulkanBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_device(src, "download")?;
        self.watch(self.stream()?.download(src, offset, out))
    }

    fn download_begin(&self, src: &VulkanBuffer, offset: u64, len: usize) -> Result<PendingDownload> {
        self.check_device(src, "download")?;
        self.watch(self.stream()?.download_begin(src, offset, len))
    }

    fn download_end(&self, pending: PendingDownload, out: &mut [u8]) -> Result<()> {
        self.watch(self.stream()?.download_end(pending, out))
    }

    fn transfers_overlap(&self) -> bool {
        self.device.copy_queues.is_some()
    }

    fn dispatch(&self, launch: Launch<'_, VulkanBuffer>) -> Result<()> {
        // A full batch is submitted while recording.
        self.watch(self.record_launch(launch))
    }

    fn gemm_tile(&self, layout: HeadLayout) -> Option<(u32, u32)> {
        match self.gemm_for(KernelId::gemm(layout)) {
            GemmKernel::Tiled => None,
            coop => Some(coop.tile()),
        }
    }

    fn finish(&self) -> Result<()> {
        self.watch(self.stream()?.flush())
    }

    fn memory(&self) -> MemoryStats {
        self.device.counters.stats()
    }

    fn reset_peak_memory(&self) {
        self.device.counters.reset_peak();
    }

    fn set_profiling(&self, on: bool) -> bool {
        match self.stream().and_then(|mut s| s.set_profiling(on)) {
            Ok(can) => can,
            Err(e) => {
                log::warn!("could not switch kernel timing: {e}");
                false
            }
        }
    }

    fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        let mut stream = self.stream()?;
        self.watch(stream.flush())?;
        Ok(stream.take_kernel_times())
    }

    fn take_diagnostics(&self) -> Vec<String> {
        self.device.instance.diagnostics.take()
    }
}

impl Drop for VulkanBackend {
    fn drop(&mut self) {
        // Finish queued work so the stream and pipelines can be destroyed;
        // the fields then drop in order: stream, pipelines, PTX module, device.
        if let Ok(mut s) = self.stream.lock() {
            let _ = s.flush();
        }
        // SAFETY: the device is valid; waiting for idle has no other effect.
        unsafe {
            let _ = self.device.raw.device_wait_idle();
        }
    }
}
