//! Downloads that do not wait: a copy into a MAP_READ staging buffer is
//! submitted and its mapping requested at once; the bytes are read later,
//! after waiting for that submission only, so the next chunk's work can be
//! queued (and run) meanwhile.

use std::sync::mpsc;

use headkl_core::toolkit::checks::check_transfer;
use headkl_core::toolkit::host::StagingPool;
use headkl_core::toolkit::{DownloadsInFlight, PendingDownload};
use headkl_core::{DeviceBuffer, Result};

use crate::buffer::{lock, WgpuBuffer};
use crate::device::{wgpu_failure, WgpuBackend};

/// A download in flight.
pub(crate) struct Readback {
    staging: wgpu::Buffer,
    submission: wgpu::SubmissionIndex,
    mapped: mpsc::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
    /// The 4-byte aligned span copied, and where the caller's bytes start
    /// inside it.
    span: u64,
    skip: usize,
    len: usize,
}

/// The backend's downloads in flight, by ticket, and idle staging buffers.
pub(crate) struct Readbacks {
    in_flight: DownloadsInFlight<Readback>,
    pool: StagingPool<wgpu::Buffer>,
}

impl Default for Readbacks {
    fn default() -> Self {
        Self {
            in_flight: DownloadsInFlight::default(),
            pool: StagingPool::new(wgpu::Buffer::size),
        }
    }
}

impl WgpuBackend {
    /// An idle MAP_READ staging buffer of at least `bytes`.
    fn readback_staging(&self, bytes: u64) -> Result<wgpu::Buffer> {
        {
            let mut r = lock(&self.readbacks);
            if let Some(staging) = r.pool.take(bytes) {
                return Ok(staging);
            }
        }
        self.create_map_read(bytes.next_multiple_of(1 << 16), "headkl readback staging")
    }

    /// [`Backend::download_begin`](headkl_core::Backend::download_begin).
    pub(crate) fn readback_begin(&self, src: &WgpuBuffer, offset: u64, len: usize) -> Result<PendingDownload> {
        self.check()?;
        check_transfer("download", offset, len as u64, src.len())?;
        let offset = offset + src.offset;
        let start = offset & !3;
        let span = (offset + len as u64).next_multiple_of(4) - start;
        if len == 0 || span > self.info.max_buffer_bytes {
            // Nothing to copy, or more than one staging buffer can hold:
            // the waiting download.
            let mut bytes = vec![0u8; len];
            self.download_bytes(src, offset - src.offset, &mut bytes)?;
            return Ok(PendingDownload::ready(bytes));
        }
        self.flush()?;
        let staging = self.readback_staging(span)?;
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("headkl readback"),
        });
        enc.copy_buffer_to_buffer(&src.raw, start, &staging, 0, span);
        let submission = self.queue.submit([enc.finish()]);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(wgpu_failure("download", e));
        }
        let (tx, mapped) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, 0..span, move |r| {
            let _ = tx.send(r);
        });
        let record = Readback {
            staging,
            submission,
            mapped,
            span,
            skip: (offset - start) as usize,
            len,
        };
        Ok(lock(&self.readbacks).in_flight.begin(record, len))
    }

    /// [`Backend::download_end`](headkl_core::Backend::download_end).
    pub(crate) fn readback_end(&self, pending: PendingDownload, out: &mut [u8]) -> Result<()> {
        let Some(rb) = lock(&self.readbacks).in_flight.end(pending, out, crate::BACKEND)? else {
            return Ok(());
        };
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(rb.submission.clone()),
                timeout: None,
            })
            .map_err(|e| self.lost_or(format!("waiting for a download: {e}")))?;
        self.await_map(&rb.mapped)?;
        {
            let view = rb
                .staging
                .get_mapped_range(0..rb.span)
                .map_err(|e| crate::driver_error(format!("reading a mapped buffer: {e}"), e))?;
            headkl_core::toolkit::host::parallel_copy(&view[rb.skip..rb.skip + rb.len], out);
        }
        rb.staging.unmap();
        // A buffer the full pool lets go is dropped (wgpu frees it).
        drop(lock(&self.readbacks).pool.give(rb.staging));
        self.check()
    }
}
