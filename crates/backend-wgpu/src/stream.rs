//! The stream of dispatches: recorded into one encoder per batch, their
//! uniform blocks in a ring, submitted on flush, with per-dispatch
//! timestamps when profiling.

use std::sync::atomic::Ordering;

use headkl_core::Result;

use headkl_core::toolkit::{fold_workgroups, KernelId};

use crate::buffer::{lock, WgpuBuffer};
use crate::device::{wgpu_failure, WgpuBackend};

/// Dispatches per submitted batch (slots of the uniform ring).
pub(crate) const RING_SLOTS: u32 = 1024;

/// Dispatches recorded but not yet submitted.
#[derive(Default)]
pub(crate) struct Batch {
    encoder: Option<wgpu::CommandEncoder>,
    /// The uniform blocks of this batch's dispatches, one ring slot each.
    params: Vec<u8>,
    slots: u32,
    /// Timestamp queries (two per slot) when profiling.
    queries: Option<wgpu::QuerySet>,
    labels: Vec<&'static str>,
}

/// Timestamps of a submitted batch, waiting to be read.
pub(crate) struct PendingTimes {
    pub(crate) readback: wgpu::Buffer,
    pub(crate) labels: Vec<&'static str>,
}

impl WgpuBackend {
    /// Submits the batch (its uniform blocks first).
    pub(crate) fn flush_locked(&self, b: &mut Batch) -> Result<()> {
        let Some(mut encoder) = b.encoder.take() else {
            return Ok(());
        };
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut pending = None;
        if let Some(qs) = b.queries.take() {
            let n = u64::from(b.slots) * 2;
            let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("headkl timestamps"),
                size: n * 8,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let readback = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("headkl timestamps readback"),
                size: n * 8,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            encoder.resolve_query_set(&qs, 0..n as u32, &resolve, 0);
            encoder.copy_buffer_to_buffer(&resolve, 0, &readback, 0, n * 8);
            pending = Some(PendingTimes {
                readback,
                labels: std::mem::take(&mut b.labels),
            });
        }
        let used = (u64::from(b.slots) * self.slot_stride) as usize;
        self.queue.write_buffer(&self.ring, 0, &b.params[..used]);
        self.queue.submit([encoder.finish()]);
        b.slots = 0;
        b.labels.clear();
        self.staged_upload_bytes.store(0, Ordering::Relaxed);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(wgpu_failure("submitting work", e));
        }
        if let Some(p) = pending {
            lock(&self.times).push(p);
        }
        Ok(())
    }

    pub(crate) fn flush(&self) -> Result<()> {
        let mut b = lock(&self.batch);
        self.flush_locked(&mut b)
    }

    /// Records one dispatch of `kernel` over `count` workgroups (folded),
    /// with the uniform block `params(grid_x)` and storage `buffers` at
    /// bindings 1.., timed under the kernel's name; `specialization` adds
    /// override values to its build (`Checked::specialization`).
    pub(crate) fn record_dispatch(
        &self,
        kernel: KernelId,
        specialization: &[(&'static str, u32)],
        count: u64,
        params: impl FnOnce(u32) -> Vec<u8>,
        buffers: &[&WgpuBuffer],
    ) -> Result<()> {
        let label = kernel.name();
        self.check()?;
        if count == 0 {
            return Ok(());
        }
        let pipeline = self.kernels.pipeline(&self.device, kernel, specialization)?;
        let mut ids = [0u64; 8];
        for (slot, b) in ids.iter_mut().zip(buffers) {
            *slot = b.id;
        }
        let bind_group = self.bind_group(kernel, ids, buffers)?;
        let (gx, gy) = fold_workgroups(count);
        let block = params(gx);

        let mut b = lock(&self.batch);
        if b.slots == RING_SLOTS {
            self.flush_locked(&mut b)?;
        }
        let slot = b.slots;
        b.slots += 1;
        let at = (u64::from(slot) * self.slot_stride) as usize;
        if b.params.len() < at + self.slot_stride as usize {
            b.params.resize(at + self.slot_stride as usize, 0);
        }
        b.params[at..at + block.len()].copy_from_slice(&block);

        let profile = self.timestamps && self.profiling.load(Ordering::Relaxed);
        if profile && b.queries.is_none() {
            b.queries = Some(self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("headkl timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: RING_SLOTS * 2,
            }));
        }
        let Batch { encoder, queries, .. } = &mut *b;
        let encoder = encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("headkl") })
        });
        let timestamp_writes = match (profile, queries.as_ref()) {
            (true, Some(qs)) => Some(wgpu::ComputePassTimestampWrites {
                query_set: qs,
                beginning_of_pass_write_index: Some(slot * 2),
                end_of_pass_write_index: Some(slot * 2 + 1),
            }),
            _ => None,
        };
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(label),
                timestamp_writes,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind_group, &[at as u32]);
            pass.dispatch_workgroups(gx, gy, 1);
        }
        if profile {
            b.labels.push(label);
        } else if b.queries.is_some() {
            // Profiling was turned off mid-batch: keep slots and labels aligned.
            b.labels.push("");
        }
        Ok(())
    }

    pub(crate) fn bind_group(
        &self,
        kernel: KernelId,
        ids: [u64; 8],
        buffers: &[&WgpuBuffer],
    ) -> Result<wgpu::BindGroup> {
        let layout = self.kernels.bind_group_layout(kernel)?;
        let mut failed = None;
        let group = self.shared.bind_group((kernel, ids), || {
            let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.ring,
                    offset: 0,
                    size: wgpu::BufferSize::new(kernel.params_bytes()),
                }),
            }];
            for (i, b) in buffers.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: b.binding(),
                });
            }
            let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("headkl"),
                layout,
                entries: &entries,
            });
            failed = pollster::block_on(scope.pop());
            group
        });
        if let Some(e) = failed {
            self.shared.drop_bind_group((kernel, ids));
            return Err(wgpu_failure("binding buffers", e));
        }
        Ok(group)
    }
}
