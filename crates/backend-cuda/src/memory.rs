//! Device buffers: allocation, the memory the backend holds, and buffers
//! that belong to a caller (PyTorch's tensors) and are only borrowed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::result;
use cudarc::driver::sys;
use headkl_core::{DeviceBuffer, MemoryStats, Result};

use crate::conv;
use crate::device::Device;
use crate::transfer::Hazards;

/// What a backend's buffers share with it: the device they live on, the
/// memory count and the events their next uses must follow.
#[derive(Debug)]
pub struct Shared {
    /// The device.
    pub device: Arc<Device>,
    /// Bytes held.
    pub counter: Counter,
    /// The buffers' pending kernels and copies.
    pub hazards: Mutex<Hazards>,
}

/// Ids of owned buffers (0: a caller's buffer, not tracked).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Bytes held now and at peak.
#[derive(Debug, Default)]
pub struct Counter {
    current: AtomicU64,
    peak: AtomicU64,
}

impl Counter {
    fn add(&self, bytes: u64) {
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, bytes: u64) {
        self.current.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            current: self.current.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
        }
    }

    /// Restarts the peak from the current count.
    pub fn reset_peak(&self) {
        self.peak.store(self.current.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// A device allocation, freed on drop, or a caller's memory (not freed).
#[derive(Debug)]
pub struct CudaBuffer {
    ptr: sys::CUdeviceptr,
    len: u64,
    /// The backend an owned allocation is returned to (`None`: a caller's).
    owner: Option<Arc<Shared>>,
    id: u64,
}

impl CudaBuffer {
    /// Allocates `bytes` on `device` (contents undefined); 0 bytes allocate
    /// nothing.
    pub(crate) fn alloc(shared: &Arc<Shared>, bytes: u64, label: &'static str) -> Result<Self> {
        let ptr = if bytes == 0 {
            0
        } else {
            shared.device.bind()?;
            // SAFETY: the context is current; the memory is freed by drop.
            unsafe { result::malloc_sync(bytes as usize) }.map_err(|e| conv::alloc(label, bytes, e))?
        };
        shared.counter.add(bytes);
        Ok(Self {
            ptr,
            len: bytes,
            owner: Some(shared.clone()),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// A caller's device memory: `len` bytes at `ptr` in the backend's
    /// context, which the caller keeps alive (and frees) itself.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be device memory of the backend's context, live
    /// and not written by anything else while a kernel that binds this
    /// buffer may run.
    pub unsafe fn borrowed(ptr: u64, len: u64) -> Self {
        Self {
            ptr,
            len,
            owner: None,
            id: 0,
        }
    }

    /// `len` bytes of this buffer from byte `offset` (a multiple of 4), as
    /// a buffer of its own: same memory, no ownership (dropping it frees
    /// nothing) and the same id, so the kernels that bind it order the
    /// parent's copies as their own. `None` where the range is not inside.
    pub(crate) fn window(&self, offset: u64, len: u64) -> Option<Self> {
        let end = offset.checked_add(len)?;
        if !offset.is_multiple_of(4) || end > self.len || self.ptr == 0 {
            return None;
        }
        Some(Self {
            ptr: self.ptr + offset,
            len,
            owner: None,
            id: self.id,
        })
    }

    /// Its id in the backend's hazard tracking (0: a caller's buffer,
    /// whose copies run in order on the kernels' stream).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Its device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
}

impl DeviceBuffer for CudaBuffer {
    fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        let Some(shared) = self.owner.take() else {
            return;
        };
        shared.counter.sub(self.len);
        if let Ok(mut hazards) = shared.hazards.lock() {
            hazards.forget(self.id);
        }
        if self.ptr == 0 || shared.device.bind().is_err() {
            return;
        }
        // Work queued on the stream may still read the buffer: cuMemFree
        // waits for the device, as the CUDA programming guide says.
        // SAFETY: our own allocation, never freed before.
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            log::warn!("cuda: freeing {} bytes: {e}", self.len);
        }
    }
}
