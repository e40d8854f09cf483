//! Copy lanes: large uploads and downloads recorded in command buffers of
//! their own and submitted to a transfer queue (a copy engine), so they
//! run while the kernels do instead of in line with them.
//!
//! Two lanes, uploads and downloads, each a ring of [`SLOTS`] command
//! buffers with fences and a timeline semaphore signalled with its
//! submission number; the kernels' submissions signal one of their own.
//! Waits are per submission and cover only what they must:
//! - an upload goes on the lane only into a buffer no unfinished
//!   submission of the kernels uses (else it stays in line), so uploads
//!   never wait for kernels;
//! - a download waits for the kernels' submission that last used its
//!   source (submitted first if it is still being recorded);
//! - a kernels' submission waits for the copies that last touched a buffer
//!   it binds (a recording that already holds a dispatch is submitted
//!   first, so earlier kernels do not wait with it).
//!
//! Uploads and downloads get a queue each where the family has two, as a
//! queue runs its submissions in order: an upload behind a download that
//! waits for kernels would wait too. Within the upload lane a barrier
//! orders a copy after an earlier one into the same buffer.

use std::collections::HashSet;

use ash::vk;
use headkl_core::Result;

use super::{Stream, SLOTS};
use crate::conv::{backend_error, vk_error};
use crate::device::Device;
use crate::memory::{HostBuffer, VulkanBuffer};

/// Copies smaller than this stay in line with the kernels: they gain
/// nothing from a queue of their own and would cost a submission each.
/// With the lanes on the kernels' own queue (`CopyQueue::Compute`, the
/// tests' way to reach this path on a device without a copy queue) every
/// copy that may goes on a lane.
const LANE_MIN_BYTES: u64 = 1 << 20;

/// Which lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dir {
    /// Host to device, through the lane's staging.
    Up,
    /// Device to a host buffer.
    Down,
}

/// The submissions that last used a buffer, per queue (0: none).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Use {
    pub(super) compute: u64,
    pub(super) up: u64,
    pub(super) down: u64,
}

/// One command buffer of a lane, with its fence and staging.
struct LaneSlot {
    pool: vk::CommandPool,
    cmd: vk::CommandBuffer,
    fence: vk::Fence,
    staging: Option<HostBuffer>,
    staging_used: u64,
    /// The submission (numbered from 1 per lane) it holds in flight.
    submission: Option<u64>,
    /// Its number in the stream's count of recordings (buffer lifetimes).
    epoch: Option<u64>,
    /// The kernels' submission it waits for: done once it is.
    wait_compute: u64,
}

impl LaneSlot {
    fn capacity(&self) -> u64 {
        self.staging.as_ref().map_or(0, HostBuffer::size)
    }
}

/// One lane: a queue, its ring and its timeline semaphore.
pub(super) struct Lane {
    queue: vk::Queue,
    semaphore: vk::Semaphore,
    slots: Vec<LaneSlot>,
    current: usize,
    recording: bool,
    /// The kernels' submission the recording waits for (0: none).
    wait_compute: u64,
    pub(super) submits: u64,
    pub(super) completed: u64,
    /// Buffers written by a copy since the lane's last barrier.
    written: HashSet<vk::Buffer>,
}

/// The stream's two lanes and the kernels' timeline semaphore.
pub(super) struct Lanes {
    pub(super) up: Lane,
    pub(super) down: Lane,
    /// Signalled by each kernels' submission with its number.
    pub(super) compute: vk::Semaphore,
    /// The smallest copy that goes on a lane.
    min_bytes: u64,
}

fn timeline_semaphore(device: &Device) -> Result<vk::Semaphore> {
    let mut kind = vk::SemaphoreTypeCreateInfo::default()
        .semaphore_type(vk::SemaphoreType::TIMELINE)
        .initial_value(0);
    let info = vk::SemaphoreCreateInfo::default().push_next(&mut kind);
    // SAFETY: valid device with timelineSemaphore enabled (it has copy
    // queues only then).
    unsafe { device.raw.create_semaphore(&info, None) }.map_err(|e| vk_error(e, "vkCreateSemaphore"))
}

impl Lane {
    fn empty(queue: vk::Queue) -> Self {
        Self {
            queue,
            semaphore: vk::Semaphore::null(),
            slots: Vec::new(),
            current: 0,
            recording: false,
            wait_compute: 0,
            submits: 0,
            completed: 0,
            written: HashSet::new(),
        }
    }

