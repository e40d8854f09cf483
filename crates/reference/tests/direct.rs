//! The direct f64 formulas checked against first principles: dx against a
//! central finite difference of the mean loss, KL ≥ 0, KL = 0 when the
//! teacher is the student, top-k against a full sort.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use headkl_core::{Engine, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, SliceOptions, Teacher};
use headkl_reference::direct::{head_kl_f64, logits_f64, softmax_over, topk_f64};
use headkl_reference::generator::{draw_case_params, Case, CaseKind, CaseParams, TeacherShape};
use headkl_reference::CpuBackend;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

/// A proptest strategy over the suite's cases of `kind`: a seed, drawn by
/// proptest, through the suite's own generator.
fn case_params(kind: CaseKind) -> impl Strategy<Value = CaseParams> {
    any::<u64>().prop_map(move |seed| draw_case_params(kind, seed))
}

/// A `head_kl` case.
fn head_kl_case() -> impl Strategy<Value = Case> {
    case_params(CaseKind::HeadKl).prop_map(|p| Case::from_params(&p))
}

/// Small, f16-exact values: multiples of 2^-11 in (−0.9, 0.9), so `x ± 2^-10`
/// is f16-exact too and rounding cannot blur a finite difference.
fn f16_exact(i: usize, salt: usize) -> f32 {
    let m = ((i * 2_654_435_761 + salt * 40_503) % 3601) as i64 - 1800;
    m as f32 / 2048.0
}

#[test]
fn dx_matches_a_central_finite_difference_of_the_mean_loss() {
    let (vocab, hs, ntok, k) = (37, 6, 3, 5);
    let w: Vec<f32> = (0..vocab * hs).map(|i| f16_exact(i, 1) * 2.0).collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| f16_exact(i, 2)).collect();
    let ids: Vec<u32> = (0..ntok * k).map(|i| ((i * 7 + i / k) % vocab) as u32).collect();
    let probs: Vec<f32> = (0..ntok * k).map(|i| 0.1 + (i % 4) as f32 * 0.2).collect();
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let teacher = Teacher::new(&ids, &probs, ntok, k, vocab).unwrap();
    let opts = LossOptions {
        config: LossConfig {
            temperature: 1.5,
            total: Some(4.0),
            ..LossConfig::default()
        },
        weights: Some(vec![1.0, 0.0, 2.5]),
        ..LossOptions::default()
    };
    let resolved = opts.resolve(ntok).unwrap();
    let mean_at = |x: &[f32]| head_kl_f64(&head, &Hidden::f32(x, ntok, hs).unwrap(), &teacher, &resolved).mean;
    let analytic = head_kl_f64(&head, &Hidden::f32(&x, ntok, hs).unwrap(), &teacher, &resolved).dx;

    let h = 1.0 / 1024.0;
    let mut numeric = vec![0f64; x.len()];
    for i in 0..x.len() {
        let (mut plus, mut minus) = (x.clone(), x.clone());
        plus[i] += h;
        minus[i] -= h;
        numeric[i] = (mean_at(&plus) - mean_at(&minus)) / (2.0 * f64::from(h));
    }
    let err: f64 = numeric
        .iter()
        .zip(&analytic)
        .map(|(n, a)| (n - a).powi(2))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = analytic.iter().map(|a| a * a).sum::<f64>().sqrt();
    assert!(norm > 1e-3, "a gradient this small checks nothing: {norm}");
    assert!(
        err / norm < 1e-5,
        "relative error {:.3e}\nnumeric  {numeric:?}\nanalytic {analytic:?}",
        err / norm
    );
    // the masked token has no gradient
    assert!(analytic[hs..2 * hs].iter().all(|&v| v == 0.0));
}

