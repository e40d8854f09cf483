//! [`CpuBackend`]: the always-available `reference` backend.
//!
//! Its kernels follow `headkl_core::toolkit::backend`'s doc comments to the letter,
//! accumulating in f64 and storing each buffer's element type (f32, or f16
//! through `half`). It is stricter than the contract requires of a GPU
//! kernel, so it doubles as a check of the core driver:
//! - new buffers are filled with `0xFF` bytes (NaN as f32 and as f16), so an
//!   element a kernel forgets to write poisons the results;
//! - every descriptor goes through the same checks in core as on the GPU
//!   backends (`headkl_core::toolkit::checks`: an [`Error::BadDescriptor`]), and
//!   teacher ids are checked against the vocabulary; never a panic;
//! - a buffer bound twice to one kernel as input and output is an error.
//!
//! [`Precision::F32`] switches every kernel to f32 arithmetic with in-order
//! sums (the worst case of a GPU's accumulation) to check that the
//! tolerances leave an f32 device room.

mod kernels;
mod resident;

use std::fmt;
use std::ops::{Deref, DerefMut, Range};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use half::f16;
use headkl_core::toolkit::checks::check_transfer;
use headkl_core::toolkit::{GemmDesc, HeadLayout, KernelId, KlDesc, Launch, SumPartsDesc, TopkDesc, TransposeDesc};
use headkl_core::{Backend, DeviceBuffer, DeviceInfo, Error, KernelTime, MemoryStats, Result, NO_LABEL};

const BACKEND: &str = "reference";

/// Default largest binding: 2 GiB, as on wgpu.
const DEFAULT_MAX_BINDING: u64 = 1 << 31;

/// Arithmetic of the CPU kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// f64 accumulation and softmax: the reference.
    #[default]
    F64,
    /// f32 accumulation and softmax, sums in order: emulates a GPU's f32
    /// arithmetic at its least accurate, for tolerance headroom checks.
    F32,
}

/// Bytes held by live buffers, shared between the backend and its buffers.
#[derive(Debug, Default)]
struct MemCounter {
    current: AtomicU64,
    peak: AtomicU64,
}

impl MemCounter {
    fn add(&self, bytes: u64) {
        let now = self.current.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    fn sub(&self, bytes: u64) {
        self.current.fetch_sub(bytes, Ordering::SeqCst);
    }
}

/// A host buffer of the CPU backend. Storage is `u32` words so f32 and f16
/// views are aligned; dropping it returns its bytes to the backend's count.
/// A window ([`headkl_core::toolkit::ResidentBackend::window`]) is a range
/// of another buffer's words: it shares them and counts no bytes.
pub struct CpuBuffer {
    storage: Arc<RwLock<Vec<u32>>>,
    /// The buffer's words in `storage` (all of them but for a window).
    words: Range<usize>,
    bytes: u64,
    /// Whether dropping it returns `bytes` to the count (not a window).
    counted: bool,
    label: &'static str,
    memory: Arc<MemCounter>,
}

impl fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuBuffer")
            .field("label", &self.label)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        if self.counted {
            self.memory.sub(self.bytes);
        }
    }
}

impl DeviceBuffer for CpuBuffer {
    fn len(&self) -> u64 {
        self.bytes
    }
}

/// A buffer's words, read (shared by the kernel's inputs).
struct Words<'a> {
    guard: RwLockReadGuard<'a, Vec<u32>>,
    range: Range<usize>,
}

impl Deref for Words<'_> {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.guard[self.range.clone()]
    }
}

/// A buffer's words, written (the kernel's output, bound once).
struct WordsMut<'a> {
    guard: RwLockWriteGuard<'a, Vec<u32>>,
    range: Range<usize>,
}

impl Deref for WordsMut<'_> {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.guard[self.range.clone()]
    }
}

impl DerefMut for WordsMut<'_> {
    fn deref_mut(&mut self) -> &mut [u32] {
        &mut self.guard[self.range.clone()]
    }
}

