//! headkl's CUDA backend: the core toolkit's [`Backend`] on NVIDIA's own
//! runtime. The GEMMs run on cuBLASLt ([`gemm`]); every other kernel is the
//! CUDA C twin of its WGSL kernel (`shaders/cuda`, PTX from headkl-ptx),
//! compiled by the driver for the device it runs on. The libraries are
//! loaded at run time ([`loader`]), so building needs no CUDA, and a
//! machine without them gets an error saying which library is missing and
//! where it was looked for.
//!
//! One context per device, the primary one (PyTorch's too), and one stream
//! that every call queues on, in order: an upload is ordered after the work
//! queued before it and a download waits for it, as the [`Backend`]
//! contract asks.

mod conv;
mod device;
mod gemm;
mod kernels;
pub mod loader;
mod memory;
mod picks;
mod transfer;

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::result;
use cudarc::driver::sys;
use headkl_core::toolkit::resident_kernels::{ResidentBackend, RowCopyDesc};
use headkl_core::toolkit::settings::CommonOptions;
use headkl_core::toolkit::{DownloadsInFlight, HeadLayout, KernelTime, MemoryStats, PendingDownload};
use headkl_core::toolkit::{GemmDesc, GemmKernel, Launch};
use headkl_core::{Backend, DeviceBuffer, DeviceInfo, Error, Result};

pub use conv::BACKEND;
pub use device::{cublaslt_version, driver_version, MIN_CAPABILITY};
pub use memory::CudaBuffer;

/// How to open the backend: the options every GPU backend takes (the
/// device's index; the rest do not apply to cuBLASLt's GEMMs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CudaOptions {
    /// The shared options (`HEADKL_DEVICE` and the GEMM settings).
    pub common: CommonOptions,
}

/// Every CUDA device, or why none can be listed (no driver, no cuBLASLt).
pub fn enumerate() -> Result<Vec<DeviceInfo>> {
    device::enumerate()
}

/// Per-kernel timing: events recorded around each launch while on.
#[derive(Debug, Default)]
struct Timing {
    on: bool,
    marks: Vec<(&'static str, sys::CUevent, sys::CUevent)>,
}

// SAFETY: the events are driver handles, used with the context current and
// behind the backend's lock.
unsafe impl Send for Timing {}

/// The CUDA backend on one device.
pub struct CudaBackend {
    // Dropped in this order: the module and cuBLASLt before the context.
    kernels: kernels::Module,
    gemm: gemm::Gemm,
    staging: Mutex<transfer::Staging>,
    /// Downloads begun and not yet ended: each one's pinned memory and the
    /// event after its copy.
    downloads: Mutex<DownloadsInFlight<(transfer::Pinned, Arc<transfer::Event>)>>,
    /// Pinned memory of ended downloads, for the next ones.
    spare: Mutex<Vec<transfer::Pinned>>,
    timing: Mutex<Timing>,
    info: DeviceInfo,
    shared: Arc<memory::Shared>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.info.device_name)
            .finish()
    }
}

fn poisoned(what: &str) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("{what}: a panic on another thread left it locked"),
    }
}

impl CudaBackend {
    /// Opens the first usable device, or `device`.
    pub fn open(device: Option<usize>) -> Result<Self> {
        Self::open_with(&CudaOptions {
            common: CommonOptions {
                device,
                ..CommonOptions::default()
            },
        })
    }

