//! [`WgpuBackend`]: opening an adapter's device, its GEMM choice, and
//! device errors (uncaptured errors, loss) mapped to `headkl_core::Error`.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, Weak};

use headkl_core::toolkit::gemm_choice::{fit_choice, resolve_choice, KernelLimits};
use headkl_core::toolkit::settings::{CommonOptions, Env};
use headkl_core::toolkit::{CoopGemm, KernelId, StagedTile};
use headkl_core::{ChoiceSource, DeviceInfo, Error, GemmChoice, Result};

use crate::adapter;
use crate::buffer::{lock, Shared};
use crate::kernels::{GemmBuild, Kernels};
use crate::stream::{Batch, PendingTimes, RING_SLOTS};
use crate::{backend_error, BACKEND};

/// How long a map's callback may take to arrive once its copy is done
/// ([`WgpuBackend::await_map`]); past it the device is taken as lost.
const MAP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// The wgpu backend's WGSL GEMM kernels without a tune cache or
/// `HEADKL_GEMM`, on an adapter that cannot run the GLSL tiles (not Vulkan
/// with `PASSTHROUGH_SHADERS`, or subgroups other than 32); where it can,
/// the default is [`GemmChoice::GLSL_DEFAULT`]
/// (`headkl_core::toolkit::gemm_choice::fit_choice`). The fastest WGSL pair on the
/// H200 (docs/PERFORMANCE.md), where wgpu's pipelines ran the Vulkan
/// backend's K-64 WGSL logits tile far slower: both GEMMs take the
/// 256 × 128 tile, K 32 per step, one stage with register prefetch.
pub const DEFAULT_GEMM: GemmChoice = GemmChoice {
    logits: CoopGemm::Staged(PREFETCH_256),
    dx: CoopGemm::Staged(PREFETCH_256),
};

const PREFETCH_256: StagedTile = StagedTile {
    bk: 32,
    rows: 4,
    stages: 1,
    prefetch: true,
};

/// headkl's wgpu backend: one adapter's device, its pipelines and a batch
/// of queued dispatches.
pub struct WgpuBackend {
    pub(crate) info: DeviceInfo,
    pub(crate) gemm_path: String,
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) shared: Arc<Shared>,
    pub(crate) kernels: Kernels,
    /// What the device allows the matrix-unit GEMM, where it runs one.
    pub(crate) gemm_limits: Option<KernelLimits>,
    /// Uniform ring: slot `i` of the current batch at `i * slot_stride`.
    pub(crate) ring: wgpu::Buffer,
    pub(crate) slot_stride: u64,
    pub(crate) timestamps: bool,
    pub(crate) profiling: AtomicBool,
    pub(crate) batch: Mutex<Batch>,
    pub(crate) times: Mutex<Vec<PendingTimes>>,
    pub(crate) staging: Mutex<Option<wgpu::Buffer>>,
    pub(crate) staged_upload_bytes: AtomicU64,
    /// Downloads started and not yet read, with their staging pool.
    pub(crate) readbacks: Mutex<crate::readback::Readbacks>,
}

/// `what` failed with wgpu's error `e` (kept as the source).
pub(crate) fn wgpu_failure(what: impl std::fmt::Display, e: wgpu::Error) -> headkl_core::Error {
    crate::driver_error(format!("{what}: {}", wgpu_error_text(&e)), e)
}

pub(crate) fn wgpu_error_text(e: &wgpu::Error) -> String {
    match e {
        wgpu::Error::OutOfMemory { .. } => "out of memory".to_string(),
        wgpu::Error::Validation { description, .. } => format!("validation: {description}"),
        wgpu::Error::Internal { description, .. } => format!("internal: {description}"),
    }
}

/// How [`WgpuBackend::open_with`] opens a device. This crate reads no
/// environment: [`OpenOptions::from_env`] builds options from the
/// `HEADKL_*` variables its caller hands it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// What both GPU backends take, under the same names: the adapter index
    /// in [`crate::enumerate`]'s list (`None`: the best usable adapter),
    /// the tiled GEMM even where matrix units exist, bounds-checked
    /// kernels, the GEMM kernels and the queue family.
    pub common: CommonOptions,
}

impl OpenOptions {
    /// Options from the environment: [`CommonOptions::from_env`] (wgpu has
    /// no switches of its own).
    pub fn from_env(env: &Env) -> Result<Self> {
        Ok(Self {
            common: CommonOptions::from_env(env)?,
        })
    }
}

