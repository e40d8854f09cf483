//! The loss terms (README "Loss terms") in the f64 reference, checked
//! against first principles: dx against a central finite difference of the
//! mean loss for random combinations of the options, and each term against
//! its PyTorch formula written out by hand.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use headkl_core::{
    Divergence, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, LossTerms, TailMode, Teacher, TeacherForm,
};
use headkl_reference::direct::{head_kl_f64, logits_f64};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

/// Small, f16-exact values: multiples of 2^-11 in (−0.9, 0.9), so `x ± 2^-10`
/// is f16-exact too and rounding cannot blur a finite difference.
fn f16_exact(i: usize, salt: u64) -> f32 {
    let h = (i as u64)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(salt.wrapping_mul(40_503))
        % 3601;
    (h as i64 - 1800) as f32 / 2048.0
}

/// One drawn problem: shapes, data seed and the options.
#[derive(Clone, Debug)]
struct Draw {
    vocab: usize,
    hs: usize,
    k: usize,
    seed: u64,
    temperature: f32,
    tail: TailMode,
    form: TeacherForm,
    softcap: Option<f32>,
    hard_weight: f32,
    soft_weight: f32,
    label_smoothing: f32,
    z_loss: f32,
    logit_scale: f32,
    divergence: Divergence,
}

fn draws() -> impl Strategy<Value = Draw> {
    (
        (20usize..48, 3usize..7, 1usize..7, any::<u64>()),
        prop_oneof![Just(1.0f32), Just(0.6), Just(1.7)],
        prop_oneof![
            Just(TailMode::Renormalize),
            Just(TailMode::Bucket),
            Just(TailMode::Unnormalized)
        ],
        prop_oneof![Just(TeacherForm::Probs), Just(TeacherForm::Logprobs)],
        prop_oneof![Just(None), (0.4f32..3.0).prop_map(Some)],
        (
            prop_oneof![Just(0.0f32), 0.2f32..1.5],
            prop_oneof![Just(1.0f32), 0.0f32..2.0],
        ),
        (
            prop_oneof![Just(0.0f32), 0.05f32..0.6],
            prop_oneof![Just(0.0f32), 1e-3f32..0.1],
            prop_oneof![Just(1.0f32), 0.3f32..2.5],
        ),
        prop_oneof![
            Just(Divergence::Forward),
            Just(Divergence::Reverse),
            (0.05f32..0.95).prop_map(|beta| Divergence::Jsd { beta })
        ],
    )
        .prop_map(
            |(
                (vocab, hs, k, seed),
                temperature,
                tail,
                form,
                softcap,
                (hard_weight, soft_weight),
                (eps, z, scale),
                divergence,
            )| {
                Draw {
                    vocab,
                    hs,
                    k,
                    seed,
                    temperature,
                    tail,
                    form,
                    softcap,
                    hard_weight,
                    soft_weight,
                    label_smoothing: eps,
                    z_loss: z,
                    logit_scale: scale,
                    divergence,
                }
            },
        )
}

/// The head, rows, teacher and options of a draw: 4 tokens, the second
/// masked, the third without a label.
fn problem(d: &Draw) -> (Vec<f32>, Vec<f32>, Teacher, LossOptions) {
    let ntok = 4;
    let (vocab, hs, k) = (d.vocab, d.hs, d.k);
    // Head rows up to 2: logits of a few units, so a cap of 0.4–3 bends them.
    let w: Vec<f32> = (0..vocab * hs).map(|i| f16_exact(i, d.seed) * 2.0).collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| f16_exact(i, d.seed ^ 0x5555)).collect();
    let ids: Vec<i64> = (0..ntok)
        .flat_map(|t| (0..k).map(move |q| ((q * 2 + t * 3 + d.seed as usize % 5) % vocab) as i64))
        .collect();
    // The k entries hold 55–95% of the mass in bucket and none mode.
    let probs: Vec<f64> = (0..ntok * k)
        .map(|i| {
            let row_mass = 0.55 + 0.1 * ((i / k) as f64);
            row_mass * (0.2 + f64::from(f16_exact(i, d.seed ^ 7).abs())) / (k as f64 * 1.1)
        })
        .collect();
    let values: Vec<f32> = match d.form {
        TeacherForm::Probs => probs.iter().map(|&p| p as f32).collect(),
        TeacherForm::Logprobs => probs.iter().map(|&p| p.ln() as f32).collect(),
    };
    let teacher = Teacher::with_form(&ids, &values, ntok, k, vocab, d.form, d.tail).unwrap();
    let labels = vec![(d.seed % vocab as u64) as i64, 1, -1, (vocab - 1) as i64];
    let opts = LossOptions {
        config: LossConfig {
            temperature: d.temperature,
            total: Some(3.0),
            terms: LossTerms {
                soft_weight: d.soft_weight,
                hard_weight: d.hard_weight,
                label_smoothing: d.label_smoothing,
                z_loss: d.z_loss,
                softcap: d.softcap,
                logit_scale: d.logit_scale,
                divergence: d.divergence,
            },
            ..LossConfig::default()
        },
        weights: Some(vec![1.0, 0.0, 2.0, 0.5]),
        labels: Some(labels),
        ..LossOptions::default()
    };
    (w, x, teacher, opts)
}

