//! headkl on a trainer's wgpu device: the backend built from the caller's
//! `Device` and `Queue`, views of the caller's buffers, and the
//! device-resident kernels ([`headkl_core::ResidentBackend`]).

use headkl_core::{Error, ResidentBackend, Result};

use headkl_core::toolkit::gemm_choice::KernelLimits;

use crate::adapter;
use crate::buffer::WgpuBuffer;
use crate::device::{OpenOptions, WgpuBackend};

impl WgpuBackend {
    /// The features a device needs for headkl: `SHADER_F16`, plus
    /// `SUBGROUP` and `EXPERIMENTAL_COOPERATIVE_MATRIX` for the matrix-unit
    /// GEMM (without them the tiled GEMM runs), `PASSTHROUGH_SHADERS` with
    /// them on a Vulkan adapter (the GLSL GEMM tiles' SPIR-V; without it a
    /// `glsl:` choice is refused) and `TIMESTAMP_QUERY` for kernel timing,
    /// where `adapter` offers them. A trainer adds these to
    /// its own `DeviceDescriptor::required_features`, with the adapter's
    /// `max_storage_buffer_binding_size` and `max_buffer_size` limits (the
    /// head is cut into slices that fit the binding limit) and
    /// the workgroup memory and size the row kernels need
    /// (`headkl_core::toolkit::kernels::device_misfit`).
    pub fn required_features(adapter: &wgpu::Adapter) -> wgpu::Features {
        let candidate = adapter::describe(adapter.clone());
        adapter::features_for(&candidate, candidate.coop.is_ok())
    }

    /// The `DeviceDescriptor::experimental_features` that go with
    /// `features` (normally [`Self::required_features`]): enabled where
    /// they hold `EXPERIMENTAL_COOPERATIVE_MATRIX`, since wgpu refuses to
    /// open a device with that feature otherwise; disabled where not.
    /// headkl's own use of the experimental feature is the matrix-unit
    /// GEMM, whose shapes come from the adapter's list.
    pub fn experimental_features(features: wgpu::Features) -> wgpu::ExperimentalFeatures {
        adapter::experimental_for(features)
    }

    /// headkl on the caller's device and queue: kernels are recorded into
    /// headkl's own command encoders and submitted to `queue`, so they are
    /// ordered after the trainer's earlier submissions and before its later
    /// ones. The backend allocates its own scratch and head planes on
    /// `device`; the caller's error and device-lost callbacks stay in place
    /// (errors inside headkl's calls come back as `Err` through error
    /// scopes).
    ///
    /// Fails with [`Error::MissingFeature`] naming what `device` lacks:
    /// `SHADER_F16`, the workgroup memory or size the row kernels need, or
    /// 7 storage buffers per shader stage.
    /// The matrix-unit GEMM runs where `device` has `SUBGROUP` and
    /// `EXPERIMENTAL_COOPERATIVE_MATRIX` enabled and `adapter` offers the
    /// 16×16×16 f16 shape at a fixed subgroup size; otherwise the tiled GEMM.
    ///
    /// On a Vulkan adapter the queue family matters: on NVIDIA, work on the
    /// graphics family (where `Adapter::request_device` puts every wgpu
    /// device) runs headkl's GEMMs up to 2.6× slower than on the
    /// compute-only family. Open the device with [`crate::request_device`]
    /// to get the family `HEADKL_QUEUE=auto` picks.
    pub fn from_device(
        adapter: &wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
        options: &OpenOptions,
    ) -> Result<Self> {
        let candidate = adapter::describe(adapter.clone());
        let features = device.features();
        let limits = device.limits();
        let mut missing = Vec::new();
        if !features.contains(wgpu::Features::SHADER_F16) {
            missing.push("wgpu::Features::SHADER_F16 (f16 arithmetic and 16-bit storage)".to_string());
        }
        let kernel_limits = KernelLimits {
            shared_bytes: limits.max_compute_workgroup_storage_size,
            invocations: limits
                .max_compute_invocations_per_workgroup
                .min(limits.max_compute_workgroup_size_x),
            subgroup_size: 0,
            subgroup_builtins: features.contains(wgpu::Features::SUBGROUP),
            spirv: adapter::spirv_passthrough(adapter, features),
            ptx: false,
        };
        if let Some(why) = headkl_core::toolkit::kernels::device_misfit(&kernel_limits) {
            missing.push(why);
        }
        if limits.max_storage_buffers_per_shader_stage < 7 {
            missing.push(format!(
                "max_storage_buffers_per_shader_stage >= 7 (the device has {})",
                limits.max_storage_buffers_per_shader_stage
            ));
        }
        if !missing.is_empty() {
            return Err(Error::MissingFeature(format!(
                "{}: the caller's wgpu device lacks {}",
                candidate.info.device_name,
                missing.join(", ")
            )));
        }
        let force_tiled = options.common.force_fallback;
        let coop_enabled =
            features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SUBGROUP);
        let use_coop = candidate.coop.is_ok() && coop_enabled && !force_tiled;
        let queue_family = crate::queue::describe_family(adapter, &device).map(|q| format!("{q}, the caller's"));
        let mut backend = Self::from_parts(candidate, device, queue, use_coop, force_tiled, options, false)?;
        backend.info.queue = queue_family;
        Ok(backend)
    }

    /// A view of the caller's `buffer`: `bytes` bytes from byte `offset`.
    /// The buffer must have `STORAGE` usage (and `COPY_SRC` / `COPY_DST`
    /// for [`headkl_core::Backend::download`] / `upload` on it) and belong
    /// to this backend's device; a view used by a kernel must start at a
    /// multiple of 256 bytes. The view holds a reference to the buffer; it
    /// does not count in [`headkl_core::Backend::memory`].
    pub fn wrap_buffer(&self, buffer: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<WgpuBuffer> {
        let field = "wrapped buffer";
        if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!("has usage {:?}, without STORAGE", buffer.usage()),
            });
        }
        if offset.checked_add(bytes).is_none_or(|end| end > buffer.size()) {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!("view of {bytes} bytes at {offset} is past its {} bytes", buffer.size()),
            });
        }
        if bytes == 0 || !bytes.is_multiple_of(4) || !offset.is_multiple_of(4) {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!("view of {bytes} bytes at {offset}: offset and length must be non-zero multiples of 4"),
            });
        }
        if bytes > self.info.max_binding_bytes {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!(
                    "view of {bytes} bytes exceeds the largest storage binding ({} bytes)",
                    self.info.max_binding_bytes
                ),
            });
        }
        Ok(WgpuBuffer::external(buffer.clone(), offset, bytes, self.shared.clone()))
    }

    /// The queue headkl submits to.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }
}

impl ResidentBackend for WgpuBackend {
    fn buffer_len(&self, buffer: &WgpuBuffer) -> u64 {
        buffer.bytes
    }

    fn buffer_offset(&self, buffer: &WgpuBuffer) -> u64 {
        buffer.offset
    }

    fn submit(&self) -> Result<()> {
        self.flush()
    }

    /// A view of the same wgpu buffer at a further offset: how the
    /// resident head gradient past one binding is written, a binding at a
    /// time.
    fn window(&self, buffer: &WgpuBuffer, offset: u64, len: u64) -> Option<WgpuBuffer> {
        if len > self.info.max_binding_bytes {
            return None;
        }
        buffer.window(offset, len)
    }
}
