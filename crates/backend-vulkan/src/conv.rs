//! Vulkan results → headkl errors.

use ash::vk;
use headkl_core::{DriverError, Error};

/// The backend's name in errors.
pub(crate) const BACKEND: &str = "vulkan";

/// An error for a failed Vulkan call `what`.
///
/// Device loss becomes [`Error::DeviceLost`]; memory exhaustion without a
/// known size becomes [`Error::OutOfMemory`] with zero bytes (callers that
/// know the size use [`alloc_error`]).
pub(crate) fn vk_error(result: vk::Result, what: &str) -> Error {
    match result {
        vk::Result::ERROR_DEVICE_LOST => Error::DeviceLost(format!("{what}: VK_ERROR_DEVICE_LOST")),
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => Error::OutOfMemory {
            bytes: 0,
            what: "vulkan driver objects",
        },
        other => driver_error(format!("{what} failed: {other}"), other),
    }
}

/// An error saying `message` with the driver's (or the shader compiler's)
/// own error kept as its source.
pub(crate) fn driver_error(message: impl Into<String>, error: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::Driver {
        backend: BACKEND,
        message: message.into(),
        source: DriverError::new(error),
    }
}

/// An error for a failed allocation of `bytes` bytes for `what`.
pub(crate) fn alloc_error(result: vk::Result, bytes: u64, what: &'static str) -> Error {
    match result {
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY
        | vk::Result::ERROR_OUT_OF_HOST_MEMORY
        | vk::Result::ERROR_TOO_MANY_OBJECTS => Error::OutOfMemory { bytes, what },
        other => vk_error(other, what),
    }
}

/// A generic backend error.
pub(crate) fn backend_error(message: impl Into<String>) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: message.into(),
    }
}

/// An error saying that no device could be opened.
pub(crate) fn no_device(reason: impl Into<String>) -> Error {
    Error::NoDevice {
        backend: BACKEND,
        reason: reason.into(),
    }
}

/// Device type in words, as [`headkl_core::DeviceInfo`] reports it.
pub(crate) fn device_type_name(t: vk::PhysicalDeviceType) -> &'static str {
    match t {
        vk::PhysicalDeviceType::DISCRETE_GPU => "discrete",
        vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated",
        vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual",
        vk::PhysicalDeviceType::CPU => "cpu",
        _ => "other",
    }
}

/// Preference rank of a device type: lower is picked first.
pub(crate) fn device_type_rank(t: vk::PhysicalDeviceType) -> u32 {
    match t {
        vk::PhysicalDeviceType::DISCRETE_GPU => 0,
        vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
        vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
        vk::PhysicalDeviceType::CPU => 3,
        _ => 4,
    }
}

/// `major.minor.patch` of a Vulkan version number.
pub(crate) fn version_string(v: u32) -> String {
    format!(
        "{}.{}.{}",
        vk::api_version_major(v),
        vk::api_version_minor(v),
        vk::api_version_patch(v)
    )
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    /// A failed Vulkan call's error has the `vk::Result` as its source (and
    /// says it); device loss and memory exhaustion stay typed.
    #[test]
    fn a_vulkan_failure_keeps_its_result_as_the_source() {
        let e = vk_error(vk::Result::ERROR_INITIALIZATION_FAILED, "vkCreateComputePipelines");
        assert!(matches!(e, Error::Driver { backend: BACKEND, .. }), "{e:?}");
        let source = e.source().expect("a source");
        assert_eq!(
            source.downcast_ref::<vk::Result>(),
            Some(&vk::Result::ERROR_INITIALIZATION_FAILED)
        );
        assert!(
            e.to_string().starts_with("vulkan: vkCreateComputePipelines failed: "),
            "{e}"
        );
        assert_eq!(e.kind(), headkl_core::ErrorKind::Device);
        assert!(matches!(
            vk_error(vk::Result::ERROR_DEVICE_LOST, "vkQueueSubmit"),
            Error::DeviceLost(_)
        ));
        assert!(matches!(
            alloc_error(vk::Result::ERROR_OUT_OF_DEVICE_MEMORY, 64, "x"),
            Error::OutOfMemory { bytes: 64, .. }
        ));
    }
}