proptest! {
    #![proptest_config(Config { cases: 24, rng_seed: RngSeed::Fixed(0x4B4C), failure_persistence: None, ..Config::default() })]

    #[test]
    fn kl_is_never_negative(case in head_kl_case()) {
        let head = case.head_weights().unwrap();
        let f16_rows = case.hidden_f16();
        let hidden = case.hidden_rows(&f16_rows).unwrap();
        let teacher = case.teacher().unwrap();
        let resolved = case.loss_options().resolve(case.ntok).unwrap();
        let out = head_kl_f64(&head, &hidden, &teacher, &resolved);
        for (t, &l) in out.loss.iter().enumerate() {
            prop_assert!(l >= -1e-12 * (1.0 + l.abs()), "L[{t}] = {l} for {}", case.describe());
        }
        prop_assert!(out.mean >= -1e-12);
    }
}

/// k = V and the teacher's probabilities are the student's own softmax.
fn teacher_is_student(seed: u64, temperature: f32) -> Case {
    let mut case = Case::from_params(&CaseParams {
        kind: CaseKind::HeadKl,
        profile: "kl_zero",
        vocab: 40,
        hs: 24,
        ntok: 19,
        k: 40,
        data_seed: seed,
        teacher: TeacherShape::Random,
        large: false,
        ties: true,
        residue: false,
        masked: true,
        temperature,
        hidden_as_f16: false,
        max_rows_per_slice: None,
        max_rows_per_chunk: Some(16),
    });
    let head = case.head_weights().unwrap();
    let s = logits_f64(&head, &case.hidden_rows(&[]).unwrap(), temperature);
    let all: Vec<u32> = (0..40).collect();
    // a shuffled id order, so the kernel cannot rely on ids being sorted
    let order: Vec<u32> = (0..40u32).map(|i| (i * 17 + 3) % 40).collect();
    case.teacher_ids = (0..case.ntok).flat_map(|_| order.iter().copied()).collect();
    case.teacher_probs = (0..case.ntok)
        .flat_map(|t| {
            let p = softmax_over(&s[t * 40..(t + 1) * 40], &all);
            order.iter().map(move |&j| p[j as usize] as f32).collect::<Vec<_>>()
        })
        .collect();
    case
}

#[test]
fn kl_is_zero_when_the_teacher_is_the_student() {
    for (seed, tau) in [(1u64, 1.0f32), (2, 0.6), (3, 2.5)] {
        let case = teacher_is_student(seed, tau);
        let head = case.head_weights().unwrap();
        let hidden = case.hidden_rows(&[]).unwrap();
        let teacher = case.teacher().unwrap();
        let opts = case.loss_options();
        let want = head_kl_f64(&head, &hidden, &teacher, &opts.resolve(case.ntok).unwrap());
        assert!(want.loss.iter().all(|l| l.abs() <= 1e-6), "direct: {:?}", want.loss);
        assert!(want.mean.abs() <= 1e-6);
        assert!(want.dx.iter().all(|d| d.abs() <= 1e-6), "direct dx");

        let backend = CpuBackend::new();
        let mut engine = Engine::new(&backend, &head, SliceOptions::default()).unwrap();
        let out = engine.head_kl(&hidden, &teacher, &opts).unwrap();
        assert!(out.loss.iter().all(|l| l.abs() <= 1e-6), "driver: {:?}", out.loss);
        assert!(out.mean.abs() <= 1e-6);
        assert!(out.dx.iter().all(|d| d.abs() <= 1e-6), "driver dx");
        // and a perturbed teacher is not zero: the check can fail
        let mut other = case.clone();
        other.teacher_probs.swap(0, 1);
        let t2 = other.teacher().unwrap();
        let moved = engine.head_kl(&hidden, &t2, &opts).unwrap();
        let expected = head_kl_f64(&head, &hidden, &t2, &opts.resolve(case.ntok).unwrap());
        if (case.teacher_probs[0] - case.teacher_probs[1]).abs() > 1e-3 {
            assert!(expected.loss[0] > 1e-6 && moved.loss[0] > 1e-6);
        }
    }
}