/// Relative L2 error of the analytic dx against a central finite
/// difference of the mean loss (step 2^-10, f16-exact).
fn fd_error(d: &Draw) -> (f64, f64) {
    let (w, x, teacher, opts) = problem(d);
    let (vocab, hs, ntok) = (d.vocab, d.hs, 4);
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let resolved = opts.resolve(ntok).unwrap();
    let mean_at = |x: &[f32]| head_kl_f64(&head, &Hidden::f32(x, ntok, hs).unwrap(), &teacher, &resolved).mean;
    let analytic = head_kl_f64(&head, &Hidden::f32(&x, ntok, hs).unwrap(), &teacher, &resolved).dx;
    let h = 1.0 / 1024.0;
    let mut err = 0f64;
    for i in 0..x.len() {
        let (mut plus, mut minus) = (x.clone(), x.clone());
        plus[i] += h;
        minus[i] -= h;
        let numeric = (mean_at(&plus) - mean_at(&minus)) / (2.0 * f64::from(h));
        err += (numeric - analytic[i]).powi(2);
    }
    // The masked token has no gradient.
    assert!(analytic[hs..2 * hs].iter().all(|&v| v == 0.0));
    let norm = analytic.iter().map(|a| a * a).sum::<f64>().sqrt();
    (err.sqrt() / norm.max(1e-300), norm)
}

proptest! {
    #![proptest_config(Config { cases: 64, rng_seed: RngSeed::Fixed(0x7E47), failure_persistence: None, ..Config::default() })]

    #[test]
    fn dx_matches_a_central_finite_difference_for_every_combination(d in draws()) {
        let (rel, norm) = fd_error(&d);
        prop_assert!(norm > 1e-4, "a gradient this small checks nothing: {norm} for {d:?}");
        prop_assert!(rel < 2e-4, "relative error {rel:.3e} for {d:?}");
    }
}

/// Every option on at once, τ ≠ 1 with the hard term, each tail mode and
/// teacher form: the combinations the issue names, not left to the draw.
#[test]
fn dx_matches_a_finite_difference_with_everything_on() {
    let divergences = [Divergence::Forward, Divergence::Reverse, Divergence::Jsd { beta: 0.3 }];
    for (tail, divergence) in [TailMode::Renormalize, TailMode::Bucket, TailMode::Unnormalized]
        .into_iter()
        .flat_map(|tail| divergences.map(|d| (tail, d)))
    {
        for form in [TeacherForm::Probs, TeacherForm::Logprobs] {
            for (softcap, logit_scale) in [(None, 1.0), (Some(1.5), 1.0), (Some(1.5), 0.4), (None, 2.2)] {
                let d = Draw {
                    vocab: 31,
                    hs: 5,
                    k: 4,
                    seed: 11,
                    temperature: 1.7,
                    tail,
                    form,
                    softcap,
                    hard_weight: 0.5,
                    soft_weight: 0.8,
                    label_smoothing: 0.2,
                    z_loss: 0.05,
                    logit_scale,
                    divergence,
                };
                let (rel, norm) = fd_error(&d);
                assert!(norm > 1e-3, "{norm} for {d:?}");
                assert!(rel < 1e-4, "relative error {rel:.3e} for {d:?}");
            }
        }
    }
}

/// `log_softmax` of a row.
fn log_softmax(row: &[f64]) -> Vec<f64> {
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    row.iter().map(|v| v - lse).collect()
}

