//! The command stream: a ring of [`SLOTS`] command buffers, each recorded
//! until something must be waited for or its room runs out (staging,
//! uniform blocks, descriptor sets, timestamp queries), then submitted
//! with its own fence. Recording moves on to the next slot, which is
//! reused only once its previous submission's fence has signalled, so the
//! host records (and stages uploads for) one submission while the device
//! runs the one before. Submissions go to the one queue in order, and a
//! global barrier before every copy and dispatch orders it after all
//! earlier work, earlier submissions included. Transfers go through each
//! slot's host-visible staging buffer, uniform blocks through its ring,
//! descriptor sets through its pool, and kernel times through timestamp
//! queries (a range of one pool per slot). Where the device has a copy
//! queue, large uploads and downloads go on copy lanes beside the kernels
//! (`lane`), synchronized with them by timeline semaphores.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ash::vk;
use headkl_core::toolkit::checks::check_transfer;
use headkl_core::{DeviceBuffer, KernelTime, Result};

use crate::conv::{backend_error, vk_error};
use crate::device::Device;
use crate::memory::VulkanBuffer;
use crate::pipeline::Pipeline;

mod lane;
mod readback;
mod slot;

use lane::{Dir, Lanes, Use};
use slot::{Slot, SlotSizes};

/// Submissions in flight at once (and command buffers in the ring).
pub(crate) const SLOTS: usize = 2;
/// Staging buffer size per slot: transfers larger than this go in pieces.
/// With [`SLOTS`] slots the stream holds `SLOTS ×` this in host-visible
/// memory (128 MiB).
pub(crate) const STAGING_BYTES: u64 = 64 << 20;
/// Uniform blocks (and descriptor sets) per submission.
const UNIFORM_SLOTS: u64 = 1024;
/// Largest uniform block a kernel takes.
const MAX_UNIFORM_BYTES: u64 = 256;
/// Storage descriptors reserved per set in the pool.
const STORAGE_PER_SET: u32 = 8;
/// Dispatches timed per submission.
const TIMED_DISPATCHES: u32 = 1024;

/// Timestamp queries around each dispatch: slot `i` owns queries
/// `[i, i + 1) · 2 · TIMED_DISPATCHES`.
struct Timer {
    pool: vk::QueryPool,
    period_ns: f64,
    mask: u64,
}

/// Records commands and submits them to the device's queue.
pub(crate) struct Stream {
    device: Arc<Device>,
    slots: Vec<Slot>,
    /// The slot being recorded (`recording`), or the next one to record:
    /// the one after the last submitted, i.e. the oldest in flight if any.
    current: usize,
    recording: bool,
    uniform_stride: u64,
    timer: Option<Timer>,
    kernel_times: Vec<KernelTime>,
    /// Submissions made, and how many of them are known to have finished
    /// (a readback recorded in submission `n` is ready once `completed ≥ n`).
    submits: u64,
    completed: u64,
    readbacks: readback::Readbacks,
    /// A download was begun in the recording: the next upload (the host
    /// path's next chunk) submits it first where the next slot is free.
    readback_recorded: bool,
    /// The copy lanes, where the device has copy queues.
    lanes: Option<Lanes>,
    /// The timeline semaphore shared with another API, once made.
    shared: Option<SharedTimeline>,
    /// The submissions that last used each buffer (with lanes only).
    uses: HashMap<vk::Buffer, Use>,
    /// The lanes' submissions the recording waits for (0: none), and
    /// whether it holds a dispatch.
    wait_up: u64,
    wait_down: u64,
    dispatched: bool,
    /// Recordings begun, on every queue: a buffer dropped now may be used
    /// by recordings up to this one ([`Device::release`]).
    epochs: u64,
    /// What the ring did, for the tests.
    #[cfg(test)]
    pub(crate) ring_stats: RingStats,
}

