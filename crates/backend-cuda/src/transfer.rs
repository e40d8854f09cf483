//! Uploads and downloads on two copy streams (one each way) beside the
//! kernels' stream, through pinned host staging, with events between the
//! streams.
//!
//! Each buffer remembers the event after the last kernel that bound it and
//! the event after the last copy that touched it ([`Hazards`]): a copy
//! waits for the kernels that use its buffer, a kernel for the copies that
//! use its buffers, and nothing else waits. So the next chunk's upload
//! and the last chunk's download run while the kernels of the chunk
//! beside them do, as core's host path expects of a backend whose
//! transfers overlap (`Backend::transfers_overlap`).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;
use headkl_core::Result;

use crate::conv::{alloc, driver};

/// Bytes of each staging slot.
pub const SLOT_BYTES: usize = 8 << 20;
/// Staging slots: enough for the host to fill some while the device
/// empties others.
pub const SLOTS: usize = 4;
/// Pieces at least this large are copied into staging by several threads:
/// one thread's memcpy into pinned memory is well below the link's rate.
const PARALLEL_COPY_BYTES: usize = 1 << 20;
/// Threads of a parallel host copy.
const COPY_THREADS: usize = 4;

/// A CUDA event, destroyed when the last holder lets go.
#[derive(Debug)]
pub struct Event(sys::CUevent);