    /// Creates the semaphore and the slots (with `staging_bytes` of staging
    /// each, or none); on error what was made stays for [`Lane::destroy`].
    fn create(&mut self, device: &Device, family: u32, staging_bytes: Option<u64>) -> Result<()> {
        self.semaphore = timeline_semaphore(device)?;
        let dev = &device.raw;
        for _ in 0..SLOTS {
            let info = vk::CommandPoolCreateInfo::default()
                .queue_family_index(family)
                .flags(vk::CommandPoolCreateFlags::TRANSIENT);
            // SAFETY: valid device and family index.
            let pool =
                unsafe { dev.create_command_pool(&info, None) }.map_err(|e| vk_error(e, "vkCreateCommandPool"))?;
            self.slots.push(LaneSlot {
                pool,
                cmd: vk::CommandBuffer::null(),
                fence: vk::Fence::null(),
                staging: None,
                staging_used: 0,
                submission: None,
                epoch: None,
                wait_compute: 0,
            });
            let slot = self
                .slots
                .last_mut()
                .ok_or_else(|| backend_error("lane slot missing"))?;
            let info = vk::CommandBufferAllocateInfo::default()
                .command_pool(pool)
                .level(vk::CommandBufferLevel::PRIMARY)
                .command_buffer_count(1);
            // SAFETY: valid pool.
            slot.cmd = unsafe { dev.allocate_command_buffers(&info) }
                .map_err(|e| vk_error(e, "vkAllocateCommandBuffers"))?
                .first()
                .copied()
                .ok_or_else(|| backend_error("vkAllocateCommandBuffers returned no buffer"))?;
            // SAFETY: valid device.
            slot.fence = unsafe { dev.create_fence(&vk::FenceCreateInfo::default(), None) }
                .map_err(|e| vk_error(e, "vkCreateFence"))?;
            if let Some(bytes) = staging_bytes {
                slot.staging = Some(HostBuffer::new(
                    device,
                    bytes,
                    vk::BufferUsageFlags::TRANSFER_SRC,
                    false,
                    "upload staging buffer",
                )?);
            }
        }
        Ok(())
    }

    /// # Safety
    ///
    /// Nothing of the lane is in use on the device (waited for, or the
    /// device is lost).
    unsafe fn destroy(&mut self, device: &Device) {
        let dev = &device.raw;
        for slot in self.slots.drain(..) {
            // SAFETY: the caller guarantees nothing is in use; null handles
            // are ignored.
            unsafe {
                if let Some(s) = slot.staging {
                    s.destroy(device);
                }
                dev.destroy_fence(slot.fence, None);
                dev.destroy_command_pool(slot.pool, None);
            }
        }
        // SAFETY: as above.
        unsafe { dev.destroy_semaphore(self.semaphore, None) };
        self.semaphore = vk::Semaphore::null();
    }

    pub(super) fn semaphore(&self) -> vk::Semaphore {
        self.semaphore
    }

    /// Whether submission `m` is known finished, asking the semaphore
    /// when the fences do not say so yet.
    fn done(&self, device: &Device, m: u64) -> Result<bool> {
        if m <= self.completed {
            return Ok(true);
        }
        if m > self.submits {
            return Ok(false);
        }
        // SAFETY: valid timeline semaphore.
        let value = unsafe { device.raw.get_semaphore_counter_value(self.semaphore) }
            .map_err(|e| vk_error(e, "vkGetSemaphoreCounterValue"))?;
        Ok(value >= m)
    }
}

impl Lanes {
    /// The lanes on `device`'s copy queues, where it has them; uploads
    /// stage through `staging_bytes` per slot.
    pub(super) fn new(device: &Device, staging_bytes: u64) -> Result<Option<Self>> {
        let Some(queues) = &device.copy_queues else {
            return Ok(None);
        };
        let mut lanes = Self {
            up: Lane::empty(queues.up),
            down: Lane::empty(queues.down),
            compute: vk::Semaphore::null(),
            min_bytes: if queues.family == device.family {
                0
            } else {
                LANE_MIN_BYTES
            },
        };
        let made = lanes
            .up
            .create(device, queues.family, Some(staging_bytes))
            .and_then(|()| lanes.down.create(device, queues.family, None))
            .and_then(|()| timeline_semaphore(device).map(|s| lanes.compute = s));
        match made {
            Ok(()) => Ok(Some(lanes)),
            Err(e) => {
                // SAFETY: nothing was submitted yet.
                unsafe { lanes.destroy(device) };
                Err(e)
            }
        }
    }

