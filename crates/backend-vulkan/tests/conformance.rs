//! The shared conformance suite (headkl-conformance) on the Vulkan backend,
//! with the Khronos validation layer on: any validation error fails a case.

/// The backend every suite below runs on: the `HEADKL_*` settings, with
/// the validation layer on.
fn open() -> headkl_core::Result<headkl_vulkan::VulkanBackend> {
    let options = headkl_vulkan::VulkanOptions::from_env(&headkl_conformance::harness_env())
        .expect("a HEADKL_* setting does not parse");
    headkl_vulkan::VulkanBackend::open_with(&headkl_vulkan::VulkanOptions {
        validation: true,
        ..options
    })
}

headkl_conformance::conformance_tests!("vulkan", open());

// Engines on one device driven from several threads, and a soak of one
// engine, with the validation layer on.
headkl_conformance::threads_tests!("vulkan", open());

// Vocabulary-parallel: 2 and 3 shards on threads, with the validation layer on.
headkl_conformance::shard_tests!("vulkan", open());

// Vocabulary-parallel on device buffers: the resident two-phase loss, one
// thread per shard, with the validation layer on.
headkl_conformance::resident_shard_tests!(threads, "vulkan", open());
