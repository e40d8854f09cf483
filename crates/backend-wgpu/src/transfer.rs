//! Transfers: uploads through the queue (flushed in pieces), downloads
//! through a reused MAP_READ staging buffer.

use std::sync::atomic::Ordering;
use std::sync::mpsc;

use headkl_core::toolkit::checks::check_transfer;
use headkl_core::{DeviceBuffer, Error, Result};

use crate::buffer::{lock, WgpuBuffer};
use crate::device::{wgpu_failure, WgpuBackend};

/// Largest staging buffer for downloads; bigger downloads go in pieces.
const MAX_STAGING: u64 = 64 << 20;
/// Uploads staged by `queue.write_buffer` past this many bytes are flushed
/// to the device, so a multi-GB head upload never stages it all at once.
const UPLOAD_FLUSH_BYTES: u64 = 256 << 20;

/// Where a transfer lands in the underlying buffer (a view of a caller's
/// buffer starts inside it): `offset`, and the 4-byte-aligned bytes
/// `[start, end)` around it.
struct Span {
    offset: u64,
    start: u64,
    end: u64,
}

impl WgpuBackend {
    /// A MAP_READ staging buffer of at least `bytes` (≤ [`MAX_STAGING`]),
    /// kept in `s` (the backend's, locked by the caller for its download).
    fn staging(&self, s: &mut Option<wgpu::Buffer>, bytes: u64) -> Result<wgpu::Buffer> {
        if let Some(b) = s.as_ref() {
            if b.size() >= bytes {
                return Ok(b.clone());
            }
        }
        let size = bytes.next_multiple_of(1 << 20).min(MAX_STAGING).max(bytes);
        let b = self.create_map_read(size, "headkl download staging")?;
        *s = Some(b.clone());
        Ok(b)
    }

    /// A new MAP_READ | COPY_DST buffer of `size` bytes, out of memory as a
    /// typed error (the download staging and the readback pool's buffers).
    pub(crate) fn create_map_read(&self, size: u64, label: &'static str) -> Result<wgpu::Buffer> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let b = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
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
        Ok(b)
    }

    /// Maps `buffer[..bytes]` for reading, waits, and hands the bytes to `read`.
    pub(crate) fn read_mapped(&self, buffer: &wgpu::Buffer, bytes: u64, read: impl FnOnce(&[u8])) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        buffer.map_async(wgpu::MapMode::Read, 0..bytes, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        self.await_map(&rx)?;
        {
            let view = buffer
                .get_mapped_range(0..bytes)
                .map_err(|e| crate::driver_error(format!("reading a mapped buffer: {e}"), e))?;
            read(&view);
        }
        buffer.unmap();
        Ok(())
    }

    /// Copies `src[offset..offset + out.len())` (4-byte aligned range) out.
    pub(crate) fn download_aligned(&self, src: &wgpu::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        let mut done = 0u64;
        let total = out.len() as u64;
        // One download at a time through the shared staging buffer: engines
        // on several threads (vocabulary shards, their status words) share
        // a backend, and a copy into the buffer while another thread has it
        // mapped is a validation error.
        let mut kept = lock(&self.staging);
        while done < total {
            let piece = (total - done).min(MAX_STAGING);
            let staging = self.staging(&mut kept, piece)?;
            let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("headkl download"),
            });
            enc.copy_buffer_to_buffer(src, offset + done, &staging, 0, piece);
            self.queue.submit([enc.finish()]);
            if let Some(e) = pollster::block_on(scope.pop()) {
                return Err(wgpu_failure("download", e));
            }
            let dst = &mut out[done as usize..(done + piece) as usize];
            self.read_mapped(&staging, piece, |bytes| {
                headkl_core::toolkit::host::parallel_copy(&bytes[..dst.len()], dst)
            })?;
            done += piece;
        }
        Ok(())
    }

    /// Checks a transfer of `len` bytes at `offset` into `buffer` and submits
    /// what is queued, so the transfer is ordered after it: its [`Span`], or
    /// `None` for an empty transfer.
    fn begin_transfer(&self, what: &'static str, buffer: &WgpuBuffer, offset: u64, len: u64) -> Result<Option<Span>> {
        self.check()?;
        check_transfer(what, offset, len, buffer.len())?;
        if len == 0 {
            return Ok(None);
        }
        let offset = offset + buffer.offset;
        self.flush()?;
        Ok(Some(Span {
            offset,
            start: offset & !3,
            end: (offset + len).next_multiple_of(4),
        }))
    }

    /// [`Backend::upload`](headkl_core::Backend::upload).
    pub(crate) fn upload_bytes(&self, dst: &WgpuBuffer, offset: u64, data: &[u8]) -> Result<()> {
        let len = data.len() as u64;
        // write_buffer lands before the next submit: the flush in
        // begin_transfer orders the upload after what is queued.
        let Some(Span { offset, start, end }) = self.begin_transfer("upload", dst, offset, len)? else {
            return Ok(());
        };
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
            return Err(wgpu_failure("upload", e));
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

    /// [`Backend::download`](headkl_core::Backend::download).
    pub(crate) fn download_bytes(&self, src: &WgpuBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        let len = out.len() as u64;
        let Some(Span { offset, start, end }) = self.begin_transfer("download", src, offset, len)? else {
            return Ok(());
        };
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
}
