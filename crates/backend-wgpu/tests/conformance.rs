//! The shared conformance suite (crates/reference) on the wgpu backend.

/// The backend every suite below runs on, with the `HEADKL_*` settings.
fn open() -> headkl_core::Result<headkl_wgpu::WgpuBackend> {
    let options = headkl_wgpu::OpenOptions::from_env(&headkl_reference::conformance::harness_env())
        .expect("a HEADKL_* setting does not parse");
    headkl_wgpu::WgpuBackend::open_with(&options)
}

headkl_reference::conformance_tests!("wgpu", open());

// Engines on one device driven from several threads, and a soak of one engine.
headkl_reference::threads_tests!("wgpu", open());

// Vocabulary-parallel: 2 and 3 shards on threads.
headkl_reference::shard_tests!("wgpu", open());

// Vocabulary-parallel on device buffers: the resident two-phase loss, one
// thread per shard.
headkl_reference::resident_shard_tests!(threads, "wgpu", open());