/// Each term alone against its PyTorch formula, written out:
/// `F.cross_entropy(z̃, y, label_smoothing=ε)`, `torch.logsumexp(z̃)²`,
/// `c·tanh(z/c)`, and `F.kl_div` against the bucketed teacher.
#[test]
fn each_term_is_its_pytorch_formula() {
    let d = Draw {
        vocab: 29,
        hs: 4,
        k: 3,
        seed: 5,
        temperature: 1.0,
        tail: TailMode::Bucket,
        form: TeacherForm::Probs,
        softcap: None,
        hard_weight: 0.0,
        soft_weight: 1.0,
        label_smoothing: 0.0,
        z_loss: 0.0,
        logit_scale: 1.0,
        divergence: Divergence::Forward,
    };
    let (w, x, teacher, base) = problem(&d);
    let (vocab, hs, ntok, k) = (d.vocab, d.hs, 4, d.k);
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let hidden = Hidden::f32(&x, ntok, hs).unwrap();
    let cap = 0.8f32;
    let z = logits_f64(&head, &hidden, 1.0);
    let capped: Vec<f64> = z
        .iter()
        .map(|&v| f64::from(cap) * (v / f64::from(cap)).tanh())
        .collect();
    let labels = base.labels.clone().unwrap();
    let eps = 0.3f32;
    let run = |terms: LossTerms| {
        let opts = LossOptions {
            config: LossConfig { terms, ..base.config },
            ..base.clone()
        };
        head_kl_f64(&head, &hidden, &teacher, &opts.resolve(ntok).unwrap())
    };
    let hard = run(LossTerms {
        soft_weight: 0.0,
        hard_weight: 1.0,
        label_smoothing: eps,
        softcap: Some(cap),
        ..LossTerms::default()
    });
    let z_only = run(LossTerms {
        soft_weight: 0.0,
        z_loss: 0.25,
        softcap: Some(cap),
        ..LossTerms::default()
    });
    let soft = run(LossTerms::default());
    // The logit scale S multiplies z before the cap: zc = c·tanh(S·z/c).
    let scale = 2.5f32;
    let scaled_z = run(LossTerms {
        soft_weight: 0.0,
        z_loss: 0.25,
        softcap: Some(cap),
        logit_scale: scale,
        ..LossTerms::default()
    });
    let mut checked_bucket = 0;
    for t in 0..ntok {
        let row = &capped[t * vocab..(t + 1) * vocab];
        let logp = log_softmax(row);
        // cross_entropy with label smoothing: (1−ε)·(−log p_y) + ε·mean_j(−log p_j)
        let want_hard = if labels[t] < 0 {
            0.0
        } else {
            let nll = -logp[labels[t] as usize];
            let smooth = -logp.iter().sum::<f64>() / vocab as f64;
            let e = f64::from(eps);
            (1.0 - e) * nll + e * smooth
        };
        assert!((hard.loss[t] - want_hard).abs() < 1e-12, "hard[{t}]");
        assert!((hard.hard[t] - want_hard).abs() < 1e-12, "hard part[{t}]");
        let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
        assert!((z_only.lse[t] - lse).abs() < 1e-12, "lse[{t}]");
        assert!((z_only.loss[t] - 0.25 * lse * lse).abs() < 1e-12, "z-loss[{t}]");
        let scaled_lse = z[t * vocab..(t + 1) * vocab]
            .iter()
            .map(|&v| (f64::from(cap) * (f64::from(scale) * v / f64::from(cap)).tanh()).exp())
            .sum::<f64>()
            .ln();
        assert!((scaled_z.lse[t] - scaled_lse).abs() < 1e-12, "scaled lse[{t}]");
        assert!((scaled_lse - lse).abs() > 1e-3, "the scale changed nothing at [{t}]");
        // The bucket: a (k+1)-way KL, teacher entries plus the rest.
        let zrow = &z[t * vocab..(t + 1) * vocab];
        let lp = log_softmax(zrow);
        let ids = &teacher.ids()[t * k..(t + 1) * k];
        let p: Vec<f64> = teacher.probs()[t * k..(t + 1) * k]
            .iter()
            .map(|&v| f64::from(v))
            .collect();
        let r_t = 1.0 - p.iter().sum::<f64>();
        let r_s: f64 = (0..vocab)
            .filter(|j| !ids.contains(&(*j as u32)))
            .map(|j| lp[j].exp())
            .sum();
        let mut want = r_t * (r_t.ln() - r_s.ln());
        for (q, &id) in ids.iter().enumerate() {
            want += p[q] * (p[q].ln() - lp[id as usize]);
        }
        assert!(
            (soft.loss[t] - want).abs() < 1e-12,
            "bucket[{t}]: {} vs {want}",
            soft.loss[t]
        );
        assert!(soft.loss[t] >= 0.0);
        checked_bucket += usize::from(r_t > 0.01);
    }
    assert_eq!(checked_bucket, ntok, "every row has a tail to bucket");
}

