//! What a machine without the pieces gets: a clear `NoDevice` error, never a
//! crash. One test in its own process, because it changes the environment
//! the Vulkan loader reads.

use headkl_core::{Backend, Error};
use headkl_vulkan::{VulkanBackend, VulkanOptions};

fn no_device_reason(result: headkl_core::Result<VulkanBackend>) -> String {
    match result {
        Err(Error::NoDevice { backend, reason }) => {
            assert_eq!(backend, "vulkan");
            reason
        }
        Err(other) => panic!("expected NoDevice, got {other}"),
        Ok(b) => panic!("opened {} anyway", b.info().device_name),
    }
}

#[test]
fn missing_layer_or_driver_is_a_no_device_error() {
    // Before the loader runs: no "XDG_RUNTIME_DIR is invalid" from Mesa.
    headkl_conformance::ensure_runtime_dir();
    // Without a loader at all there is nothing to test here.
    if let Err(e) = headkl_vulkan::enumerate() {
        eprintln!("SKIPPED: no Vulkan loader to take pieces away from: {e}");
        assert!(matches!(e, Error::NoDevice { .. }), "{e}");
        return;
    }
    let empty = std::env::temp_dir().join("headkl-vulkan-empty-dir");
    std::fs::create_dir_all(&empty).unwrap();

    // Validation asked for, but the loader finds no layers.
    std::env::set_var("VK_LAYER_PATH", &empty);
    std::env::set_var("VK_ADD_LAYER_PATH", &empty);
    let reason = no_device_reason(VulkanBackend::open_with(&VulkanOptions {
        validation: true,
        ..VulkanOptions::default()
    }));
    assert!(reason.contains("validation layer"), "{reason}");
    std::env::remove_var("VK_LAYER_PATH");
    std::env::remove_var("VK_ADD_LAYER_PATH");

    // No driver: the loader finds no ICD.
    let missing = empty.join("no_such_icd.json");
    std::env::set_var("VK_ICD_FILENAMES", &missing);
    std::env::set_var("VK_DRIVER_FILES", &missing);
    let reason = no_device_reason(VulkanBackend::open(None));
    eprintln!("without a driver: {reason}");
    match headkl_vulkan::enumerate() {
        Ok(list) => assert!(list.is_empty(), "{list:?}"),
        Err(e) => assert!(matches!(e, Error::NoDevice { .. }), "{e}"),
    }
}