    /// Opens the device `options` name (the first usable one by default) on
    /// a stream of its own; [`CudaBackend::set_stream`] moves it to a
    /// caller's.
    pub fn open_with(options: &CudaOptions) -> Result<Self> {
        device::init()?;
        let infos = enumerate()?;
        let ordinal = match options.common.device {
            Some(i) => i,
            None => infos
                .iter()
                .position(|i| i.unusable.is_none())
                .ok_or_else(|| Error::NoDevice {
                    backend: BACKEND,
                    reason: match infos.first() {
                        None => "the driver lists no CUDA device".into(),
                        Some(first) => first.unusable.clone().unwrap_or_default(),
                    },
                })?,
        };
        let info = infos.get(ordinal).cloned().ok_or_else(|| Error::NoDevice {
            backend: BACKEND,
            reason: format!("device {ordinal} asked for, {} present", infos.len()),
        })?;
        if let Some(why) = &info.unusable {
            return Err(Error::NoDevice {
                backend: BACKEND,
                reason: format!("device {ordinal} ({}): {why}", info.device_name),
            });
        }
        let device = Arc::new(device::Device::open(ordinal)?);
        let kernels = kernels::Module::load()?;
        let libraries = crate::loader::load().unwrap_or("?");
        // The picks hold for this device, driver and cuBLASLt; they live
        // beside the tune cache (none kept without a cache folder).
        let scope = format!("{} | {} | {libraries}", info.device_name, info.driver);
        let folder = options
            .common
            .gemm_sources
            .tune_cache
            .as_deref()
            .and_then(|f| f.parent());
        let gemm = gemm::Gemm::new(picks::Picks::open(folder, &scope))?;
        let staging = transfer::Staging::new()?;
        log::info!("cuda: {} ({}), {libraries}", info.device_name, info.driver);
        Ok(Self {
            kernels,
            gemm,
            staging: Mutex::new(staging),
            downloads: Mutex::new(DownloadsInFlight::default()),
            spare: Mutex::new(Vec::new()),
            timing: Mutex::new(Timing::default()),
            info,
            shared: Arc::new(memory::Shared {
                device,
                counter: memory::Counter::default(),
                hazards: Mutex::new(transfer::Hazards::default()),
            }),
        })
    }

    /// The stream every call queues on, as an address (for a caller that
    /// orders its own work with it).
    pub fn stream(&self) -> u64 {
        self.device().stream() as u64
    }

