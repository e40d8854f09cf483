//! Device buffers and the state they share with the backend: memory
//! accounting, the bind-group cache (entries die with their buffers), and
//! the error log the device's callbacks write.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use headkl_core::{DeviceBuffer, MemoryStats};

use headkl_core::toolkit::KernelId;

/// Bind groups are keyed by kernel (its layout) and the ids of the buffers
/// at bindings 1.. (0 where unused).
pub(crate) type BindKey = (KernelId, [u64; 8]);

/// Errors the device reported outside any call's error scope, and device
/// loss.
#[derive(Default)]
pub(crate) struct ErrorLog {
    /// Everything reported, until `take_diagnostics`.
    pub diagnostics: Vec<String>,
    /// Reported but not yet returned from a call.
    pub unreported: Vec<String>,
    /// Set by the device-lost callback.
    pub lost: Option<String>,
}

/// State shared by the backend, its buffers and the device callbacks.
#[derive(Default)]
pub(crate) struct Shared {
    memory: Mutex<MemoryStats>,
    bind_groups: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
    pub errors: Mutex<ErrorLog>,
    next_id: AtomicU64,
}

/// Locks a mutex, recovering the data if a panic poisoned it (every value
/// guarded here stays consistent between statements).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    pub fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn allocated(&self, bytes: u64) {
        let mut m = lock(&self.memory);
        m.current += bytes;
        m.peak = m.peak.max(m.current);
    }

    pub fn memory(&self) -> MemoryStats {
        *lock(&self.memory)
    }

    pub fn reset_peak(&self) {
        let mut m = lock(&self.memory);
        m.peak = m.current;
    }

    /// The cached bind group for `key`, made by `make` on a miss.
    pub fn bind_group(&self, key: BindKey, make: impl FnOnce() -> wgpu::BindGroup) -> wgpu::BindGroup {
        lock(&self.bind_groups).entry(key).or_insert_with(make).clone()
    }

    /// Drops one cached bind group (one whose creation failed).
    pub fn drop_bind_group(&self, key: BindKey) {
        lock(&self.bind_groups).remove(&key);
    }

    fn forget(&self, id: u64, bytes: u64) {
        lock(&self.bind_groups).retain(|(_, ids), _| !ids.contains(&id));
        let mut m = lock(&self.memory);
        m.current = m.current.saturating_sub(bytes);
    }

    pub fn record_error(&self, message: String) {
        let mut e = lock(&self.errors);
        e.diagnostics.push(message.clone());
        e.unreported.push(message);
    }
}

/// A device-local storage buffer (STORAGE | COPY_SRC | COPY_DST). Dropping
/// it frees the memory once queued work no longer uses it.
pub struct WgpuBuffer {
    pub(crate) raw: wgpu::Buffer,
    pub(crate) id: u64,
    /// Bytes asked for (the buffer itself is rounded up to 16 bytes), or
    /// the length of a view of a caller's buffer.
    pub(crate) bytes: u64,
    /// Where a view of a caller's buffer starts (0 for the backend's own).
    pub(crate) offset: u64,
    /// Bytes this buffer counts in the backend's memory (0 for a caller's).
    accounted: u64,
    shared: Arc<Shared>,
}

impl DeviceBuffer for WgpuBuffer {
    /// Bytes asked for when the buffer was allocated.
    fn len(&self) -> u64 {
        self.bytes
    }
}

impl WgpuBuffer {
    pub(crate) fn new(raw: wgpu::Buffer, bytes: u64, shared: Arc<Shared>) -> Self {
        let id = shared.new_id();
        let accounted = raw.size();
        shared.allocated(accounted);
        Self {
            raw,
            id,
            bytes,
            offset: 0,
            accounted,
            shared,
        }
    }

    /// A view of a caller's buffer (not counted in the backend's memory).
    pub(crate) fn external(raw: wgpu::Buffer, offset: u64, bytes: u64, shared: Arc<Shared>) -> Self {
        let id = shared.new_id();
        Self {
            raw,
            id,
            bytes,
            offset,
            accounted: 0,
            shared,
        }
    }

    /// `len` bytes of this buffer from byte `offset` as a view of their own
    /// for one binding ([`headkl_core::ResidentBackend::window`]), not
    /// counted in the backend's memory. `None` where the range is empty,
    /// not inside this buffer or not in whole words, or starts off
    /// [`headkl_core::resident::VIEW_ALIGN`] in the underlying buffer, as a
    /// caller's views must.
    pub(crate) fn window(&self, offset: u64, len: u64) -> Option<Self> {
        let end = offset.checked_add(len)?;
        let start = self.offset.checked_add(offset)?;
        if len == 0
            || end > self.bytes
            || !len.is_multiple_of(4)
            || !start.is_multiple_of(headkl_core::resident::VIEW_ALIGN)
        {
            return None;
        }
        Some(Self::external(self.raw.clone(), start, len, Arc::clone(&self.shared)))
    }

    /// Where this view starts in the underlying buffer (0 for a buffer the
    /// backend allocated).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// How a kernel binds this buffer: the whole of one the backend
    /// allocated, exactly the view of a caller's.
    pub(crate) fn binding(&self) -> wgpu::BindingResource<'_> {
        if self.accounted > 0 {
            return self.raw.as_entire_binding();
        }
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.raw,
            offset: self.offset,
            size: wgpu::BufferSize::new(self.bytes.next_multiple_of(4)),
        })
    }

    /// The underlying wgpu buffer.
    pub fn raw(&self) -> &wgpu::Buffer {
        &self.raw
    }
}

impl Drop for WgpuBuffer {
    fn drop(&mut self) {
        // Cached bind groups hold the buffer alive: drop them with it.
        self.shared.forget(self.id, self.accounted);
    }
}

impl std::fmt::Debug for WgpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuBuffer")
            .field("id", &self.id)
            .field("bytes", &self.bytes)
            .field("offset", &self.offset)
            .finish()
    }
}
