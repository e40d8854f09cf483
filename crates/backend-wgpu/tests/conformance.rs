//! The shared conformance suite (crates/reference) on the wgpu backend.

headkl_reference::conformance_tests!("wgpu", headkl_wgpu::WgpuBackend::open(None));
