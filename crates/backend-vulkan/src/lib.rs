//! headkl-vulkan: headkl's raw Vulkan backend through `ash`.
//!
//! The Vulkan loader is found at run time (a machine without one gets
//! [`headkl_core::Error::NoDevice`], not a crash). Kernels are the shared
//! WGSL in `shaders/`, translated to SPIR-V by naga with per-pipeline
//! override values. The GEMM runs on the matrix units
//! (`VK_KHR_cooperative_matrix`, 16×16×16 f16→f32) where the device has
//! them, else on the tiled fallback; `HEADKL_NO_COOPMAT=1` forces the
//! fallback; `HEADKL_GEMM` (or a `headkl tune` cache entry) picks the
//! matrix-unit kernels. With validation on, the Khronos validation layer's errors are
//! collected and returned by [`Backend::take_diagnostics`].
//!
//! Module map: `instance` (loader, layer, debug messenger), `adapter`
//! (physical devices and their capabilities), `device` (logical device and
//! deferred frees), `memory` (buffers), `command` (recording, submission,
//! staging, timestamps), `pipeline` (naga and compute pipelines), `kernels`
//! (the shared shaders and their grids), `conv` (errors).

#![warn(missing_docs)]

mod adapter;
mod command;
mod conv;
mod device;
mod external;
mod instance;
mod kernels;
mod memory;
mod pipeline;

#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex, MutexGuard};

use headkl_core::params::{ConvertParams, GemmParams, RowParams};
use headkl_core::{
    fold_workgroups, tuning, Backend, ChoiceSource, ConvertDesc, CoopGemm, DeviceInfo, GemmChoice, GemmDesc,
    HeadLayout, KernelTime, KlDesc, MemoryStats, Result, TopkDesc,
};

use crate::command::{Binding, Stream};
use crate::conv::{backend_error, BACKEND};
use crate::device::Device;
use crate::instance::Instance;
use crate::kernels::CoopPlan;
use crate::pipeline::{PipelineCache, PipelineKey, ShaderSource};

pub use crate::external::ExternalVulkan;
pub use crate::memory::VulkanBuffer;

/// Whether an environment variable is set to a true value (`1`, `true`,
/// `yes`, `on`).
fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

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
    /// Index of the device to open (in [`enumerate`]'s order); `None` picks
    /// the first usable one by type: discrete, integrated, virtual, cpu.
    pub device: Option<usize>,
    /// Load the Khronos validation layer and collect its errors (opening
    /// fails if the layer is not installed).
    pub validation: bool,
    /// Use the tiled fallback GEMM even on a device with matrix units.
    pub force_fallback: bool,
    /// Keep naga's runtime bounds checks in the GEMM too (they are off by
    /// default there: core validated every extent).
    pub checked: bool,
    /// The matrix-unit GEMM kernels; `None`: `HEADKL_GEMM`, else the tune
    /// cache's entry for the device, else [`GemmChoice::DEFAULT`].
    pub gemm: Option<GemmChoice>,
}

impl VulkanOptions {
    /// Options from the environment: `device` if given, else
    /// `HEADKL_DEVICE`; `HEADKL_VALIDATION=1` turns validation on,
    /// `HEADKL_NO_COOPMAT=1` forces the fallback GEMM, `HEADKL_CHECKED=1`
    /// keeps bounds checks in every kernel. (`HEADKL_GEMM`, which picks the
    /// matrix-unit GEMM, is read when the device opens.)
    pub fn from_env(device: Option<usize>) -> Self {
        let device = device.or_else(|| {
            let value = std::env::var("HEADKL_DEVICE").ok()?;
            match value.trim().parse::<usize>() {
                Ok(i) => Some(i),
                Err(_) => {
                    eprintln!("headkl-vulkan: ignoring HEADKL_DEVICE={value:?}: not a device index");
                    None
                }
            }
        });
        Self {
            device,
            validation: env_flag("HEADKL_VALIDATION"),
            force_fallback: env_flag("HEADKL_NO_COOPMAT"),
            checked: env_flag("HEADKL_CHECKED"),
            gemm: None,
        }
    }
}

