//! [`WgpuBackend`]: the device, the batching of dispatches into one encoder
//! per submit, transfers, error mapping and kernel timing.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, Weak};

use headkl_core::params::{ConvertParams, GemmParams, RowParams};
use headkl_core::{
    fold_workgroups, tuning, Backend, ConvertDesc, DeviceInfo, Error, GemmChoice, GemmDesc, HeadLayout, KernelTime,
    KlDesc, MemoryStats, Result, TopkDesc,
};

use crate::adapter;
use crate::buffer::{lock, LayoutKind, Shared, WgpuBuffer};
use crate::kernels::{params_size, GemmBuild, Kernel, Kernels, ROW_WORKGROUP};
use crate::{backend_error, env_flag, BACKEND};

/// Dispatches per submitted batch (slots of the uniform ring).
const RING_SLOTS: u32 = 1024;
/// Largest staging buffer for downloads; bigger downloads go in pieces.
const MAX_STAGING: u64 = 64 << 20;
/// Uploads staged by `queue.write_buffer` past this many bytes are flushed
/// to the device, so a multi-GB head upload never stages it all at once.
const UPLOAD_FLUSH_BYTES: u64 = 256 << 20;

/// Dispatches recorded but not yet submitted.
struct Batch {
    encoder: Option<wgpu::CommandEncoder>,
    /// The uniform blocks of this batch's dispatches, one ring slot each.
    params: Vec<u8>,
    slots: u32,
    /// Timestamp queries (two per slot) when profiling.
    queries: Option<wgpu::QuerySet>,
    labels: Vec<&'static str>,
}

/// Timestamps of a submitted batch, waiting to be read.
struct PendingTimes {
    readback: wgpu::Buffer,
    labels: Vec<&'static str>,
}

/// headkl's wgpu backend: one adapter's device, its pipelines and a batch
/// of queued dispatches.
pub struct WgpuBackend {
    pub(crate) info: DeviceInfo,
    gemm_path: String,
    device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) shared: Arc<Shared>,
    kernels: Kernels,
    /// Uniform ring: slot `i` of the current batch at `i * slot_stride`.
    ring: wgpu::Buffer,
    slot_stride: u64,
    coop: bool,
    timestamps: bool,
    profiling: AtomicBool,
    batch: Mutex<Batch>,
    times: Mutex<Vec<PendingTimes>>,
    staging: Mutex<Option<wgpu::Buffer>>,
    staged_upload_bytes: AtomicU64,
}

pub(crate) fn wgpu_error_text(e: &wgpu::Error) -> String {
    match e {
        wgpu::Error::OutOfMemory { .. } => "out of memory".to_string(),
        wgpu::Error::Validation { description, .. } => format!("validation: {description}"),
        wgpu::Error::Internal { description, .. } => format!("internal: {description}"),
    }
}

/// How [`WgpuBackend::open_with`] opens a device. The environment variables
/// (`HEADKL_DEVICE`, `HEADKL_NO_COOPMAT`, `HEADKL_CHECKED`) apply on top.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// Adapter index in [`crate::enumerate`]'s list; `None`: `HEADKL_DEVICE`,
    /// else the best usable adapter.
    pub index: Option<usize>,
    /// The tiled GEMM even where matrix units exist.
    pub force_tiled: bool,
    /// Build every kernel with runtime bounds checks.
    pub checked: bool,
    /// The matrix-unit GEMM kernels; `None`: `HEADKL_GEMM`, else the tune
    /// cache's entry for the adapter, else [`GemmChoice::WGPU_DEFAULT`].
    pub gemm: Option<GemmChoice>,
}

impl WgpuBackend {
    /// Opens adapter `index` of [`crate::enumerate`]'s list; `None` takes
    /// `HEADKL_DEVICE` if set, else the first discrete GPU, then integrated,
    /// then any other usable adapter.
    pub fn open(index: Option<usize>) -> Result<Self> {
        Self::open_with(&OpenOptions {
            index,
            ..OpenOptions::default()
        })
    }