impl CpuBuffer {
    /// The label given at allocation.
    pub fn label(&self) -> &'static str {
        self.label
    }

    /// `len` bytes from byte `offset` as a buffer of their own (the same
    /// words), where both are whole words inside this buffer.
    fn window(&self, offset: u64, len: u64) -> Option<CpuBuffer> {
        let end = offset.checked_add(len)?;
        if !offset.is_multiple_of(4) || !len.is_multiple_of(4) || end > self.bytes {
            return None;
        }
        let first = self.words.start + usize::try_from(offset / 4).ok()?;
        Some(CpuBuffer {
            storage: Arc::clone(&self.storage),
            words: first..first + usize::try_from(len / 4).ok()?,
            bytes: len,
            counted: false,
            label: self.label,
            memory: Arc::clone(&self.memory),
        })
    }

    fn read(&self, kernel: &str) -> Result<Words<'_>> {
        let guard = self.storage.try_read().map_err(|_| self.aliased(kernel))?;
        Ok(Words {
            guard,
            range: self.words.clone(),
        })
    }

    fn write(&self, kernel: &str) -> Result<WordsMut<'_>> {
        let guard = self.storage.try_write().map_err(|_| self.aliased(kernel))?;
        Ok(WordsMut {
            guard,
            range: self.words.clone(),
        })
    }

    /// Whether bytes `mine` of this buffer and bytes `theirs` of `other`
    /// are the same memory anywhere (windows of one storage).
    pub(crate) fn overlaps(&self, mine: &Range<u64>, other: &CpuBuffer, theirs: &Range<u64>) -> bool {
        let at = |b: &CpuBuffer, r: &Range<u64>| {
            let base = 4 * b.words.start as u64;
            base + r.start..base + r.end
        };
        let (x, y) = (at(self, mine), at(other, theirs));
        Arc::ptr_eq(&self.storage, &other.storage) && x.start < y.end && y.start < x.end
    }

    fn aliased(&self, kernel: &str) -> Error {
        backend_error(format!(
            "{kernel}: buffer '{}' is bound both as an input and as an output",
            self.label
        ))
    }
}

fn backend_error(message: String) -> Error {
    Error::Backend {
        backend: BACKEND,
        message,
    }
}

fn f16s(words: &[u32]) -> &[f16] {
    bytemuck::cast_slice(words)
}
fn f16s_mut(words: &mut [u32]) -> &mut [f16] {
    bytemuck::cast_slice_mut(words)
}
fn f32s(words: &[u32]) -> &[f32] {
    bytemuck::cast_slice(words)
}
fn f32s_mut(words: &mut [u32]) -> &mut [f32] {
    bytemuck::cast_slice_mut(words)
}

/// The f64 reference backend (see the module docs).
///
/// ```
/// use headkl_core::Backend;
/// use headkl_reference::CpuBackend;
///
/// let cpu = CpuBackend::new();
/// assert_eq!(cpu.info().backend, "reference");
/// let buf = cpu.alloc(64, "scratch")?;
/// assert_eq!(cpu.memory().current, 64);
/// drop(buf);
/// assert_eq!(cpu.memory().current, 0);
/// # Ok::<(), headkl_core::Error>(())
/// ```
#[derive(Debug)]
pub struct CpuBackend {
    info: DeviceInfo,
    precision: Precision,
    memory: Arc<MemCounter>,
    profiling: AtomicBool,
    times: Mutex<Vec<KernelTime>>,
    /// What [`Backend::gemm_tile`] reports ([`CpuBackend::with_gemm_tile`]).
    gemm_tile: Option<(u32, u32)>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// The reference backend with a 2 GiB largest binding.
    pub fn new() -> Self {
        Self::with_max_binding(DEFAULT_MAX_BINDING)
    }

    /// The reference backend with a largest binding (and largest buffer) of
    /// `bytes`: a small value makes the driver cut the head into several
    /// slices and the tokens into several chunks.
    pub fn with_max_binding(bytes: u64) -> Self {
        Self::with_limits(bytes, bytes)
    }