/// Every Vulkan physical device, in index order, with what it offers;
/// `unusable` says why headkl cannot run on one. Fails with
/// [`headkl_core::Error::NoDevice`] when there is no Vulkan loader.
pub fn enumerate() -> Result<Vec<DeviceInfo>> {
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
            a.caps.device_info(matches!(coop, Ok(Some(_))))
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
    /// Declared last: dropped after the stream and pipelines.
    pub(crate) device: Arc<Device>,
}

impl VulkanBackend {
    /// Opens device `index` (or the best one) with options from the
    /// environment ([`VulkanOptions::from_env`]).
    pub fn open(index: Option<usize>) -> Result<Self> {
        Self::open_with(&VulkanOptions::from_env(index))
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
        let chosen = adapter::pick(&adapters, options.device)?;
        // Resolved (and a bad HEADKL_GEMM reported) even where the tiled
        // GEMM runs, so a typo never goes unnoticed.
        let caps = &chosen.caps;
        let (choice, source) = tuning::resolve_choice(options.gemm, BACKEND, &caps.name, &caps.driver)?;
        let coop = if options.force_fallback {
            None
        } else {
            kernels::coop_plan(caps, choice, source)?
        };
        let device = Device::new(instance, chosen, coop.is_some())?;
        let coop = coop.filter(|_| device.enabled.cooperative_matrix);
        let mut info = device.caps.device_info(coop.is_some());
        info.gemm = Some(describe_gemm(coop.as_ref()));
        let stream = Stream::new(Arc::clone(&device), staging_bytes)?;
        let pipelines = PipelineCache::new(Arc::clone(&device));
        Ok(Self {
            info,
            options: options.clone(),
            coop,
            stream: Mutex::new(stream),
            pipelines: Mutex::new(pipelines),
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

    pub(crate) fn stream(&self) -> Result<MutexGuard<'_, Stream>> {
        self.stream
            .lock()
            .map_err(|_| backend_error("the command stream's lock was poisoned by a panic"))
    }

    /// Checks that `buffer` was made by this backend's device and that
    /// `bytes` from its start fit in it and in one binding.
    pub(crate) fn check_binding(&self, buffer: &VulkanBuffer, bytes: u64, kernel: &str) -> Result<()> {
        if !Arc::ptr_eq(&buffer.device, &self.device) {
            return Err(backend_error(format!(
                "{kernel}: buffer {} belongs to another Vulkan device",
                buffer.label()
            )));
        }
        let limit = buffer.size().min(self.device.caps.max_storage_buffer_range / 16 * 16);
        if bytes > limit {
            return Err(backend_error(format!(
                "{kernel}: {} needs {bytes} bytes but binds {limit}",
                buffer.label()
            )));
        }
        Ok(())
    }

    /// Builds (or finds) a pipeline and records one dispatch of `count`
    /// workgroups, folded; `params` gets the grid width.
    #[allow(clippy::too_many_arguments)]
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

    /// Checks and dispatches a row kernel (`kl_rows`, `topk_rows`): one
    /// workgroup per row; `bufs` start with logits `[rows][ld]` f32, ids and
    /// probs `[rows][k]`, whose bindings are checked here (the caller checks
    /// any others).
    fn row_dispatch(
        &self,
        source: &ShaderSource,
        entry: &'static str,
        shape: RowShape,
        bufs: &[&VulkanBuffer],
    ) -> Result<()> {
        for (v, what) in [
            (shape.rows, "rows"),
            (shape.vocab, "vocab"),
            (shape.ld, "ld"),
            (shape.k, "k"),
        ] {
            to_u32(v, what)?;
        }
        let (rows, ld, k) = (shape.rows as u64, shape.ld as u64, shape.k as u64);
        let [logits, ids, probs, ..] = bufs else {
            return Err(backend_error(format!("{entry}: needs logits, ids and probs buffers")));
        };
        self.check_binding(logits, rows * ld * 4, entry)?;
        self.check_binding(ids, rows * k * 4, entry)?;
        self.check_binding(probs, rows * k * 4, entry)?;
        let params =
            |grid_x| bytemuck::bytes_of(&RowParams::new(shape.rows, shape.vocab, shape.ld, shape.k, grid_x)).to_vec();
        self.dispatch(source, Self::row_key(source, entry), rows, params, bufs, entry)
    }

    pub(crate) fn row_key(source: &ShaderSource, entry: &'static str) -> PipelineKey {
        PipelineKey {
            file: source.file,
            entry,
            overrides: Vec::new(),
            // The row kernels are memory-bound: checks cost little there.
            checked: true,
            full_subgroups: false,
            required_subgroup_size: None,
        }
    }
}

/// The extents shared by the row kernels' descriptors (`KlDesc`, `TopkDesc`).
#[derive(Clone, Copy)]
struct RowShape {
    rows: usize,
    vocab: usize,
    ld: usize,
    k: usize,
}

/// `x` as `u32`, or an error naming `what`.
fn to_u32(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| backend_error(format!("{what} = {x} exceeds the kernels' 32-bit indices")))
}

/// Bytes spanned by `rows` rows of `cols` elements at stride `ld` starting
/// at element `offset`, with `elem` bytes per element.
fn span_bytes(offset: usize, rows: usize, ld: usize, cols: usize, elem: usize) -> u64 {
    if rows == 0 || cols == 0 {
        return 0;
    }
    let elems = offset as u128 + (rows as u128 - 1) * ld as u128 + cols as u128;
    u64::try_from(elems * elem as u128).unwrap_or(u64::MAX)
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
        self.check_binding(dst, 0, "upload")?;
        self.stream()?.upload(dst, offset, data)
    }

