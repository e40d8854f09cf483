//! Buffers and their memory: device-local buffers the driver sees, and the
//! persistently mapped host-visible buffers used for staging and uniforms.

use std::ptr::NonNull;
use std::sync::Arc;

use ash::vk;
use headkl_core::{Error, Result};

use crate::conv::{alloc_error, backend_error};
use crate::device::Device;

/// A buffer and its dedicated memory.
#[derive(Debug)]
pub(crate) struct RawBuffer {
    pub(crate) buffer: vk::Buffer,
    pub(crate) memory: vk::DeviceMemory,
    /// Bytes usable (what was asked, rounded up to 4).
    pub(crate) size: u64,
    /// Bytes of memory allocated (counted in the memory stats when
    /// `counted`).
    allocated: u64,
    counted: bool,
}

impl RawBuffer {
    /// Destroys the buffer and frees its memory.
    ///
    /// # Safety
    /// The GPU must be done with it and it must have been made on `device`.
    pub(crate) unsafe fn destroy(self, device: &Device) {
        // SAFETY: per the contract above.
        unsafe {
            device.raw.destroy_buffer(self.buffer, None);
            device.raw.free_memory(self.memory, None);
        }
        if self.counted {
            device.counters.sub(self.allocated);
        }
    }
}

/// The index of a memory type allowed by `type_bits` that has all of
/// `required`, preferring one with none of `avoid`.
pub(crate) fn find_memory_type(
    props: &vk::PhysicalDeviceMemoryProperties,
    type_bits: u32,
    required: vk::MemoryPropertyFlags,
    avoid: vk::MemoryPropertyFlags,
) -> Option<u32> {
    let types = props.memory_types_as_slice();
    let allowed = |i: usize| type_bits & (1 << i) != 0 && types[i].property_flags.contains(required);
    (0..types.len())
        .find(|&i| allowed(i) && !types[i].property_flags.intersects(avoid))
        .or_else(|| (0..types.len()).find(|&i| allowed(i)))
        .map(|i| i as u32)
}

/// Where a buffer's memory goes: a type that has `required` (and, if
/// possible, none of `avoid`), and whether another API may import it
/// through a POSIX fd (`VK_KHR_external_memory_fd`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Placement {
    pub(crate) required: vk::MemoryPropertyFlags,
    pub(crate) avoid: vk::MemoryPropertyFlags,
    pub(crate) export: bool,
}

impl Placement {
    /// Memory with `required`, preferably none of `avoid`, not exported.
    pub(crate) fn new(required: vk::MemoryPropertyFlags, avoid: vk::MemoryPropertyFlags) -> Self {
        Self {
            required,
            avoid,
            export: false,
        }
    }
}