    /// Queues later work on `stream` (PyTorch's current stream, say),
    /// after everything queued so far.
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of this device's primary context
    /// (where PyTorch's live) and outlive its use: until the next
    /// `set_stream` or the backend's drop, which waits for it.
    pub unsafe fn set_stream(&self, stream: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.device().set_stream(stream as sys::CUstream) }
    }

    fn device(&self) -> &device::Device {
        &self.shared.device
    }

    fn staging(&self) -> Result<MutexGuard<'_, transfer::Staging>> {
        self.staging.lock().map_err(|_| poisoned("the staging buffers"))
    }

    fn hazards(&self) -> Result<MutexGuard<'_, transfer::Hazards>> {
        self.shared.hazards.lock().map_err(|_| poisoned("the buffers' events"))
    }

    /// The stream a copy of `buffer` goes on: for the backend's own
    /// buffers the uploads' or the downloads' stream (`upload` says which),
    /// after the kernels and the other copies of that buffer; the kernels'
    /// stream, in order, for a caller's.
    fn copy_stream_for(&self, buffer: &CudaBuffer, upload: bool) -> Result<sys::CUstream> {
        if buffer.id() == 0 {
            return Ok(self.device().stream());
        }
        let copy = match upload {
            true => self.device().copy_in,
            false => self.device().copy_out,
        };
        self.hazards()?.before_copy(copy, buffer.id())?;
        Ok(copy)
    }

    /// Files the event after a copy of `buffer` for the kernels that use it
    /// next.
    fn copied(&self, buffer: &CudaBuffer, event: Option<Arc<transfer::Event>>) -> Result<()> {
        if let (Some(event), true) = (event, buffer.id() != 0) {
            self.hazards()?.after_copy(buffer.id(), event);
        }
        Ok(())
    }

    /// Pinned memory of at least `len` bytes: a spare one, or new.
    fn pinned(&self, len: usize) -> Result<transfer::Pinned> {
        let mut spare = self.spare.lock().map_err(|_| poisoned("the spare pinned memory"))?;
        let best = spare
            .iter()
            .enumerate()
            .filter(|(_, p)| p.bytes().len() >= len)
            .min_by_key(|(_, p)| p.bytes().len())
            .map(|(i, _)| i);
        match best {
            Some(i) => Ok(spare.swap_remove(i)),
            None => transfer::Pinned::new(len),
        }
    }

    fn check_range(what: &'static str, buffer: &CudaBuffer, offset: u64, bytes: u64) -> Result<()> {
        if offset.checked_add(bytes).is_none_or(|end| end > buffer.len()) {
            return Err(Error::TransferOutOfRange {
                what,
                offset,
                bytes,
                len: buffer.len(),
            });
        }
        Ok(())
    }

    /// Records an event on the stream when timing is on; the pair's end
    /// comes from [`Self::time_end`].
    fn time_start(&self) -> Result<Option<sys::CUevent>> {
        let timing = self.timing.lock().map_err(|_| poisoned("the kernel timings"))?;
        if !timing.on {
            return Ok(None);
        }
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| conv::driver("creating a timing event", e))?;
        // SAFETY: a live event on our stream.
        unsafe { result::event::record(event, self.device().stream()) }
            .map_err(|e| conv::driver("recording a timing event", e))?;
        Ok(Some(event))
    }

    fn time_end(&self, name: &'static str, start: Option<sys::CUevent>) -> Result<()> {
        let Some(start) = start else {
            return Ok(());
        };
        let end = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| conv::driver("creating a timing event", e))?;
        // SAFETY: a live event on our stream.
        unsafe { result::event::record(end, self.device().stream()) }
            .map_err(|e| conv::driver("recording a timing event", e))?;
        self.timing
            .lock()
            .map_err(|_| poisoned("the kernel timings"))?
            .marks
            .push((name, start, end));
        Ok(())
    }

    /// Queues `work` on the kernels' stream (the context bound) after the
    /// copies pending on `buffers` (the backend's own; a caller's are in
    /// order already), timed as `name` while profiling, and files the
    /// event after it for their next copies.
    fn queued(
        &self,
        name: &'static str,
        buffers: &[&CudaBuffer],
        work: impl FnOnce(sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        self.device().bind()?;
        let stream = self.device().stream();
        let bound: Vec<u64> = buffers.iter().map(|b| b.id()).filter(|&i| i != 0).collect();
        self.hazards()?.before_kernel(stream, &bound)?;
        let start = self.time_start()?;
        work(stream)?;
        self.time_end(name, start)?;
        if !bound.is_empty() {
            let event = transfer::Event::record(stream)?;
            self.hazards()?.after_kernel(&event, &bound);
        }
        Ok(())
    }

    fn run_gemm(&self, launch: &Launch<'_, CudaBuffer>, alpha: gemm::Alpha) -> Result<()> {
        let Launch::Gemm { a, b, c, desc } = *launch else {
            return Ok(());
        };
        if desc.mask_rows > 0 {
            return Err(Error::MissingFeature(
                "cuda: the dx GEMM's block filter (cuBLASLt cannot skip blocks; the engine runs without it)".into(),
            ));
        }
        let addresses = (a.device_ptr(), b.device_ptr(), c.device_ptr());
        self.gemm.run(self.device().stream(), addresses, &desc, alpha)?;
        if desc.row_stats.is_some() {
            // cuBLASLt has no such epilogue: a kernel reads C back for them.
            let checked = launch.check(self.info.max_binding_bytes)?;
            let Some(params) = checked.gemm_params() else {
                return Ok(());
            };
            let groups = desc.n.div_ceil(headkl_core::toolkit::STATS_GROUP_COLS) as u64;
            let blocks = (desc.m as u64 * groups).div_ceil(u64::from(kernels::BLOCK));
            self.kernels.launch(
                kernels::ROW_STATS_ENTRY,
                self.device().stream(),
                blocks,
                kernels::BLOCK,
                |grid_x| bytemuck::bytes_of(&params.with_grid(grid_x)).to_vec(),
                &[c.device_ptr()],
            )?;
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: u64, label: &'static str) -> Result<CudaBuffer> {
        CudaBuffer::alloc(&self.shared, bytes, label)
    }

    fn upload(&self, dst: &CudaBuffer, offset: u64, data: &[u8]) -> Result<()> {
        Self::check_range("upload", dst, offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        self.device().bind()?;
        let stream = self.copy_stream_for(dst, true)?;
        let event = self.staging()?.upload(stream, dst.device_ptr() + offset, data)?;
        self.copied(dst, event)
    }

    fn download(&self, src: &CudaBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        Self::check_range("download", src, offset, out.len() as u64)?;
        if out.is_empty() {
            return Ok(());
        }
        self.device().bind()?;
        let stream = self.copy_stream_for(src, false)?;
        self.staging()?.download(stream, src.device_ptr() + offset, out)
    }

    fn download_begin(&self, src: &CudaBuffer, offset: u64, len: usize) -> Result<PendingDownload> {
        Self::check_range("download", src, offset, len as u64)?;
        self.device().bind()?;
        let host = self.pinned(len)?;
        let stream = self.copy_stream_for(src, false)?;
        if len > 0 {
            // SAFETY: the source range is inside the buffer (checked above);
            // the pinned memory holds `len` bytes and stays filed until
            // download_end has waited for this copy.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    host.bytes().as_ptr() as *mut c_void,
                    src.device_ptr() + offset,
                    len,
                    stream,
                )
            }
            .result()
            .map_err(|e| conv::driver(format_args!("downloading {len} bytes"), e))?;
        }
        let event = transfer::Event::record(stream)?;
        self.copied(src, Some(event.clone()))?;
        Ok(self
            .downloads
            .lock()
            .map_err(|_| poisoned("the downloads in flight"))?
            .begin((host, event), len))
    }

    fn download_end(&self, pending: PendingDownload, out: &mut [u8]) -> Result<()> {
        let record = self
            .downloads
            .lock()
            .map_err(|_| poisoned("the downloads in flight"))?
            .end(pending, out, BACKEND)?;
        let Some((host, event)) = record else {
            return Ok(());
        };
        self.device().bind()?;
        event.synchronize()?;
        transfer::host_copy(out, &host.bytes()[..out.len()]);
        self.spare
            .lock()
            .map_err(|_| poisoned("the spare pinned memory"))?
            .push(host);
        Ok(())
    }

    fn transfers_overlap(&self) -> bool {
        true
    }

    fn dispatch(&self, launch: Launch<'_, CudaBuffer>) -> Result<()> {
        let checked = launch.check(self.info.max_binding_bytes)?;
        let id = checked.id();
        self.queued(id.name(), &launch.buffers(), |stream| {
            if id.gemm_layout().is_some() {
                return self.run_gemm(&launch, gemm::Alpha::Host);
            }
            let buffers: Vec<u64> = launch.buffers().iter().map(|b| b.device_ptr()).collect();
            self.kernels.launch(
                id.name(),
                stream,
                launch.workgroups(GemmKernel::Tiled),
                kernels::threads(id),
                |grid_x| checked.bytes(grid_x),
                &buffers,
            )
        })
    }

    fn gemm_tile(&self, _layout: HeadLayout) -> Option<(u32, u32)> {
        None
    }

    fn gemm_row_stats(&self) -> bool {
        false
    }

    fn gemm_a_columns(&self) -> bool {
        // cuBLASLt transposes an operand for free.
        true
    }

    fn gemm_block_filter(&self) -> bool {
        false
    }

    fn finish(&self) -> Result<()> {
        self.device().synchronize()
    }

    fn memory(&self) -> MemoryStats {
        self.shared.counter.stats()
    }

    fn reset_peak_memory(&self) {
        self.shared.counter.reset_peak()
    }

    fn set_profiling(&self, on: bool) -> bool {
        if let Ok(mut timing) = self.timing.lock() {
            timing.on = on;
        }
        true
    }

    fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        self.device().bind()?;
        let marks = std::mem::take(&mut self.timing.lock().map_err(|_| poisoned("the kernel timings"))?.marks);
        let mut times = Vec::with_capacity(marks.len());
        let mut failed = None;
        for (kernel, start, end) in marks {
            // SAFETY: both events were recorded on our stream and are
            // destroyed once, here.
            unsafe {
                match result::event::synchronize(end).and_then(|()| result::event::elapsed(start, end)) {
                    Ok(ms) => times.push(KernelTime {
                        kernel,
                        ms: f64::from(ms),
                    }),
                    Err(e) => failed = failed.or(Some(conv::driver("reading a kernel's time", e))),
                }
                let _ = result::event::destroy(start);
                let _ = result::event::destroy(end);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(times),
        }
    }
}

