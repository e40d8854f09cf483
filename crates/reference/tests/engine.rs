//! The core driver on the CPU kernels, with the head cut into several
//! vocabulary slices and the tokens into several chunks, matches the direct
//! f64 formula.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use headkl_core::{Backend, DxSplit, Engine, HiddenData, SliceOptions};

use headkl_conformance::generator::{Case, CaseKind, CaseParams, TeacherShape};
use headkl_core::toolkit::KernelId;
use headkl_reference::direct::{head_kl_f64, topk_f64};
use headkl_reference::{CpuBackend, Tolerance};

fn case(kind: CaseKind, hidden_as_f16: bool) -> Case {
    Case::from_params(&params(kind, hidden_as_f16))
}

fn params(kind: CaseKind, hidden_as_f16: bool) -> CaseParams {
    CaseParams {
        kind,
        profile: "driver_test",
        vocab: 1111,
        hs: 70,
        ntok: 83,
        k: 19,
        data_seed: 77,
        teacher: TeacherShape::Random,
        large: false,
        ties: true,
        residue: false,
        masked: true,
        temperature: 1.7,
        hidden_as_f16,
        max_rows_per_slice: Some(300),
        max_rows_per_chunk: Some(20),
    }
}

fn check(backend: &CpuBackend, case: &Case, min_slices: usize, min_chunks: usize) {
    let head = case.head_weights().unwrap();
    let mut engine = Engine::new(backend, &head, case.slice_options()).unwrap();
    assert!(engine.slices().len() >= min_slices, "{} slices", engine.slices().len());
    let opts = case.loss_options();
    let plan = engine.loss_plan(case.ntok, case.k, !case.hidden_as_f16, &opts).unwrap();
    assert!(plan.chunks >= min_chunks, "{} chunks", plan.chunks);
    check_on(&mut engine, case);
}

/// The case's job on `engine`, against the direct f64 formula.
fn check_on<B: Backend>(engine: &mut Engine<B>, case: &Case) {
    let tol = Tolerance::default();
    let head = case.head_weights().unwrap();
    let f16_rows = case.hidden_f16();
    let hidden = case.hidden_rows(&f16_rows).unwrap();
    assert_eq!(matches!(hidden.data(), HiddenData::F16(_)), case.hidden_as_f16);
    let opts = case.loss_options();
    match case.kind {
        CaseKind::HeadKl => {
            let teacher = case.teacher().unwrap();
            let out = engine.head_kl(&hidden, &teacher, &opts).unwrap();
            let want = head_kl_f64(&head, &hidden, &teacher, &opts.resolve(case.ntok).unwrap());
            let l = tol
                .check_loss(&out.loss, out.mean, &want)
                .unwrap_or_else(|e| panic!("{e}"));
            let d = tol
                .check_dx_rows(&out.dx, &want.dx, Some(case.hs))
                .unwrap_or_else(|e| panic!("{e}"));
            // f64 kernels: only the f32 logits and the f16 gradient round
            assert!(l < 1e-6, "loss error {l:.3e}");
            assert!(d < 1e-3, "dx error {d:.3e}");
        }
        CaseKind::Topk => {
            let out = engine.topk(&hidden, &case.topk_options()).unwrap();
            let want = topk_f64(&head, &hidden, case.k, case.temperature);
            let p = tol
                .check_topk(&out.ids, &out.probs, &want)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(p < 1e-5, "prob error {p:.3e}");
        }
    }
}