/// Creates a buffer of `bytes` bytes with dedicated memory placed as
/// `placement` says. Memory exhaustion is [`Error::OutOfMemory`] naming
/// `what` and the bytes asked.
pub(crate) fn create_buffer(
    device: &Device,
    bytes: u64,
    usage: vk::BufferUsageFlags,
    placement: Placement,
    what: &'static str,
    counted: bool,
) -> Result<RawBuffer> {
    let Placement {
        required,
        avoid,
        export,
    } = placement;
    let size = bytes.max(4).div_ceil(4) * 4;
    if size > device.caps.max_buffer_bytes {
        return Err(Error::OutOfMemory { bytes, what });
    }
    // Shared by the kernels' and the copies' families where they differ:
    // a queue family ownership transfer would need a release recorded on
    // the queue that used the buffer last, in a command buffer that may
    // already be submitted when the next use on the other queue is known.
    let mut external =
        vk::ExternalMemoryBufferCreateInfo::default().handle_types(vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD);
    let mut info = vk::BufferCreateInfo::default().size(size).usage(usage);
    if export {
        info = info.push_next(&mut external);
    }
    let info = if device.sharing.is_empty() {
        info.sharing_mode(vk::SharingMode::EXCLUSIVE)
    } else {
        info.sharing_mode(vk::SharingMode::CONCURRENT)
            .queue_family_indices(&device.sharing)
    };
    // SAFETY: valid device and create info.
    let buffer = unsafe { device.raw.create_buffer(&info, None) }.map_err(|e| alloc_error(e, bytes, what))?;
    // SAFETY: `buffer` was just created on this device.
    let req = unsafe { device.raw.get_buffer_memory_requirements(buffer) };
    let free_buffer = |err: Error| {
        // SAFETY: the buffer is unused and has no memory bound.
        unsafe { device.raw.destroy_buffer(buffer, None) };
        err
    };
    let Some(type_index) = find_memory_type(&device.memory_properties, req.memory_type_bits, required, avoid) else {
        return Err(free_buffer(backend_error(format!(
            "{what}: no memory type with {required:?} for this buffer"
        ))));
    };
    let mut dedicated = vk::MemoryDedicatedAllocateInfo::default().buffer(buffer);
    let mut address = vk::MemoryAllocateFlagsInfo::default().flags(vk::MemoryAllocateFlags::DEVICE_ADDRESS);
    let mut exported =
        vk::ExportMemoryAllocateInfo::default().handle_types(vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD);
    let mut alloc = vk::MemoryAllocateInfo::default()
        .allocation_size(req.size)
        .memory_type_index(type_index)
        .push_next(&mut dedicated);
    if usage.contains(vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS) {
        alloc = alloc.push_next(&mut address);
    }
    if export {
        alloc = alloc.push_next(&mut exported);
    }
    // SAFETY: valid device; the type index comes from this device's list and
    // the dedicated buffer is this (unbound) buffer.
    let memory = match unsafe { device.raw.allocate_memory(&alloc, None) } {
        Ok(m) => m,
        Err(e) => return Err(free_buffer(alloc_error(e, bytes, what))),
    };
    // SAFETY: fresh buffer and memory of the required size and type.
    if let Err(e) = unsafe { device.raw.bind_buffer_memory(buffer, memory, 0) } {
        // SAFETY: the memory is not in use.
        unsafe { device.raw.free_memory(memory, None) };
        return Err(free_buffer(alloc_error(e, bytes, what)));
    }
    if counted {
        device.counters.add(req.size);
    }
    Ok(RawBuffer {
        buffer,
        memory,
        size,
        allocated: req.size,
        counted,
    })
}

/// A device buffer handed to the driver. It frees itself when dropped
/// (after the GPU is done with it); it holds the device alive.
pub struct VulkanBuffer {
    pub(crate) device: Arc<Device>,
    /// `None` during drop, and for a view of a caller's buffer.
    raw: Option<RawBuffer>,
    /// A caller's buffer: handle, byte offset and length of the view (the
    /// caller owns and frees it).
    view: Option<(vk::Buffer, u64, u64)>,
    label: &'static str,
}

impl headkl_core::DeviceBuffer for VulkanBuffer {
    /// Usable size in bytes (a view's length).
    fn len(&self) -> u64 {
        if let Some((_, _, bytes)) = self.view {
            return bytes;
        }
        self.raw.as_ref().map_or(0, |r| r.size)
    }
}

impl VulkanBuffer {
    /// A device-local storage buffer of `bytes` bytes.
    pub(crate) fn new(device: &Arc<Device>, bytes: u64, label: &'static str) -> Result<Self> {
        Self::allocate(device, bytes, label, false)
    }

    /// A device-local storage buffer whose memory another API may import
    /// through a POSIX fd ([`Self::export_fd`]).
    pub(crate) fn exportable(device: &Arc<Device>, bytes: u64, label: &'static str) -> Result<Self> {
        Self::allocate(device, bytes, label, true)
    }

