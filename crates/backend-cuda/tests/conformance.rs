//! The shared conformance suite (headkl-conformance) on the CUDA backend:
//! kernel cases, regression cases, planted faults, threads and shards. On a
//! machine without an NVIDIA driver or cuBLASLt each test says why it was
//! skipped (a failure where `HEADKL_REQUIRE` names cuda).

/// The backend every suite below runs on, with the `HEADKL_*` settings.
fn open() -> headkl_core::Result<headkl_cuda::CudaBackend> {
    let common = headkl_core::toolkit::settings::CommonOptions::from_env(&headkl_conformance::harness_env())
        .expect("a HEADKL_* setting does not parse");
    headkl_cuda::CudaBackend::open_with(&headkl_cuda::CudaOptions { common })
}

headkl_conformance::conformance_tests!("cuda", open());

// Engines on one device driven from several threads, and a soak of one engine.
headkl_conformance::threads_tests!("cuda", open());

// Vocabulary-parallel: 2 and 3 shards on threads.
headkl_conformance::shard_tests!("cuda", open());

// Vocabulary-parallel on device buffers: the resident two-phase loss.
headkl_conformance::resident_shard_tests!(threads, "cuda", open());
