//! The command stream: one command buffer recorded until something must be
//! waited for (a download, `finish`, a full staging or uniform ring), then
//! submitted and waited on with a fence. Transfers go through a reusable
//! host-visible staging buffer, uniform blocks through a host-visible ring,
//! descriptor sets through a pool reset after each wait, and kernel times
//! through timestamp queries.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ash::vk;
use headkl_core::checks::check_transfer;
use headkl_core::{DeviceBuffer, KernelTime, Result};

use crate::conv::{backend_error, vk_error};
use crate::device::Device;
use crate::memory::{HostBuffer, VulkanBuffer};
use crate::pipeline::Pipeline;

mod readback;

/// Staging buffer size: transfers larger than this go in pieces.
pub(crate) const STAGING_BYTES: u64 = 64 << 20;
/// Uniform blocks (and descriptor sets) per submission.
const UNIFORM_SLOTS: u64 = 1024;
/// Largest uniform block a kernel takes.
const MAX_UNIFORM_BYTES: u64 = 256;
/// Storage descriptors reserved per set in the pool.
const STORAGE_PER_SET: u32 = 8;
/// Dispatches timed per submission.
const TIMED_DISPATCHES: u32 = 1024;

/// Timestamp queries around each dispatch.
struct Timer {
    pool: vk::QueryPool,
    /// Queries written in the current command buffer (two per dispatch).
    used: u32,
    labels: Vec<&'static str>,
    period_ns: f64,
    mask: u64,
}

/// Records commands and submits them to the device's queue.
pub(crate) struct Stream {
    device: Arc<Device>,
    pool: vk::CommandPool,
    cmd: vk::CommandBuffer,
    fence: vk::Fence,
    recording: bool,
    /// A submission not yet waited for (`submit`): the command buffer, ring,
    /// staging and descriptor pool are reused only after its fence.
    in_flight: bool,
    staging: Option<HostBuffer>,
    staging_used: u64,
    uniforms: Option<HostBuffer>,
    uniform_used: u64,
    uniform_stride: u64,
    descriptor_pool: vk::DescriptorPool,
    sets_used: u64,
    timer: Option<Timer>,
    kernel_times: Vec<KernelTime>,
    /// Submissions made, and how many of them are known to have finished
    /// (a readback recorded in submission `n` is ready once `completed ≥ n`).
    submits: u64,
    completed: u64,
    readbacks: readback::Readbacks,
}

/// A buffer binding: the handle and its size.
pub(crate) struct Binding {
    pub(crate) buffer: vk::Buffer,
    /// Where the bound range starts (a view of a caller's buffer).
    pub(crate) offset: u64,
    pub(crate) size: u64,
}

impl From<&VulkanBuffer> for Binding {
    fn from(b: &VulkanBuffer) -> Self {
        Self {
            buffer: b.handle(),
            offset: b.offset(),
            size: b.len(),
        }
    }
}

impl Stream {
    /// A stream on `device`'s compute queue with a staging buffer of
    /// `staging_bytes`.
    pub(crate) fn new(device: Arc<Device>, staging_bytes: u64) -> Result<Self> {
        let mut stream = Self {
            device: Arc::clone(&device),
            pool: vk::CommandPool::null(),
            cmd: vk::CommandBuffer::null(),
            fence: vk::Fence::null(),
            recording: false,
            in_flight: false,
            staging: None,
            staging_used: 0,
            uniforms: None,
            uniform_used: 0,
            uniform_stride: device.caps.min_uniform_offset_alignment.max(MAX_UNIFORM_BYTES),
            descriptor_pool: vk::DescriptorPool::null(),
            sets_used: 0,
            timer: None,
            kernel_times: Vec::new(),
            submits: 0,
            completed: 0,
            readbacks: readback::Readbacks::default(),
        };
        // On error, `Drop` destroys whatever was created so far.
        stream.create_objects(staging_bytes)?;
        Ok(stream)
    }