    fn download(&self, src: &VulkanBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_binding(src, 0, "download")?;
        self.stream()?.download(src, offset, out)
    }

    fn convert_f16(&self, src: &VulkanBuffer, dst: &VulkanBuffer, desc: &ConvertDesc) -> Result<()> {
        let elems = desc.rows_padded as u64 * desc.ld as u64;
        to_u32(desc.rows_padded * desc.ld, "convert rows_padded · ld")?;
        self.check_binding(src, span_bytes(0, desc.rows, desc.cols, desc.cols, 4), "convert")?;
        self.check_binding(dst, elems * 2, "convert")?;
        let params = |grid_x| bytemuck::bytes_of(&ConvertParams::new(desc, grid_x)).to_vec();
        let key = Self::row_key(&kernels::CONVERT, "convert_f16");
        self.dispatch(
            &kernels::CONVERT,
            key,
            elems.div_ceil(kernels::CONVERT_WG),
            params,
            &[src, dst],
            "convert",
        )
    }

    fn gemm(
        &self,
        a: &VulkanBuffer,
        b: &VulkanBuffer,
        c: &VulkanBuffer,
        desc: &GemmDesc,
        label: &'static str,
    ) -> Result<()> {
        for (v, what) in [
            (desc.m, "m"),
            (desc.n, "n"),
            (desc.k, "k"),
            (desc.a_offset, "a_offset"),
            (desc.lda, "lda"),
            (desc.ldb, "ldb"),
            (desc.c_offset, "c_offset"),
            (desc.ldc, "ldc"),
        ] {
            to_u32(v, what)?;
        }
        if desc.m == 0 || desc.n == 0 {
            return Ok(());
        }
        self.check_binding(a, span_bytes(desc.a_offset, desc.m, desc.lda, desc.k, 2), label)?;
        let b_bytes = match desc.b_layout {
            HeadLayout::RowsAreOutputs => span_bytes(0, desc.n, desc.ldb, desc.k, 2),
            HeadLayout::RowsAreReduction => span_bytes(0, desc.k, desc.ldb, desc.n, 2),
        };
        self.check_binding(b, b_bytes, label)?;
        self.check_binding(c, span_bytes(desc.c_offset, desc.m, desc.ldc, desc.n, 4), label)?;

        let entry = match desc.b_layout {
            HeadLayout::RowsAreOutputs => "gemm_nt",
            HeadLayout::RowsAreReduction => "gemm_nn",
        };
        let (source, tile, overrides) = match &self.coop {
            Some(plan) => kernels::coop_pipeline(plan.choice.for_layout(desc.b_layout), plan.subgroup_size),
            None => (
                &kernels::GEMM_TILED,
                (kernels::TILED_TILE, kernels::TILED_TILE),
                Vec::new(),
            ),
        };
        let key = PipelineKey {
            file: source.file,
            entry,
            overrides,
            checked: self.options.checked,
            // Cooperative ops need whole subgroups, of the size SG_SIZE says.
            full_subgroups: self.coop.is_some(),
            required_subgroup_size: self.coop.as_ref().filter(|p| p.require_size).map(|p| p.subgroup_size),
        };
        let count = (desc.m as u64).div_ceil(tile.0) * (desc.n as u64).div_ceil(tile.1);
        let params = |grid_x| bytemuck::bytes_of(&GemmParams::new(desc, grid_x)).to_vec();
        self.dispatch(source, key, count, params, &[a, b, c], label)
    }

