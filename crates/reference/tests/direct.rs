//! The direct f64 formulas checked against first principles: dx and the
//! head's gradient against a central finite difference of the mean loss,
//! KL ≥ 0, KL = 0 when the teacher is the student, top-k against a full
//! sort.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use headkl_conformance::generator::{draw_case_params, Case, CaseKind, CaseParams, TeacherShape};
use headkl_core::{
    Divergence, Engine, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, LossTerms, Reduction, SliceOptions,
    TailMode, Teacher, TeacherForm,
};
use headkl_reference::direct::{
    head_kl_and_head_grad_f64, head_kl_f64, head_kl_full_vocab_and_head_grad_f64, head_kl_full_vocab_f64, logits_f64,
    softmax_over, topk_f64,
};
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

/// `‖a − b‖₂ / ‖b‖₂`, and `‖b‖₂`.
fn rel_err(a: &[f64], b: &[f64]) -> (f64, f64) {
    let err: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    (err / norm, norm)
}

#[test]
fn head_grad_matches_a_central_finite_difference_of_the_mean_loss() {
    let (vocab, hs, ntok, k) = (29, 5, 4, 4);
    // |W| < 1.8 and multiples of 2^-10, so W ± 2^-10 is f16-exact.
    let w: Vec<f32> = (0..vocab * hs).map(|i| f16_exact(i, 3) * 2.0).collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| f16_exact(i, 4)).collect();
    let ids: Vec<i64> = (0..ntok * k).map(|i| ((i * 7 + i / k) % vocab) as i64).collect();
    let probs: Vec<f32> = (0..ntok * k).map(|i| 0.05 + (i % 4) as f32 * 0.05).collect();
    let hidden = Hidden::f32(&x, ntok, hs).unwrap();
    // The plain loss with weights (one masked) and an explicit total, then
    // every term with the JSD in bucket mode and the sum.
    let every = LossTerms {
        soft_weight: 0.7,
        hard_weight: 0.5,
        label_smoothing: 0.1,
        z_loss: 1e-2,
        softcap: Some(4.0),
        logit_scale: 0.8,
        divergence: Divergence::Jsd { beta: 0.3 },
    };
    let setups = [
        (
            TailMode::Renormalize,
            LossConfig {
                temperature: 1.5,
                total: Some(4.0),
                ..LossConfig::default()
            },
        ),
        (
            TailMode::Bucket,
            LossConfig {
                temperature: 2.0,
                terms: every,
                reduction: Reduction::Sum,
                ..LossConfig::default()
            },
        ),
    ];
    for (tail, config) in setups {
        let teacher = Teacher::with_form(&ids, &probs, ntok, k, vocab, TeacherForm::Probs, tail).unwrap();
        let opts = LossOptions {
            config,
            weights: Some(vec![1.0, 0.0, 2.5, 0.5]),
            labels: Some(vec![3, -100, 17, 28]),
            ..LossOptions::default()
        };
        let resolved = opts.resolve(ntok).unwrap();
        let mean_at = |w: &[f32]| {
            let h = HeadWeights::new(HeadData::F32(w), vocab, hs).unwrap();
            head_kl_f64(&h, &hidden, &teacher, &resolved).mean
        };
        let h0 = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
        let (out, analytic) = head_kl_and_head_grad_f64(&h0, &hidden, &teacher, &resolved);
        assert_eq!(out, head_kl_f64(&h0, &hidden, &teacher, &resolved));
        assert_eq!(analytic.len(), vocab * hs);
        let h = 1.0 / 1024.0;
        let numeric: Vec<f64> = (0..w.len())
            .map(|i| {
                let (mut plus, mut minus) = (w.clone(), w.clone());
                plus[i] += h;
                minus[i] -= h;
                (mean_at(&plus) - mean_at(&minus)) / (2.0 * f64::from(h))
            })
            .collect();
        let (err, norm) = rel_err(&numeric, &analytic);
        assert!(norm > 1e-3, "{tail:?}: a gradient this small checks nothing: {norm}");
        assert!(
            err < 1e-5,
            "{tail:?}: relative error {err:.3e}\nnumeric  {numeric:?}\nanalytic {analytic:?}"
        );
    }
}

