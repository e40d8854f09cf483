//! A wgpu device on the queue family `HEADKL_QUEUE` chooses
//! ([`headkl_core::QueueChoice`], the same choice the Vulkan backend makes).
//!
//! wgpu-hal opens every Vulkan device on queue family 0. On NVIDIA's driver
//! that is the graphics family, which runs the same compute pipelines up to
//! 2.6× slower than the compute-only family (docs/PERFORMANCE.md, row 33).
//! Where the choice is another family, the device is created here on it,
//! with exactly the extensions and features wgpu-hal would enable for the
//! requested features (`required_device_extensions`,
//! `physical_device_features`), and handed to wgpu (`device_from_raw`,
//! `Adapter::create_device_from_hal`).

use headkl_core::{Error, QueueChoice, Result};

use headkl_core::toolkit::QueueFamily;

use crate::BACKEND;

/// A device and queue, and the queue's family in words where the adapter is
/// Vulkan (`family 2 (compute)`).
pub(crate) type OpenedDevice = (wgpu::Device, wgpu::Queue, Option<String>);

/// Opens a device on `adapter` as `desc` says, on the queue family `choice`
/// picks (Vulkan adapters; on others `auto` and `universal` take wgpu's
/// queue, and a family index is [`Error::InvalidSetting`]).
///
/// A trainer that opens its own device can call this instead of
/// `Adapter::request_device` to get the faster queue for its own work and
/// headkl's ([`crate::WgpuBackend::from_device`]).
pub fn request_device(
    adapter: &wgpu::Adapter,
    desc: &wgpu::DeviceDescriptor<'_>,
    choice: QueueChoice,
) -> Result<(wgpu::Device, wgpu::Queue)> {
    open(adapter, desc, choice).map(|(device, queue, _)| (device, queue))
}

pub(crate) fn open(
    adapter: &wgpu::Adapter,
    desc: &wgpu::DeviceDescriptor<'_>,
    choice: QueueChoice,
) -> Result<OpenedDevice> {
    #[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
    if adapter.get_info().backend == wgpu::Backend::Vulkan {
        return vulkan::open(adapter, desc, choice);
    }
    if let QueueChoice::Family(_) = choice {
        return Err(Error::InvalidSetting {
            name: headkl_core::toolkit::settings::QUEUE,
            value: choice.to_string(),
            reason: format!(
                "a queue family index applies to Vulkan adapters; this one is {:?}",
                adapter.get_info().backend
            ),
        });
    }
    let (device, queue) = wgpu_default(adapter, desc)?;
    Ok((device, queue, None))
}

/// wgpu's own device and queue (family 0 on Vulkan).
fn wgpu_default(adapter: &wgpu::Adapter, desc: &wgpu::DeviceDescriptor<'_>) -> Result<(wgpu::Device, wgpu::Queue)> {
    pollster::block_on(adapter.request_device(desc))
        .map_err(|e| no_device(adapter, &format!("request_device failed: {e}")))
}

/// The family of the queue `device` submits to, in words, where it is a
/// Vulkan device (a trainer's device: see [`request_device`]).
pub(crate) fn describe_family(adapter: &wgpu::Adapter, device: &wgpu::Device) -> Option<String> {
    #[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
    if adapter.get_info().backend == wgpu::Backend::Vulkan {
        return vulkan::describe_family(adapter, device);
    }
    let _ = (adapter, device);
    None
}

fn no_device(adapter: &wgpu::Adapter, why: &str) -> Error {
    Error::NoDevice {
        backend: BACKEND,
        reason: format!("{}: {why}", adapter.get_info().name),
    }
}

#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
mod vulkan {
    use ash::vk;
    use wgpu::hal::api::Vulkan;

    use super::*;

    /// The family wgpu-hal opens on its own.
    const WGPU_FAMILY: u32 = 0;