    /// # Safety
    ///
    /// As for [`Lane::destroy`], for both lanes and the kernels' semaphore.
    pub(super) unsafe fn destroy(&mut self, device: &Device) {
        // SAFETY: the caller's guarantee.
        unsafe {
            self.up.destroy(device);
            self.down.destroy(device);
            device.raw.destroy_semaphore(self.compute, None);
        }
        self.compute = vk::Semaphore::null();
    }

    pub(super) fn lane(&self, dir: Dir) -> &Lane {
        match dir {
            Dir::Up => &self.up,
            Dir::Down => &self.down,
        }
    }

    fn lane_mut(&mut self, dir: Dir) -> &mut Lane {
        match dir {
            Dir::Up => &mut self.up,
            Dir::Down => &mut self.down,
        }
    }

    /// The epochs of the lanes' slots still recording or in flight.
    pub(super) fn open_epochs(&self) -> impl Iterator<Item = u64> + '_ {
        self.up.slots.iter().chain(&self.down.slots).filter_map(|s| s.epoch)
    }
}

impl Stream {
    fn lanes_mut(&mut self) -> Result<&mut Lanes> {
        self.lanes.as_mut().ok_or_else(|| backend_error("no copy lanes"))
    }

    /// Whether the kernels' submission `n` is known finished.
    pub(super) fn compute_done(&self, n: u64) -> Result<bool> {
        if n <= self.completed {
            return Ok(true);
        }
        let Some(lanes) = &self.lanes else {
            return Ok(false);
        };
        if n > self.submits {
            return Ok(false);
        }
        // SAFETY: valid timeline semaphore.
        let value = unsafe { self.device.raw.get_semaphore_counter_value(lanes.compute) }
            .map_err(|e| vk_error(e, "vkGetSemaphoreCounterValue"))?;
        Ok(value >= n)
    }

    /// Whether lane `dir`'s submission `m` is known finished.
    fn lane_done(&self, dir: Dir, m: u64) -> Result<bool> {
        match &self.lanes {
            Some(lanes) => lanes.lane(dir).done(&self.device, m),
            None => Ok(true),
        }
    }

    /// Whether a copy of `bytes` into (`Up`) or out of (`Down`) `buffer`
    /// goes on a lane: there are lanes, it is large, the buffer is
    /// headkl's own (shared by both families), and for an upload no
    /// unfinished submission of the kernels or the other lane uses it
    /// (a download waits for the kernels; one after an unfinished upload
    /// stays in line).
    pub(super) fn lane_takes(&self, dir: Dir, buffer: &VulkanBuffer, bytes: u64) -> Result<bool> {
        let Some(lanes) = &self.lanes else {
            return Ok(false);
        };
        if bytes < lanes.min_bytes || buffer.is_view() {
            return Ok(false);
        }
        let u = self.uses.get(&buffer.handle()).copied().unwrap_or_default();
        match dir {
            Dir::Up => Ok(self.compute_done(u.compute)? && self.lane_done(Dir::Down, u.down)?),
            Dir::Down => self.lane_done(Dir::Up, u.up),
        }
    }

    /// Before the recording uses `buffers` (a dispatch or an in-line
    /// copy, called right after the recording is begun with room): makes
    /// it wait for the lanes' unfinished copies that touched them, and
    /// marks them as used by it. A recording that already holds a
    /// dispatch is submitted first, so its kernels do not wait with it.
    pub(super) fn compute_uses(&mut self, buffers: &[vk::Buffer]) -> Result<()> {
        if self.lanes.is_none() {
            return Ok(());
        }
        let (mut up, mut down) = (0, 0);
        for b in buffers {
            if let Some(u) = self.uses.get(b) {
                up = up.max(u.up);
                down = down.max(u.down);
            }
        }
        if self.lane_done(Dir::Up, up)? {
            up = 0;
        }
        if self.lane_done(Dir::Down, down)? {
            down = 0;
        }
        if up > self.wait_up || down > self.wait_down {
            // The copies' batches go first: a wait names a submitted value.
            if up > self.lanes_mut()?.up.submits {
                self.lane_submit(Dir::Up)?;
            }
            if down > self.lanes_mut()?.down.submits {
                self.lane_submit(Dir::Down)?;
            }
            if self.dispatched {
                self.submit()?;
                self.begin()?;
            }
            self.wait_up = self.wait_up.max(up);
            self.wait_down = self.wait_down.max(down);
        }
        // The recording now comes after those copies (it waits for them, or
        // they are finished): waiting for it covers them.
        let n = self.submits + 1;
        for b in buffers {
            *self.uses.entry(*b).or_default() = Use {
                compute: n,
                up: 0,
                down: 0,
            };
        }
        Ok(())
    }

