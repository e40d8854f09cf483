//! What the conformance suite does not reach: device selection and
//! reporting, memory accounting, unaligned and ordered transfers, timing,
//! errors instead of panics, checked vs unchecked GEMM builds, and a head
//! that needs several slices on its own (lavapipe's 128 MiB binding).

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use half::f16;
use headkl_conformance::{gemm_choice_outcome, harness_env, open_or_skip, run_part, Part, SuiteConfig};
use headkl_core::toolkit::Kernels;
use headkl_core::toolkit::{GemmDesc, HeadLayout, HiddenInDesc, Launch};
use headkl_core::CommonOptions;
use headkl_core::{
    Backend, Engine, Error, GemmChoice, HeadData, HeadWeights, Hidden, LossOptions, QueueChoice, SliceOptions, Teacher,
    TopkOptions,
};
use headkl_reference::direct::{head_kl_f64, topk_f64};
use headkl_reference::Tolerance;
use headkl_wgpu::{OpenOptions, WgpuBackend};

fn open() -> Option<WgpuBackend> {
    open_or_skip("wgpu", || {
        WgpuBackend::open_with(&OpenOptions::from_env(&harness_env()).expect("a HEADKL_* setting does not parse"))
    })
}

/// Deterministic values in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// f32 rows `[rows][cols]` of `src` into `dst` as the padded f16 operand
/// `[rows_padded][ld]` (`hidden_in`, as the host path runs it).
fn hidden_in_f32(
    b: &WgpuBackend,
    src: &headkl_wgpu::WgpuBuffer,
    dst: &headkl_wgpu::WgpuBuffer,
    (rows, cols, rows_padded, ld): (usize, usize, usize, usize),
) {
    let desc = HiddenInDesc::f32(rows, cols, ld, rows_padded);
    b.dispatch(Launch::HiddenIn { src, dst, desc }).unwrap();
}

fn upload_f16(b: &WgpuBackend, v: &[f32]) -> headkl_wgpu::WgpuBuffer {
    let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
    let buf = b.alloc((h.len() * 2) as u64, "test f16").unwrap();
    b.upload(&buf, 0, bytemuck::cast_slice(&h)).unwrap();
    buf
}

