//! A backend wrapper that counts downloads in flight, so the suite can
//! check that the host path keeps two chunks in flight (DESIGN §8) and
//! that an error leaves none behind.

use std::sync::atomic::{AtomicUsize, Ordering};

use headkl_core::{Backend, DeviceInfo, HeadLayout, KernelTime, Launch, MemoryStats, PendingDownload, Result};

/// `inner`, with a count of the downloads begun and not yet ended.
pub(crate) struct CountInFlight<'a, B: Backend + ?Sized> {
    inner: &'a B,
    pending: AtomicUsize,
    most: AtomicUsize,
}

impl<'a, B: Backend + ?Sized> CountInFlight<'a, B> {
    pub(crate) fn new(inner: &'a B) -> Self {
        Self {
            inner,
            pending: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
        }
    }

    /// Downloads begun and not ended now.
    pub(crate) fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// The most downloads in flight at once since the last call; restarts
    /// the count.
    pub(crate) fn take_most(&self) -> usize {
        self.most.swap(0, Ordering::SeqCst)
    }
}

impl<B: Backend + ?Sized> Backend for CountInFlight<'_, B> {
    type Buffer = B::Buffer;

    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn alloc(&self, bytes: u64, label: &'static str) -> Result<Self::Buffer> {
        self.inner.alloc(bytes, label)
    }
    fn upload(&self, dst: &Self::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        self.inner.upload(dst, offset, data)
    }
    fn download(&self, src: &Self::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.inner.download(src, offset, out)
    }
    fn download_begin(&self, src: &Self::Buffer, offset: u64, len: usize) -> Result<PendingDownload> {
        let pending = self.inner.download_begin(src, offset, len)?;
        let now = self.pending.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        Ok(pending)
    }
    fn download_end(&self, pending: PendingDownload, out: &mut [u8]) -> Result<()> {
        self.pending.fetch_sub(1, Ordering::SeqCst);
        self.inner.download_end(pending, out)
    }
    fn dispatch(&self, launch: Launch<'_, Self::Buffer>) -> Result<()> {
        self.inner.dispatch(launch)
    }
    fn gemm_tile(&self, layout: HeadLayout) -> Option<(u32, u32)> {
        self.inner.gemm_tile(layout)
    }
    fn finish(&self) -> Result<()> {
        self.inner.finish()
    }
    fn memory(&self) -> MemoryStats {
        self.inner.memory()
    }
    fn reset_peak_memory(&self) {
        self.inner.reset_peak_memory()
    }
    fn set_profiling(&self, on: bool) -> bool {
        self.inner.set_profiling(on)
    }
    fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        self.inner.take_kernel_times()
    }
    fn take_diagnostics(&self) -> Vec<String> {
        self.inner.take_diagnostics()
    }
}