    /// Starts recording lane `dir` (waiting for its slot's previous
    /// submission) with room for `fits`; a recording that waits for less
    /// than `wait_compute`, or is full, is submitted first.
    fn lane_begin(&mut self, dir: Dir, wait_compute: u64, fits: impl Fn(&LaneSlot) -> bool) -> Result<()> {
        let lane = self.lanes_mut()?.lane_mut(dir);
        if lane.recording && (wait_compute > lane.wait_compute || !fits(&lane.slots[lane.current])) {
            self.lane_submit(dir)?;
        }
        let lane = self.lanes_mut()?.lane_mut(dir);
        if !lane.recording {
            if let Some(n) = lane.slots[lane.current].submission {
                self.lane_wait_through(dir, n)?;
            }
            let epoch = self.open_epoch();
            let dev = &self.device.raw;
            let lane = self
                .lanes
                .as_mut()
                .ok_or_else(|| backend_error("no copy lanes"))?
                .lane_mut(dir);
            let slot = &mut lane.slots[lane.current];
            let info = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: the buffer is not pending (its pool was reset after
            // its last submission was waited for, or it never ran).
            unsafe { dev.begin_command_buffer(slot.cmd, &info) }.map_err(|e| vk_error(e, "vkBeginCommandBuffer"))?;
            slot.epoch = Some(epoch);
            lane.recording = true;
            lane.wait_compute = 0;
        }
        let lane = self.lanes_mut()?.lane_mut(dir);
        lane.wait_compute = lane.wait_compute.max(wait_compute);
        Ok(())
    }

    /// Submits lane `dir`'s recording, if any: it signals the lane's
    /// semaphore with its number and waits for the kernels' submission it
    /// names.
    pub(super) fn lane_submit(&mut self, dir: Dir) -> Result<()> {
        let Some(lanes) = self.lanes.as_mut() else {
            return Ok(());
        };
        let compute = lanes.compute;
        let lane = lanes.lane_mut(dir);
        if !lane.recording {
            return Ok(());
        }
        lane.recording = false;
        let i = lane.current;
        let dev = &self.device.raw;
        let slot = &lane.slots[i];
        let signal = [lane.semaphore];
        let signal_values = [lane.submits + 1];
        let waits = [compute];
        let wait_values = [lane.wait_compute];
        let stages = [vk::PipelineStageFlags::TRANSFER];
        let n_waits = usize::from(lane.wait_compute > 0);
        let mut timeline = vk::TimelineSemaphoreSubmitInfo::default()
            .wait_semaphore_values(&wait_values[..n_waits])
            .signal_semaphore_values(&signal_values);
        let cmds = [slot.cmd];
        let submit = [vk::SubmitInfo::default()
            .command_buffers(&cmds)
            .wait_semaphores(&waits[..n_waits])
            .wait_dst_stage_mask(&stages[..n_waits])
            .signal_semaphores(&signal)
            .push_next(&mut timeline)];
        // SAFETY: the buffer is recording (ended here); the queue is used
        // only under the stream's lock; the fence is unsignalled; the
        // waited value was submitted (the kernels' submission is made
        // before a copy names it).
        let result = unsafe { dev.end_command_buffer(slot.cmd) }
            .map_err(|e| vk_error(e, "vkEndCommandBuffer"))
            .and_then(|()| {
                // SAFETY: as above.
                unsafe { dev.queue_submit(lane.queue, &submit, slot.fence) }.map_err(|e| vk_error(e, "vkQueueSubmit"))
            });
        if let Err(e) = result {
            // Nothing was submitted: the slot is free again.
            // SAFETY: the slot's command buffer is not pending.
            let _ = unsafe { reset_lane_slot(&self.device, &mut lane.slots[i]) };
            self.update_finished();
            return Err(e);
        }
        lane.submits += 1;
        lane.slots[i].submission = Some(lane.submits);
        lane.slots[i].wait_compute = lane.wait_compute;
        lane.current = (i + 1) % SLOTS;
        #[cfg(test)]
        {
            self.ring_stats.lane_submits += 1;
        }
        Ok(())
    }

    /// Waits for lane `dir`'s submissions numbered `m` or lower, oldest
    /// first, and frees their slots (every one even after an error; the
    /// first error is returned).
    pub(super) fn lane_wait_through(&mut self, dir: Dir, m: u64) -> Result<()> {
        let mut result = Ok(());
        loop {
            let Some(lanes) = self.lanes.as_mut() else {
                return result;
            };
            let lane = lanes.lane_mut(dir);
            let Some((submission, i)) = lane
                .slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| s.submission.map(|k| (k, i)))
                .min()
            else {
                break;
            };
            if submission > m {
                break;
            }
            let slot = &mut lane.slots[i];
            // SAFETY: the fence was submitted with the slot's buffer.
            let waited = unsafe { self.device.raw.wait_for_fences(&[slot.fence], true, u64::MAX) }
                .map_err(|e| vk_error(e, "vkWaitForFences"));
            if waited.is_ok() {
                lane.completed = lane.completed.max(submission);
            }
            let compute = slot.wait_compute;
            // SAFETY: the fence wait returned, or the device is lost.
            let reset = unsafe { reset_lane_slot(&self.device, slot) };
            // The kernels' submission it waited for is done too: its slot
            // is freed now (the fence's wait returns at once).
            let kernels = self.wait_through(compute);
            self.update_finished();
            result = result.and(waited).and(reset).and(kernels);
        }
        result
    }