    fn kl_rows(
        &self,
        logits: &VulkanBuffer,
        ids: &VulkanBuffer,
        probs: &VulkanBuffer,
        coef: &VulkanBuffer,
        loss: &VulkanBuffer,
        grad: &VulkanBuffer,
        desc: &KlDesc,
    ) -> Result<()> {
        let (rows, ld) = (desc.rows as u64, desc.ld as u64);
        self.check_binding(coef, rows * 4, "kl_rows")?;
        self.check_binding(loss, rows * 4, "kl_rows")?;
        self.check_binding(grad, rows * ld * 2, "kl_rows")?;
        let shape = RowShape {
            rows: desc.rows,
            vocab: desc.vocab,
            ld: desc.ld,
            k: desc.k,
        };
        self.row_dispatch(
            &kernels::KL_ROWS,
            "kl_rows",
            shape,
            &[logits, ids, probs, coef, loss, grad],
        )
    }

    fn topk_rows(
        &self,
        logits: &VulkanBuffer,
        ids: &VulkanBuffer,
        probs: &VulkanBuffer,
        desc: &TopkDesc,
    ) -> Result<()> {
        let shape = RowShape {
            rows: desc.rows,
            vocab: desc.vocab,
            ld: desc.ld,
            k: desc.k,
        };
        self.row_dispatch(&kernels::TOPK_ROWS, "topk_rows", shape, &[logits, ids, probs])
    }

    fn finish(&self) -> Result<()> {
        self.stream()?.flush()
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
                eprintln!("headkl-vulkan: could not switch kernel timing: {e}");
                false
            }
        }
    }

    fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        let mut stream = self.stream()?;
        stream.flush()?;
        Ok(stream.take_kernel_times())
    }

    fn take_diagnostics(&self) -> Vec<String> {
        self.device.instance.diagnostics.take()
    }
}

impl Drop for VulkanBackend {
    fn drop(&mut self) {
        // Finish queued work so the stream and pipelines can be destroyed;
        // the fields then drop in order: stream, pipelines, device.
        if let Ok(mut s) = self.stream.lock() {
            let _ = s.flush();
        }
        // SAFETY: the device is valid; waiting for idle has no other effect.
        unsafe {
            let _ = self.device.raw.device_wait_idle();
        }
    }
}
