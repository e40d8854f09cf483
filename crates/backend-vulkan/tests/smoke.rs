//! Smoke tests of the Vulkan backend through its public API and the shared
//! kernels: the GEMM's name, f32 hidden rows into the padded f16 operand
//! (`hidden_in`), errors, timing.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use half::f16;
use headkl_conformance::{harness_env, open_or_skip};
use headkl_core::toolkit::{GemmDesc, HeadLayout, HiddenInDesc, Kernels, Launch};
use headkl_core::{Backend, Error, QueueChoice};
use headkl_vulkan::{VulkanBackend, VulkanOptions};

/// Opens with `options` (built from the harness settings); skips, or fails
/// when `HEADKL_REQUIRE` names vulkan, as the conformance suite does.
fn open_with(options: VulkanOptions) -> Option<VulkanBackend> {
    open_or_skip("vulkan", || VulkanBackend::open_with(&options))
}

fn settings_options() -> VulkanOptions {
    VulkanOptions::from_env(&harness_env()).expect("a HEADKL_* setting does not parse")
}

fn open() -> Option<VulkanBackend> {
    open_with(VulkanOptions {
        validation: true,
        ..settings_options()
    })
}

fn assert_clean(b: &VulkanBackend) {
    let d = b.take_diagnostics();
    assert!(d.is_empty(), "validation messages:\n{}", d.join("\n"));
}

/// The GEMM the device picked is named for what it runs on (its results,
/// both layouts, offsets, split-K and accumulation, are the conformance
/// suite's `kernels/gemm_*` cases, run with the validation layer on).
#[test]
fn gemm_name_matches_the_matrix_units() {
    let Some(b) = open() else { return };
    eprintln!(
        "device: {} ({}), GEMM: {}",
        b.info().device_name,
        b.info().driver,
        b.gemm_kernel()
    );
    assert_eq!(b.uses_matrix_units(), b.gemm_kernel().starts_with("cooperative"));
    assert_clean(&b);
}

#[test]
fn hidden_in_pads_with_zeros_and_saturates_to_inf() {
    let Some(b) = open() else { return };
    let (rows, cols, rows_padded, ld) = (5, 21, 16, 32);
    let mut src: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.37 - 9.0).collect();
    src[3] = 70000.0;
    src[4] = -1e30;
    src[5] = f32::NAN;
    let src_buf = b.alloc((src.len() * 4) as u64, "x32").unwrap();
    let dst_buf = b.alloc((rows_padded * ld * 2) as u64, "x16").unwrap();
    b.upload(&src_buf, 0, bytemuck::cast_slice(&src)).unwrap();
    b.upload(&dst_buf, 0, &vec![0xff; rows_padded * ld * 2]).unwrap();
    let desc = HiddenInDesc::f32(rows, cols, ld, rows_padded);
    b.dispatch(Launch::HiddenIn {
        src: &src_buf,
        dst: &dst_buf,
        desc,
    })
    .unwrap();
    let mut out = vec![f16::ZERO; rows_padded * ld];
    b.download(&dst_buf, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    for r in 0..rows_padded {
        for c in 0..ld {
            let got = out[r * ld + c];
            if r < rows && c < cols {
                let want = f16::from_f32(src[r * cols + c]);
                assert!(
                    got == want || (got.is_nan() && want.is_nan()),
                    "[{r}][{c}] = {got}, want {want}"
                );
            } else {
                assert_eq!(got.to_bits(), 0, "pad [{r}][{c}] = {got}");
            }
        }
    }
    assert_eq!(out[3], f16::INFINITY);
    assert_eq!(out[4], f16::NEG_INFINITY);
    assert_clean(&b);
}