/// The device-resident calls: a caller's buffer is a [`CudaBuffer`] at the
/// caller's address (a view starts where its pointer does).
impl ResidentBackend for CudaBackend {
    fn buffer_len(&self, buffer: &CudaBuffer) -> u64 {
        buffer.len()
    }

    fn buffer_offset(&self, _buffer: &CudaBuffer) -> u64 {
        0
    }

    /// Launches go to the device as they are queued: nothing waits here.
    fn submit(&self) -> Result<()> {
        Ok(())
    }

    /// A window is an address range of the buffer's memory: kernels bind
    /// any range whose start is 4-byte aligned (they index in elements).
    fn window(&self, buffer: &CudaBuffer, offset: u64, len: u64) -> Option<CudaBuffer> {
        buffer.window(offset, len)
    }

    /// Kernels and cuBLASLt take device pointers: windows of one buffer
    /// bind together.
    fn defers_head_grad(&self) -> bool {
        true
    }

    /// `cuMemcpy2DAsync` (a contiguous run: `cuMemcpyDtoDAsync`) on the
    /// kernels' stream, so it is ordered with them.
    fn copy_rows(&self, src: &CudaBuffer, dst: &CudaBuffer, desc: &RowCopyDesc) -> Result<()> {
        desc.check(src.len(), dst.len())?;
        if desc.rows == 0 || desc.row_bytes == 0 {
            return Ok(());
        }
        let (from, to) = (src.device_ptr() + desc.src_offset, dst.device_ptr() + desc.dst_offset);
        let contiguous = desc.rows == 1 || (desc.src_pitch == desc.row_bytes && desc.dst_pitch == desc.row_bytes);
        self.queued("copy_rows", &[src, dst], |stream| {
            // SAFETY: `check` put every row inside its buffer; the caller keeps
            // the ranges apart; the context is current.
            let copied = unsafe {
                match contiguous {
                    true => sys::cuMemcpyDtoDAsync_v2(to, from, desc.rows * desc.row_bytes, stream),
                    false => {
                        // Every field named: the memory-type enum has no zero
                        // value, so the struct cannot be zero-initialized.
                        let copy = sys::CUDA_MEMCPY2D {
                            srcXInBytes: 0,
                            srcY: 0,
                            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                            srcHost: std::ptr::null(),
                            srcDevice: from,
                            srcArray: std::ptr::null_mut(),
                            srcPitch: desc.src_pitch,
                            dstXInBytes: 0,
                            dstY: 0,
                            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                            dstHost: std::ptr::null_mut(),
                            dstDevice: to,
                            dstArray: std::ptr::null_mut(),
                            dstPitch: desc.dst_pitch,
                            WidthInBytes: desc.row_bytes,
                            Height: desc.rows,
                        };
                        sys::cuMemcpy2DAsync_v2(&copy, stream)
                    }
                }
            };
            copied.result().map_err(|e| {
                conv::driver(
                    format_args!("copying {} rows of {} bytes", desc.rows, desc.row_bytes),
                    e,
                )
            })
        })
    }