/// With the k holding the whole mass, the three tail modes agree; a cap far
/// above the logits changes nothing measurable.
#[test]
fn tail_modes_agree_on_a_full_teacher_and_a_wide_cap_is_no_cap() {
    let (vocab, hs, ntok, k) = (23, 4, 3, 5);
    let w: Vec<f32> = (0..vocab * hs).map(|i| f16_exact(i, 3)).collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| f16_exact(i, 4)).collect();
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let hidden = Hidden::f32(&x, ntok, hs).unwrap();
    let ids: Vec<i64> = (0..ntok * k).map(|i| ((i * 5) % vocab) as i64).collect();
    let probs = vec![0.2f32; ntok * k];
    let opts = LossOptions::default();
    let resolved = opts.resolve(ntok).unwrap();
    let out: Vec<_> = [TailMode::Renormalize, TailMode::Bucket, TailMode::Unnormalized]
        .into_iter()
        .map(|tail| {
            let teacher = Teacher::with_form(&ids, &probs, ntok, k, vocab, TeacherForm::Probs, tail).unwrap();
            head_kl_f64(&head, &hidden, &teacher, &resolved)
        })
        .collect();
    for o in &out[1..] {
        for (a, b) in o.loss.iter().zip(&out[0].loss) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        for (a, b) in o.dx.iter().zip(&out[0].dx) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }
    let teacher = Teacher::from_i64(&ids, &probs, ntok, k, vocab).unwrap();
    let wide = LossOptions::from(LossConfig {
        terms: LossTerms {
            softcap: Some(1e4),
            ..LossTerms::default()
        },
        ..LossConfig::default()
    });
    let capped = head_kl_f64(&head, &hidden, &teacher, &wide.resolve(ntok).unwrap());
    for (a, b) in capped.loss.iter().zip(&out[0].loss) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
}

/// `topk` with `logprobs`, a softcap and a logit scale: the log-probabilities
/// over the full vocabulary of the capped scaled logits at τ, and the softmax
/// over the k of the same, as `torch.log_softmax(c·tanh(S·z/c)/τ)` gathered
/// at the top ids.
#[test]
fn topk_logprobs_are_the_full_log_softmax_of_the_capped_logits() {
    use headkl_core::{Engine, SliceOptions, TopkOptions};
    use headkl_reference::CpuBackend;
    let (vocab, hs, ntok, k) = (300, 8, 5, 7);
    let w: Vec<f32> = (0..vocab * hs).map(|i| f16_exact(i, 21) * 4.0).collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| f16_exact(i, 22)).collect();
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let hidden = Hidden::f32(&x, ntok, hs).unwrap();
    let (cap, tau, scale) = (2.5f32, 1.5f32, 1.25f32);
    let mut engine = Engine::new(CpuBackend::new(), &head, SliceOptions::default()).unwrap();
    let opts = TopkOptions {
        temperature: tau,
        softcap: Some(cap),
        logit_scale: scale,
        logprobs: true,
        ..TopkOptions::new(k)
    };
    let top = engine.topk(&hidden, &opts).unwrap();
    assert_eq!(top.logprobs.len(), ntok * k);
    let z = logits_f64(&head, &hidden, 1.0);
    for t in 0..ntok {
        let u: Vec<f64> = z[t * vocab..(t + 1) * vocab]
            .iter()
            .map(|&v| f64::from(cap) * (f64::from(scale) * v / f64::from(cap)).tanh() / f64::from(tau))
            .collect();
        let lp = log_softmax(&u);
        let ids = &top.ids[t * k..(t + 1) * k];
        let mass: f64 = ids.iter().map(|&j| lp[j as usize].exp()).sum();
        for (q, &j) in ids.iter().enumerate() {
            let got = f64::from(top.logprobs[t * k + q]);
            assert!(
                (got - lp[j as usize]).abs() < 1e-5,
                "lp[{t}][{q}] {got} vs {}",
                lp[j as usize]
            );
            let p = f64::from(top.probs[t * k + q]);
            assert!((p - lp[j as usize].exp() / mass).abs() < 1e-6);
        }
        assert!(mass < 0.999, "the k leave a tail to check against");
    }
    // Without the options the file's probabilities are unchanged and no
    // log-probabilities come back.
    let plain = engine.topk(&hidden, &TopkOptions::new(k)).unwrap();
    assert!(plain.logprobs.is_empty());
}

