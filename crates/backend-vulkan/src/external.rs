//! headkl on a trainer's Vulkan device: the backend built from the caller's
//! ash instance, physical device, device and queue; views of the caller's
//! `vk::Buffer`s; and the device-resident kernels
//! ([`headkl_core::ResidentBackend`]).

use ash::vk;
use headkl_core::toolkit::gemm_choice::resolve_choice;
use headkl_core::{Error, ResidentBackend, Result};

use crate::adapter;
use crate::command;
use crate::conv::BACKEND;
use crate::device::{Device, Enabled};
use crate::instance::Instance;
use crate::kernels;
use crate::memory::VulkanBuffer;
use crate::{VulkanBackend, VulkanOptions, DEFAULT_GEMM};

/// The caller's Vulkan objects [`VulkanBackend::from_raw`] runs on.
pub struct ExternalVulkan {
    /// The loader's entry points the instance was made with.
    pub entry: ash::Entry,
    /// The caller's instance.
    pub instance: ash::Instance,
    /// The `apiVersion` the instance was created with (1.1 or newer).
    pub api_version: u32,
    /// The physical device the device was made on.
    pub physical_device: vk::PhysicalDevice,
    /// The caller's logical device.
    pub device: ash::Device,
    /// The queue headkl submits to: `(queue family, index)`. The family must
    /// support compute.
    pub queue: (u32, u32),
    /// Whether the device was created with `VK_KHR_cooperative_matrix`
    /// (feature `cooperativeMatrix`) and the Vulkan memory model
    /// (`vulkanMemoryModel`, `vulkanMemoryModelDeviceScope`): then the GEMM
    /// runs on matrix units where the device offers the 16×16×16 f16 shape
    /// at a fixed subgroup size; otherwise the tiled GEMM.
    pub matrix_units: bool,
}

impl VulkanBackend {
    /// headkl on the caller's device: work is recorded into headkl's own
    /// command buffers and submitted to the caller's queue `ext.queue`.
    /// headkl allocates its own scratch and head planes on the device.
    ///
    /// # Safety
    ///
    /// - Every handle in `ext` is valid and stays alive (not destroyed) until
    ///   the backend and every buffer and engine made from it are dropped;
    ///   headkl never destroys them.
    /// - `ext.device` was created from `ext.instance` on
    ///   `ext.physical_device` with queue `ext.queue` (a compute-capable
    ///   family), with `storageBuffer16BitAccess`,
    ///   `uniformAndStorageBuffer16BitAccess` (`VK_KHR_16bit_storage` or
    ///   Vulkan 1.1) and `shaderFloat16` (`VK_KHR_shader_float16_int8` or
    ///   Vulkan 1.2) enabled, and, when `ext.matrix_units` is set,
    ///   `VK_KHR_cooperative_matrix` with `cooperativeMatrix`,
    ///   `vulkanMemoryModel` and `vulkanMemoryModelDeviceScope`.
    /// - While a headkl call runs, nothing else submits to that queue from
    ///   another thread (Vulkan requires external synchronization of a
    ///   queue); between calls the caller may submit freely, and its
    ///   submissions are ordered with headkl's by the queue.
    pub unsafe fn from_raw(ext: ExternalVulkan, options: &VulkanOptions) -> Result<Self> {
        let instance = Instance::external(ext.entry, ext.instance, ext.api_version);
        let mut caps = adapter::query_caps(&instance, ext.physical_device)?;
        // The caller's device was not opened with VK_NVX_binary_import and
        // buffer device addresses for headkl: no PTX tiles on it.
        caps.nvx_binary_import = false;
        if let Some(why) = &caps.unusable {
            return Err(Error::MissingFeature(format!("{}: {why}", caps.name)));
        }
        let (choice, source) = resolve_choice(
            options.common.gemm,
            headkl_core::GemmChoice::default_for(DEFAULT_GEMM, Some(&kernels::kernel_limits(&caps))),
            &options.common.gemm_sources,
            BACKEND,
            &caps.name,
            &caps.driver,
        )?;
        // Without subgroup-size control (not asked of the caller) the GEMM's
        // subgroup size cannot be pinned: only a fixed size qualifies.
        let coop = match kernels::coop_plan(&caps, choice, source)? {
            Some(plan) if ext.matrix_units && !options.common.force_fallback && !plan.require_size => Some(plan),
            _ => None,
        };
        let enabled = Enabled {
            cooperative_matrix: coop.is_some(),
            ..Enabled::default()
        };
        let device = Device::external(instance, ext.physical_device, caps, ext.device, ext.queue, enabled);
        let queue = format!("{}, the caller's", device.queue_description());
        Self::assemble(device, options, coop, None, queue, command::STAGING_BYTES)
    }

    /// A view of `bytes` bytes at byte `offset` of the caller's `buffer`,
    /// up to the device's largest buffer: one past the largest binding is
    /// for what is written a binding at a time (the resident head
    /// gradient, `DeviceLossOptions::head_grad_out`).
    ///
    /// # Safety
    ///
    /// `buffer` was created on this backend's device with
    /// `STORAGE_BUFFER` usage (and `TRANSFER_SRC` / `TRANSFER_DST` for
    /// [`headkl_core::Backend::download`] / `upload` on the view), is bound
    /// to memory, is at least `offset + bytes` bytes long, and stays alive
    /// while any headkl work using the view may run (until
    /// [`headkl_core::Engine::wait_device`] or
    /// [`headkl_core::Backend::finish`] returns after the last use).
    pub unsafe fn wrap_buffer(&self, buffer: vk::Buffer, offset: u64, bytes: u64) -> Result<VulkanBuffer> {
        let field = "wrapped buffer";
        if buffer == vk::Buffer::null() {
            return Err(Error::DeviceBuffer {
                field,
                reason: "is VK_NULL_HANDLE".into(),
            });
        }
        // Kernels also need the offset at a multiple of 256 (checked by the
        // engine: Vulkan's largest minStorageBufferOffsetAlignment).
        if bytes == 0 || !bytes.is_multiple_of(4) || !offset.is_multiple_of(4) {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!("view of {bytes} bytes at {offset}: offset and length must be non-zero multiples of 4"),
            });
        }
        // A view past one binding serves what binds it a window at a time
        // (the resident head gradient); a kernel that would reach past one
        // binding of it is refused by its launch's check.
        if bytes > self.device.caps.max_buffer_bytes {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!(
                    "view of {bytes} bytes exceeds the device's largest buffer ({} bytes)",
                    self.device.caps.max_buffer_bytes
                ),
            });
        }
        Ok(VulkanBuffer::external(&self.device, buffer, offset, bytes))
    }
}

impl ResidentBackend for VulkanBackend {
    fn buffer_len(&self, buffer: &VulkanBuffer) -> u64 {
        headkl_core::DeviceBuffer::len(buffer)
    }

    fn buffer_offset(&self, buffer: &VulkanBuffer) -> u64 {
        buffer.offset()
    }

    fn submit(&self) -> Result<()> {
        self.stream()?.submit()
    }

    /// A view of the same handle at a further offset (descriptors bind
    /// ranges of a buffer): how the resident head gradient past one
    /// binding is written, a binding at a time.
    fn window(&self, buffer: &VulkanBuffer, offset: u64, len: u64) -> Option<VulkanBuffer> {
        if len > self.device.caps.max_storage_buffer_range || self.check_device(buffer, "window").is_err() {
            return None;
        }
        buffer.window(offset, len)
    }
}