#[test]
fn head_grad_sums_the_tokens_and_a_non_finite_token_makes_it_nan() {
    // One token at a time (the others masked, the total fixed): the
    // tokens' gradients add up to the whole call's.
    let case = Case::from_params(&CaseParams {
        masked: false,
        ..draw_case_params(CaseKind::HeadKl, 0xD1)
    });
    let head = case.head_weights().unwrap();
    let f16_rows = case.hidden_f16();
    let hidden = case.hidden_rows(&f16_rows).unwrap();
    let teacher = case.teacher().unwrap();
    let total = case.ntok as f32;
    let opts_with = |weights: Vec<f32>| LossOptions {
        config: LossConfig {
            total: Some(total),
            ..case.loss_options().config
        },
        weights: Some(weights),
        ..case.loss_options()
    };
    let all = opts_with(vec![1.0; case.ntok]).resolve(case.ntok).unwrap();
    let (_, whole) = head_kl_and_head_grad_f64(&head, &hidden, &teacher, &all);
    let mut summed = vec![0f64; whole.len()];
    for t in 0..case.ntok {
        let mut w = vec![0f32; case.ntok];
        w[t] = 1.0;
        let one = opts_with(w).resolve(case.ntok).unwrap();
        let (_, part) = head_kl_and_head_grad_f64(&head, &hidden, &teacher, &one);
        summed.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
    }
    let (err, _) = rel_err(&summed, &whole);
    assert!(err < 1e-12, "{err:e} for {}", case.describe());
    let mut masked = vec![1.0; case.ntok];
    masked[0] = 0.0;
    let masked = opts_with(masked).resolve(case.ntok).unwrap();
    let mut none = vec![0.0; case.ntok];
    none[0] = 1.0;
    let none = opts_with(none).resolve(case.ntok).unwrap();
    // A NaN in a hidden row (masked or not): its loss and dx row are NaN,
    // and so is every element of dW (every head row meets it).
    let mut x = case.hidden.clone();
    x[case.hs + 1] = f32::NAN;
    let poisoned = Hidden::f32(&x, case.ntok, case.hs).unwrap();
    for resolved in [&all, &masked, &none] {
        let (out, dw) = head_kl_and_head_grad_f64(&head, &poisoned, &teacher, resolved);
        assert!(out.loss[1].is_nan() && out.dx[case.hs..2 * case.hs].iter().all(|v| v.is_nan()));
        assert!(dw.iter().all(|v| v.is_nan()), "one non-finite token: dW all NaN");
    }
    // Every token but the first masked, and then the first alone: the
    // masked tokens add nothing.
    let (_, first_only) = head_kl_and_head_grad_f64(&head, &hidden, &teacher, &none);
    let (_, rest) = head_kl_and_head_grad_f64(&head, &hidden, &teacher, &masked);
    let both: Vec<f64> = first_only.iter().zip(&rest).map(|(a, b)| a + b).collect();
    assert!(rel_err(&both, &whole).0 < 1e-12);
}

#[test]
fn the_full_vocabulary_head_grad_is_the_top_k_one_at_k_eq_v() {
    let (vocab, hs, ths, ntok) = (23, 6, 4, 3);
    let w: Vec<f32> = (0..vocab * hs).map(|i| f16_exact(i, 5) * 2.0).collect();
    let tw: Vec<f32> = (0..vocab * ths).map(|i| f16_exact(i, 6) * 2.0).collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| f16_exact(i, 7)).collect();
    let tx: Vec<f32> = (0..ntok * ths).map(|i| f16_exact(i, 8)).collect();
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let t_head = HeadWeights::new(HeadData::F32(&tw), vocab, ths).unwrap();
    let hidden = Hidden::f32(&x, ntok, hs).unwrap();
    let t_hidden = Hidden::f32(&tx, ntok, ths).unwrap();
    let resolved = LossOptions::from(LossConfig {
        temperature: 1.5,
        ..LossConfig::default()
    })
    .resolve(ntok)
    .unwrap();
    let (out, dw) = head_kl_full_vocab_and_head_grad_f64(&head, &hidden, (&t_head, &t_hidden), &resolved);
    assert_eq!(
        out,
        head_kl_full_vocab_f64(&head, &hidden, (&t_head, &t_hidden), &resolved)
    );
    let (ids, probs) = headkl_reference::direct::dense_teacher_f64(&t_head, &t_hidden, 1.5);
    let teacher = Teacher::new(&ids, &probs, ntok, vocab, vocab).unwrap();
    let (_, top_k) = head_kl_and_head_grad_f64(&head, &hidden, &teacher, &resolved);
    assert_eq!(dw, top_k);
    assert!(dw.iter().any(|&v| v != 0.0));
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