/// Counts of the ring's behaviour since the last reset (tests only).
#[cfg(test)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RingStats {
    /// The most submissions in flight at once.
    pub(crate) most_in_flight: usize,
    /// Recordings that had to wait for their slot's previous submission.
    pub(crate) begin_waits: usize,
    /// Submissions made.
    pub(crate) submits: usize,
    /// Submissions made on the copy lanes.
    pub(crate) lane_submits: usize,
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
    /// `staging_bytes` per slot.
    pub(crate) fn new(device: Arc<Device>, staging_bytes: u64) -> Result<Self> {
        let uniform_stride = device.caps.min_uniform_offset_alignment.max(MAX_UNIFORM_BYTES);
        let mut stream = Self {
            device: Arc::clone(&device),
            slots: (0..SLOTS).map(|_| Slot::empty()).collect(),
            current: 0,
            recording: false,
            uniform_stride,
            timer: None,
            kernel_times: Vec::new(),
            submits: 0,
            completed: 0,
            readbacks: readback::Readbacks::default(),
            readback_recorded: false,
            lanes: None,
            shared: None,
            uses: HashMap::new(),
            wait_up: 0,
            wait_down: 0,
            dispatched: false,
            epochs: 0,
            #[cfg(test)]
            ring_stats: RingStats::default(),
        };
        let sizes = SlotSizes {
            staging_bytes,
            uniform_bytes: UNIFORM_SLOTS * uniform_stride,
            sets: UNIFORM_SLOTS as u32,
            storage_per_set: STORAGE_PER_SET,
        };
        // On error, `Drop` destroys whatever was created so far.
        for slot in &mut stream.slots {
            slot.create(&device, &sizes)?;
        }
        stream.lanes = Lanes::new(&device, staging_bytes)?;
        Ok(stream)
    }

    /// The command buffer being recorded.
    fn cmd(&self) -> vk::CommandBuffer {
        self.slots[self.current].cmd
    }

    /// Submissions in flight (submitted, not yet waited for), and how many
    /// have finished.
    #[cfg(test)]
    pub(crate) fn submissions(&self) -> (usize, u64) {
        let in_flight = self.slots.iter().filter(|s| s.submission.is_some()).count();
        (in_flight, self.completed)
    }

    /// Whether large copies run on copy lanes.
    #[cfg(test)]
    pub(crate) fn has_lanes(&self) -> bool {
        self.lanes.is_some()
    }

    /// Opens the next recording's epoch: buffers dropped from now on may be
    /// used by it.
    fn open_epoch(&mut self) -> u64 {
        self.epochs += 1;
        self.device.last_use.fetch_max(self.epochs, Ordering::SeqCst);
        self.epochs
    }

    /// Marks every epoch below the oldest still recording or in flight
    /// finished, and frees the buffers parked until then.
    fn update_finished(&self) {
        let compute = self.slots.iter().filter_map(|s| s.epoch);
        let oldest = match &self.lanes {
            Some(l) => compute.chain(l.open_epochs()).min(),
            None => compute.min(),
        };
        let finished = oldest.map_or(self.epochs, |e| e - 1);
        self.device.finished.fetch_max(finished, Ordering::SeqCst);
        self.device.collect_garbage();
    }

    /// Whether the queue can write timestamps.
    pub(crate) fn can_time(&self) -> bool {
        self.device.timestamp_valid_bits() > 0
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
                .query_count(2 * TIMED_DISPATCHES * SLOTS as u32);
            // SAFETY: valid device and create info.
            let pool = unsafe { self.device.raw.create_query_pool(&info, None) }
                .map_err(|e| vk_error(e, "vkCreateQueryPool"))?;
            let bits = self.device.timestamp_valid_bits();
            self.timer = Some(Timer {
                pool,
                period_ns: f64::from(self.device.caps.timestamp_period_ns),
                mask: if bits >= 64 { u64::MAX } else { (1u64 << bits) - 1 },
            });
        }
        Ok(true)
    }

    /// Takes the kernel times of the waited-for work, in submission order.
    pub(crate) fn take_kernel_times(&mut self) -> Vec<KernelTime> {
        std::mem::take(&mut self.kernel_times)
    }

    fn destroy_timer(&mut self) {
        if let Some(t) = self.timer.take() {
            // SAFETY: called after a flush; no command buffer uses the pool.
            unsafe { self.device.raw.destroy_query_pool(t.pool, None) };
        }
    }

    /// Starts recording the current slot if it is not recording, after
    /// waiting for the submission it still holds (the oldest in flight).
    fn begin(&mut self) -> Result<()> {
        if self.recording {
            return Ok(());
        }
        if let Some(n) = self.slots[self.current].submission {
            #[cfg(test)]
            {
                self.ring_stats.begin_waits += 1;
            }
            self.wait_through(n)?;
        }
        let dev = &self.device.raw;
        let cmd = self.cmd();
        let info = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: the buffer is not recording or pending (its pool was reset
        // after its last submission was waited for, or it never ran).
        unsafe { dev.begin_command_buffer(cmd, &info) }.map_err(|e| vk_error(e, "vkBeginCommandBuffer"))?;
        if let Some(t) = &self.timer {
            let queries = 2 * TIMED_DISPATCHES;
            // SAFETY: recording command buffer; the slot's range is inside
            // the pool, and no pending submission uses it (waited above).
            unsafe { dev.cmd_reset_query_pool(cmd, t.pool, self.current as u32 * queries, queries) };
        }
        let epoch = self.open_epoch();
        self.slots[self.current].epoch = Some(epoch);
        self.recording = true;
        Ok(())
    }

    /// Orders the next command after everything recorded or submitted
    /// before it: shader and transfer writes become visible to shader and
    /// transfer reads and writes. A pipeline barrier's first scope is every
    /// command earlier in submission order, so this also covers the
    /// hazards between consecutive submissions of the ring.
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
                self.cmd(),
                stages,
                stages,
                vk::DependencyFlags::empty(),
                &barrier,
                &[],
                &[],
            )
        };
    }

    /// Submits the recorded work and waits for every submission in flight;
    /// their slots are reset and buffers dropped meanwhile are freed.
    pub(crate) fn flush(&mut self) -> Result<()> {
        let submitted = self.submit();
        let waited = self.wait_through(self.submits);
        let lanes = self.flush_lanes();
        // Entries of finished work say nothing any more.
        self.uses.clear();
        submitted.and(waited).and(lanes)
    }

    /// Submits the recorded work without waiting for it; recording goes on
    /// in the next slot, which first waits for the submission it holds.
    pub(crate) fn submit(&mut self) -> Result<()> {
        if !self.recording {
            return Ok(());
        }
        self.recording = false;
        self.readback_recorded = false;
        let i = self.current;
        let submitted = self.submit_slot(i);
        let lane_waits = (self.wait_up, self.wait_down);
        (self.wait_up, self.wait_down, self.dispatched) = (0, 0, false);
        if let Err(e) = submitted {
            // Nothing was submitted: the slot is free again.
            // SAFETY: the slot's command buffer is not pending.
            let _ = unsafe { self.slots[i].reset(&self.device) };
            self.update_finished();
            return Err(e);
        }
        self.submits += 1;
        self.slots[i].submission = Some(self.submits);
        self.slots[i].lane_waits = lane_waits;
        self.current = (i + 1) % SLOTS;
        #[cfg(test)]
        {
            let (in_flight, _) = self.submissions();
            self.ring_stats.submits += 1;
            self.ring_stats.most_in_flight = self.ring_stats.most_in_flight.max(in_flight);
        }
        Ok(())
    }

    fn submit_slot(&mut self, i: usize) -> Result<()> {
        let dev = &self.device.raw;
        let slot = &self.slots[i];
        // SAFETY: the buffer is recording.
        unsafe { dev.end_command_buffer(slot.cmd) }.map_err(|e| vk_error(e, "vkEndCommandBuffer"))?;
        let cmds = [slot.cmd];
        let mut sync = TimelineSync::default();
        // With lanes: signal the kernels' semaphore with this submission's
        // number, after the copies it must wait for.
        if let Some(lanes) = &self.lanes {
            for (semaphore, value) in [
                (lanes.up.semaphore(), self.wait_up),
                (lanes.down.semaphore(), self.wait_down),
            ] {
                if value > 0 {
                    sync.wait(semaphore, value);
                }
            }
            sync.signal(lanes.compute, self.submits + 1);
        }
        if let Some(shared) = &mut self.shared {
            shared.take_into(&mut sync);
        }
        // SAFETY: executable command buffer; the queue is used only by this
        // stream, under the backend's lock; the slot's fence is unsignaled
        // (reset after its last wait); every waited lane value was
        // submitted on its lane before (`compute_uses` submits the lane
        // first).
        unsafe { sync.submit(dev, self.device.queue, &cmds, slot.fence) }
    }

    /// The shared timeline semaphore (made, exportable as an opaque fd, on
    /// first use).
    pub(crate) fn shared_timeline(&mut self) -> Result<vk::Semaphore> {
        Ok(self.shared_mut()?.semaphore)
    }

    /// The shared timeline and its pending wait and signal, made on first
    /// use.
    fn shared_mut(&mut self) -> Result<&mut SharedTimeline> {
        let shared = match self.shared.take() {
            Some(shared) => shared,
            None => self.new_shared_timeline()?,
        };
        Ok(self.shared.insert(shared))
    }

    fn new_shared_timeline(&self) -> Result<SharedTimeline> {
        let mut kind = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let mut export =
            vk::ExportSemaphoreCreateInfo::default().handle_types(vk::ExternalSemaphoreHandleTypeFlags::OPAQUE_FD);
        let info = vk::SemaphoreCreateInfo::default()
            .push_next(&mut kind)
            .push_next(&mut export);
        // SAFETY: valid device with timeline semaphores and
        // VK_KHR_external_semaphore_fd enabled (the caller checks
        // `enabled.external_fd`).
        let semaphore =
            unsafe { self.device.raw.create_semaphore(&info, None) }.map_err(|e| vk_error(e, "vkCreateSemaphore"))?;
        Ok(SharedTimeline {
            semaphore,
            wait: None,
            signal: None,
        })
    }

    /// The shared timeline's value now (the tests' view of it).
    #[cfg(test)]
    pub(crate) fn shared_value(&self) -> u64 {
        let Some(shared) = &self.shared else {
            return 0;
        };
        // SAFETY: a live timeline semaphore of this device.
        unsafe { self.device.raw.get_semaphore_counter_value(shared.semaphore) }.unwrap_or(u64::MAX)
    }

    /// The next submission waits (before its kernels and copies) for the
    /// shared timeline to reach `value`.
    pub(crate) fn wait_shared(&mut self, value: u64) -> Result<()> {
        let shared = self.shared_mut()?;
        shared.wait = Some(shared.wait.map_or(value, |w| w.max(value)));
        Ok(())
    }

    /// Submits what is recorded and signals the shared timeline with
    /// `value` once every submission so far has finished (a semaphore
    /// signal's first scope is every command earlier in submission order).
    pub(crate) fn signal_shared(&mut self, value: u64) -> Result<()> {
        self.shared_mut()?.signal = Some(value);
        if self.recording {
            return self.submit();
        }
        let mut sync = TimelineSync::default();
        self.shared_mut()?.take_into(&mut sync);
        // SAFETY: a submission of no command buffers and no fence; the
        // queue is this stream's, under the backend's lock.
        unsafe { sync.submit(&self.device.raw, self.device.queue, &[], vk::Fence::null()) }
    }

    /// Waits for every submission in flight numbered `n` or lower, oldest
    /// first (so kernel times stay in order), and resets their slots. Every
    /// such slot is reset even after an error (a lost device runs nothing);
    /// the first error is returned.
    fn wait_through(&mut self, n: u64) -> Result<()> {
        let mut result = Ok(());
        while let Some((submission, i)) = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.submission.map(|k| (k, i)))
            .min()
        {
            if submission > n {
                break;
            }
            let waited = self.wait_slot(i, submission);
            let (up, down) = self.slots[i].lane_waits;
            // SAFETY: the slot's fence wait returned, or the device is lost
            // and runs nothing.
            let reset = unsafe { self.slots[i].reset(&self.device) };
            self.update_finished();
            // The copies it waited for are done: their slots are freed now
            // (their fences' waits return at once), so buffers they used
            // can go. (After the reset: these waits may come back here.)
            let lanes = self
                .lane_wait_through(Dir::Up, up)
                .and(self.lane_wait_through(Dir::Down, down));
            result = result.and(waited).and(reset).and(lanes);
        }
        result.and(self.reap_lanes())
    }

    /// Waits for slot `i`'s fence (holding `submission`) and collects its
    /// kernel times.
    fn wait_slot(&mut self, i: usize, submission: u64) -> Result<()> {
        let dev = &self.device.raw;
        let slot = &self.slots[i];
        // SAFETY: the fence was submitted with the slot's command buffer.
        unsafe { dev.wait_for_fences(&[slot.fence], true, u64::MAX) }.map_err(|e| vk_error(e, "vkWaitForFences"))?;
        self.completed = self.completed.max(submission);
        if let Some(t) = &self.timer {
            if slot.queries_used > 0 {
                let mut data = vec![0u64; slot.queries_used as usize];
                let first = i as u32 * 2 * TIMED_DISPATCHES;
                // SAFETY: the slot's queries [first, first + used) were reset
                // and written in the command buffer that just completed.
                unsafe { dev.get_query_pool_results(t.pool, first, &mut data, vk::QueryResultFlags::TYPE_64) }
                    .map_err(|e| vk_error(e, "vkGetQueryPoolResults"))?;
                for (pair, label) in data.chunks_exact(2).zip(&slot.labels) {
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

    /// Starts recording with room for what `fits` asks of the slot: when
    /// the recording slot is full, it is submitted and the next one begun.
    fn begin_with_room(&mut self, fits: impl Fn(&Slot) -> bool) -> Result<()> {
        self.begin()?;
        if !fits(&self.slots[self.current]) {
            self.submit()?;
            self.begin()?;
        }
        Ok(())
    }

    /// Records a copy of `data` into `dst` at `offset`, after all queued
    /// work, through the slots' staging buffers.
    pub(crate) fn upload(&mut self, dst: &VulkanBuffer, offset: u64, data: &[u8]) -> Result<()> {
        check_transfer("upload", offset, data.len() as u64, dst.len())?;
        if self.lane_takes(Dir::Up, dst, data.len() as u64)? {
            return self.lane_upload(dst, offset, data);
        }
        // The host path's first chunk goes to the device while the second
        // is recorded (later chunks are submitted by `download_end`). Only
        // where no wait follows: the next slot holds nothing in flight.
        if self.readback_recorded && self.slots[(self.current + 1) % SLOTS].submission.is_none() {
            self.submit()?;
        }
        let mut done = 0usize;
        while done < data.len() {
            self.begin_with_room(|s| s.staging_used < s.staging_capacity())?;
            self.compute_uses(&[dst.handle()])?;
            let cmd = self.cmd();
            let slot = &mut self.slots[self.current];
            let capacity = slot.staging_capacity();
            let at = slot.staging_used;
            let piece = (data.len() - done).min((capacity - at) as usize);
            let staging = slot.staging_mut()?;
            staging.write(at, &data[done..done + piece]);
            let src = staging.raw.buffer;
            // Keep later pieces 16-byte aligned in the staging buffer.
            slot.staging_used = ((at + piece as u64).div_ceil(16) * 16).min(capacity);
            self.barrier();
            let region = [vk::BufferCopy {
                src_offset: at,
                dst_offset: dst.offset() + offset + done as u64,
                size: piece as u64,
            }];
            // SAFETY: recording command buffer; both ranges are inside their
            // buffers (checked above and by the staging room).
            unsafe { self.device.raw.cmd_copy_buffer(cmd, src, dst.handle(), &region) };
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
        let mut done = 0usize;
        while done < out.len() {
            self.begin()?;
            self.compute_uses(&[src.handle()])?;
            let i = self.current;
            let cmd = self.cmd();
            let slot = &self.slots[i];
            let piece = (out.len() - done).min(slot.staging_capacity() as usize);
            let dst = slot.staging()?.raw.buffer;
            // The barrier also orders this copy after pending uploads that
            // read the same staging range.
            self.barrier();
            // SAFETY: recording command buffer; both ranges are inside their
            // buffers (checked above; `piece` ≤ staging size).
            unsafe {
                readback::record_copy_to_host(
                    &self.device.raw,
                    cmd,
                    (src.handle(), src.offset() + offset + done as u64),
                    dst,
                    piece as u64,
                )
            };
            self.flush()?;
            // Slot `i`'s staging holds the piece (a reset leaves its bytes).
            self.slots[i].staging()?.read(0, &mut out[done..done + piece]);
            done += piece;
        }
        Ok(())
    }

    /// Starts recording one kernel launch: a slot with room for it (`fits`,
    /// and two timestamps when timing), the copy lanes ordered before it
    /// on `buffers`. Returns the slot's index and command buffer.
    fn open_launch(&mut self, buffers: &[Binding], fits: impl Fn(&Slot) -> bool) -> Result<(usize, vk::CommandBuffer)> {
        let timed = self.timer.is_some();
        self.begin_with_room(|s| fits(s) && (!timed || s.queries_used + 2 <= 2 * TIMED_DISPATCHES))?;
        if self.lanes.is_some() {
            let handles: Vec<vk::Buffer> = buffers.iter().map(|b| b.buffer).collect();
            self.compute_uses(&handles)?;
        }
        self.dispatched = true;
        Ok((self.current, self.cmd()))
    }

    /// Records `record`'s commands on slot `i`'s `cmd` after the barrier
    /// every launch gets, between timestamps labelled `label` when timing.
    fn record_timed(&mut self, i: usize, cmd: vk::CommandBuffer, label: &'static str, record: impl FnOnce()) {
        let slot = &mut self.slots[i];
        let timer = self.timer.as_ref().map(|t| {
            let first = i as u32 * 2 * TIMED_DISPATCHES + slot.queries_used;
            slot.queries_used += 2;
            slot.labels.push(label);
            (t.pool, first)
        });
        self.barrier();
        let dev = &self.device.raw;
        if let Some((pool, first)) = timer {
            // SAFETY: recording command buffer; the query index is inside
            // the pool and was reset at begin.
            unsafe { dev.cmd_write_timestamp(cmd, vk::PipelineStageFlags::COMPUTE_SHADER, pool, first) };
        }
        record();
        if let Some((pool, first)) = timer {
            // SAFETY: as above.
            unsafe { dev.cmd_write_timestamp(cmd, vk::PipelineStageFlags::COMPUTE_SHADER, pool, first + 1) };
        }
    }

    /// Records one launch that is not a pipeline's (a PTX tile's, through
    /// `VK_NVX_binary_import`): `record` gets the command buffer after the
    /// barrier every dispatch gets, between its timestamps. `buffers` are
    /// the ones it reads and writes (for the copy lanes' ordering).
    pub(crate) fn launch(
        &mut self,
        buffers: &[Binding],
        label: &'static str,
        record: impl FnOnce(vk::CommandBuffer),
    ) -> Result<()> {
        let (i, cmd) = self.open_launch(buffers, |_| true)?;
        self.record_timed(i, cmd, label, || record(cmd));
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
        let stride = self.uniform_stride;
        let (i, cmd) = self.open_launch(buffers, |s| {
            s.uniform_used + stride <= UNIFORM_SLOTS * stride && s.sets_used < UNIFORM_SLOTS
        })?;
        let slot = &mut self.slots[i];
        let at = slot.uniform_used;
        let uniforms = slot.uniforms_mut()?;
        uniforms.write(at, params);
        let uniform_buffer = uniforms.raw.buffer;
        slot.uniform_used += stride;

        let dev = &self.device.raw;
        let set_layouts = [pipeline.set_layout];
        let info = vk::DescriptorSetAllocateInfo::default()
            .descriptor_pool(slot.descriptor_pool)
            .set_layouts(&set_layouts);
        // SAFETY: valid pool and layout; the pool is reset only after a wait.
        let set = unsafe { dev.allocate_descriptor_sets(&info) }
            .map_err(|e| vk_error(e, "vkAllocateDescriptorSets"))?
            .first()
            .copied()
            .ok_or_else(|| backend_error("vkAllocateDescriptorSets returned no set"))?;
        slot.sets_used += 1;

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

        let device = Arc::clone(&self.device);
        self.record_timed(i, cmd, label, || {
            let dev = &device.raw;
            // SAFETY: recording command buffer; pipeline, layout and set
            // match.
            unsafe {
                dev.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, pipeline.raw);
                dev.cmd_bind_descriptor_sets(cmd, vk::PipelineBindPoint::COMPUTE, pipeline.layout, 0, &[set], &[]);
                dev.cmd_dispatch(cmd, grid.0, grid.1, 1);
            }
        });
        Ok(())
    }
}

/// The timeline semaphore shared with another API, and what the next
/// submission waits for and signals on it.
struct SharedTimeline {
    semaphore: vk::Semaphore,
    wait: Option<u64>,
    signal: Option<u64>,
}

impl SharedTimeline {
    fn take_into(&mut self, sync: &mut TimelineSync) {
        if let Some(value) = self.wait.take() {
            sync.wait(self.semaphore, value);
        }
        if let Some(value) = self.signal.take() {
            sync.signal(self.semaphore, value);
        }
    }
}

/// A submission's timeline waits and signals.
#[derive(Default)]
struct TimelineSync {
    waits: Vec<vk::Semaphore>,
    wait_values: Vec<u64>,
    signals: Vec<vk::Semaphore>,
    signal_values: Vec<u64>,
}

impl TimelineSync {
    fn wait(&mut self, semaphore: vk::Semaphore, value: u64) {
        self.waits.push(semaphore);
        self.wait_values.push(value);
    }

    fn signal(&mut self, semaphore: vk::Semaphore, value: u64) {
        self.signals.push(semaphore);
        self.signal_values.push(value);
    }

    /// Submits `cmds` to `queue` with these waits and signals.
    ///
    /// # Safety
    /// The command buffers are executable, the queue is externally
    /// synchronized by the caller, `fence` is null or unsignaled, and every
    /// semaphore is a live timeline semaphore of this device.
    unsafe fn submit(
        &self,
        dev: &ash::Device,
        queue: vk::Queue,
        cmds: &[vk::CommandBuffer],
        fence: vk::Fence,
    ) -> Result<()> {
        let stages = vec![vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER; self.waits.len()];
        let mut timeline = vk::TimelineSemaphoreSubmitInfo::default()
            .wait_semaphore_values(&self.wait_values)
            .signal_semaphore_values(&self.signal_values);
        let mut submit = vk::SubmitInfo::default()
            .command_buffers(cmds)
            .wait_semaphores(&self.waits)
            .wait_dst_stage_mask(&stages)
            .signal_semaphores(&self.signals);
        if !(self.waits.is_empty() && self.signals.is_empty()) {
            submit = submit.push_next(&mut timeline);
        }
        // SAFETY: per the contract above.
        unsafe { dev.queue_submit(queue, &[submit], fence) }.map_err(|e| vk_error(e, "vkQueueSubmit"))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Finish (or abandon, if the device is lost) every submission in
        // flight before anything they use is freed.
        let _ = self.flush();
        self.destroy_timer();
        self.readbacks.destroy(&self.device);
        if let Some(shared) = self.shared.take() {
            // SAFETY: the flush waited for (or abandoned) every submission
            // that waits for or signals it; an importer keeps its own
            // reference to the payload.
            unsafe { self.device.raw.destroy_semaphore(shared.semaphore, None) };
        }
        if let Some(lanes) = &mut self.lanes {
            // SAFETY: the flush waited for (or, on a lost device,
            // abandoned) every lane submission.
            unsafe { lanes.destroy(&self.device) };
        }
        for slot in &mut self.slots {
            // SAFETY: the flush waited for (or, on a lost device, abandoned)
            // every slot's submission.
            unsafe { slot.destroy(&self.device) };
        }
    }
}