    /// A one-thread kernel writes `desc.alpha` times the word into
    /// cuBLASLt's device alpha, then the GEMM runs in device pointer mode.
    fn gemm_scaled_by_word(
        &self,
        (a, b, c): (&CudaBuffer, &CudaBuffer, &CudaBuffer),
        desc: &GemmDesc,
        (scale, word): (&CudaBuffer, usize),
    ) -> Result<()> {
        let launch = Launch::Gemm { a, b, c, desc: *desc };
        let checked = launch.check(self.info.max_binding_bytes)?;
        if (word as u64 + 1) * 4 > scale.len() {
            return Err(Error::BadDescriptor {
                kernel: kernels::ALPHA_WORD_ENTRY,
                field: "word",
                value: word as u128,
                reason: format!("past the scale buffer's {} bytes", scale.len()),
            });
        }
        let params = kernels::AlphaWordParams {
            factor: desc.alpha,
            word: word as u32,
            pad: [0; 2],
        };
        self.queued(checked.id().name(), &[a, b, c, scale], |stream| {
            let buffers = [scale.device_ptr(), self.gemm.device_alpha()];
            self.kernels.launch(
                kernels::ALPHA_WORD_ENTRY,
                stream,
                1,
                1,
                |_| bytemuck::bytes_of(&params).to_vec(),
                &buffers,
            )?;
            self.run_gemm(&launch, gemm::Alpha::Device)
        })
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.device().bind().is_ok() {
            let _ = self.device().synchronize();
            if let Ok(mut timing) = self.timing.lock() {
                for (_, start, end) in timing.marks.drain(..) {
                    // SAFETY: recorded by us, destroyed once.
                    unsafe {
                        let _ = result::event::destroy(start);
                        let _ = result::event::destroy(end);
                    }
                }
            }
        }
    }
}