/// All ids of a row by (logit descending, id ascending), by a plain sort.
fn full_sort(row: &[f64]) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    idx.sort_by(|&a, &b| row[b as usize].partial_cmp(&row[a as usize]).unwrap().then(a.cmp(&b)));
    idx
}

#[test]
fn topk_matches_a_full_sort() {
    let mut runner = proptest::test_runner::TestRunner::new_with_rng(
        Config::default(),
        proptest::test_runner::TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &[7; 32]),
    );
    let mut seen_ties = 0;
    let mut seen_residue = 0;
    for _ in 0..40 {
        let p = proptest::strategy::ValueTree::current(&case_params(CaseKind::Topk).new_tree(&mut runner).unwrap());
        let case = Case::from_params(&p);
        let head = case.head_weights().unwrap();
        let f16_rows = case.hidden_f16();
        let hidden = case.hidden_rows(&f16_rows).unwrap();
        let top = topk_f64(&head, &hidden, case.k, case.temperature);
        let s = logits_f64(&head, &hidden, case.temperature);
        for t in 0..case.ntok {
            let row = &s[t * case.vocab..(t + 1) * case.vocab];
            let sorted = full_sort(row);
            assert_eq!(
                &top.ids[t * case.k..(t + 1) * case.k],
                &sorted[..case.k],
                "{}",
                case.describe()
            );
            let want = softmax_over(row, &sorted[..case.k]);
            for (got, want) in top.probs[t * case.k..(t + 1) * case.k].iter().zip(&want) {
                assert!((got - want).abs() <= 1e-12 * want.max(1e-300), "{}", case.describe());
            }
            let ids = &sorted[..case.k];
            if ids.windows(2).any(|w| row[w[0] as usize] == row[w[1] as usize]) {
                seen_ties += 1;
            }
            if p.residue && ids.iter().all(|&i| i % 256 == ids[0] % 256) && case.k > 1 {
                seen_residue += 1;
            }
        }
    }
    assert!(seen_ties > 0, "no exact ties among the drawn top-k rows");
    assert!(seen_residue > 0, "no row whose top-k shares one residue class mod 256");
}

#[test]
fn exact_ties_go_to_the_lowest_id() {
    // rows 1, 4 and 6 of the head are equal, and lead: x·w_1 = 1 while every
    // other row has |entries| < 0.45, so |x·w_j| ≤ 0.9
    let (vocab, hs) = (8, 4);
    let mut w: Vec<f32> = (0..vocab * hs).map(|i| f16_exact(i, 9) * 0.5).collect();
    for lead in [1, 4, 6] {
        w[lead * hs..(lead + 1) * hs].fill(0.5);
    }
    let x = vec![0.5f32; hs];
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let hidden = Hidden::f32(&x, 1, hs).unwrap();
    let s = logits_f64(&head, &hidden, 1.0);
    assert_eq!((s[1], s[4], s[6]), (1.0, 1.0, 1.0));
    let top = topk_f64(&head, &hidden, 3, 1.0);
    assert_eq!(top.ids, vec![1, 4, 6]);
    assert_eq!(top.ids, full_sort(&s)[..3].to_vec());
    assert!(top.probs.iter().all(|p| (p - 1.0 / 3.0).abs() < 1e-15));
    // k = 2 cuts the tie at the boundary: the lower ids stay
    assert_eq!(topk_f64(&head, &hidden, 2, 1.0).ids, vec![1, 4]);
    // and the CPU driver agrees exactly (its f32 logits tie too)
    let backend = CpuBackend::new();
    let mut engine = Engine::new(&backend, &head, SliceOptions::default()).unwrap();
    let out = engine.topk(&hidden, &headkl_core::TopkOptions::new(2)).unwrap();
    assert_eq!(out.ids, vec![1, 4]);
    assert_eq!(out.probs, vec![0.5, 0.5]);
}