    /// Opens a device as `options` say.
    pub fn open_with(options: &OpenOptions) -> Result<Self> {
        let instance = adapter::instance();
        let candidate = adapter::choose(adapter::candidates(&instance), options.index)?;
        let force_tiled = options.force_tiled || env_flag("HEADKL_NO_COOPMAT");
        let use_coop = candidate.coop.is_ok() && !force_tiled;
        let features = adapter::features_for(&candidate, use_coop);
        let (device, queue) = adapter::open_device(&candidate, features)?;
        Self::from_parts(candidate, device, queue, use_coop, force_tiled, options, true)
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
        let (choice, source) = tuning::resolve_choice(options.gemm, BACKEND, &i.device_name, &i.driver)?;
        let coop = match &candidate.coop {
            Ok(sg) if use_coop => {
                let fitted = tuning::fit_choice(
                    BACKEND,
                    choice,
                    source,
                    &adapter::kernel_limits(&candidate.adapter, *sg),
                )?;
                Some((*sg, fitted))
            }
            _ => None,
        };
        let gemm_path = adapter::gemm_path(&candidate.coop, coop.as_ref().map(|(_, plan)| plan), force_tiled);
        info.gemm = Some(gemm_path.clone());
        let kernels = Kernels::new(
            &device,
            GemmBuild {
                coop: coop.map(|(sg, (choice, _))| (sg, choice)),
                checked: options.checked || env_flag("HEADKL_CHECKED"),
            },
        );
        let align = u64::from(device.limits().min_uniform_buffer_offset_alignment);
        let slot_stride = align.max(64);
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
            ring,
            slot_stride,
            coop: use_coop,
            timestamps,
            profiling: AtomicBool::new(false),
            batch: Mutex::new(Batch {
                encoder: None,
                params: Vec::new(),
                slots: 0,
                queries: None,
                labels: Vec::new(),
            }),
            times: Mutex::new(Vec::new()),
            staging: Mutex::new(None),
            staged_upload_bytes: AtomicU64::new(0),
        })
    }

    /// How the GEMM runs on this device (cooperative matrices or tiled, and
    /// why).
    pub fn gemm_path(&self) -> &str {
        &self.gemm_path
    }

    /// The wgpu device.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// Fails with device loss, or with errors the device reported since the
    /// last call.
    fn check(&self) -> Result<()> {
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

    fn lost_or(&self, fallback: String) -> Error {
        match &lock(&self.shared.errors).lost {
            Some(lost) => Error::DeviceLost(lost.clone()),
            None => backend_error(fallback),
        }
    }

    /// Waits for all submitted work.
    fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.lost_or(format!("waiting for the device: {e}")))?;
        Ok(())
    }

    /// Submits the batch (its uniform blocks first).
    fn flush_locked(&self, b: &mut Batch) -> Result<()> {
        let Some(mut encoder) = b.encoder.take() else {
            return Ok(());
        };
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut pending = None;
        if let Some(qs) = b.queries.take() {
            let n = u64::from(b.slots) * 2;
            let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("headkl timestamps"),
                size: n * 8,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let readback = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("headkl timestamps readback"),
                size: n * 8,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            encoder.resolve_query_set(&qs, 0..n as u32, &resolve, 0);
            encoder.copy_buffer_to_buffer(&resolve, 0, &readback, 0, n * 8);
            pending = Some(PendingTimes {
                readback,
                labels: std::mem::take(&mut b.labels),
            });
        }
        let used = (u64::from(b.slots) * self.slot_stride) as usize;
        self.queue.write_buffer(&self.ring, 0, &b.params[..used]);
        self.queue.submit([encoder.finish()]);
        b.slots = 0;
        b.labels.clear();
        self.staged_upload_bytes.store(0, Ordering::Relaxed);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(backend_error(format!("submitting work: {}", wgpu_error_text(&e))));
        }
        if let Some(p) = pending {
            lock(&self.times).push(p);
        }
        Ok(())
    }

    pub(crate) fn flush(&self) -> Result<()> {
        let mut b = lock(&self.batch);
        self.flush_locked(&mut b)
    }

    /// Records one dispatch of `kernel` over `count` workgroups (folded),
    /// with the uniform block `params(grid_x)` and storage `buffers` at
    /// bindings 1...
    pub(crate) fn dispatch(
        &self,
        kernel: Kernel,
        count: u64,
        params: impl FnOnce(u32) -> Vec<u8>,
        buffers: &[&WgpuBuffer],
        label: &'static str,
    ) -> Result<()> {
        self.check()?;
        if count == 0 {
            return Ok(());
        }
        let pipeline = self.kernels.pipeline(&self.device, kernel)?;
        let kind = kernel.layout();
        let mut ids = [0u64; 8];
        for (slot, b) in ids.iter_mut().zip(buffers) {
            *slot = b.id;
        }
        let bind_group = self.bind_group(kind, ids, buffers)?;
        let (gx, gy) = fold_workgroups(count);
        let block = params(gx);

        let mut b = lock(&self.batch);
        if b.slots == RING_SLOTS {
            self.flush_locked(&mut b)?;
        }
        let slot = b.slots;
        b.slots += 1;
        let at = (u64::from(slot) * self.slot_stride) as usize;
        if b.params.len() < at + self.slot_stride as usize {
            b.params.resize(at + self.slot_stride as usize, 0);
        }
        b.params[at..at + block.len()].copy_from_slice(&block);

        let profile = self.timestamps && self.profiling.load(Ordering::Relaxed);
        if profile && b.queries.is_none() {
            b.queries = Some(self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("headkl timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: RING_SLOTS * 2,
            }));
        }
        let Batch { encoder, queries, .. } = &mut *b;
        let encoder = encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("headkl") })
        });
        let timestamp_writes = match (profile, queries.as_ref()) {
            (true, Some(qs)) => Some(wgpu::ComputePassTimestampWrites {
                query_set: qs,
                beginning_of_pass_write_index: Some(slot * 2),
                end_of_pass_write_index: Some(slot * 2 + 1),
            }),
            _ => None,
        };
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(label),
                timestamp_writes,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind_group, &[at as u32]);
            pass.dispatch_workgroups(gx, gy, 1);
        }
        if profile {
            b.labels.push(label);
        } else if b.queries.is_some() {
            // Profiling was turned off mid-batch: keep slots and labels aligned.
            b.labels.push("");
        }
        Ok(())
    }

    fn bind_group(&self, kind: LayoutKind, ids: [u64; 8], buffers: &[&WgpuBuffer]) -> Result<wgpu::BindGroup> {
        let layout = self.kernels.bind_group_layout(kind)?;
        let mut failed = None;
        let group = self.shared.bind_group((kind, ids), || {
            let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.ring,
                    offset: 0,
                    size: wgpu::BufferSize::new(params_size(kind)),
                }),
            }];
            for (i, b) in buffers.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: b.binding(),
                });
            }
            let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("headkl"),
                layout,
                entries: &entries,
            });
            failed = pollster::block_on(scope.pop());
            group
        });
        if let Some(e) = failed {
            self.shared.drop_bind_group((kind, ids));
            return Err(backend_error(format!("binding buffers: {}", wgpu_error_text(&e))));
        }
        Ok(group)
    }

    /// A MAP_READ staging buffer of at least `bytes` (≤ [`MAX_STAGING`]).
    fn staging(&self, bytes: u64) -> Result<wgpu::Buffer> {
        let mut s = lock(&self.staging);
        if let Some(b) = s.as_ref() {
            if b.size() >= bytes {
                return Ok(b.clone());
            }
        }
        let size = bytes.next_multiple_of(1 << 20).min(MAX_STAGING).max(bytes);
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let b = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("headkl download staging"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if pollster::block_on(scope.pop()).is_some() {
            return Err(Error::OutOfMemory {
                bytes: size,
                what: "download staging",
            });
        }
        *s = Some(b.clone());
        Ok(b)
    }

    /// Maps `buffer[..bytes]` for reading, waits, and hands the bytes to `read`.
    fn read_mapped(&self, buffer: &wgpu::Buffer, bytes: u64, read: impl FnOnce(&[u8])) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        buffer.map_async(wgpu::MapMode::Read, 0..bytes, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        match rx.try_recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(self.lost_or(format!("mapping a buffer: {e}"))),
            Err(_) => return Err(self.lost_or("mapping a buffer: no completion".into())),
        }
        {
            let view = buffer
                .get_mapped_range(0..bytes)
                .map_err(|e| backend_error(format!("reading a mapped buffer: {e}")))?;
            read(&view);
        }
        buffer.unmap();
        Ok(())
    }

    /// Copies `src[offset..offset + out.len())` (4-byte aligned range) out.
    fn download_aligned(&self, src: &wgpu::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        let mut done = 0u64;
        let total = out.len() as u64;
        while done < total {
            let piece = (total - done).min(MAX_STAGING);
            let staging = self.staging(piece)?;
            let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("headkl download"),
            });
            enc.copy_buffer_to_buffer(src, offset + done, &staging, 0, piece);
            self.queue.submit([enc.finish()]);
            if let Some(e) = pollster::block_on(scope.pop()) {
                return Err(backend_error(format!("download: {}", wgpu_error_text(&e))));
            }
            let dst = &mut out[done as usize..(done + piece) as usize];
            self.read_mapped(&staging, piece, |bytes| {
                headkl_core::host::parallel_copy(&bytes[..dst.len()], dst)
            })?;
            done += piece;
        }
        Ok(())
    }

    fn check_range(buffer: &WgpuBuffer, offset: u64, len: u64, what: &str) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > buffer.bytes) {
            return Err(backend_error(format!(
                "{what} of {len} bytes at {offset} is outside a buffer of {} bytes",
                buffer.bytes
            )));
        }
        Ok(())
    }

    fn gemm_bounds(a: &WgpuBuffer, b: &WgpuBuffer, c: &WgpuBuffer, d: &GemmDesc) -> Result<()> {
        let bad = |why: String| Err(backend_error(format!("gemm {d:?}: {why}")));
        if !d.m.is_multiple_of(16) || !d.n.is_multiple_of(16) || !d.k.is_multiple_of(16) {
            return bad("m, n and k must be multiples of 16".into());
        }
        if d.lda < d.k || d.ldc < d.n {
            return bad("leading dimension below the extent".into());
        }
        let (m, n, k) = (d.m as u64, d.n as u64, d.k as u64);
        let a_end = d.a_offset as u64 + (m - 1) * d.lda as u64 + k;
        let b_end = match d.b_layout {
            HeadLayout::RowsAreOutputs => {
                if d.ldb < d.k {
                    return bad("ldb < k".into());
                }
                (n - 1) * d.ldb as u64 + k
            }
            HeadLayout::RowsAreReduction => {
                if d.ldb < d.n {
                    return bad("ldb < n".into());
                }
                (k.max(1) - 1) * d.ldb as u64 + n
            }
        };
        let c_end = d.c_offset as u64 + (m - 1) * d.ldc as u64 + n;
        if a_end * 2 > a.bytes || b_end * 2 > b.bytes || c_end * 4 > c.bytes {
            return bad(format!(
                "operands past their buffers (A {a_end} of {} halves, B {b_end} of {} halves, C {c_end} of {} floats)",
                a.bytes / 2,
                b.bytes / 2,
                c.bytes / 4
            ));
        }
        if a.bytes > u64::from(u32::MAX) || b.bytes > u64::from(u32::MAX) || c.bytes / 4 > u64::from(u32::MAX) {
            return bad("a buffer past 4 GiB cannot be indexed with u32".into());
        }
        Ok(())
    }
}