    fn create_objects(&mut self, staging_bytes: u64) -> Result<()> {
        let dev = &self.device.raw;
        let info = vk::CommandPoolCreateInfo::default()
            .queue_family_index(self.device.family)
            .flags(vk::CommandPoolCreateFlags::TRANSIENT);
        // SAFETY: valid device and family index.
        self.pool = unsafe { dev.create_command_pool(&info, None) }.map_err(|e| vk_error(e, "vkCreateCommandPool"))?;
        let info = vk::CommandBufferAllocateInfo::default()
            .command_pool(self.pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        // SAFETY: valid pool.
        let buffers =
            unsafe { dev.allocate_command_buffers(&info) }.map_err(|e| vk_error(e, "vkAllocateCommandBuffers"))?;
        self.cmd = buffers
            .first()
            .copied()
            .ok_or_else(|| backend_error("vkAllocateCommandBuffers returned no buffer"))?;
        // SAFETY: valid device.
        self.fence = unsafe { dev.create_fence(&vk::FenceCreateInfo::default(), None) }
            .map_err(|e| vk_error(e, "vkCreateFence"))?;
        self.staging = Some(HostBuffer::new(
            &self.device,
            staging_bytes,
            vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST,
            true,
            "staging buffer",
        )?);
        self.uniforms = Some(HostBuffer::new(
            &self.device,
            UNIFORM_SLOTS * self.uniform_stride,
            vk::BufferUsageFlags::UNIFORM_BUFFER,
            false,
            "uniform ring",
        )?);
        let sizes = [
            vk::DescriptorPoolSize {
                ty: vk::DescriptorType::UNIFORM_BUFFER,
                descriptor_count: UNIFORM_SLOTS as u32,
            },
            vk::DescriptorPoolSize {
                ty: vk::DescriptorType::STORAGE_BUFFER,
                descriptor_count: UNIFORM_SLOTS as u32 * STORAGE_PER_SET,
            },
        ];
        let info = vk::DescriptorPoolCreateInfo::default()
            .max_sets(UNIFORM_SLOTS as u32)
            .pool_sizes(&sizes);
        // SAFETY: valid device and create info.
        self.descriptor_pool =
            unsafe { dev.create_descriptor_pool(&info, None) }.map_err(|e| vk_error(e, "vkCreateDescriptorPool"))?;
        Ok(())
    }

    /// Whether the queue can write timestamps.
    pub(crate) fn can_time(&self) -> bool {
        self.device.caps.timestamp_valid_bits > 0
    }

    /// Turns timing on (creating the query pool) or off. Waits for queued
    /// work first so a command buffer never mixes timed and untimed halves.
    pub(crate) fn set_profiling(&mut self, on: bool) -> Result<bool> {
        self.flush()?;
        if !on {
            self.destroy_timer();
            return Ok(self.can_time());
        }
        if !self.can_time() {
            return Ok(false);
        }
        if self.timer.is_none() {
            let info = vk::QueryPoolCreateInfo::default()
                .query_type(vk::QueryType::TIMESTAMP)
                .query_count(2 * TIMED_DISPATCHES);
            // SAFETY: valid device and create info.
            let pool = unsafe { self.device.raw.create_query_pool(&info, None) }
                .map_err(|e| vk_error(e, "vkCreateQueryPool"))?;
            let bits = self.device.caps.timestamp_valid_bits;
            self.timer = Some(Timer {
                pool,
                used: 0,
                labels: Vec::new(),
                period_ns: f64::from(self.device.caps.timestamp_period_ns),
                mask: if bits >= 64 { u64::MAX } else { (1u64 << bits) - 1 },
            });
        }
        Ok(true)
    }

    /// Takes the kernel times of the waited-for work.
    pub(crate) fn take_kernel_times(&mut self) -> Vec<KernelTime> {
        std::mem::take(&mut self.kernel_times)
    }

    fn destroy_timer(&mut self) {
        if let Some(t) = self.timer.take() {
            // SAFETY: called after a wait; no command buffer uses the pool.
            unsafe { self.device.raw.destroy_query_pool(t.pool, None) };
        }
    }

    /// Starts the command buffer if it is not recording.
    fn begin(&mut self) -> Result<()> {
        if self.recording {
            return Ok(());
        }
        self.wait_in_flight()?;
        let dev = &self.device.raw;
        let info = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: the buffer is not recording or pending (its pool was reset
        // after the last wait).
        unsafe { dev.begin_command_buffer(self.cmd, &info) }.map_err(|e| vk_error(e, "vkBeginCommandBuffer"))?;
        if let Some(t) = &mut self.timer {
            // SAFETY: recording command buffer; the range is inside the pool.
            unsafe { dev.cmd_reset_query_pool(self.cmd, t.pool, 0, 2 * TIMED_DISPATCHES) };
            t.used = 0;
        }
        self.device.work_pending.store(true, Ordering::SeqCst);
        self.recording = true;
        Ok(())
    }

    /// Orders the next command after everything recorded or submitted
    /// before it: shader and transfer writes become visible to shader and
    /// transfer reads and writes.
    fn barrier(&self) {
        let stages = vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER;
        let barrier = [vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(
                vk::AccessFlags::SHADER_READ
                    | vk::AccessFlags::SHADER_WRITE
                    | vk::AccessFlags::TRANSFER_READ
                    | vk::AccessFlags::TRANSFER_WRITE,
            )];
        // SAFETY: recording command buffer; a global memory barrier.
        unsafe {
            self.device.raw.cmd_pipeline_barrier(
                self.cmd,
                stages,
                stages,
                vk::DependencyFlags::empty(),
                &barrier,
                &[],
                &[],
            )
        };
    }

    /// Submits the recorded work and waits for it; then resets the command
    /// buffer, staging, uniform ring, descriptor pool and queries, and
    /// frees buffers dropped meanwhile.
    pub(crate) fn flush(&mut self) -> Result<()> {
        if !self.recording {
            return self.wait_in_flight();
        }
        let result = self.submit_and_wait();
        let reset = self.reset_after_wait();
        result.and(reset)
    }

    /// Submits the recorded work without waiting for it; the next
    /// recording, transfer or flush waits for it first.
    pub(crate) fn submit(&mut self) -> Result<()> {
        if !self.recording {
            return Ok(());
        }
        if let Err(e) = self.submit_only() {
            // Nothing was submitted: reset as after a wait.
            let _ = self.reset_after_wait();
            return Err(e);
        }
        self.recording = false;
        self.in_flight = true;
        Ok(())
    }

    /// Waits for the work [`Stream::submit`] left in flight, and resets.
    fn wait_in_flight(&mut self) -> Result<()> {
        if !self.in_flight {
            return Ok(());
        }
        self.in_flight = false;
        let result = self.wait_submitted();
        let reset = self.reset_after_wait();
        result.and(reset)
    }

    fn submit_and_wait(&mut self) -> Result<()> {
        self.submit_only()?;
        self.wait_submitted()
    }

    fn submit_only(&mut self) -> Result<()> {
        let dev = &self.device.raw;
        // SAFETY: the buffer is recording.
        unsafe { dev.end_command_buffer(self.cmd) }.map_err(|e| vk_error(e, "vkEndCommandBuffer"))?;
        let cmds = [self.cmd];
        let submit = [vk::SubmitInfo::default().command_buffers(&cmds)];
        // SAFETY: executable command buffer; the queue is used only by this
        // stream, under the backend's lock; the fence is unsignaled.
        unsafe { dev.queue_submit(self.device.queue, &submit, self.fence) }
            .map_err(|e| vk_error(e, "vkQueueSubmit"))?;
        self.submits += 1;
        Ok(())
    }

    fn wait_submitted(&mut self) -> Result<()> {
        let dev = &self.device.raw;
        // SAFETY: the fence was submitted with the command buffer.
        unsafe { dev.wait_for_fences(&[self.fence], true, u64::MAX) }.map_err(|e| vk_error(e, "vkWaitForFences"))?;
        self.completed = self.submits;
        if let Some(t) = &mut self.timer {
            if t.used > 0 {
                let mut data = vec![0u64; t.used as usize];
                // SAFETY: queries [0, used) were reset and written in the
                // command buffer that just completed.
                unsafe { dev.get_query_pool_results(t.pool, 0, &mut data, vk::QueryResultFlags::TYPE_64) }
                    .map_err(|e| vk_error(e, "vkGetQueryPoolResults"))?;
                for (pair, label) in data.chunks_exact(2).zip(&t.labels) {
                    let ticks = pair[1].wrapping_sub(pair[0]) & t.mask;
                    self.kernel_times.push(KernelTime {
                        kernel: label,
                        ms: ticks as f64 * t.period_ns / 1e6,
                    });
                }
            }
        }
        Ok(())
    }

    fn reset_after_wait(&mut self) -> Result<()> {
        let dev = &self.device.raw;
        self.recording = false;
        self.staging_used = 0;
        self.uniform_used = 0;
        self.sets_used = 0;
        if let Some(t) = &mut self.timer {
            t.used = 0;
            t.labels.clear();
        }
        // SAFETY: the fence wait returned (or the device is lost and runs
        // nothing): no command buffer or descriptor set is in use.
        let result = unsafe {
            dev.reset_fences(&[self.fence])
                .and_then(|()| dev.reset_command_pool(self.pool, vk::CommandPoolResetFlags::empty()))
                .and_then(|()| dev.reset_descriptor_pool(self.descriptor_pool, vk::DescriptorPoolResetFlags::empty()))
        };
        self.device.work_pending.store(false, Ordering::SeqCst);
        self.device.collect_garbage();
        result.map_err(|e| vk_error(e, "resetting the command stream"))
    }

    /// Records a copy of `data` into `dst` at `offset`, after all queued
    /// work; flushes when the staging buffer is full.
    pub(crate) fn upload(&mut self, dst: &VulkanBuffer, offset: u64, data: &[u8]) -> Result<()> {
        check_transfer("upload", offset, data.len() as u64, dst.len())?;
        let mut done = 0usize;
        while done < data.len() {
            let capacity = self.staging.as_ref().map_or(0, HostBuffer::size);
            let room = capacity - self.staging_used;
            if room == 0 {
                self.flush()?;
                continue;
            }
            let piece = (data.len() - done).min(room as usize);
            self.begin()?;
            let at = self.staging_used;
            let Some(staging) = self.staging.as_mut() else {
                return Err(backend_error("staging buffer missing"));
            };
            staging.write(at, &data[done..done + piece]);
            let src = staging.raw.buffer;
            self.barrier();
            let region = [vk::BufferCopy {
                src_offset: at,
                dst_offset: dst.offset() + offset + done as u64,
                size: piece as u64,
            }];
            // SAFETY: recording command buffer; both ranges are inside their
            // buffers (checked above and by `room`).
            unsafe { self.device.raw.cmd_copy_buffer(self.cmd, src, dst.handle(), &region) };
            // Keep later pieces 16-byte aligned in the staging buffer.
            self.staging_used = (at + piece as u64).div_ceil(16) * 16;
            self.staging_used = self.staging_used.min(capacity);
            done += piece;
        }
        Ok(())
    }

    /// Copies `out.len()` bytes of `src` at `offset` into `out` after all
    /// queued work, in staging-sized pieces, each submitted and waited for.
    pub(crate) fn download(&mut self, src: &VulkanBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        check_transfer("download", offset, out.len() as u64, src.len())?;
        if out.is_empty() {
            return self.flush();
        }
        let capacity = self.staging.as_ref().map_or(0, HostBuffer::size) as usize;
        let mut done = 0usize;
        while done < out.len() {
            let piece = (out.len() - done).min(capacity);
            self.begin()?;
            let Some(staging) = self.staging.as_ref() else {
                return Err(backend_error("staging buffer missing"));
            };
            let dst = staging.raw.buffer;
            // The barrier also orders this copy after pending uploads that
            // read the same staging range.
            self.barrier();
            let region = [vk::BufferCopy {
                src_offset: src.offset() + offset + done as u64,
                dst_offset: 0,
                size: piece as u64,
            }];
            let to_host = [vk::MemoryBarrier::default()
                .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                .dst_access_mask(vk::AccessFlags::HOST_READ)];
            // SAFETY: recording command buffer; both ranges are inside their
            // buffers (checked above; `piece` ≤ staging size).
            unsafe {
                self.device.raw.cmd_copy_buffer(self.cmd, src.handle(), dst, &region);
                self.device.raw.cmd_pipeline_barrier(
                    self.cmd,
                    vk::PipelineStageFlags::TRANSFER,
                    vk::PipelineStageFlags::HOST,
                    vk::DependencyFlags::empty(),
                    &to_host,
                    &[],
                    &[],
                );
            }
            self.flush()?;
            let Some(staging) = self.staging.as_ref() else {
                return Err(backend_error("staging buffer missing"));
            };
            staging.read(0, &mut out[done..done + piece]);
            done += piece;
        }
        Ok(())
    }

    /// Records one dispatch of `pipeline` with `params` at binding 0 and
    /// `buffers` at bindings 1.., on a `(x, y, 1)` grid; `label` names it in
    /// the kernel times.
    pub(crate) fn dispatch(
        &mut self,
        pipeline: &Pipeline,
        params: &[u8],
        buffers: &[Binding],
        grid: (u32, u32),
        label: &'static str,
    ) -> Result<()> {
        if buffers.len() as u32 != pipeline.storage_bindings {
            return Err(backend_error(format!(
                "{label}: {} buffers for a pipeline with {} storage bindings",
                buffers.len(),
                pipeline.storage_bindings
            )));
        }
        if params.len() as u64 > MAX_UNIFORM_BYTES {
            return Err(backend_error(format!(
                "{label}: uniform block of {} bytes",
                params.len()
            )));
        }
        let limits = self.device.caps.max_workgroup_count;
        if grid.0 == 0 || grid.1 == 0 || grid.0 > limits[0] || grid.1 > limits[1] {
            return Err(backend_error(format!(
                "{label}: dispatch grid {grid:?} outside the device's limits {limits:?}"
            )));
        }
        let full_uniforms = self.uniform_used + self.uniform_stride > UNIFORM_SLOTS * self.uniform_stride;
        let full_sets = self.sets_used >= UNIFORM_SLOTS;
        let full_queries = self.timer.as_ref().is_some_and(|t| t.used + 2 > 2 * TIMED_DISPATCHES);
        if full_uniforms || full_sets || full_queries {
            self.flush()?;
        }
        self.begin()?;

        let at = self.uniform_used;
        let Some(uniforms) = self.uniforms.as_mut() else {
            return Err(backend_error("uniform ring missing"));
        };
        uniforms.write(at, params);
        let uniform_buffer = uniforms.raw.buffer;
        self.uniform_used += self.uniform_stride;

        let dev = &self.device.raw;
        let set_layouts = [pipeline.set_layout];
        let info = vk::DescriptorSetAllocateInfo::default()
            .descriptor_pool(self.descriptor_pool)
            .set_layouts(&set_layouts);
        // SAFETY: valid pool and layout; the pool is reset only after a wait.
        let set = unsafe { dev.allocate_descriptor_sets(&info) }
            .map_err(|e| vk_error(e, "vkAllocateDescriptorSets"))?
            .first()
            .copied()
            .ok_or_else(|| backend_error("vkAllocateDescriptorSets returned no set"))?;
        self.sets_used += 1;

        let max_range = self.device.caps.max_storage_buffer_range / 16 * 16;
        let uniform_info = [vk::DescriptorBufferInfo {
            buffer: uniform_buffer,
            offset: at,
            range: (params.len() as u64).div_ceil(16) * 16,
        }];
        let storage_infos: Vec<[vk::DescriptorBufferInfo; 1]> = buffers
            .iter()
            .map(|b| {
                [vk::DescriptorBufferInfo {
                    buffer: b.buffer,
                    offset: b.offset,
                    range: b.size.min(max_range),
                }]
            })
            .collect();
        let mut writes = vec![vk::WriteDescriptorSet::default()
            .dst_set(set)
            .dst_binding(0)
            .descriptor_type(vk::DescriptorType::UNIFORM_BUFFER)
            .buffer_info(&uniform_info)];
        for (i, info) in storage_infos.iter().enumerate() {
            writes.push(
                vk::WriteDescriptorSet::default()
                    .dst_set(set)
                    .dst_binding(i as u32 + 1)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(info),
            );
        }
        // SAFETY: the set is fresh (not in use); every buffer is alive and
        // the ranges are inside it.
        unsafe { dev.update_descriptor_sets(&writes, &[]) };

        self.barrier();
        let timer = self.timer.as_mut().map(|t| {
            let first = t.used;
            t.used += 2;
            t.labels.push(label);
            (t.pool, first)
        });
        // SAFETY: recording command buffer; pipeline, layout and set match;
        // query indices are inside the pool and were reset at begin.
        unsafe {
            if let Some((pool, first)) = timer {
                dev.cmd_write_timestamp(self.cmd, vk::PipelineStageFlags::COMPUTE_SHADER, pool, first);
            }
            dev.cmd_bind_pipeline(self.cmd, vk::PipelineBindPoint::COMPUTE, pipeline.raw);
            dev.cmd_bind_descriptor_sets(
                self.cmd,
                vk::PipelineBindPoint::COMPUTE,
                pipeline.layout,
                0,
                &[set],
                &[],
            );
            dev.cmd_dispatch(self.cmd, grid.0, grid.1, 1);
            if let Some((pool, first)) = timer {
                dev.cmd_write_timestamp(self.cmd, vk::PipelineStageFlags::COMPUTE_SHADER, pool, first + 1);
            }
        }
        Ok(())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Finish (or abandon, if the device is lost) what was recorded.
        let _ = self.flush();
        self.destroy_timer();
        self.readbacks.destroy(&self.device);
        let dev = &self.device.raw;
        // SAFETY: nothing is pending after the flush; each object is
        // destroyed once (null handles are ignored by Vulkan).
        unsafe {
            if let Some(s) = self.staging.take() {
                s.destroy(&self.device);
            }
            if let Some(u) = self.uniforms.take() {
                u.destroy(&self.device);
            }
            dev.destroy_descriptor_pool(self.descriptor_pool, None);
            dev.destroy_fence(self.fence, None);
            dev.destroy_command_pool(self.pool, None);
        }
    }
}