/// With the teacher over the whole vocabulary (k = V), each divergence in
/// each tail mode is its full-vocabulary definition, as PyTorch writes it:
/// `F.kl_div(log_t, log_s, log_target=True)` for the reverse KL, TRL's
/// `generalized_jsd_loss` (the mixture by `logsumexp`) for the JSD.
#[test]
fn each_divergence_at_k_equal_v_is_its_full_vocabulary_definition() {
    let (vocab, hs, ntok) = (17, 4, 3);
    let w: Vec<f32> = (0..vocab * hs).map(|i| f16_exact(i, 31) * 2.0).collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| f16_exact(i, 32)).collect();
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let hidden = Hidden::f32(&x, ntok, hs).unwrap();
    // Every id, in a shuffled order, with a teacher softmax over them.
    let ids: Vec<i64> = (0..ntok * vocab)
        .map(|i| ((i * 7 + i / vocab) % vocab) as i64)
        .collect();
    let raw: Vec<f64> = (0..ntok * vocab).map(|i| f64::from(f16_exact(i, 33)) * 3.0).collect();
    let mut log_t = vec![0f64; ntok * vocab];
    for t in 0..ntok {
        let lp = log_softmax(&raw[t * vocab..(t + 1) * vocab]);
        log_t[t * vocab..(t + 1) * vocab].copy_from_slice(&lp);
    }
    let values: Vec<f32> = log_t.iter().map(|&v| v as f32).collect();
    let temperature = 1.3f32;
    let student = logits_f64(&head, &hidden, 1.0);
    let mut checked = 0;
    for divergence in [Divergence::Forward, Divergence::Reverse, Divergence::Jsd { beta: 0.35 }] {
        for tail in [TailMode::Renormalize, TailMode::Bucket, TailMode::Unnormalized] {
            let teacher = Teacher::with_form(&ids, &values, ntok, vocab, vocab, TeacherForm::Logprobs, tail).unwrap();
            let opts = LossOptions::from(LossConfig {
                temperature,
                terms: LossTerms {
                    divergence,
                    ..LossTerms::default()
                },
                ..LossConfig::default()
            });
            let out = head_kl_f64(&head, &hidden, &teacher, &opts.resolve(ntok).unwrap());
            for t in 0..ntok {
                let u: Vec<f64> = student[t * vocab..(t + 1) * vocab]
                    .iter()
                    .map(|v| v / f64::from(temperature))
                    .collect();
                let log_s = log_softmax(&u);
                // The teacher as the device reads it: f32 values, by id.
                let mut lt = vec![0f64; vocab];
                for q in 0..vocab {
                    lt[ids[t * vocab + q] as usize] = f64::from(values[t * vocab + q]);
                }
                let kl = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(&la, &lb)| la.exp() * (la - lb)).sum::<f64>();
                let want = match divergence {
                    Divergence::Forward => kl(&lt, &log_s),
                    Divergence::Reverse => kl(&log_s, &lt),
                    Divergence::Jsd { beta } => {
                        let b = f64::from(beta);
                        let log_m: Vec<f64> = log_s
                            .iter()
                            .zip(&lt)
                            .map(|(&s, &t)| ((s + (1.0 - b).ln()).exp() + (t + b.ln()).exp()).ln())
                            .collect();
                        b * kl(&lt, &log_m) + (1.0 - b) * kl(&log_s, &log_m)
                    }
                };
                // f32 teacher values sum to 1 within ~1e-7: the modes differ
                // by that much at most.
                assert!(
                    (out.loss[t] - want).abs() < 1e-5,
                    "{divergence:?} {tail:?} row {t}: {} vs {want}",
                    out.loss[t]
                );
                assert!(want > 1e-3, "a divergence this small checks nothing: {want}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 27);
}
