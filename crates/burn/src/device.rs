//! One wgpu device for burn and headkl: burn's runtime registered on a
//! device that has what headkl needs, and the handles headkl opens on.

use burn::tensor::wgpu::WgpuSetup;
use burn::tensor::Device;
use headkl_core::{Error, Result};
use headkl_wgpu::{OpenOptions, WgpuBackend};

/// headkl binds a caller's buffer only at an offset that is a multiple of
/// this (`Engine::head_kl_device`'s views); burn's allocator aligns every
/// tensor to the device's `min_{storage,uniform}_buffer_offset_alignment`,
/// so a device opened with both at least this makes every fresh burn tensor
/// bindable in place.
pub const BIND_ALIGN: u64 = headkl_core::resident::VIEW_ALIGN;

/// A wgpu device shared by burn and headkl: the burn [`Device`] tensors are
/// made on, and the wgpu handles headkl's backend opens on
/// ([`crate::HeadKl::new`]).
#[derive(Clone, Debug)]
pub struct SharedDevice {
    device: Device,
    adapter: wgpu::Adapter,
    wgpu_device: wgpu::Device,
    queue: wgpu::Queue,
}

/// How [`SharedDevice::open`] opens the device.
#[derive(Clone, Debug, Default)]
pub struct DeviceOptions {
    /// headkl's backend options: the adapter index, the queue family
    /// (`queue`; `Auto` takes a compute-only family where there is one),
    /// the GEMM choice.
    pub headkl: OpenOptions,
    /// burn's `tasks_max` (kernels per submission); `None`: burn's default.
    pub burn_tasks_max: Option<usize>,
}

/// What a device needs for headkl and burn, as a descriptor a trainer
/// opening its own device starts from: headkl's features
/// ([`WgpuBackend::required_features`]) and every other feature the
/// adapter offers (burn compiles for those), the adapter's limits with
/// both offset alignments raised to [`BIND_ALIGN`] so burn's tensors are
/// bindable in place, and the experimental opt-in the matrix units need.
pub fn device_descriptor(adapter: &wgpu::Adapter) -> wgpu::DeviceDescriptor<'static> {
    // burn's runtime compiles for what the adapter offers (f32 atomics in
    // its reductions, say), not for what the device enabled: the device
    // takes every adapter feature, as burn's own devices do, besides
    // headkl's.
    let features = WgpuBackend::required_features(adapter)
        | adapter.features().difference(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
    let mut limits = adapter.limits();
    let align = BIND_ALIGN as u32;
    limits.min_storage_buffer_offset_alignment = limits.min_storage_buffer_offset_alignment.max(align);
    limits.min_uniform_buffer_offset_alignment = limits.min_uniform_buffer_offset_alignment.max(align);
    wgpu::DeviceDescriptor {
        label: Some("headkl-burn"),
        required_features: features,
        required_limits: limits,
        experimental_features: WgpuBackend::experimental_features(features),
        memory_hints: wgpu::MemoryHints::Performance,
        trace: wgpu::Trace::Off,
    }
}

fn burn_error(what: &str, err: impl std::fmt::Display) -> Error {
    Error::Backend {
        backend: crate::BACKEND,
        message: format!("{what}: {err}"),
    }
}

impl SharedDevice {
    /// headkl opens the device: the adapter `options.headkl.common.device` names
    /// (else the best usable one), on the queue family
    /// `options.headkl.common.queue` picks, with [`device_descriptor`]'s features
    /// and limits; then burn's wgpu runtime is registered on it.
    pub fn open(options: &DeviceOptions) -> crate::Result<Self> {
        let (instance, adapter) = headkl_wgpu::choose_adapter(options.headkl.common.device)?;
        let (wgpu_device, queue) =
            headkl_wgpu::request_device(&adapter, &device_descriptor(&adapter), options.headkl.common.queue)?;
        let setup = WgpuSetup {
            instance,
            backend: adapter.get_info().backend,
            adapter: adapter.clone(),
            device: wgpu_device.clone(),
            queue: queue.clone(),
        };
        let mut burn_options = Device::wgpu_options().setup(setup);
        if let Some(tasks) = options.burn_tasks_max {
            burn_options = burn_options.tasks_max(tasks);
        }
        let device = burn_options
            .init()
            .map_err(|e| burn_error("registering the device with burn", e))?;
        log::info!(
            "headkl-burn: {} ({:?})",
            adapter.get_info().name,
            adapter.get_info().backend
        );
        Ok(Self {
            device,
            adapter,
            wgpu_device,
            queue,
        })
    }

    /// The trainer made the device: `setup` is what it registered with
    /// burn (`Device::wgpu_options().setup(setup.clone()).init()`), and
    /// `device` what that returned. headkl needs `SHADER_F16` on it (and
    /// runs its matrix-unit GEMM where the trainer enabled
    /// [`device_descriptor`]'s features); where the trainer's offset
    /// alignments are below [`BIND_ALIGN`], tensors at unaligned offsets are
    /// copied on the device.
    pub fn from_setup(setup: &WgpuSetup, device: Device) -> Self {
        Self {
            device,
            adapter: setup.adapter.clone(),
            wgpu_device: setup.device.clone(),
            queue: setup.queue.clone(),
        }
    }

    /// The burn device (`.autodiff()` for a trainer's tensors).
    pub fn device(&self) -> Device {
        self.device.clone()
    }

    /// The wgpu adapter.
    pub fn adapter(&self) -> &wgpu::Adapter {
        &self.adapter
    }

    /// The wgpu device.
    pub fn wgpu_device(&self) -> &wgpu::Device {
        &self.wgpu_device
    }

    /// The queue burn and headkl both submit to.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// headkl's wgpu backend on this device (a fresh one per call; the
    /// engine owns it).
    pub(crate) fn backend(&self, options: &OpenOptions) -> Result<WgpuBackend> {
        WgpuBackend::from_device(&self.adapter, self.wgpu_device.clone(), self.queue.clone(), options)
    }
}
