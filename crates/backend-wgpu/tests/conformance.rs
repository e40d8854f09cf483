//! The shared conformance suite (crates/reference) on the wgpu backend.

headkl_reference::conformance_tests!(
    "wgpu",
    headkl_wgpu::WgpuBackend::open_with(&headkl_wgpu::OpenOptions::from_settings(
        &headkl_reference::conformance::harness_settings(),
        None
    ))
);
