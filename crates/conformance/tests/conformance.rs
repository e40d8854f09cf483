//! The conformance suite on the CPU reference backend: as is, with a
//! largest binding small enough that the driver cuts heads into several
//! slices and tokens into several chunks on its own, and with f32
//! arithmetic to prove the tolerances leave an f32 device room.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use headkl_conformance::generator::MIN_BINDING_BYTES;
use headkl_reference::{CpuBackend, Precision};

headkl_conformance::conformance_tests!(
    "reference",
    Ok::<_, headkl_core::Error>(headkl_reference::cpu::CpuBackend::new())
);

headkl_conformance::conformance_tests!(
    mod small_binding,
    "reference",
    Ok::<_, headkl_core::Error>(CpuBackend::with_max_binding(MIN_BINDING_BYTES))
);

headkl_conformance::conformance_tests!(
    mod f32_emulation,
    "reference",
    Ok::<_, headkl_core::Error>(CpuBackend::new().with_precision(Precision::F32))
);

// The device-resident entry points on the CPU kernels (the same cases the
// GPU backends run).
headkl_conformance::resident_conformance_tests!("reference", Ok::<_, headkl_core::Error>(CpuBackend::new()));

/// The resident head gradient into a caller's buffer past one binding: the
/// reference makes windows of it, as CUDA does, so the windowed write runs
/// here without a GPU (24 KiB bindings: the case's gradient is 28,800
/// bytes).
#[test]
fn resident_head_grad_through_windows() {
    let backend = CpuBackend::with_limits(24 << 10, 1 << 31);
    headkl_conformance::resident::check_head_grad_through_windows(&backend).unwrap();
    let whole = CpuBackend::new();
    let refused = headkl_conformance::resident::check_head_grad_through_windows(&whole).unwrap_err();
    assert!(refused.contains("past one binding"), "{refused}");
}

// Engines on threads, and a soak of one engine (CpuBackend is Sync: its
// buffers belong to the engine that made them).
headkl_conformance::threads_tests!("reference", Ok::<_, headkl_core::Error>(CpuBackend::new()));

// Vocabulary-parallel: 2 and 3 shards on threads against the reference.
headkl_conformance::shard_tests!("reference", Ok::<_, headkl_core::Error>(CpuBackend::new()));

// Vocabulary-parallel on device buffers (the CPU kernels): the resident
// two-phase loss, the shards in turn.
headkl_conformance::resident_shard_tests!(serial, "reference", Ok::<_, headkl_core::Error>(CpuBackend::new()));
