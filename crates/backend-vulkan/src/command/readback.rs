//! Downloads that do not wait: the copy into a host buffer of its own is
//! recorded in the stream's current batch, and read once that batch has
//! finished. Reading first submits whatever is recorded since, so the
//! device computes the next chunk while the host copies this one out.

use ash::vk;
use headkl_core::toolkit::checks::check_transfer;
use headkl_core::toolkit::host::StagingPool;
use headkl_core::toolkit::{DownloadsInFlight, PendingDownload};
use headkl_core::{DeviceBuffer, Result};

use super::{Dir, Stream};
use crate::conv::backend_error;
use crate::device::Device;
use crate::memory::{HostBuffer, VulkanBuffer};

/// A download in flight: its host buffer and the submission that fills it
/// (the kernels' queue's, or the download lane's).
struct Readback {
    host: HostBuffer,
    submission: u64,
    on_lane: bool,
    len: usize,
}

/// The stream's downloads in flight, by ticket, and idle host buffers.
pub(super) struct Readbacks {
    in_flight: DownloadsInFlight<Readback>,
    pool: StagingPool<HostBuffer>,
}

impl Default for Readbacks {
    fn default() -> Self {
        Self {
            in_flight: DownloadsInFlight::default(),
            pool: StagingPool::new(HostBuffer::size),
        }
    }
}

impl Readbacks {
    /// Frees every host buffer. The stream has waited for its work.
    pub(super) fn destroy(&mut self, device: &Device) {
        let pooled = self.pool.drain();
        let in_flight = self.in_flight.drain().map(|r| r.host);
        for host in pooled.chain(in_flight) {
            // SAFETY: the stream flushed before this (Stream's drop), so the
            // GPU is done with every host buffer; each was made on `device`.
            unsafe { host.destroy(device) };
        }
    }
}

impl Stream {
    /// [`Backend::download_begin`](headkl_core::Backend::download_begin):
    /// records the copy after all queued work and returns.
    pub(crate) fn download_begin(&mut self, src: &VulkanBuffer, offset: u64, len: usize) -> Result<PendingDownload> {
        check_transfer("download", offset, len as u64, src.len())?;
        if len == 0 {
            return Ok(PendingDownload::ready(Vec::new()));
        }
        let bytes = len as u64;
        let host = match self.readbacks.pool.take(bytes) {
            Some(host) => host,
            None => HostBuffer::new(
                &self.device,
                bytes.next_multiple_of(1 << 16),
                vk::BufferUsageFlags::TRANSFER_DST,
                true,
                "download buffer",
            )?,
        };
        let on_lane = match self.lane_takes(Dir::Down, src, bytes) {
            Ok(on_lane) => on_lane,
            Err(e) => {
                self.give_back(host);
                return Err(e);
            }
        };
        if on_lane {
            return match self.lane_download(src, offset, &host, bytes) {
                Ok(submission) => {
                    let record = Readback {
                        host,
                        submission,
                        on_lane: true,
                        len,
                    };
                    Ok(self.readbacks.in_flight.begin(record, len))
                }
                Err(e) => {
                    // Whatever was submitted is waited for before the host
                    // buffer can be reused or freed.
                    let _ = self.flush();
                    self.give_back(host);
                    Err(e)
                }
            };
        }
        if let Err(e) = self.begin().and_then(|()| self.compute_uses(&[src.handle()])) {
            self.give_back(host);
            return Err(e);
        }
        self.barrier();
        // SAFETY: the current slot's command buffer is recording; the
        // source range was checked above and the host buffer holds at least
        // `bytes`.
        unsafe {
            record_copy_to_host(
                &self.device.raw,
                self.cmd(),
                (src.handle(), src.offset() + offset),
                host.raw.buffer,
                bytes,
            )
        };
        self.readback_recorded = true;
        let record = Readback {
            host,
            // The batch being recorded goes out as the next submission.
            submission: self.submits + 1,
            on_lane: false,
            len,
        };
        Ok(self.readbacks.in_flight.begin(record, len))
    }

    /// [`Backend::download_end`](headkl_core::Backend::download_end): waits
    /// for the download's batch (submitting what is recorded first, so the
    /// device keeps working while the host copies) and reads it.
    pub(crate) fn download_end(&mut self, pending: PendingDownload, out: &mut [u8]) -> Result<()> {
        let Some(rb) = self.readbacks.in_flight.end(pending, out, crate::conv::BACKEND)? else {
            return Ok(());
        };
        let waited = if rb.on_lane {
            self.wait_for_lane(Dir::Down, rb.submission)
        } else {
            self.wait_for_submission(rb.submission)
        };
        if waited.is_ok() {
            rb.host.read(0, &mut out[..rb.len]);
        }
        // The buffer is idle after the wait, or the device is lost and runs
        // nothing.
        self.give_back(rb.host);
        waited
    }

    /// Makes submission `n` finished. What is recorded is submitted first
    /// (the ring holds it beside `n`), so the device works on it while the
    /// host waits for `n` and reads.
    fn wait_for_submission(&mut self, n: u64) -> Result<()> {
        self.submit()?;
        if self.completed < n {
            self.wait_through(n)?;
        }
        if self.completed >= n {
            Ok(())
        } else {
            Err(backend_error(format!(
                "download_end: submission {n} not finished after waiting ({} finished)",
                self.completed
            )))
        }
    }

    /// Keeps a host buffer the GPU is done with for reuse, freeing the one
    /// the full pool lets go.
    fn give_back(&mut self, host: HostBuffer) {
        if let Some(spare) = self.readbacks.pool.give(host) {
            // SAFETY: the caller waited for the submission that used it (or
            // the device is lost), or never submitted one; it was made on
            // this stream's device.
            unsafe { spare.destroy(&self.device) };
        }
    }
}

/// Records a copy of `bytes` from `src` (buffer, byte offset) into the
/// host-visible `host` at 0, then the barrier that makes it visible to the
/// host's reads once the submission's fence has signalled. Both the kernels'
/// queue and the download lane record it.
///
/// # Safety
/// `cmd` is recording on `device`; `src` holds `offset + bytes` bytes and
/// `host` at least `bytes`.
pub(super) unsafe fn record_copy_to_host(
    device: &ash::Device,
    cmd: vk::CommandBuffer,
    (src, offset): (vk::Buffer, u64),
    host: vk::Buffer,
    bytes: u64,
) {
    let region = [vk::BufferCopy {
        src_offset: offset,
        dst_offset: 0,
        size: bytes,
    }];
    let to_host = [vk::MemoryBarrier::default()
        .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
        .dst_access_mask(vk::AccessFlags::HOST_READ)];
    // SAFETY: the caller's contract: a recording command buffer and ranges
    // inside both buffers.
    unsafe {
        device.cmd_copy_buffer(cmd, src, host, &region);
        device.cmd_pipeline_barrier(
            cmd,
            vk::PipelineStageFlags::TRANSFER,
            vk::PipelineStageFlags::HOST,
            vk::DependencyFlags::empty(),
            &to_host,
            &[],
            &[],
        );
    }
}