#[test]
fn device_facts_and_errors() {
    let Some(b) = open() else { return };
    let info = b.info().clone();
    assert_eq!(info.backend, "vulkan");
    assert!(info.shader_f16 && info.unusable.is_none());
    assert!(info.max_binding_bytes >= 1 << 27, "binding {}", info.max_binding_bytes);
    assert!(info.max_buffer_bytes >= info.max_binding_bytes.min(1 << 30));
    assert_eq!(info.matrix_units, b.uses_matrix_units());
    assert_eq!(info.matrix_shapes, b.matrix_shapes());
    assert_eq!(b.validation_layer().is_some(), b.options().validation);
    eprintln!("validation layer: {:?}, API {}", b.validation_layer(), b.api_version());

    let listed = headkl_vulkan::enumerate().unwrap();
    assert!(listed.iter().any(|d| d.device_name == info.device_name));

    // An absurd allocation is an out-of-memory error with the bytes asked.
    let huge = 1u64 << 50;
    match b.alloc(huge, "huge") {
        Err(Error::OutOfMemory { bytes, what }) => assert_eq!((bytes, what), (huge, "huge")),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Memory accounting follows allocations.
    let before = b.memory().current;
    let x = b.alloc(1 << 20, "x").unwrap();
    assert!(b.memory().current >= before + (1 << 20));
    assert!(b.memory().peak >= b.memory().current);
    drop(x);
    assert_eq!(b.memory().current, before);
    b.reset_peak_memory();
    assert_eq!(b.memory().peak, before);

    // A device index past the list is a NoDevice error naming it.
    match VulkanBackend::open(Some(999)) {
        Err(Error::NoDevice { backend, reason }) => {
            assert_eq!(backend, "vulkan");
            assert!(reason.contains("999"), "{reason}");
        }
        Err(other) => panic!("expected NoDevice, got {other}"),
        Ok(_) => panic!("device 999 opened"),
    }

    // The queue family: auto's pick is reported; `universal` and an index
    // open the family they name; an index the device lacks is an
    // InvalidSetting naming HEADKL_QUEUE.
    let queue = info.queue.clone().expect("an open device reports its queue");
    assert!(queue.starts_with("family "), "{queue}");
    let with_queue = |queue| {
        let mut options = settings_options();
        options.common.queue = queue;
        VulkanBackend::open_with(&options)
    };
    let universal = with_queue(QueueChoice::Universal).unwrap();
    let universal_queue = universal.info().queue.clone().unwrap();
    assert!(universal_queue.contains("graphics"), "{universal_queue}");
    drop(universal);
    let family0 = with_queue(QueueChoice::Family(0)).unwrap();
    assert!(family0.info().queue.as_deref().unwrap().starts_with("family 0 ("));
    drop(family0);
    match with_queue(QueueChoice::Family(99)) {
        Err(Error::InvalidSetting { name, value, .. }) => assert_eq!((name, value.as_str()), ("HEADKL_QUEUE", "99")),
        other => panic!("family 99: {:?}", other.map(|b| b.info().queue.clone())),
    }
    assert_clean(&b);
}

#[test]
fn forced_fallback_and_kernel_labels() {
    let mut options = settings_options();
    options.validation = true;
    options.common.force_fallback = true;
    let Some(b) = open_with(options) else {
        return;
    };
    assert!(!b.uses_matrix_units() && !b.info().matrix_units);
    assert_eq!(b.gemm_kernel(), "tiled (gemm_tiled.wgsl)");
    assert_eq!(b.info().gemm.as_deref(), Some("tiled (gemm_tiled.wgsl)"));
    assert_eq!(b.gemm_choice(), None);
    if !b.set_profiling(true) {
        eprintln!("SKIPPED (timing part): no timestamps on this queue");
        return;
    }
    let (m, n, k) = (32, 48, 32);
    let a = b.alloc((m * k * 2) as u64, "A").unwrap();
    let w = b.alloc((n * k * 2) as u64, "B").unwrap();
    let c = b.alloc((m * n * 4) as u64, "C").unwrap();
    b.gemm(&a, &w, &c, &GemmDesc::dense(m, n, k, HeadLayout::Logits))
        .unwrap();
    b.finish().unwrap();
    let times = b.take_kernel_times().unwrap();
    assert_eq!(times.len(), 1, "{times:?}");
    assert_eq!(times[0].kernel, "gemm_logits");
    assert_clean(&b);
}