    /// The adapter's queue families.
    fn families(hal: &wgpu::hal::vulkan::Adapter) -> Vec<QueueFamily> {
        let instance = hal.shared_instance().raw_instance();
        // SAFETY: the physical device belongs to that instance; plain data back.
        let props = unsafe { instance.get_physical_device_queue_family_properties(hal.raw_physical_device()) };
        props
            .iter()
            .map(|f| QueueFamily::from_vulkan(f.queue_flags.as_raw(), f.timestamp_valid_bits, f.queue_count))
            .collect()
    }

    pub(super) fn describe_family(adapter: &wgpu::Adapter, device: &wgpu::Device) -> Option<String> {
        // SAFETY: both are Vulkan objects (checked by the caller); the
        // guards only read handles and are dropped on return.
        let hal_device = unsafe { device.as_hal::<Vulkan>() }?;
        // SAFETY: as above.
        let hal = unsafe { adapter.as_hal::<Vulkan>() }?;
        Some(QueueFamily::describe_in(
            &families(&hal),
            hal_device.queue_family_index(),
        ))
    }

    pub(super) fn open(
        adapter: &wgpu::Adapter,
        desc: &wgpu::DeviceDescriptor<'_>,
        choice: QueueChoice,
    ) -> Result<OpenedDevice> {
        // SAFETY: the adapter is a Vulkan one (checked by the caller); the
        // guard is dropped before wgpu is used again below.
        let Some(hal) = (unsafe { adapter.as_hal::<Vulkan>() }) else {
            return Err(no_device(adapter, "the Vulkan adapter has no wgpu-hal Vulkan object"));
        };
        let families = families(&hal);
        // wgpu cannot drop TIMESTAMP_QUERY for one family, so a device that
        // asks for it needs a family that has timestamps.
        let timestamps = desc.required_features.contains(wgpu::Features::TIMESTAMP_QUERY);
        let family = choice.pick(&families, timestamps)?;
        let described = Some(QueueFamily::describe_in(&families, family));
        // An explicit family always goes through the device made here, so
        // that path runs (and is tested) on one-family devices too.
        if family == WGPU_FAMILY && !matches!(choice, QueueChoice::Family(_)) {
            drop(hal);
            let (device, queue) = wgpu_default(adapter, desc)?;
            return Ok((device, queue, described));
        }

        let features = desc.required_features;
        let extensions = hal.required_device_extensions(features);
        let mut phd_features = hal.physical_device_features(&extensions, features);
        let priorities = [1.0f32];
        let queue_info = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&priorities)];
        let names: Vec<*const std::ffi::c_char> = extensions.iter().map(|e| e.as_ptr()).collect();
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queue_info)
            .enabled_extension_names(&names);
        let info = phd_features.add_to_device_create(info);
        let instance = hal.shared_instance().raw_instance();
        // SAFETY: the extensions and features are the ones wgpu-hal derives
        // for `features` on this adapter (what its own `open` creates the
        // device with); the family exists and has compute (`pick`); every
        // pointer in `info` outlives the call.
        let raw = unsafe { instance.create_device(hal.raw_physical_device(), &info, None) }
            .map_err(|e| no_device(adapter, &format!("vkCreateDevice on queue family {family}: {e}")))?;
        // SAFETY: `raw` was created from this adapter with `extensions`, the
        // features `physical_device_features` gave for them, and one queue
        // of `family`; with no drop callback wgpu-hal owns and destroys it.
        let opened = unsafe {
            hal.device_from_raw(
                raw,
                None,
                &extensions,
                features,
                &desc.required_limits,
                &desc.memory_hints,
                family,
                0,
            )
        }
        .map_err(|e| no_device(adapter, &format!("wgpu-hal on queue family {family}: {e}")))?;
        drop(hal);
        // SAFETY: `opened` is a wgpu-hal device of this adapter's Vulkan
        // object, created with the features `desc` requires (above).
        let (device, queue) = unsafe { adapter.create_device_from_hal(opened, desc) }
            .map_err(|e| no_device(adapter, &format!("wgpu on queue family {family}: {e}")))?;
        Ok((device, queue, described))
    }
}