// SAFETY: an event handle may be recorded, waited on and destroyed from
// any thread with its context current (the backend binds it first).
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// An event recorded on `stream` now.
    pub fn record(stream: sys::CUstream) -> Result<Arc<Self>> {
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("creating an event", e))?;
        let event = Arc::new(Self(event));
        // SAFETY: a live event and stream.
        unsafe { result::event::record(event.0, stream) }.map_err(|e| driver("recording an event", e))?;
        Ok(event)
    }

    /// Makes `stream`'s later work wait for this event.
    pub fn wait_on(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: a live event and stream.
        unsafe { result::stream::wait_event(stream, self.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| driver("ordering one stream after another", e))
    }

    /// Waits on the host for the event.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live event.
        unsafe { result::event::synchronize(self.0) }.map_err(|e| driver("waiting for the device", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: ours; CUDA releases an event still pending once it
        // completes.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// The events a buffer's next kernel or copy must follow, by buffer id.
#[derive(Debug, Default)]
pub struct Hazards {
    /// After the last kernel that bound the buffer.
    after_kernel: HashMap<u64, Arc<Event>>,
    /// After the last copy that read or wrote it.
    after_copy: HashMap<u64, Arc<Event>>,
}

impl Hazards {
    /// Before a kernel binding `buffers` is queued on `compute`: waits for
    /// their copies.
    pub fn before_kernel(&mut self, compute: sys::CUstream, buffers: &[u64]) -> Result<()> {
        for id in buffers {
            if let Some(event) = self.after_copy.remove(id) {
                event.wait_on(compute)?;
            }
        }
        Ok(())
    }

    /// After that kernel: its event, for later copies of its buffers.
    pub fn after_kernel(&mut self, event: &Arc<Event>, buffers: &[u64]) {
        for &id in buffers {
            self.after_kernel.insert(id, event.clone());
        }
    }

    /// Before a copy of buffer `id` is queued on `copy`: waits for its
    /// last kernel and its last copy. Both events stay filed: uploads and
    /// downloads run on two streams, so a copy on one orders nothing on
    /// the other (a download waits for the kernel that wrote its buffer,
    /// and an upload after it must still wait for that kernel and for the
    /// download).
    pub fn before_copy(&mut self, copy: sys::CUstream, id: u64) -> Result<()> {
        for event in [self.after_kernel.get(&id), self.after_copy.get(&id)]
            .into_iter()
            .flatten()
        {
            event.wait_on(copy)?;
        }
        Ok(())
    }

    /// After that copy: its event, for later kernels binding the buffer.
    pub fn after_copy(&mut self, id: u64, event: Arc<Event>) {
        self.after_copy.insert(id, event);
    }

    /// A buffer freed: nothing is owed to it any more.
    pub fn forget(&mut self, id: u64) {
        self.after_kernel.remove(&id);
        self.after_copy.remove(&id);
    }
}

/// Pinned host memory, freed on drop.
#[derive(Debug)]
pub struct Pinned {
    host: *mut u8,
    len: usize,
}

// SAFETY: plain host memory owned here.
unsafe impl Send for Pinned {}

impl Pinned {
    /// `len` bytes of page-locked host memory (the context must be current).
    pub fn new(len: usize) -> Result<Self> {
        // SAFETY: freed by drop.
        let host = unsafe { result::malloc_host(len.max(1), 0) }
            .map_err(|e| alloc("pinned host staging", len as u64, e))? as *mut u8;
        Ok(Self { host, len })
    }

    /// Its bytes (no copy into or out of it may be in flight).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated by `new`.
        unsafe { std::slice::from_raw_parts(self.host, self.len) }
    }

    /// Its bytes, to fill (no copy out of it may be in flight).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes allocated by `new`, borrowed uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, freed once.
        let _ = unsafe { result::free_host(self.host as *mut c_void) };
    }
}

/// `src` into `dst` (the same length), by several threads when large.
pub fn host_copy(dst: &mut [u8], src: &[u8]) {
    if src.len() < PARALLEL_COPY_BYTES {
        dst.copy_from_slice(src);
        return;
    }
    let part = src.len().div_ceil(COPY_THREADS);
    std::thread::scope(|scope| {
        for (d, s) in dst.chunks_mut(part).zip(src.chunks(part)) {
            scope.spawn(move || d.copy_from_slice(s));
        }
    });
}

/// The staging ring: slots of pinned memory, each with the event of the
/// last copy that used it.
#[derive(Debug)]
pub struct Staging {
    slots: Vec<(Pinned, Option<Arc<Event>>)>,
    next: usize,
}

impl Staging {
    /// [`SLOTS`] slots of [`SLOT_BYTES`] (the context must be current).
    pub fn new() -> Result<Self> {
        let slots = (0..SLOTS)
            .map(|_| Ok((Pinned::new(SLOT_BYTES)?, None)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { slots, next: 0 })
    }

    /// Copies `data` to device address `dst` on `stream`; returns once
    /// `data` is in staging (the device copies may still run) with the
    /// event after the last of them.
    pub fn upload(&mut self, stream: sys::CUstream, dst: u64, data: &[u8]) -> Result<Option<Arc<Event>>> {
        let mut last = None;
        for (i, piece) in data.chunks(SLOT_BYTES).enumerate() {
            let (slot, used) = &mut self.slots[self.next];
            self.next = (self.next + 1) % SLOTS;
            if let Some(event) = used.take() {
                event.synchronize()?;
            }
            host_copy(&mut slot.bytes_mut()[..piece.len()], piece);
            let at = dst + (i * SLOT_BYTES) as u64;
            // SAFETY: `at..at + len` is inside the destination (the caller
            // checked the range); the slot stays untouched until its event.
            unsafe { sys::cuMemcpyHtoDAsync_v2(at, slot.host as *const c_void, piece.len(), stream) }
                .result()
                .map_err(|e| driver(format_args!("uploading {} bytes", piece.len()), e))?;
            let event = Event::record(stream)?;
            *used = Some(event.clone());
            last = Some(event);
        }
        Ok(last)
    }

    /// Copies `out.len()` bytes from device address `src` into `out` on
    /// `stream` and waits for them, the device filling one slot while the
    /// host empties another.
    pub fn download(&mut self, stream: sys::CUstream, src: u64, out: &mut [u8]) -> Result<()> {
        let pieces: Vec<(usize, usize)> = (0..out.len())
            .step_by(SLOT_BYTES)
            .map(|start| (start, SLOT_BYTES.min(out.len() - start)))
            .collect();
        for (_, used) in &mut self.slots {
            if let Some(event) = used.take() {
                event.synchronize()?;
            }
        }
        let queue = |slots: &mut Vec<(Pinned, Option<Arc<Event>>)>, i: usize| -> Result<()> {
            let (start, len) = pieces[i];
            let (slot, used) = &mut slots[i % SLOTS];
            // SAFETY: the source range is inside the buffer (the caller
            // checked it); the slot is free (its last copy was read out).
            unsafe { sys::cuMemcpyDtoHAsync_v2(slot.host as *mut c_void, src + start as u64, len, stream) }
                .result()
                .map_err(|e| driver(format_args!("downloading {len} bytes"), e))?;
            *used = Some(Event::record(stream)?);
            Ok(())
        };
        // Up to SLOTS - 1 pieces in flight ahead of the one being read.
        let ahead = SLOTS - 1;
        for i in 0..pieces.len().min(ahead) {
            queue(&mut self.slots, i)?;
        }
        for i in 0..pieces.len() {
            let (start, len) = pieces[i];
            let (slot, used) = &mut self.slots[i % SLOTS];
            if let Some(event) = used.take() {
                event.synchronize()?;
            }
            host_copy(&mut out[start..start + len], &slot.bytes()[..len]);
            if i + ahead < pieces.len() {
                queue(&mut self.slots, i + ahead)?;
            }
        }
        Ok(())
    }
}