impl WgpuBackend {
    /// Opens adapter `index` of [`crate::enumerate`]'s list with default
    /// options; `None` takes the first discrete GPU, then integrated, then
    /// any other usable adapter.
    pub fn open(index: Option<usize>) -> Result<Self> {
        Self::open_with(&OpenOptions {
            common: CommonOptions {
                device: index,
                ..CommonOptions::default()
            },
        })
    }

    /// Opens a device as `options` say.
    pub fn open_with(options: &OpenOptions) -> Result<Self> {
        let instance = adapter::instance();
        let candidate = adapter::choose(adapter::candidates(&instance), options.common.device)?;
        let force_tiled = options.common.force_fallback;
        let use_coop = candidate.coop.is_ok() && !force_tiled;
        let features = adapter::features_for(&candidate, use_coop);
        let (device, queue, queue_family) = adapter::open_device(&candidate, features, options.common.queue)?;
        let mut backend = Self::from_parts(candidate, device, queue, use_coop, force_tiled, options, true)?;
        backend.info.queue = queue_family;
        Ok(backend)
    }

    /// The backend on an open device. `own_device`: the device is the
    /// backend's, so it takes the device's error and loss callbacks (a
    /// trainer's device keeps its own; errors inside headkl's calls still
    /// come back through error scopes).
    pub(crate) fn from_parts(
        candidate: adapter::Candidate,
        device: wgpu::Device,
        queue: wgpu::Queue,
        use_coop: bool,
        force_tiled: bool,
        options: &OpenOptions,
        own_device: bool,
    ) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        if own_device {
            let weak: Weak<Shared> = Arc::downgrade(&shared);
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                if let Some(s) = weak.upgrade() {
                    s.record_error(wgpu_error_text(&e));
                }
            }));
            let weak: Weak<Shared> = Arc::downgrade(&shared);
            device.set_device_lost_callback(move |reason, message| {
                if reason == wgpu::DeviceLostReason::Destroyed {
                    return;
                }
                if let Some(s) = weak.upgrade() {
                    lock(&s.errors).lost = Some(format!("{reason:?}: {message}"));
                }
            });
        }

        let mut info = candidate.info.clone();
        info.matrix_units = use_coop;
        // What the device was opened with (a trainer's may ask for less
        // than the adapter offers).
        let limits = device.limits();
        info.max_binding_bytes = limits.max_storage_buffer_binding_size;
        info.max_buffer_bytes = limits.max_buffer_size;
        // Resolved (and a bad HEADKL_GEMM reported) even where the tiled
        // GEMM runs, so a typo never goes unnoticed.
        let i = &candidate.info;
        let gemm_limits = match &candidate.coop {
            Ok(sg) if use_coop => Some(adapter::kernel_limits(&candidate.adapter, device.features(), *sg)),
            _ => None,
        };
        let (choice, source) = resolve_choice(
            options.common.gemm,
            GemmChoice::default_for(DEFAULT_GEMM, gemm_limits.as_ref()),
            &options.common.gemm_sources,
            BACKEND,
            &i.device_name,
            &i.driver,
        )?;
        let coop = match (&candidate.coop, &gemm_limits) {
            (Ok(sg), Some(limits)) => Some((*sg, fit_choice(DEFAULT_GEMM, choice, source, limits)?)),
            _ => None,
        };
        let gemm_path = adapter::gemm_path(&candidate.coop, coop.as_ref().map(|(_, plan)| plan), force_tiled);
        info.gemm = Some(gemm_path.clone());
        let kernels = Kernels::new(
            &device,
            GemmBuild {
                coop: coop.map(|(sg, (choice, _))| (sg, choice)),
                checked: options.common.checked,
            },
        );
        let align = u64::from(device.limits().min_uniform_buffer_offset_alignment);
        let slot_stride = align.max(KernelId::MAX_PARAMS_BYTES);
        let ring = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("headkl params"),
            size: slot_stride * u64::from(RING_SLOTS),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let timestamps = device.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        Ok(Self {
            info,
            gemm_path,
            device,
            queue,
            shared,
            kernels,
            gemm_limits,
            ring,
            slot_stride,
            timestamps,
            profiling: AtomicBool::new(false),
            batch: Mutex::new(Batch::default()),
            times: Mutex::new(Vec::new()),
            staging: Mutex::new(None),
            staged_upload_bytes: AtomicU64::new(0),
            readbacks: Mutex::new(crate::readback::Readbacks::default()),
        })
    }

    /// How the GEMM runs on this device (cooperative matrices or tiled, and
    /// why).
    pub fn gemm_path(&self) -> &str {
        &self.gemm_path
    }

    /// The matrix-unit GEMM kernels, when the GEMM runs on matrix units.
    pub fn gemm_choice(&self) -> Option<GemmChoice> {
        self.kernels.gemm_choice()
    }

    /// Makes [`headkl_core::Backend::gemm`] run `choice` from now on, as if
    /// the open options had named it. Fails with [`Error::InvalidSetting`]
    /// where a kernel of `choice` cannot run here ([`CoopGemm::misfit`]:
    /// a GLSL tile without `PASSTHROUGH_SHADERS` or subgroups of 32), or
    /// where the GEMM does not run on matrix units at all.
    pub fn use_gemm(&mut self, choice: GemmChoice) -> Result<()> {
        let coop = self.gemm_limits.zip(self.kernels.coop_subgroup());
        choice.check_use(&self.info.device_name, coop.as_ref().map(|(limits, _)| limits))?;
        if let Some((_, subgroup)) = coop {
            self.kernels.set_gemm_choice(choice);
            self.gemm_path = adapter::gemm_path(&Ok(subgroup), Some(&(choice, ChoiceSource::Options)), false);
            self.info.gemm = Some(self.gemm_path.clone());
        }
        Ok(())
    }

    /// The wgpu device.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// Fails with device loss, or with errors the device reported since the
    /// last call.
    pub(crate) fn check(&self) -> Result<()> {
        let mut e = lock(&self.shared.errors);
        if let Some(lost) = &e.lost {
            return Err(Error::DeviceLost(lost.clone()));
        }
        if !e.unreported.is_empty() {
            let all = std::mem::take(&mut e.unreported);
            return Err(backend_error(all.join("; ")));
        }
        Ok(())
    }

    pub(crate) fn lost_or(&self, fallback: String) -> Error {
        match &lock(&self.shared.errors).lost {
            Some(lost) => Error::DeviceLost(lost.clone()),
            None => backend_error(fallback),
        }
    }

    /// The result of a `map_async` whose work was waited for: its
    /// callback runs in whichever thread's poll found the copy done, which
    /// with engines on several threads may be another thread still inside
    /// its poll when this one returns. So the callback is awaited (polling
    /// again meanwhile), up to [`MAP_DEADLINE`], not merely looked for.
    pub(crate) fn await_map(
        &self,
        mapped: &std::sync::mpsc::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
    ) -> Result<()> {
        let deadline = std::time::Instant::now() + MAP_DEADLINE;
        loop {
            match mapped.recv_timeout(std::time::Duration::from_millis(1)) {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => return Err(self.lost_or(format!("mapping a buffer: {e}"))),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(self.lost_or("mapping a buffer: its callback was dropped".into()))
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if std::time::Instant::now() >= deadline {
                        return Err(self.lost_or(format!(
                            "mapping a buffer: no completion within {} s of its copy",
                            MAP_DEADLINE.as_secs()
                        )));
                    }
                    let _ = self.device.poll(wgpu::PollType::Poll);
                }
            }
        }
    }

    /// Waits for all submitted work.
    pub(crate) fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.lost_or(format!("waiting for the device: {e}")))?;
        Ok(())
    }
}

impl Drop for WgpuBackend {
    fn drop(&mut self) {
        // Let queued work finish before the device goes.
        let _ = self.flush();
        let _ = self.device.poll(wgpu::PollType::wait_indefinitely());
    }
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuBackend")
            .field("device", &self.info.device_name)
            .field("gemm", &self.gemm_path)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::WgpuBackend;

    /// Engines on several threads: the poll that finds a copy done may be
    /// another thread's, which runs the map's callback after this thread's
    /// poll has returned (seen on the H200 with three engines at shape S).
    #[test]
    fn a_map_callback_that_arrives_after_the_poll_is_awaited() {
        let Some(backend) = headkl_conformance::open_or_skip("wgpu", || WgpuBackend::open(None)) else {
            return;
        };
        let (tx, rx) = mpsc::channel();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let _ = tx.send(Ok(()));
        });
        assert_eq!(backend.await_map(&rx), Ok(()));
        late.join().expect("the sender");

        // A callback dropped unrun is an error, not a wait.
        let (tx, rx) = mpsc::channel::<Result<(), wgpu::BufferAsyncError>>();
        drop(tx);
        let e = backend.await_map(&rx).expect_err("no callback will come");
        assert!(e.to_string().contains("callback was dropped"), "{e}");
    }
}
