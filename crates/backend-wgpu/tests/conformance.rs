//! The shared conformance suite (crates/reference) on the wgpu backend.

headkl_reference::conformance_tests!(
    "wgpu",
    headkl_wgpu::WgpuBackend::open_with(
        &headkl_wgpu::OpenOptions::from_env(&headkl_reference::conformance::harness_env())
            .expect("a HEADKL_* setting does not parse")
    )
);

// Engines on one device driven from several threads, and a soak of one engine.
headkl_reference::threads_tests!(
    "wgpu",
    headkl_wgpu::WgpuBackend::open_with(
        &headkl_wgpu::OpenOptions::from_env(&headkl_reference::conformance::harness_env())
            .expect("a HEADKL_* setting does not parse")
    )
);

// Vocabulary-parallel: 2 and 3 shards on threads.
headkl_reference::shard_tests!(
    "wgpu",
    headkl_wgpu::WgpuBackend::open_with(
        &headkl_wgpu::OpenOptions::from_env(&headkl_reference::conformance::harness_env())
            .expect("a HEADKL_* setting does not parse")
    )
);

// Vocabulary-parallel on device buffers: the resident two-phase loss, one
// thread per shard.
headkl_reference::resident_shard_tests!(
    threads,
    "wgpu",
    headkl_wgpu::WgpuBackend::open_with(
        &headkl_wgpu::OpenOptions::from_env(&headkl_reference::conformance::harness_env())
            .expect("a HEADKL_* setting does not parse")
    )
);