    fn allocate(device: &Arc<Device>, bytes: u64, label: &'static str, export: bool) -> Result<Self> {
        // Where the PTX tiles can run, every buffer has a device address
        // (their only way to the buffers).
        let address = if device.enabled.ptx {
            vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS
        } else {
            vk::BufferUsageFlags::empty()
        };
        let usage = vk::BufferUsageFlags::STORAGE_BUFFER
            | vk::BufferUsageFlags::TRANSFER_SRC
            | vk::BufferUsageFlags::TRANSFER_DST
            | address;
        let local = Placement {
            export,
            ..Placement::new(
                vk::MemoryPropertyFlags::DEVICE_LOCAL,
                vk::MemoryPropertyFlags::HOST_VISIBLE,
            )
        };
        let raw = create_buffer(device, bytes, usage, local, label, true).or_else(|e| match e {
            // A device without device-local memory for buffers (none known)
            // still has some memory type that takes them.
            Error::Backend { .. } | Error::Driver { .. } => {
                let any = Placement {
                    export,
                    ..Placement::new(vk::MemoryPropertyFlags::empty(), vk::MemoryPropertyFlags::empty())
                };
                create_buffer(device, bytes, usage, any, label, true)
            }
            other => Err(other),
        })?;
        Ok(Self {
            device: Arc::clone(device),
            raw: Some(raw),
            view: None,
            label,
        })
    }

    /// A POSIX fd of an [`Self::exportable`] buffer's memory
    /// (`VK_KHR_external_memory_fd`, opaque), and the bytes allocated (what
    /// the importer maps). Each call gives a new fd, which the caller owns.
    pub(crate) fn export_fd(&self) -> Result<(std::os::fd::OwnedFd, u64)> {
        use std::os::fd::FromRawFd;
        let Some(raw) = self.raw.as_ref() else {
            return Err(backend_error(format!(
                "{}: a caller's buffer cannot be exported",
                self.label
            )));
        };
        let loader = ash::khr::external_memory_fd::Device::new(&self.device.instance.raw, &self.device.raw);
        let info = vk::MemoryGetFdInfoKHR::default()
            .memory(raw.memory)
            .handle_type(vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD);
        // SAFETY: the memory is alive and was allocated exportable as an
        // opaque fd (the caller made the buffer with `exportable`, on a
        // device with VK_KHR_external_memory_fd enabled).
        let fd = unsafe { loader.get_memory_fd(&info) }.map_err(|e| crate::conv::vk_error(e, "vkGetMemoryFdKHR"))?;
        // SAFETY: vkGetMemoryFdKHR returned a new fd that we now own.
        Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, raw.allocated))
    }

    /// A view of `bytes` bytes at `offset` of a caller's `buffer` (made on
    /// `device`; the caller keeps it alive while the view is used).
    pub(crate) fn external(device: &Arc<Device>, buffer: vk::Buffer, offset: u64, bytes: u64) -> Self {
        Self {
            device: Arc::clone(device),
            raw: None,
            view: Some((buffer, offset, bytes)),
            label: "caller's buffer",
        }
    }

    /// `len` bytes of this buffer from byte `offset` as a buffer of their
    /// own for one binding ([`headkl_core::ResidentBackend::window`]): the
    /// same handle at a further offset, owning nothing, so dropping it frees
    /// nothing (the trait has it live no longer than the call that binds
    /// it, inside its parent's life). `None` where the range is empty, not
    /// inside this buffer or not in whole words, or starts off
    /// [`headkl_core::resident::VIEW_ALIGN`] in the handle, as a caller's
    /// views must.
    pub(crate) fn window(&self, offset: u64, len: u64) -> Option<Self> {
        use headkl_core::DeviceBuffer;
        let end = offset.checked_add(len)?;
        let start = self.offset().checked_add(offset)?;
        if len == 0
            || end > self.len()
            || !len.is_multiple_of(4)
            || !start.is_multiple_of(headkl_core::resident::VIEW_ALIGN)
        {
            return None;
        }
        Some(Self {
            device: Arc::clone(&self.device),
            raw: None,
            view: Some((self.handle(), start, len)),
            label: "window",
        })
    }

    /// Where a view starts in the caller's buffer (0 for headkl's own).
    pub fn offset(&self) -> u64 {
        self.view.map_or(0, |(_, offset, _)| offset)
    }

    /// Whether this is a view of a caller's buffer (shared with no other
    /// queue family, so it stays on the kernels' queue).
    pub(crate) fn is_view(&self) -> bool {
        self.view.is_some()
    }

    /// The label given at allocation.
    pub fn label(&self) -> &'static str {
        self.label
    }

    /// The Vulkan handle (valid while `self` lives).
    /// The buffer's device address, for the PTX tiles. Only headkl's own
    /// buffers have one (made with it where the device can launch them); a
    /// view of a caller's buffer is refused.
    pub(crate) fn device_address(&self) -> Result<u64> {
        if self.view.is_some() || !self.device.enabled.ptx {
            return Err(backend_error(format!(
                "{}: the PTX tiles need a buffer headkl made with a device address",
                self.label
            )));
        }
        let info = vk::BufferDeviceAddressInfo::default().buffer(self.handle());
        // SAFETY: the buffer is alive, was made with SHADER_DEVICE_ADDRESS
        // (device.enabled.ptx) and its memory with DEVICE_ADDRESS.
        Ok(unsafe { self.device.raw.get_buffer_device_address(&info) })
    }

    pub(crate) fn handle(&self) -> vk::Buffer {
        if let Some((buffer, _, _)) = self.view {
            return buffer;
        }
        self.raw.as_ref().map_or(vk::Buffer::null(), |r| r.buffer)
    }
}