/// On a backend with a matrix-unit tile, `auto` splits a dx GEMM whose
/// output is one tile but whose reduction is long: V 8200 (8208 padded,
/// two parts of at least 4096) in one slice, 16 rows of hs 16. The split
/// result matches the f64 formula, and the sum of parts runs once per chunk.
#[test]
fn auto_splits_a_long_reduction_on_few_tiles() {
    let backend = CpuBackend::new().with_gemm_tile(Some((128, 128)));
    let case = Case::from_params(&CaseParams {
        vocab: 8200,
        hs: 16,
        ntok: 16,
        max_rows_per_slice: None,
        max_rows_per_chunk: None,
        ..params(CaseKind::HeadKl, false)
    });
    let head = case.head_weights().unwrap();
    let mut engine = Engine::new(&backend, &head, case.slice_options()).unwrap();
    assert_eq!(engine.dx_split(), DxSplit::Auto);
    assert_eq!(engine.dx_parts(16), vec![2]);
    // No matrix units: auto never splits; a forced split does.
    let plain = CpuBackend::new();
    let mut unsplit = Engine::new(&plain, &head, case.slice_options()).unwrap();
    assert_eq!(unsplit.dx_parts(16), vec![1]);
    unsplit.set_dx_split(DxSplit::Parts(3));
    assert_eq!(unsplit.dx_parts(16), vec![3]);
    backend.set_profiling(true);
    check_on(&mut engine, &case);
    let sums = backend
        .take_kernel_times()
        .unwrap()
        .iter()
        .filter(|t| t.kernel == KernelId::SumParts.name())
        .count();
    assert_eq!(sums, 1);
}

#[test]
fn forced_slices_and_chunks_match_the_direct_formula() {
    let backend = CpuBackend::new();
    for kind in [CaseKind::HeadKl, CaseKind::Topk] {
        for f16 in [false, true] {
            check(&backend, &case(kind, f16), 4, 5);
        }
    }
}

#[test]
fn a_small_binding_slices_and_chunks_on_its_own() {
    // 96 KiB: 128-row blocks of hs_pad = 80 f16 take 20 KiB, so 4 blocks
    // (512 rows) per slice and 3 slices for V = 1111; a row of 1120 f32
    // logits takes 4480 bytes, so 16 rows per chunk and 6 chunks of 83.
    let backend = CpuBackend::with_max_binding(96 << 10);
    for kind in [CaseKind::HeadKl, CaseKind::Topk] {
        let mut c = case(kind, false);
        c.max_rows_per_slice = None;
        c.max_rows_per_chunk = None;
        check(&backend, &c, 3, 5);
    }
    assert_eq!(backend.memory().current, 0, "every buffer was freed");
    assert!(backend.memory().peak > 0);
}

#[test]
fn one_engine_serves_calls_of_different_shapes() {
    let backend = CpuBackend::new();
    let kl = case(CaseKind::HeadKl, false);
    let head = kl.head_weights().unwrap();
    let mut engine = Engine::new(
        &backend,
        &head,
        SliceOptions {
            max_rows_per_slice: Some(256),
        },
    )
    .unwrap();
    let tol = Tolerance::default();
    for (ntok, k, chunk) in [(83, 19, Some(20)), (5, 3, None), (40, 19, Some(16))] {
        let mut c = kl.clone();
        c.ntok = ntok;
        c.k = k;
        c.hidden.truncate(ntok * c.hs);
        c.teacher_ids = leading(&kl.teacher_ids, 19, (ntok, k));
        c.teacher_probs = leading(&kl.teacher_probs, 19, (ntok, k));
        c.weights = None;
        c.max_rows_per_chunk = chunk;
        let hidden = c.hidden_rows(&[]).unwrap();
        let teacher = c.teacher().unwrap();
        let opts = c.loss_options();
        let out = engine.head_kl(&hidden, &teacher, &opts).unwrap();
        let want = head_kl_f64(&head, &hidden, &teacher, &opts.resolve(ntok).unwrap());
        tol.check_loss(&out.loss, out.mean, &want).unwrap();
        tol.check_dx(&out.dx, &want.dx).unwrap();
        let top = engine.topk(&hidden, &c.topk_options()).unwrap();
        tol.check_topk(&top.ids, &top.probs, &topk_f64(&head, &hidden, k, c.temperature))
            .unwrap();
    }
}