    /// The reference backend with a largest binding of `binding` bytes and
    /// a largest buffer of `buffer` bytes: with a buffer larger than a
    /// binding, a caller's buffer past one binding (a large head's
    /// resident gradient) is written through windows, as on CUDA.
    pub fn with_limits(binding: u64, buffer: u64) -> Self {
        Self {
            info: DeviceInfo {
                backend: BACKEND,
                device_name: device_name(Precision::F64).into(),
                driver: format!("headkl-reference {}", env!("CARGO_PKG_VERSION")),
                device_type: "cpu".into(),
                matrix_units: false,
                gemm: None,
                queue: None,
                matrix_shapes: Vec::new(),
                shader_f16: true,
                subgroup_size: None,
                max_binding_bytes: binding,
                max_buffer_bytes: buffer,
                memory_bytes: None,
                unusable: None,
            },
            precision: Precision::F64,
            memory: Arc::new(MemCounter::default()),
            profiling: AtomicBool::new(false),
            times: Mutex::new(Vec::new()),
            gemm_tile: None,
        }
    }

    /// The same backend reporting `tile` as its matrix-unit GEMM's output
    /// tile ([`Backend::gemm_tile`]; the arithmetic is unchanged): a test
    /// knob, so the driver's automatic dx split (which splits only on
    /// matrix units) can run on the CPU.
    pub fn with_gemm_tile(mut self, tile: Option<(u32, u32)>) -> Self {
        self.gemm_tile = tile;
        self
    }

    /// The same backend computing at `precision`.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self.info.device_name = device_name(precision).into();
        self
    }

    /// The kernels' arithmetic.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Runs `f`, recording its wall time as `kernel` when profiling is on.
    fn timed<T>(&self, kernel: KernelId, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if !self.profiling.load(Ordering::Relaxed) {
            return f();
        }
        let start = Instant::now();
        let out = f()?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if let Ok(mut times) = self.times.lock() {
            times.push(KernelTime {
                kernel: kernel.name(),
                ms,
            });
        }
        Ok(out)
    }
}

fn device_name(precision: Precision) -> &'static str {
    match precision {
        Precision::F64 => "CPU (f64 reference)",
        Precision::F32 => "CPU (f32 emulation)",
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: u64, label: &'static str) -> Result<CpuBuffer> {
        if bytes > self.info.max_buffer_bytes {
            return Err(backend_error(format!(
                "alloc: {bytes} bytes for {label} exceed the largest buffer ({} bytes)",
                self.info.max_buffer_bytes
            )));
        }
        let words = usize::try_from(bytes.div_ceil(4)).map_err(|_| Error::OutOfMemory { bytes, what: label })?;
        let mut v: Vec<u32> = Vec::new();
        v.try_reserve_exact(words)
            .map_err(|_| Error::OutOfMemory { bytes, what: label })?;
        // 0xFF bytes: NaN as f32 and as f16, so unwritten elements poison results.
        v.resize(words, u32::MAX);
        self.memory.add(bytes);
        Ok(CpuBuffer {
            storage: Arc::new(RwLock::new(v)),
            words: 0..words,
            bytes,
            counted: true,
            label,
            memory: Arc::clone(&self.memory),
        })
    }

    fn upload(&self, dst: &CpuBuffer, offset: u64, data: &[u8]) -> Result<()> {
        check_transfer("upload", offset, data.len() as u64, dst.bytes)?;
        let mut words = dst.write("upload")?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words[..]);
        bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn download(&self, src: &CpuBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        check_transfer("download", offset, out.len() as u64, src.bytes)?;
        let words = src.read("download")?;
        let bytes: &[u8] = bytemuck::cast_slice(&words[..]);
        out.copy_from_slice(&bytes[offset as usize..offset as usize + out.len()]);
        Ok(())
    }

    fn dispatch(&self, launch: Launch<'_, CpuBuffer>) -> Result<()> {
        let checked = launch.check(self.info.max_binding_bytes)?;
        self.timed(launch.id(), || match launch {
            Launch::Gemm { a, b, c, desc } => self.run_gemm(a, b, c, &desc),
            Launch::SumParts { parts, dst, desc } => self.run_sum_parts(parts, dst, &desc),
            Launch::Transpose { src, dst, desc } => self.run_transpose(src, dst, &desc),
            Launch::KlRows { desc, .. } => self.run_kl_rows(launch.bound()?, &desc),
            Launch::TopkRows { desc, .. } => self.run_topk_rows(launch.bound()?, &desc),
            // The device-resident kernels, by the kernel id.
            _ => self.run_resident(&checked, &launch.buffers()),
        })
    }

    fn gemm_a_columns(&self) -> bool {
        // As cuBLASLt's: the head's gradient reads the logits gradient as
        // it is (the kernel backends' transpose is their suites' to prove).
        true
    }

    fn gemm_tile(&self, _layout: HeadLayout) -> Option<(u32, u32)> {
        self.gemm_tile
    }

    fn finish(&self) -> Result<()> {
        Ok(())
    }

    fn memory(&self) -> MemoryStats {
        MemoryStats {
            current: self.memory.current.load(Ordering::SeqCst),
            peak: self.memory.peak.load(Ordering::SeqCst),
        }
    }

    fn reset_peak_memory(&self) {
        let now = self.memory.current.load(Ordering::SeqCst);
        self.memory.peak.store(now, Ordering::SeqCst);
    }

    fn set_profiling(&self, on: bool) -> bool {
        self.profiling.store(on, Ordering::Relaxed);
        true
    }

    fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        Ok(self
            .times
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default())
    }
}