    /// Frees the lanes' slots whose submissions have finished, without
    /// waiting (a copy that no wait of the host covered, such as an upload
    /// the kernels found finished, would otherwise hold its buffers).
    pub(super) fn reap_lanes(&mut self) -> Result<()> {
        let mut result = Ok(());
        for dir in [Dir::Up, Dir::Down] {
            let Some(lanes) = &self.lanes else {
                return result;
            };
            let lane = lanes.lane(dir);
            let mut through = 0;
            let mut in_flight: Vec<(u64, vk::Fence)> = lane
                .slots
                .iter()
                .filter_map(|s| s.submission.map(|k| (k, s.fence)))
                .collect();
            in_flight.sort_unstable();
            for (submission, fence) in in_flight {
                // SAFETY: the fence was submitted with the slot's buffer.
                match unsafe { self.device.raw.get_fence_status(fence) } {
                    Ok(true) => through = submission,
                    Ok(false) => break,
                    Err(e) => {
                        result = result.and(Err(vk_error(e, "vkGetFenceStatus")));
                        break;
                    }
                }
            }
            if through > 0 {
                result = result.and(self.lane_wait_through(dir, through));
            }
        }
        result
    }

    /// Records an upload of `data` into `dst` at `offset` on the upload
    /// lane (the caller checked [`Stream::lane_takes`]) and submits it.
    pub(super) fn lane_upload(&mut self, dst: &VulkanBuffer, offset: u64, data: &[u8]) -> Result<()> {
        let handle = dst.handle();
        let mut done = 0usize;
        while done < data.len() {
            self.lane_begin(Dir::Up, 0, |s| s.staging_used < s.capacity())?;
            let dev = &self.device.raw;
            let lane = self.lanes.as_mut().ok_or_else(|| backend_error("no copy lanes"))?;
            let lane = &mut lane.up;
            let slot = &mut lane.slots[lane.current];
            let capacity = slot.capacity();
            let at = slot.staging_used;
            let piece = (data.len() - done).min((capacity - at) as usize);
            let staging = slot
                .staging
                .as_mut()
                .ok_or_else(|| backend_error("upload staging buffer missing"))?;
            staging.write(at, &data[done..done + piece]);
            let src = staging.raw.buffer;
            slot.staging_used = ((at + piece as u64).div_ceil(16) * 16).min(capacity);
            if lane.written.contains(&handle) {
                let barrier = [vk::MemoryBarrier::default()
                    .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                    .dst_access_mask(vk::AccessFlags::TRANSFER_WRITE)];
                // SAFETY: recording command buffer; a global barrier.
                unsafe {
                    dev.cmd_pipeline_barrier(
                        slot.cmd,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::DependencyFlags::empty(),
                        &barrier,
                        &[],
                        &[],
                    )
                };
                lane.written.clear();
            }
            let region = [vk::BufferCopy {
                src_offset: at,
                dst_offset: dst.offset() + offset + done as u64,
                size: piece as u64,
            }];
            // SAFETY: recording command buffer; both ranges are inside
            // their buffers (checked by the caller and the staging room).
            unsafe { dev.cmd_copy_buffer(slot.cmd, src, handle, &region) };
            lane.written.insert(handle);
            self.uses.entry(handle).or_default().up = lane.submits + 1;
            done += piece;
        }
        self.lane_submit(Dir::Up)
    }