/// `head_kl_into` with an output kept from a call of another size gives
/// exactly what `head_kl` gives, on both the padded (hs = 70) and the dense
/// (hs = 64) download paths.
#[test]
fn head_kl_into_reuses_an_output_of_any_size() {
    let backend = CpuBackend::new();
    let mut out = headkl_core::LossOutput {
        loss: vec![f32::NAN; 500],
        mean: f64::NAN,
        dx: vec![f32::NAN; 3],
        lse: vec![f32::NAN; 7],
        soft: Vec::new(),
        hard: vec![1.0; 900],
        filter: None,
        head_grad: vec![f32::NAN; 11],
    };
    for hs in [70, 64] {
        let c = Case::from_params(&CaseParams {
            hs,
            ..params(CaseKind::HeadKl, false)
        });
        let head = c.head_weights().unwrap();
        let mut engine = Engine::new(&backend, &head, c.slice_options()).unwrap();
        let rows = c.hidden_f16();
        let hidden = c.hidden_rows(&rows).unwrap();
        let teacher = c.teacher().unwrap();
        let opts = c.loss_options();
        let fresh = engine.head_kl(&hidden, &teacher, &opts).unwrap();
        engine.head_kl_into(&hidden, &teacher, &opts, &mut out).unwrap();
        assert_eq!(out, fresh, "hs = {hs}");
        assert_eq!((out.loss.len(), out.dx.len()), (c.ntok, c.ntok * hs));
    }
}

/// bf16 hidden rows on the host path give exactly what the same values as
/// f32 give: both are rounded to f16 once on the way up.
#[test]
fn bf16_rows_match_their_f32_values() {
    let backend = CpuBackend::new();
    let c = case(CaseKind::HeadKl, false);
    let head = c.head_weights().unwrap();
    let rows: Vec<half::bf16> = c.hidden.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let values: Vec<f32> = rows.iter().map(|v| v.to_f32()).collect();
    let teacher = c.teacher().unwrap();
    let opts = c.loss_options();
    let mut engine = Engine::new(&backend, &head, c.slice_options()).unwrap();
    let as_bf16 = headkl_core::Hidden::bf16(&rows, c.ntok, c.hs).unwrap();
    let as_f32 = headkl_core::Hidden::f32(&values, c.ntok, c.hs).unwrap();
    let from_bf16 = engine.head_kl(&as_bf16, &teacher, &opts).unwrap();
    let from_f32 = engine.head_kl(&as_f32, &teacher, &opts).unwrap();
    assert_eq!(from_bf16, from_f32);
    let top_bf16 = engine.topk(&as_bf16, &c.topk_options()).unwrap();
    let top_f32 = engine.topk(&as_f32, &c.topk_options()).unwrap();
    assert_eq!(top_bf16, top_f32);
}

/// The progress callback hears every chunk of one call, tokens summing to
/// ntok, and leaves the results as they are without it.
#[test]
fn progress_reports_every_chunk_and_changes_nothing() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let backend = CpuBackend::new();
    for kind in [CaseKind::HeadKl, CaseKind::Topk] {
        let case = case(kind, false);
        let head = case.head_weights().unwrap();
        let f16_rows = case.hidden_f16();
        let hidden = case.hidden_rows(&f16_rows).unwrap();
        let mut engine = Engine::new(&backend, &head, case.slice_options()).unwrap();
        let run = |engine: &mut Engine<&CpuBackend>| match kind {
            CaseKind::HeadKl => {
                let out = engine
                    .head_kl(&hidden, &case.teacher().unwrap(), &case.loss_options())
                    .unwrap();
                (out.loss, out.dx)
            }
            CaseKind::Topk => {
                let out = engine.topk(&hidden, &case.topk_options()).unwrap();
                (out.probs, out.ids.iter().map(|&i| i as f32).collect())
            }
        };
        let quiet = run(&mut engine);
        let (tokens, calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (t, c) = (tokens.clone(), calls.clone());
        engine.set_progress(Some(Box::new(move |rows| {
            t.fetch_add(rows, Ordering::SeqCst);
            c.fetch_add(1, Ordering::SeqCst);
        })));
        let heard = run(&mut engine);
        assert_eq!(heard, quiet, "{kind}");
        assert_eq!(tokens.load(Ordering::SeqCst), case.ntok, "{kind}");
        // 83 tokens in chunks of at most 20 rows: one report per chunk.
        assert!(calls.load(Ordering::SeqCst) >= case.ntok.div_ceil(20), "{kind}");
    }
}

