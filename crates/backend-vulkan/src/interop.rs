//! Memory and a timeline semaphore shared with another API on the same GPU
//! (CUDA, for PyTorch's tensors) through POSIX fds: buffers whose memory
//! the other API maps (`VK_KHR_external_memory_fd`), and one timeline
//! semaphore both sides wait on and signal (`VK_KHR_external_semaphore_fd`),
//! so the two order their work on the device with no host wait.

use std::os::fd::{FromRawFd, OwnedFd};

use ash::vk;
use headkl_core::{Error, Result};

use crate::conv::vk_error;
use crate::memory::VulkanBuffer;
use crate::VulkanBackend;

/// A buffer whose memory another API can import: the buffer, an opaque fd
/// of its memory (the importer takes it over), and the bytes allocated
/// (what the importer maps; at least the buffer's length).
#[derive(Debug)]
pub struct ExportedBuffer {
    /// The buffer, for headkl's calls.
    pub buffer: VulkanBuffer,
    /// The memory's fd (`VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT`,
    /// a dedicated allocation).
    pub fd: OwnedFd,
    /// Bytes of memory behind the fd.
    pub allocation_bytes: u64,
}

impl VulkanBackend {
    /// Whether this device can share memory and a timeline with another
    /// API, or why not.
    pub fn interop(&self) -> Result<()> {
        if self.device.enabled.external_fd {
            return Ok(());
        }
        let caps = &self.device.caps;
        let why = if !caps.external_fd {
            "it lacks VK_KHR_external_memory_fd or VK_KHR_external_semaphore_fd"
        } else if !caps.timeline_semaphore {
            "it lacks timeline semaphores"
        } else {
            "the caller's device was not opened with the external memory and semaphore extensions"
        };
        Err(Error::MissingFeature(format!(
            "{}: cannot share memory with CUDA: {why}",
            caps.name
        )))
    }

    /// `VkPhysicalDeviceIDProperties::deviceUUID`: the same 16 bytes as
    /// CUDA's `cuDeviceGetUuid` for the same GPU.
    pub fn device_uuid(&self) -> [u8; 16] {
        self.device.caps.device_uuid
    }

    /// A device-local buffer of `bytes` bytes whose memory another API
    /// can import.
    pub fn export_buffer(&self, bytes: u64, label: &'static str) -> Result<ExportedBuffer> {
        self.interop()?;
        let buffer = VulkanBuffer::exportable(&self.device, bytes, label)?;
        let (fd, allocation_bytes) = buffer.export_fd()?;
        Ok(ExportedBuffer {
            buffer,
            fd,
            allocation_bytes,
        })
    }

    /// An opaque fd of the backend's shared timeline semaphore (made on
    /// first use, starting at 0). Each call gives a new fd.
    pub fn export_timeline(&self) -> Result<OwnedFd> {
        self.interop()?;
        let semaphore = self.stream()?.shared_timeline()?;
        let loader = ash::khr::external_semaphore_fd::Device::new(&self.device.instance.raw, &self.device.raw);
        let info = vk::SemaphoreGetFdInfoKHR::default()
            .semaphore(semaphore)
            .handle_type(vk::ExternalSemaphoreHandleTypeFlags::OPAQUE_FD);
        // SAFETY: a live semaphore made exportable as an opaque fd on this
        // device, with VK_KHR_external_semaphore_fd enabled.
        let fd = unsafe { loader.get_semaphore_fd(&info) }.map_err(|e| vk_error(e, "vkGetSemaphoreFdKHR"))?;
        // SAFETY: vkGetSemaphoreFdKHR returned a new fd that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// headkl's next submission waits for the shared timeline to reach
    /// `value` (signalled by the other API once the inputs are written).
    pub fn wait_timeline(&self, value: u64) -> Result<()> {
        self.interop()?;
        self.stream()?.wait_shared(value)
    }

    /// Submits what headkl has recorded and signals the shared timeline
    /// with `value` once all of it has finished on the device (the other
    /// API waits for it before reading the outputs). No host wait.
    pub fn signal_timeline(&self, value: u64) -> Result<()> {
        self.interop()?;
        self.stream()?.signal_shared(value)
    }
}