/// Each kernel on checked launches ([`Backend::dispatch`] checks and times
/// them).
impl CpuBackend {
    fn run_gemm(&self, a: &CpuBuffer, b: &CpuBuffer, c: &CpuBuffer, d: &GemmDesc) -> Result<()> {
        const K: &str = "gemm";
        let mut out = c.write(K)?;
        let (a_words, b_words) = (a.read(K)?, b.read(K)?);
        kernels::gemm(f16s(&a_words), f16s(&b_words), f32s_mut(&mut out), d, self.precision);
        Ok(())
    }

    fn run_sum_parts(&self, parts: &CpuBuffer, dst: &CpuBuffer, d: &SumPartsDesc) -> Result<()> {
        const K: &str = "sum_parts";
        let mut out = dst.write(K)?;
        let input = parts.read(K)?;
        kernels::sum_parts(f32s(&input), f32s_mut(&mut out), d);
        Ok(())
    }

    fn run_transpose(&self, src: &CpuBuffer, dst: &CpuBuffer, d: &TransposeDesc) -> Result<()> {
        const K: &str = "transpose";
        let mut out = dst.write(K)?;
        let input = src.read(K)?;
        kernels::transpose(f16s(&input), f16s_mut(&mut out), d);
        Ok(())
    }

    fn run_kl_rows(&self, [logits, ids, probs, coef, loss, grad]: [&CpuBuffer; 6], d: &KlDesc) -> Result<()> {
        const K: &str = "kl_rows";
        let (mut loss_w, mut grad_w) = (loss.write(K)?, grad.write(K)?);
        let (logits_w, ids_w, probs_w, coef_w) = (logits.read(K)?, ids.read(K)?, probs.read(K)?, coef.read(K)?);
        // A dense teacher's kernel does not read the ids.
        let id_vals: &[u32] = if d.dense_teacher { &[] } else { &ids_w[..d.rows * d.k] };
        if let Some(i) = id_vals.iter().position(|&id| id as usize >= d.vocab) {
            return Err(backend_error(format!(
                "{K}: ids[{}][{}] = {} is not below vocab = {}",
                i / d.k,
                i % d.k,
                id_vals[i],
                d.vocab
            )));
        }
        let labels = coef_w[..d.rows * 2].iter().skip(1).step_by(2);
        if let Some((t, &l)) = labels
            .enumerate()
            .find(|(_, &l)| l != NO_LABEL && l as usize >= d.vocab)
        {
            return Err(backend_error(format!(
                "{K}: row_in[{t}] has label {l}, not below vocab = {}",
                d.vocab
            )));
        }
        kernels::kl_rows(
            f32s(&logits_w),
            id_vals,
            f32s(&probs_w),
            &coef_w,
            f32s_mut(&mut loss_w),
            f16s_mut(&mut grad_w),
            d,
            self.precision,
        );
        Ok(())
    }

    fn run_topk_rows(&self, [logits, ids, probs]: [&CpuBuffer; 3], d: &TopkDesc) -> Result<()> {
        const K: &str = "topk_rows";
        let (mut ids_w, mut probs_w) = (ids.write(K)?, probs.write(K)?);
        let logits_w = logits.read(K)?;
        kernels::topk_rows(
            f32s(&logits_w),
            &mut ids_w[..],
            f32s_mut(&mut probs_w),
            d,
            self.precision,
        );
        Ok(())
    }
}
