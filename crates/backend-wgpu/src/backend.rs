//! The [`Backend`] impl of [`WgpuBackend`]: allocation, and one dispatch:
//! each launch checked by core ([`Launch::check`]) and built from the
//! catalogue (`headkl_core::toolkit::kernels`).

use std::sync::atomic::Ordering;

use headkl_core::{Backend, DeviceInfo, Error, KernelTime, MemoryStats, Result};

use headkl_core::toolkit::{GemmKernel, HeadLayout, KernelId, Launch, PendingDownload};

use crate::buffer::{lock, WgpuBuffer};
use crate::device::{wgpu_failure, WgpuBackend};

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
            return Err(wgpu_failure(format_args!("allocating {bytes} bytes for {label}"), e));
        }
        Ok(WgpuBuffer::new(raw, bytes, self.shared.clone()))
    }

    fn upload(&self, dst: &WgpuBuffer, offset: u64, data: &[u8]) -> Result<()> {
        self.upload_bytes(dst, offset, data)
    }

    fn download(&self, src: &WgpuBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        self.download_bytes(src, offset, out)
    }

    fn download_begin(&self, src: &WgpuBuffer, offset: u64, len: usize) -> Result<PendingDownload> {
        self.readback_begin(src, offset, len)
    }

    fn download_end(&self, pending: PendingDownload, out: &mut [u8]) -> Result<()> {
        self.readback_end(pending, out)
    }

    fn dispatch(&self, launch: Launch<'_, WgpuBuffer>) -> Result<()> {
        let checked = launch.check(self.info.max_binding_bytes)?;
        let id = checked.id();
        let groups = launch.workgroups(self.kernels.gemm_kernel(id));
        self.record_dispatch(
            id,
            &checked.specialization(),
            groups,
            |gx| checked.bytes(gx),
            &launch.buffers(),
        )
    }

    fn gemm_tile(&self, layout: HeadLayout) -> Option<(u32, u32)> {
        match self.kernels.gemm_kernel(KernelId::gemm(layout)) {
            GemmKernel::Tiled => None,
            coop => Some(coop.tile()),
        }
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
