//! The shared conformance suite (crates/conformance) on the wgpu backend.

/// The backend every suite below runs on, with the `HEADKL_*` settings.
fn open() -> headkl_core::Result<headkl_wgpu::WgpuBackend> {
    let options = headkl_wgpu::OpenOptions::from_env(&headkl_conformance::harness_env())
        .expect("a HEADKL_* setting does not parse");
    headkl_wgpu::WgpuBackend::open_with(&options)
}

headkl_conformance::conformance_tests!("wgpu", open());

// Engines on one device driven from several threads, and a soak of one engine.
headkl_conformance::threads_tests!("wgpu", open());

// Vocabulary-parallel: 2 and 3 shards on threads.
headkl_conformance::shard_tests!("wgpu", open());

// Vocabulary-parallel on device buffers: the resident two-phase loss, one
// thread per shard.
headkl_conformance::resident_shard_tests!(threads, "wgpu", open());
