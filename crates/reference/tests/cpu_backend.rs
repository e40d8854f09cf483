//! The CPU backend's own contract: memory accounting, NaN-poisoned new
//! buffers, profiling, and errors (never panics) for descriptors that break
//! the driver's contract.

use half::f16;
use headkl_core::toolkit::{GemmDesc, HeadLayout, HiddenInDesc, Kernels, KlDesc, Launch, TopkDesc};
use headkl_core::{Backend, Error};
use headkl_reference::{CpuBackend, Precision};

fn gemm_desc(m: usize, n: usize, k: usize) -> GemmDesc {
    GemmDesc::dense(m, n, k, HeadLayout::Logits)
}

/// The kernel, field and value a descriptor error names.
fn bad_field(e: Error) -> (&'static str, &'static str, u128) {
    match e {
        Error::BadDescriptor {
            kernel, field, value, ..
        } => (kernel, field, value),
        other => panic!("expected a descriptor error, got {other:?}"),
    }
}

fn message(e: Error) -> String {
    match e {
        Error::Backend {
            backend: "reference",
            message,
        } => message,
        other => panic!("expected a reference backend error, got {other:?}"),
    }
}

#[test]
fn info_is_as_documented() {
    let cpu = CpuBackend::new();
    let i = cpu.info();
    assert_eq!(i.backend, "reference");
    assert_eq!(i.device_name, "CPU (f64 reference)");
    assert_eq!(i.device_type, "cpu");
    assert!(!i.matrix_units && i.shader_f16);
    assert_eq!(i.max_binding_bytes, 1 << 31);
    assert_eq!(i.memory_bytes, None);
    assert_eq!(i.unusable, None);
    assert_eq!(CpuBackend::with_max_binding(4096).info().max_binding_bytes, 4096);
    let f32_cpu = CpuBackend::new().with_precision(Precision::F32);
    assert_eq!(f32_cpu.precision(), Precision::F32);
    assert_eq!(f32_cpu.info().device_name, "CPU (f32 emulation)");
}

#[test]
fn memory_is_counted_freed_and_peaked() {
    let cpu = CpuBackend::new();
    let a = cpu.alloc(100, "a").unwrap();
    let b = cpu.alloc(30, "b").unwrap();
    assert_eq!(cpu.memory().current, 130);
    drop(a);
    assert_eq!(cpu.memory().current, 30);
    assert_eq!(cpu.memory().peak, 130);
    cpu.reset_peak_memory();
    assert_eq!(cpu.memory().peak, 30);
    drop(b);
    assert_eq!(cpu.memory().current, 0);
    let e = cpu.alloc((1 << 31) + 1, "huge").unwrap_err();
    assert!(message(e).contains("exceed the largest buffer"));
}

#[test]
fn new_buffers_are_nan_and_round_trip() {
    let cpu = CpuBackend::new();
    let buf = cpu.alloc(10, "odd size").unwrap();
    let mut raw = [0u8; 10];
    cpu.download(&buf, 0, &mut raw).unwrap();
    assert!(raw.iter().all(|&b| b == 0xFF));
    assert!(f32::from_ne_bytes([raw[0], raw[1], raw[2], raw[3]]).is_nan());
    assert!(f16::from_bits(0xFFFF).is_nan());
    cpu.upload(&buf, 6, &[1, 2, 3, 4]).unwrap();
    let mut tail = [0u8; 5];
    cpu.download(&buf, 5, &mut tail).unwrap();
    assert_eq!(tail, [0xFF, 1, 2, 3, 4]);
    for e in [
        cpu.upload(&buf, 8, &[0; 3]).unwrap_err(),
        cpu.download(&buf, 0, &mut [0; 11]).unwrap_err(),
    ] {
        assert!(matches!(e, Error::TransferOutOfRange { len: 10, .. }), "{e:?}");
    }
}