    /// Records a copy of `bytes` of `src` at `offset` into `host` on the
    /// download lane, after the kernels' submission that last used `src`
    /// (submitted first where it is being recorded), and submits it.
    /// Returns the lane's submission that fills `host`.
    pub(super) fn lane_download(
        &mut self,
        src: &VulkanBuffer,
        offset: u64,
        host: &HostBuffer,
        bytes: u64,
    ) -> Result<u64> {
        let handle = src.handle();
        let writer = self.uses.get(&handle).map_or(0, |u| u.compute);
        if writer > self.submits {
            self.submit()?;
        }
        let wait = if self.compute_done(writer)? { 0 } else { writer };
        self.lane_begin(Dir::Down, wait, |_| true)?;
        let dev = &self.device.raw;
        let lane = &mut self.lanes.as_mut().ok_or_else(|| backend_error("no copy lanes"))?.down;
        let cmd = lane.slots[lane.current].cmd;
        // SAFETY: the lane's current command buffer is recording; the
        // source range was checked by the caller and the host buffer holds
        // at least `bytes`.
        unsafe {
            super::readback::record_copy_to_host(dev, cmd, (handle, src.offset() + offset), host.raw.buffer, bytes)
        };
        let m = lane.submits + 1;
        self.uses.entry(handle).or_default().down = m;
        self.lane_submit(Dir::Down)?;
        Ok(m)
    }

    /// Makes lane `dir`'s submission `m` finished; the kernels' recording
    /// is submitted first, so the device works on it meanwhile.
    pub(super) fn wait_for_lane(&mut self, dir: Dir, m: u64) -> Result<()> {
        self.submit()?;
        self.lane_submit(dir)?;
        self.lane_wait_through(dir, m)?;
        let completed = self.lanes.as_ref().map_or(0, |l| l.lane(dir).completed);
        if completed >= m {
            Ok(())
        } else {
            Err(backend_error(format!(
                "download_end: copy {m} not finished after waiting ({completed} finished)"
            )))
        }
    }

    /// Submits both lanes' recordings and waits for all their work.
    pub(super) fn flush_lanes(&mut self) -> Result<()> {
        let Some(lanes) = &self.lanes else {
            return Ok(());
        };
        let (up, down) = (lanes.up.submits + 1, lanes.down.submits + 1);
        let submitted = self.lane_submit(Dir::Up).and(self.lane_submit(Dir::Down));
        let waited = self
            .lane_wait_through(Dir::Up, up)
            .and(self.lane_wait_through(Dir::Down, down));
        submitted.and(waited)
    }
}

/// Frees a lane slot for recording.
///
/// # Safety
///
/// Its submission has finished, was never made, or the device is lost.
unsafe fn reset_lane_slot(device: &Device, slot: &mut LaneSlot) -> Result<()> {
    slot.staging_used = 0;
    slot.submission = None;
    slot.epoch = None;
    slot.wait_compute = 0;
    // SAFETY: the caller guarantees the slot's command buffer is not in use.
    unsafe {
        device.raw.reset_fences(&[slot.fence]).and_then(|()| {
            device
                .raw
                .reset_command_pool(slot.pool, vk::CommandPoolResetFlags::empty())
        })
    }
    .map_err(|e| vk_error(e, "resetting a copy lane slot"))
}
