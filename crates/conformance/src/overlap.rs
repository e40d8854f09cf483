//! A backend wrapper that counts downloads in flight, so the suite can
//! check that the host path keeps two chunks in flight (DESIGN §8) and
//! that an error leaves none behind.

use std::sync::atomic::{AtomicUsize, Ordering};

use headkl_core::{Backend, Result};

use headkl_core::toolkit::PendingDownload;

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

    crate::forward_backend!(
        info,
        alloc,
        upload,
        download,
        dispatch,
        gemm_tile,
        finish,
        memory,
        reset_peak_memory,
        set_profiling,
        take_kernel_times,
        take_diagnostics,
    );
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
}

/// Writes, for each [`Backend`] method named, one that hands the call to
/// `self.inner` unchanged: for a wrapper that changes only some of them
/// (the download counter here, the planted faults of the suite's own
/// tests). A method not named keeps the trait's default.
#[doc(hidden)]
#[macro_export]
macro_rules! forward_backend {
    ($($method:ident),+ $(,)?) => {
        $($crate::forward_backend!(@ $method);)+
    };
    (@ info) => {
        fn info(&self) -> &headkl_core::DeviceInfo {
            self.inner.info()
        }
    };
    (@ alloc) => {
        fn alloc(&self, bytes: u64, label: &'static str) -> headkl_core::Result<Self::Buffer> {
            self.inner.alloc(bytes, label)
        }
    };
    (@ upload) => {
        fn upload(&self, dst: &Self::Buffer, offset: u64, data: &[u8]) -> headkl_core::Result<()> {
            self.inner.upload(dst, offset, data)
        }
    };
    (@ download) => {
        fn download(&self, src: &Self::Buffer, offset: u64, out: &mut [u8]) -> headkl_core::Result<()> {
            self.inner.download(src, offset, out)
        }
    };
    (@ dispatch) => {
        fn dispatch(&self, launch: headkl_core::toolkit::Launch<'_, Self::Buffer>) -> headkl_core::Result<()> {
            self.inner.dispatch(launch)
        }
    };
    (@ gemm_tile) => {
        fn gemm_tile(&self, layout: headkl_core::toolkit::HeadLayout) -> Option<(u32, u32)> {
            self.inner.gemm_tile(layout)
        }
    };
    (@ finish) => {
        fn finish(&self) -> headkl_core::Result<()> {
            self.inner.finish()
        }
    };
    (@ memory) => {
        fn memory(&self) -> headkl_core::MemoryStats {
            self.inner.memory()
        }
    };
    (@ reset_peak_memory) => {
        fn reset_peak_memory(&self) {
            self.inner.reset_peak_memory()
        }
    };
    (@ set_profiling) => {
        fn set_profiling(&self, on: bool) -> bool {
            self.inner.set_profiling(on)
        }
    };
    (@ take_kernel_times) => {
        fn take_kernel_times(&self) -> headkl_core::Result<Vec<headkl_core::KernelTime>> {
            self.inner.take_kernel_times()
        }
    };
    (@ take_diagnostics) => {
        fn take_diagnostics(&self) -> Vec<String> {
            self.inner.take_diagnostics()
        }
    };
}