#[test]
fn contract_violations_are_errors() {
    let cpu = CpuBackend::new();
    let a = cpu.alloc(16 * 16 * 2, "a").unwrap();
    let b = cpu.alloc(16 * 16 * 2, "b").unwrap();
    let c = cpu.alloc(16 * 16 * 4, "c").unwrap();
    let e = cpu.gemm(&a, &b, &c, &gemm_desc(17, 16, 16)).unwrap_err();
    assert_eq!(bad_field(e), ("gemm_logits", "m", 17));
    let e = cpu.gemm(&a, &b, &c, &gemm_desc(16, 32, 16)).unwrap_err();
    assert_eq!(bad_field(e), ("gemm_logits", "B", 32 * 16 * 2));
    // the same buffer as input and output
    let e = cpu.gemm(&c, &b, &c, &gemm_desc(16, 16, 16)).unwrap_err();
    assert!(message(e).contains("bound both as an input and as an output"));
    cpu.gemm(&a, &b, &c, &gemm_desc(16, 16, 16)).unwrap();

    let ids = cpu.alloc(4, "ids").unwrap();
    cpu.upload(&ids, 0, &40u32.to_ne_bytes()).unwrap();
    let f = |bytes| cpu.alloc(bytes, "f").unwrap();
    let (logits, probs, coef, loss, grad) = (f(16 * 4), f(4), f(8), f(16), f(32));
    let kl = KlDesc::plain(1, 10, 16, 1);
    let e = cpu
        .kl_rows(&logits, &ids, &probs, &coef, &loss, &grad, &kl)
        .unwrap_err();
    assert!(message(e).contains("ids[0][0] = 40 is not below vocab = 10"));
    let e = cpu
        .topk_rows(&logits, &ids, &probs, &TopkDesc::plain(1, 10, 16, 11))
        .unwrap_err();
    assert_eq!(bad_field(e), ("topk_rows", "k", 11));
    let e = cpu
        .dispatch(Launch::HiddenIn {
            src: &logits,
            dst: &grad,
            desc: HiddenInDesc::f32(2, 4, 4, 1),
        })
        .unwrap_err();
    assert_eq!(bad_field(e), ("hidden_in", "rows_padded", 1));
}

#[test]
fn profiling_records_each_kernel() {
    let cpu = CpuBackend::new();
    assert!(cpu.set_profiling(true));
    let a = cpu.alloc(16 * 16 * 2, "a").unwrap();
    let b = cpu.alloc(16 * 16 * 2, "b").unwrap();
    let c = cpu.alloc(16 * 16 * 4, "c").unwrap();
    cpu.upload(&a, 0, &[0; 512]).unwrap();
    cpu.upload(&b, 0, &[0; 512]).unwrap();
    cpu.gemm(&a, &b, &c, &gemm_desc(16, 16, 16)).unwrap();
    let times = cpu.take_kernel_times().unwrap();
    assert_eq!(times.len(), 1);
    assert_eq!(times[0].kernel, "gemm_logits");
    assert!(times[0].ms >= 0.0);
    assert!(cpu.take_kernel_times().unwrap().is_empty());
    cpu.set_profiling(false);
    cpu.gemm(&a, &b, &c, &gemm_desc(16, 16, 16)).unwrap();
    assert!(cpu.take_kernel_times().unwrap().is_empty());
    assert!(cpu.take_diagnostics().is_empty());
}

#[test]
fn the_backend_can_move_to_another_thread() {
    fn assert_send<T: Send>() {}
    fn assert_sync<T: Sync>() {}
    assert_send::<CpuBackend>();
    assert_sync::<CpuBackend>();
    assert_send::<headkl_reference::CpuBuffer>();
}

#[test]
fn a_window_shares_its_buffers_words_and_counts_no_bytes() {
    use headkl_core::DeviceBuffer;
    use headkl_core::ResidentBackend;
    let b = CpuBackend::new();
    let buf = b.alloc(64, "whole").unwrap();
    let words: Vec<u32> = (0..16).collect();
    b.upload(&buf, 0, bytemuck::cast_slice(&words)).unwrap();
    let held = b.memory().current;
    let w = b.window(&buf, 16, 32).unwrap();
    assert_eq!(w.len(), 32);
    assert_eq!(b.memory().current, held, "a window allocates nothing");
    let mut got = [0u32; 8];
    b.download(&w, 0, bytemuck::cast_slice_mut(&mut got)).unwrap();
    assert_eq!(got, [4, 5, 6, 7, 8, 9, 10, 11]);
    b.upload(&w, 4, &[0xab; 4]).unwrap();
    let mut whole = [0u32; 16];
    b.download(&buf, 0, bytemuck::cast_slice_mut(&mut whole)).unwrap();
    assert_eq!(whole[5], 0xabab_abab, "the window writes the buffer's words");
    assert_eq!(whole[4], 4);
    assert!(b.upload(&w, 32, &[0; 4]).is_err(), "a window ends where it says");
    drop(w);
    assert_eq!(b.memory().current, held, "dropping a window frees nothing");
    assert!(b.window(&buf, 2, 8).is_none(), "an offset inside a word");
    assert!(b.window(&buf, 0, 6).is_none(), "a length inside a word");
    assert!(b.window(&buf, 48, 32).is_none(), "past the buffer");
}
