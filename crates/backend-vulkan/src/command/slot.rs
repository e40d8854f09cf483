//! One slot of the stream's ring: a command buffer with its fence and
//! everything the host writes for it (staging, uniform blocks, descriptor
//! sets, timestamp labels), reused only after the fence has signalled.

use ash::vk;
use headkl_core::Result;

use crate::conv::{backend_error, vk_error};
use crate::device::Device;
use crate::memory::HostBuffer;

/// A command buffer and the host-written objects of one submission.
pub(super) struct Slot {
    pool: vk::CommandPool,
    pub(super) cmd: vk::CommandBuffer,
    pub(super) fence: vk::Fence,
    staging: Option<HostBuffer>,
    pub(super) staging_used: u64,
    uniforms: Option<HostBuffer>,
    pub(super) uniform_used: u64,
    pub(super) descriptor_pool: vk::DescriptorPool,
    pub(super) sets_used: u64,
    /// Timestamp queries written in this slot's range of the pool (two per
    /// dispatch), and the dispatches' labels.
    pub(super) queries_used: u32,
    pub(super) labels: Vec<&'static str>,
    /// The submission (numbered from 1) this slot holds in flight, until
    /// its fence has been waited for.
    pub(super) submission: Option<u64>,
    /// Its number in the stream's count of recordings (buffer lifetimes),
    /// while recording or in flight.
    pub(super) epoch: Option<u64>,
    /// The copy lanes' submissions (uploads, downloads) it waits for: done
    /// once it is.
    pub(super) lane_waits: (u64, u64),
}

/// The sizes of a slot's host-written objects.
pub(super) struct SlotSizes {
    pub(super) staging_bytes: u64,
    pub(super) uniform_bytes: u64,
    /// Descriptor sets (one per dispatch) and storage descriptors per set.
    pub(super) sets: u32,
    pub(super) storage_per_set: u32,
}

impl Slot {
    /// A slot holding no Vulkan object yet ([`Slot::create`] makes them;
    /// [`Slot::destroy`] ignores null handles).
    pub(super) fn empty() -> Self {
        Self {
            pool: vk::CommandPool::null(),
            cmd: vk::CommandBuffer::null(),
            fence: vk::Fence::null(),
            staging: None,
            staging_used: 0,
            uniforms: None,
            uniform_used: 0,
            descriptor_pool: vk::DescriptorPool::null(),
            sets_used: 0,
            queries_used: 0,
            labels: Vec::new(),
            submission: None,
            epoch: None,
            lane_waits: (0, 0),
        }
    }

    /// Creates the slot's objects on `device`; on error the ones made so
    /// far stay in the slot for [`Slot::destroy`].
    pub(super) fn create(&mut self, device: &Device, sizes: &SlotSizes) -> Result<()> {
        let dev = &device.raw;
        let info = vk::CommandPoolCreateInfo::default()
            .queue_family_index(device.family)
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
            device,
            sizes.staging_bytes,
            vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST,
            true,
            "staging buffer",
        )?);
        self.uniforms = Some(HostBuffer::new(
            device,
            sizes.uniform_bytes,
            vk::BufferUsageFlags::UNIFORM_BUFFER,
            false,
            "uniform ring",
        )?);
        let pool_sizes = [
            vk::DescriptorPoolSize {
                ty: vk::DescriptorType::UNIFORM_BUFFER,
                descriptor_count: sizes.sets,
            },
            vk::DescriptorPoolSize {
                ty: vk::DescriptorType::STORAGE_BUFFER,
                descriptor_count: sizes.sets * sizes.storage_per_set,
            },
        ];
        let info = vk::DescriptorPoolCreateInfo::default()
            .max_sets(sizes.sets)
            .pool_sizes(&pool_sizes);
        // SAFETY: valid device and create info.
        self.descriptor_pool =
            unsafe { dev.create_descriptor_pool(&info, None) }.map_err(|e| vk_error(e, "vkCreateDescriptorPool"))?;
        Ok(())
    }

    pub(super) fn staging(&self) -> Result<&HostBuffer> {
        self.staging
            .as_ref()
            .ok_or_else(|| backend_error("staging buffer missing"))
    }

    pub(super) fn staging_mut(&mut self) -> Result<&mut HostBuffer> {
        self.staging
            .as_mut()
            .ok_or_else(|| backend_error("staging buffer missing"))
    }

    pub(super) fn staging_capacity(&self) -> u64 {
        self.staging.as_ref().map_or(0, HostBuffer::size)
    }

    pub(super) fn uniforms_mut(&mut self) -> Result<&mut HostBuffer> {
        self.uniforms
            .as_mut()
            .ok_or_else(|| backend_error("uniform ring missing"))
    }

    /// Makes the slot free for recording: counters cleared, fence unsignalled,
    /// command and descriptor pools reset.
    ///
    /// # Safety
    ///
    /// The slot's submission has finished (its fence was waited for), was
    /// never made, or the device is lost and runs nothing.
    pub(super) unsafe fn reset(&mut self, device: &Device) -> Result<()> {
        self.staging_used = 0;
        self.uniform_used = 0;
        self.sets_used = 0;
        self.queries_used = 0;
        self.labels.clear();
        self.submission = None;
        self.epoch = None;
        self.lane_waits = (0, 0);
        let dev = &device.raw;
        // SAFETY: the caller guarantees no command buffer or descriptor set
        // of this slot is in use.
        unsafe {
            dev.reset_fences(&[self.fence])
                .and_then(|()| dev.reset_command_pool(self.pool, vk::CommandPoolResetFlags::empty()))
                .and_then(|()| dev.reset_descriptor_pool(self.descriptor_pool, vk::DescriptorPoolResetFlags::empty()))
        }
        .map_err(|e| vk_error(e, "resetting a command slot"))
    }

    /// Destroys the slot's objects (each once; null handles are ignored).
    ///
    /// # Safety
    ///
    /// As for [`Slot::reset`]: nothing of the slot is in use on the device.
    pub(super) unsafe fn destroy(&mut self, device: &Device) {
        let dev = &device.raw;
        // SAFETY: the caller guarantees nothing of the slot is in use; the
        // handles are taken or destroyed once.
        unsafe {
            if let Some(s) = self.staging.take() {
                s.destroy(device);
            }
            if let Some(u) = self.uniforms.take() {
                u.destroy(device);
            }
            dev.destroy_descriptor_pool(self.descriptor_pool, None);
            dev.destroy_fence(self.fence, None);
            dev.destroy_command_pool(self.pool, None);
        }
        self.descriptor_pool = vk::DescriptorPool::null();
        self.fence = vk::Fence::null();
        self.pool = vk::CommandPool::null();
        self.cmd = vk::CommandBuffer::null();
    }
}