fn download_f32(b: &WgpuBackend, buf: &headkl_wgpu::WgpuBuffer, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    b.download(buf, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    out
}

#[test]
fn open_reports_the_device_and_enumerate_lists_it() {
    let Some(b) = open() else { return };
    let info = b.info();
    eprintln!("{info:?}\ngemm: {}", b.gemm_path());
    assert_eq!(info.backend, "wgpu");
    assert!(info.shader_f16);
    assert!(info.unusable.is_none());
    assert!(info.max_binding_bytes >= 1 << 20, "{info:?}");
    assert!(info.max_buffer_bytes >= info.max_binding_bytes.min(1 << 27), "{info:?}");
    assert_eq!(info.matrix_units, b.gemm_path().starts_with("cooperative"));
    let all = headkl_wgpu::enumerate().unwrap();
    assert!(all.iter().any(|d| d.device_name == info.device_name), "{all:?}");
    let out_of_range = WgpuBackend::open(Some(all.len()));
    assert!(matches!(out_of_range, Err(Error::NoDevice { .. })), "{out_of_range:?}");
}

#[test]
fn memory_is_counted_and_returned() {
    let Some(b) = open() else { return };
    let before = b.memory().current;
    let x = b.alloc(1000, "x").unwrap();
    let y = b.alloc(4 << 20, "y").unwrap();
    let m = b.memory();
    assert!(m.current >= before + 1000 + (4 << 20), "{m:?}");
    assert!(m.peak >= m.current);
    drop(y);
    assert!(b.memory().current < before + (4 << 20));
    b.reset_peak_memory();
    assert_eq!(b.memory().peak, b.memory().current);
    drop(x);
    assert_eq!(b.memory().current, before);
}

#[test]
fn unaligned_uploads_and_downloads_round_trip() {
    let Some(b) = open() else { return };
    let buf = b.alloc(64, "bytes").unwrap();
    let mut model: Vec<u8> = (0..64u8).collect();
    b.upload(&buf, 0, &model).unwrap();
    let patch = [200u8, 201, 202, 203, 204, 205, 206];
    b.upload(&buf, 5, &patch).unwrap();
    model[5..12].copy_from_slice(&patch);
    b.upload(&buf, 62, &[250, 251]).unwrap();
    model[62..64].copy_from_slice(&[250, 251]);
    for (offset, len) in [(0usize, 64usize), (3, 13), (1, 1), (61, 3), (8, 8)] {
        let mut out = vec![0u8; len];
        b.download(&buf, offset as u64, &mut out).unwrap();
        assert_eq!(out, model[offset..offset + len], "offset {offset} len {len}");
    }
    let past = b.download(&buf, 60, &mut [0u8; 8]);
    assert!(
        matches!(past, Err(Error::TransferOutOfRange { offset: 60, .. })),
        "{past:?}"
    );
    let past = b.upload(&buf, 63, &[1, 2]);
    assert!(
        matches!(past, Err(Error::TransferOutOfRange { offset: 63, .. })),
        "{past:?}"
    );
    assert!(b.take_diagnostics().is_empty());
}

#[test]
fn uploads_are_ordered_after_queued_kernels() {
    let Some(b) = open() else { return };
    let (rows, cols, ld) = (5usize, 20usize, 32usize);
    let first: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
    let src = b.alloc((rows * cols * 4) as u64, "src").unwrap();
    let dst = b.alloc((16 * ld * 2) as u64, "dst").unwrap();
    b.upload(&src, 0, bytemuck::cast_slice(&first)).unwrap();
    hidden_in_f32(&b, &src, &dst, (rows, cols, 16, ld));
    // Queued after the conversion: must not be what it reads.
    b.upload(&src, 0, bytemuck::cast_slice(&vec![-1f32; rows * cols]))
        .unwrap();
    let mut out = vec![f16::ZERO; 16 * ld];
    b.download(&dst, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    for r in 0..16 {
        for c in 0..ld {
            let want = if r < rows && c < cols {
                (r * cols + c) as f32
            } else {
                0.0
            };
            assert_eq!(out[r * ld + c].to_f32(), want, "dst[{r}][{c}]");
        }
    }
}

#[test]
fn hidden_in_flags_values_past_f16_range() {
    let Some(b) = open() else { return };
    let vals = [65504.0f32, 65519.0, 65520.0, -1e30, f32::INFINITY, f32::NAN, 1e-8, -0.5];
    let src = b.alloc(32, "src").unwrap();
    let dst = b.alloc(16 * 16 * 2, "dst").unwrap();
    b.upload(&src, 0, bytemuck::cast_slice(&vals)).unwrap();
    hidden_in_f32(&b, &src, &dst, (1, 8, 16, 16));
    let mut out = vec![f16::ZERO; 256];
    b.download(&dst, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    assert_eq!(out[0].to_f32(), 65504.0);
    assert_eq!(out[1].to_f32(), 65504.0);
    assert_eq!(out[2], f16::INFINITY);
    assert_eq!(out[3], f16::NEG_INFINITY);
    assert_eq!(out[4], f16::INFINITY);
    assert!(out[5].is_nan());
    assert_eq!(out[6].to_f32(), f16::from_f32(1e-8).to_f32());
    assert_eq!(out[7].to_f32(), -0.5);
    assert!(out[8..].iter().all(|h| h.to_f32() == 0.0));
}

fn small_gemm(b: &WgpuBackend) -> Vec<f32> {
    let (m, n, k) = (48usize, 80usize, 96usize);
    let a = upload_f16(b, &noise(m * k, 1));
    let w = upload_f16(b, &noise(n * k, 2));
    let c = b.alloc((m * n * 4) as u64, "c").unwrap();
    let desc = GemmDesc {
        alpha: 0.5,
        ..GemmDesc::dense(m, n, k, HeadLayout::Logits)
    };
    b.gemm(&a, &w, &c, &desc).unwrap();
    download_f32(b, &c, m * n)
}

#[test]
fn checked_build_gives_the_same_gemm() {
    let Some(fast) = open() else { return };
    let got = small_gemm(&fast);
    drop(fast);
    let checked = WgpuBackend::open_with(&OpenOptions {
        common: CommonOptions {
            checked: true,
            force_fallback: true,
            ..CommonOptions::default()
        },
    })
    .unwrap();
    let want = small_gemm(&checked);
    let (a, w) = (noise(48 * 96, 1), noise(80 * 96, 2));
    for i in 0..48 {
        for j in 0..80 {
            let exact: f64 = (0..96)
                .map(|q| f64::from(f16::from_f32(a[i * 96 + q])) * f64::from(f16::from_f32(w[j * 96 + q])))
                .sum::<f64>()
                * 0.5;
            assert!(
                (f64::from(want[i * 80 + j]) - exact).abs() < 1e-4,
                "checked c[{i}][{j}]"
            );
            assert!((f64::from(got[i * 80 + j]) - exact).abs() < 1e-4, "c[{i}][{j}]");
        }
    }
}

#[test]
fn an_explicit_queue_family_opens_through_wgpu_hal() {
    let Some(default) = open() else { return };
    let default_queue = default.info().queue.clone();
    drop(default);
    let settings = OpenOptions::from_env(&harness_env()).expect("a HEADKL_* setting does not parse");
    let options = |queue| {
        let mut options = settings.clone();
        options.common.queue = queue;
        options
    };
    let auto = WgpuBackend::open_with(&options(QueueChoice::Auto)).unwrap();
    let auto_queue = auto.info().queue.clone();
    drop(auto);
    assert_eq!(auto_queue, default_queue);
    if default_queue.is_none() {
        // Not a Vulkan adapter: there are no queue families to name.
        assert!(matches!(
            WgpuBackend::open_with(&options(QueueChoice::Family(0))),
            Err(Error::InvalidSetting { .. })
        ));
        return;
    }
    // Family 0 exists on every Vulkan device with compute (lavapipe has only
    // it): the device is made by headkl and handed to wgpu.
    let b = WgpuBackend::open_with(&options(QueueChoice::Family(0))).unwrap();
    let queue = b
        .info()
        .queue
        .clone()
        .expect("a Vulkan adapter reports its queue family");
    assert!(queue.starts_with("family 0 ("), "{queue}");
    let report = run_part(&b, Part::Kernels, &SuiteConfig { cases: 0, seed: 0 }, &mut |_| {});
    assert!(
        report.cases > 0 && report.failures.is_empty(),
        "{:?}",
        report.failures.first()
    );
    match WgpuBackend::open_with(&options(QueueChoice::Family(99))) {
        Err(Error::InvalidSetting { name, value, .. }) => {
            assert_eq!(name, headkl_core::toolkit::settings::QUEUE);
            assert_eq!(value, "99");
        }
        other => panic!("family 99: {:?}", other.map(|b| b.info().queue.clone())),
    }
}

#[test]
fn profiling_times_every_dispatch() {
    let Some(b) = open() else { return };
    if !b.set_profiling(true) {
        eprintln!(
            "no timestamp queries on {}: checking that none are reported",
            b.info().device_name
        );
        small_gemm(&b);
        assert!(b.take_kernel_times().unwrap().is_empty());
        return;
    }
    small_gemm(&b);
    let times = b.take_kernel_times().unwrap();
    assert_eq!(times.len(), 1, "{times:?}");
    assert_eq!(times[0].kernel, "gemm_logits");
    assert!(times[0].ms >= 0.0 && times[0].ms < 60_000.0, "{times:?}");
    b.set_profiling(false);
    small_gemm(&b);
    assert!(b.take_kernel_times().unwrap().is_empty());
}

#[test]
fn failures_are_errors_not_panics() {
    let Some(b) = open() else { return };
    let huge = b.alloc(u64::MAX / 4, "huge");
    assert!(matches!(huge, Err(Error::OutOfMemory { what: "huge", .. })), "{huge:?}");
    let a = b.alloc(16 * 16 * 2, "a").unwrap();
    let c = b.alloc(16 * 16 * 4, "c").unwrap();
    let desc = GemmDesc::dense(32, 16, 16, HeadLayout::Dx);
    let past = b.gemm(&a, &a, &c, &desc);
    assert!(
        matches!(
            past,
            Err(Error::BadDescriptor {
                kernel: "gemm_dx",
                field: "A",
                ..
            })
        ),
        "{past:?}"
    );
    // The device is still fine afterwards.
    b.finish().unwrap();
    assert!(b.take_diagnostics().is_empty());
}

#[test]
fn head_past_the_binding_limit_runs_in_several_slices() {
    let Some(b) = open() else { return };
    let max_binding = b.info().max_binding_bytes.min(b.info().max_buffer_bytes);
    let hs = 2048;
    // Just past one binding: two natural slices.
    let vocab = ((max_binding / (hs as u64 * 2)) as usize + 200).min(2_000_000);
    if (vocab * hs * 2) as u64 > 512 << 20 {
        eprintln!(
            "binding of {max_binding} bytes: a head past it would be too big for this test; checking the plan only"
        );
        let slices = headkl_core::slice_vocab(1 << 20, hs, max_binding, None).unwrap();
        assert!(!slices.is_empty());
        return;
    }
    let (ntok, k) = (20usize, 64usize);
    let w: Vec<f16> = noise(vocab * hs, 3).iter().map(|&v| f16::from_f32(v * 0.5)).collect();
    let head = HeadWeights::new(HeadData::F16(&w), vocab, hs).unwrap();
    let mut engine = Engine::new(&b, &head, SliceOptions::default()).unwrap();
    assert!(engine.slices().len() >= 2, "{:?}", engine.slices());
    let x = noise(ntok * hs, 4);
    let hidden = Hidden::f32(&x, ntok, hs).unwrap();

    let top = engine.topk(&hidden, &TopkOptions::new(k)).unwrap();
    let want = topk_f64(&head, &hidden, k, 1.0);
    Tolerance::default().check_topk(&top.ids, &top.probs, &want).unwrap();

    let teacher = Teacher::new(&top.ids, &top.probs, ntok, k, vocab).unwrap();
    let opts = LossOptions::default();
    let out = engine.head_kl(&hidden, &teacher, &opts).unwrap();
    let want = head_kl_f64(&head, &hidden, &teacher, &opts.resolve(ntok).unwrap());
    let tol = Tolerance::default();
    let loss_err = tol.check_loss(&out.loss, out.mean, &want).unwrap();
    let dx_err = tol.check_dx(&out.dx, &want.dx).unwrap();
    eprintln!(
        "{} slices, vocab {vocab}: loss err {loss_err:.2e}, dx err {dx_err:.2e}",
        engine.slices().len()
    );
    drop(engine);
    assert!(b.take_diagnostics().is_empty());
}

/// A named row of logits, by column.
type Pattern = (&'static str, Box<dyn Fn(usize) -> f32>);

/// Exact top-k on crafted rows against a CPU sort (value descending, id
/// ascending, -0 == +0): ties at every digit boundary of the radix select.
#[test]
fn topk_rows_is_exact_on_crafted_rows() {
    let Some(b) = open() else { return };
    let vocab = 5000usize;
    let ld = 5008usize;
    let base = 1.5f32.to_bits();
    let patterns: Vec<Pattern> = vec![
        ("all equal", Box::new(|_| 0.25)),
        (
            "low bits only",
            Box::new(move |j| f32::from_bits(base + (j % 7) as u32)),
        ),
        (
            "middle digit",
            Box::new(move |j| f32::from_bits(base + (((j * 13) % 5) << 10) as u32)),
        ),
        (
            "residue 3 mod 256 on top",
            Box::new(|j| {
                if j % 256 == 3 {
                    2.0 + (j / 256) as f32 * 1e-3
                } else {
                    -1.0
                }
            }),
        ),
        ("signed zeros", Box::new(|j| if j % 2 == 0 { 0.0 } else { -0.0 })),
        ("negatives", Box::new(|j| -((j % 97) as f32) - 0.5)),
        ("two values", Box::new(|j| if j % 3 == 0 { 1.0 } else { 0.5 })),
    ];
    for k in [1usize, 17, 256, 2048] {
        let rows = patterns.len();
        let mut logits = vec![f32::NAN; rows * ld];
        for (r, (_, f)) in patterns.iter().enumerate() {
            for j in 0..vocab {
                logits[r * ld + j] = f(j);
            }
        }
        let lbuf = b.alloc((logits.len() * 4) as u64, "logits").unwrap();
        b.upload(&lbuf, 0, bytemuck::cast_slice(&logits)).unwrap();
        let ids = b.alloc((rows * k * 4) as u64, "ids").unwrap();
        let probs = b.alloc((rows * k * 4) as u64, "probs").unwrap();
        b.upload(&probs, 0, bytemuck::cast_slice(&vec![f32::NAN; rows * k]))
            .unwrap();
        b.topk_rows(
            &lbuf,
            &ids,
            &probs,
            &headkl_core::toolkit::TopkDesc::plain(rows, vocab, ld, k),
        )
        .unwrap();
        let mut got_ids = vec![0u32; rows * k];
        b.download(&ids, 0, bytemuck::cast_slice_mut(&mut got_ids)).unwrap();
        let got_probs = download_f32(&b, &probs, rows * k);
        for (r, (name, _)) in patterns.iter().enumerate() {
            let row = &logits[r * ld..r * ld + vocab];
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|&x, &y| row[y as usize].partial_cmp(&row[x as usize]).unwrap().then(x.cmp(&y)));
            assert_eq!(&got_ids[r * k..(r + 1) * k], &order[..k], "{name}, k = {k}");
            let top = f64::from(row[order[0] as usize]);
            let e: Vec<f64> = order[..k]
                .iter()
                .map(|&i| (f64::from(row[i as usize]) - top).exp())
                .collect();
            let sum: f64 = e.iter().sum();
            for q in 0..k {
                let want = e[q] / sum;
                let got = f64::from(got_probs[r * k + q]);
                assert!(
                    (got - want).abs() <= 1e-5 * want + 1e-12,
                    "{name}, k = {k}, q = {q}: {got} vs {want}"
                );
            }
        }
    }
}

/// The GLSL tiles through `PASSTHROUGH_SHADERS`: where the GEMM has no
/// matrix units (lavapipe in CI) naming them is a typed error; where they
/// are taken (a Vulkan adapter with subgroups of 32, the H200), the kernel
/// cases pass with them.
#[test]
fn glsl_tiles_run_or_are_refused_with_a_typed_error() {
    let Some(mut b) = open() else { return };
    let choice = GemmChoice::parse(
        "logits=glsl:bm128.bk64.s1,dx=glsl:bm128.bk32.s2",
        headkl_wgpu::DEFAULT_GEMM,
    )
    .unwrap();
    let outcome = b.use_gemm(choice);
    let accepted = gemm_choice_outcome(&b, choice, outcome).unwrap();
    eprintln!("glsl tiles accepted: {accepted}; gemm: {}", b.gemm_path());
    assert_eq!(b.gemm_choice() == Some(choice), accepted);
    assert_eq!(b.gemm_path().contains("glsl:bm128.bk32.s2"), accepted);
    assert_eq!(b.take_diagnostics(), Vec::<String>::new());
}