/// The first `k` entries of the first `ntok` rows of `rows`, `width` a row.
fn leading<T: Copy>(rows: &[T], width: usize, (ntok, k): (usize, usize)) -> Vec<T> {
    rows.chunks(width).take(ntok).flat_map(|r| r[..k].to_vec()).collect()
}

/// A head read from the device (`Engine::from_device_head`) and read again
/// after it changed (`Engine::refill_device_head`, planes rewritten in
/// place) gives what an engine made from the new head gives, bit for bit,
/// the head's gradient included; a wrong number of row norms is refused.
#[test]
fn a_refilled_device_head_is_the_new_head() {
    use half::f16;
    use headkl_core::{DevicePlane, HeadData, HeadWeights, LossConfig, LossOptions};
    let backend = CpuBackend::new();
    let c = case(CaseKind::HeadKl, false);
    let (vocab, hs) = (c.vocab, c.hs);
    let before: Vec<f32> = c.head.iter().map(|v| v * 0.5).collect();
    let after = c.head.clone();
    // Writes `w`'s rows, rounded to f16 and zero-padded, into the plane.
    let fill_from = |w: &[f32]| {
        let w16: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        move |b: &&CpuBackend, plane: DevicePlane<'_, _>| {
            let mut rows = vec![f16::ZERO; plane.padded_rows * plane.hs_padded];
            for r in 0..plane.rows {
                let src = &w16[(plane.first_row + r) * hs..(plane.first_row + r + 1) * hs];
                rows[r * plane.hs_padded..r * plane.hs_padded + hs].copy_from_slice(src);
            }
            b.upload(plane.buffer, 0, bytemuck::cast_slice(&rows))
        }
    };
    let norms = |w: &[f32]| -> Vec<f32> {
        w.chunks_exact(hs)
            .map(|r| r.iter().map(|&v| f16::from_f32(v).to_f32().powi(2)).sum::<f32>().sqrt())
            .collect()
    };
    let slicing = c.slice_options();
    let mut engine =
        Engine::from_device_head(&backend, (vocab, hs), slicing, &norms(&before), fill_from(&before)).unwrap();
    let rows = c.hidden_f16();
    let hidden = c.hidden_rows(&rows).unwrap();
    let teacher = c.teacher().unwrap();
    let opts = LossOptions {
        config: LossConfig {
            head_grad: true,
            ..c.loss_options().config
        },
        ..c.loss_options()
    };
    let old = engine.head_kl(&hidden, &teacher, &opts).unwrap();
    assert!(engine
        .refill_device_head(&norms(&after)[1..], fill_from(&after))
        .is_err());
    engine.refill_device_head(&norms(&after), fill_from(&after)).unwrap();
    let refilled = engine.head_kl(&hidden, &teacher, &opts).unwrap();
    let head = HeadWeights::new(HeadData::F32(&after), vocab, hs).unwrap();
    let fresh = Engine::new(&backend, &head, slicing)
        .unwrap()
        .head_kl(&hidden, &teacher, &opts)
        .unwrap();
    assert_ne!(old.loss, fresh.loss);
    assert_eq!(refilled, fresh);
    assert_eq!(refilled.head_grad.len(), vocab * hs);
    // The reference's dx GEMM has the block filter, whose bound reads the
    // norms: a refill without them is refused before any plane is written.
    let mut written = false;
    let refused = engine.refill_device_head_queued(|_, _| {
        written = true;
        Ok(())
    });
    assert!(
        matches!(refused, Err(headkl_core::Error::MissingFeature(_))),
        "{refused:?}"
    );
    assert!(!written, "a plane was written before the refusal");
}