impl Backend for WgpuBackend {
    type Buffer = WgpuBuffer;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: u64, label: &'static str) -> Result<WgpuBuffer> {
        self.check()?;
        let size = bytes.max(16).next_multiple_of(16);
        if size > self.info.max_buffer_bytes {
            return Err(Error::OutOfMemory { bytes, what: label });
        }
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let raw = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let validation = pollster::block_on(validation.pop());
        let oom = pollster::block_on(oom.pop());
        if oom.is_some() {
            return Err(Error::OutOfMemory { bytes, what: label });
        }
        if let Some(e) = validation {
            return Err(backend_error(format!(
                "allocating {bytes} bytes for {label}: {}",
                wgpu_error_text(&e)
            )));
        }
        Ok(WgpuBuffer::new(raw, bytes, self.shared.clone()))
    }

    fn upload(&self, dst: &WgpuBuffer, offset: u64, data: &[u8]) -> Result<()> {
        self.check()?;
        let len = data.len() as u64;
        Self::check_range(dst, offset, len, "upload")?;
        if len == 0 {
            return Ok(());
        }
        // A view of a caller's buffer starts inside it.
        let offset = offset + dst.offset;
        // write_buffer lands before the next submit: submit what is queued
        // first so the upload is ordered after it.
        self.flush()?;
        let start = offset & !3;
        let end = (offset + len).next_multiple_of(4);
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        if start == offset && end == offset + len {
            self.queue.write_buffer(&dst.raw, offset, data);
        } else {
            // Unaligned edges: merge with the bytes already there.
            let mut merged = vec![0u8; (end - start) as usize];
            self.download_aligned(&dst.raw, start, &mut merged[..4])?;
            let tail = merged.len() - 4;
            self.download_aligned(&dst.raw, end - 4, &mut merged[tail..])?;
            let at = (offset - start) as usize;
            merged[at..at + data.len()].copy_from_slice(data);
            self.queue.write_buffer(&dst.raw, start, &merged);
        }
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(backend_error(format!("upload: {}", wgpu_error_text(&e))));
        }
        let staged = self.staged_upload_bytes.fetch_add(len, Ordering::Relaxed) + len;
        if staged >= UPLOAD_FLUSH_BYTES {
            self.queue.submit([]);
            self.staged_upload_bytes.store(0, Ordering::Relaxed);
            // Lets finished staging buffers go.
            let _ = self.device.poll(wgpu::PollType::Poll);
        }
        Ok(())
    }

    fn download(&self, src: &WgpuBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check()?;
        let len = out.len() as u64;
        Self::check_range(src, offset, len, "download")?;
        if len == 0 {
            return Ok(());
        }
        let offset = offset + src.offset;
        self.flush()?;
        let start = offset & !3;
        let end = (offset + len).next_multiple_of(4);
        if start == offset && end == offset + len {
            self.download_aligned(&src.raw, offset, out)?;
        } else {
            let mut wide = vec![0u8; (end - start) as usize];
            self.download_aligned(&src.raw, start, &mut wide)?;
            let at = (offset - start) as usize;
            out.copy_from_slice(&wide[at..at + out.len()]);
        }
        self.check()
    }

    fn convert_f16(&self, src: &WgpuBuffer, dst: &WgpuBuffer, desc: &ConvertDesc) -> Result<()> {
        let total = (desc.rows_padded * desc.ld) as u64;
        self.dispatch(
            Kernel::Convert,
            total.div_ceil(ROW_WORKGROUP as u64),
            |gx| bytemuck::bytes_of(&ConvertParams::new(desc, gx)).to_vec(),
            &[src, dst],
            "convert",
        )
    }

    fn gemm(&self, a: &WgpuBuffer, b: &WgpuBuffer, c: &WgpuBuffer, desc: &GemmDesc, label: &'static str) -> Result<()> {
        if desc.m == 0 || desc.n == 0 {
            return self.check();
        }
        Self::gemm_bounds(a, b, c, desc)?;
        let aligned = desc.a_offset.is_multiple_of(8) && desc.lda.is_multiple_of(8) && desc.ldb.is_multiple_of(8);
        if self.coop && !aligned {
            return Err(backend_error(format!(
                "gemm {desc:?}: the cooperative GEMM needs a_offset, lda and ldb in multiples of 8"
            )));
        }
        let kernel = match desc.b_layout {
            HeadLayout::RowsAreOutputs => Kernel::GemmNt,
            HeadLayout::RowsAreReduction => Kernel::GemmNn,
        };
        let (tm, tn) = self.kernels.gemm_tile(kernel);
        let count = (desc.m.div_ceil(tm) * desc.n.div_ceil(tn)) as u64;
        self.dispatch(
            kernel,
            count,
            |gx| bytemuck::bytes_of(&GemmParams::new(desc, gx)).to_vec(),
            &[a, b, c],
            label,
        )
    }

    fn kl_rows(
        &self,
        logits: &WgpuBuffer,
        ids: &WgpuBuffer,
        probs: &WgpuBuffer,
        coef: &WgpuBuffer,
        loss: &WgpuBuffer,
        grad: &WgpuBuffer,
        desc: &KlDesc,
    ) -> Result<()> {
        self.dispatch(
            Kernel::Kl,
            desc.rows as u64,
            |gx| bytemuck::bytes_of(&RowParams::new(desc.rows, desc.vocab, desc.ld, desc.k, gx)).to_vec(),
            &[logits, ids, probs, coef, loss, grad],
            "kl_rows",
        )
    }

    fn topk_rows(&self, logits: &WgpuBuffer, ids: &WgpuBuffer, probs: &WgpuBuffer, desc: &TopkDesc) -> Result<()> {
        self.dispatch(
            Kernel::Topk,
            desc.rows as u64,
            |gx| bytemuck::bytes_of(&RowParams::new(desc.rows, desc.vocab, desc.ld, desc.k, gx)).to_vec(),
            &[logits, ids, probs],
            "topk_rows",
        )
    }

    fn finish(&self) -> Result<()> {
        self.check()?;
        self.flush()?;
        self.wait()?;
        self.check()
    }

    fn memory(&self) -> MemoryStats {
        self.shared.memory()
    }

    fn reset_peak_memory(&self) {
        self.shared.reset_peak();
    }

    fn set_profiling(&self, on: bool) -> bool {
        if !self.timestamps {
            return false;
        }
        if self.profiling.load(Ordering::Relaxed) != on {
            // Keep each batch either fully timed or not at all.
            if let Err(e) = self.flush() {
                self.shared.record_error(format!("{e}"));
            }
            self.profiling.store(on, Ordering::Relaxed);
        }
        true
    }

    fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        self.finish()?;
        let pending = std::mem::take(&mut *lock(&self.times));
        let period = f64::from(self.queue.get_timestamp_period());
        let mut out = Vec::new();
        for p in pending {
            let bytes = p.readback.size();
            let mut stamps = vec![0u64; (bytes / 8) as usize];
            self.read_mapped(&p.readback, bytes, |raw| {
                stamps.copy_from_slice(bytemuck::cast_slice(raw));
            })?;
            for (i, label) in p.labels.iter().enumerate() {
                if label.is_empty() {
                    continue;
                }
                let (t0, t1) = (stamps[2 * i], stamps[2 * i + 1]);
                out.push(KernelTime {
                    kernel: label,
                    ms: t1.wrapping_sub(t0) as f64 * period / 1e6,
                });
            }
        }
        Ok(out)
    }

    fn take_diagnostics(&self) -> Vec<String> {
        let mut e = lock(&self.shared.errors);
        e.unreported.clear();
        std::mem::take(&mut e.diagnostics)
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