impl std::fmt::Debug for VulkanBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VulkanBuffer")
            .field("label", &self.label)
            .field("size", &headkl_core::DeviceBuffer::len(self))
            .finish()
    }
}

impl Drop for VulkanBuffer {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            self.device.release(raw);
        }
    }
}

/// A persistently mapped, host-coherent buffer (staging or uniforms). Its
/// owner destroys it explicitly with [`HostBuffer::destroy`].
pub(crate) struct HostBuffer {
    pub(crate) raw: RawBuffer,
    ptr: NonNull<u8>,
}

// SAFETY: the mapping is plain memory; every access goes through `&mut self`
// or happens while the owner's lock is held.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    /// A mapped buffer of `bytes` bytes for `usage`; `cached` prefers a
    /// host-cached type (for reading back).
    pub(crate) fn new(
        device: &Device,
        bytes: u64,
        usage: vk::BufferUsageFlags,
        cached: bool,
        what: &'static str,
    ) -> Result<Self> {
        let coherent = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        let make = |required| {
            let placement = Placement::new(required, vk::MemoryPropertyFlags::empty());
            create_buffer(device, bytes, usage, placement, what, false)
        };
        let raw = if cached {
            make(coherent | vk::MemoryPropertyFlags::HOST_CACHED).or_else(|_| make(coherent))?
        } else {
            make(coherent)?
        };
        // SAFETY: host-visible memory, not yet mapped, whole range.
        let mapped = unsafe {
            device
                .raw
                .map_memory(raw.memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty())
        };
        let ptr = match mapped.map(|p| NonNull::new(p.cast::<u8>())) {
            Ok(Some(p)) => p,
            Ok(None) | Err(_) => {
                // SAFETY: the buffer is unused.
                unsafe { raw.destroy(device) };
                return Err(Error::OutOfMemory { bytes, what });
            }
        };
        Ok(Self { raw, ptr })
    }

    /// Usable size in bytes.
    pub(crate) fn size(&self) -> u64 {
        self.raw.size
    }

    /// Copies `data` into the mapping at `offset`.
    pub(crate) fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset.saturating_add(data.len() as u64);
        assert!(end <= self.raw.size, "host buffer write out of range");
        // SAFETY: the range was checked against the mapped size; the memory
        // is host-coherent and the GPU is not using this range (the stream
        // hands out each range once per submission).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset as usize), data.len()) };
        headkl_core::toolkit::host::parallel_copy(data, dst);
    }

    /// Copies the mapping at `offset` into `out`.
    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) {
        let end = offset.saturating_add(out.len() as u64);
        assert!(end <= self.raw.size, "host buffer read out of range");
        // SAFETY: the range was checked; the GPU finished writing it (the
        // stream waited on the fence) and coherent memory needs no
        // invalidation.
        let src = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), out.len()) };
        headkl_core::toolkit::host::parallel_copy(src, out);
    }

    /// Unmaps and frees the buffer.
    ///
    /// # Safety
    /// The GPU must be done with it; it must have been made on `device`.
    pub(crate) unsafe fn destroy(self, device: &Device) {
        // SAFETY: per the contract; unmapping before freeing.
        unsafe {
            device.raw.unmap_memory(self.raw.memory);
            self.raw.destroy(device);
        }
    }
}
