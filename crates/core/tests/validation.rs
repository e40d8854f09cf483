//! Every invalid input of DESIGN §3 gets its own typed error naming the
//! field, the row and the value, before anything reaches a device. One test
//! per variant; the engine-level ones run on the CPU reference backend and
//! check that no scratch memory was allocated.

use half::{bf16, f16};
use headkl_core::{
    Backend, Engine, Error, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, SliceOptions, Teacher, TopkOptions,
};
use headkl_reference::CpuBackend;

const V: usize = 40;
const HS: usize = 8;

fn teacher_err(ids: &[u32], probs: &[f32], ntok: usize, k: usize) -> Error {
    Teacher::new(ids, probs, ntok, k, V).expect_err("must be rejected")
}

#[test]
fn k_zero() {
    assert_eq!(teacher_err(&[], &[], 1, 0), Error::KZero);
}

#[test]
fn k_above_vocab_or_2048() {
    assert_eq!(
        Teacher::new(&[0; 41], &[1.0; 41], 1, 41, V).unwrap_err(),
        Error::KTooLarge {
            k: 41,
            vocab: 40,
            max: 40
        }
    );
    let e = TopkOptions::new(2049).check(100_000).unwrap_err();
    assert_eq!(
        e,
        Error::KTooLarge {
            k: 2049,
            vocab: 100_000,
            max: 2048
        }
    );
    assert!(e.to_string().contains("k = 2049"), "{e}");
}

#[test]
fn id_out_of_range_names_row_col_and_id() {
    let e = teacher_err(&[0, 1, 2, 40], &[0.25; 4], 2, 2);
    assert_eq!(
        e,
        Error::IdOutOfRange {
            row: 1,
            col: 1,
            id: 40,
            vocab: V
        }
    );
    assert!(e.to_string().contains("ids[1][1] = 40"), "{e}");
    let e = Teacher::from_i64(&[-3], &[1.0], 1, 1, V).unwrap_err();
    assert_eq!(
        e,
        Error::IdOutOfRange {
            row: 0,
            col: 0,
            id: -3,
            vocab: V
        }
    );
}

#[test]
fn duplicate_id_in_a_row() {
    let e = teacher_err(&[5, 6, 7, 9, 3, 9], &[0.2; 6], 2, 3);
    assert_eq!(
        e,
        Error::DuplicateId {
            row: 1,
            id: 9,
            first: 0,
            second: 2
        }
    );
}

#[test]
fn negative_probability() {
    let e = teacher_err(&[1, 2], &[0.5, -0.1], 1, 2);
    assert_eq!(
        e,
        Error::NegativeProbability {
            row: 0,
            col: 1,
            value: -0.1
        }
    );
}

#[test]
fn non_finite_probability() {
    let e = teacher_err(&[1, 2, 3, 4], &[0.5, 0.5, f32::NAN, 0.1], 2, 2);
    assert!(matches!(e, Error::NonFiniteProbability { row: 1, col: 0, .. }), "{e}");
    let e = teacher_err(&[1, 2], &[f32::INFINITY, 0.5], 1, 2);
    assert!(matches!(e, Error::NonFiniteProbability { row: 0, col: 0, .. }), "{e}");
}

#[test]
fn row_summing_to_zero() {
    let e = teacher_err(&[1, 2, 3, 4], &[0.5, 0.5, 0.0, 0.0], 2, 2);
    assert_eq!(e, Error::ProbabilityRowSum { row: 1, sum: 0.0 });
}

#[test]
fn teacher_is_renormalized() {
    let t = Teacher::new(&[1, 2], &[3.0, 1.0], 1, 2, V).unwrap();
    assert_eq!(t.probs(), &[0.75, 0.25]);
}

#[test]
fn length_mismatches() {
    assert_eq!(
        Teacher::new(&[1, 2, 3], &[0.5; 4], 2, 2, V).unwrap_err(),
        Error::LengthMismatch {
            field: headkl_core::error::Field::Ids,
            expected: 4,
            got: 3
        }
    );
    assert_eq!(
        Teacher::new(&[1, 2, 3, 4], &[0.5; 3], 2, 2, V).unwrap_err(),
        Error::LengthMismatch {
            field: headkl_core::error::Field::Probs,
            expected: 4,
            got: 3
        }
    );
    let x = [0f32; 10];
    assert_eq!(
        Hidden::f32(&x, 2, 4).unwrap_err(),
        Error::LengthMismatch {
            field: headkl_core::error::Field::Hidden,
            expected: 8,
            got: 10
        }
    );
    let w = [0f32; 10];
    assert_eq!(
        HeadWeights::new(HeadData::F32(&w), 3, 4).unwrap_err(),
        Error::LengthMismatch {
            field: headkl_core::error::Field::Head,
            expected: 12,
            got: 10
        }
    );
    let opts = LossOptions {
        weights: Some(vec![1.0; 3]),
        ..LossOptions::default()
    };
    assert_eq!(
        opts.resolve(2).unwrap_err(),
        Error::LengthMismatch {
            field: headkl_core::error::Field::Weights,
            expected: 2,
            got: 3
        }
    );
}

#[test]
fn zero_sizes() {
    assert_eq!(
        HeadWeights::new(HeadData::F32(&[]), 0, 4).unwrap_err(),
        Error::VocabZero
    );
    assert_eq!(
        HeadWeights::new(HeadData::F32(&[]), 4, 0).unwrap_err(),
        Error::HiddenSizeZero
    );
    assert_eq!(Hidden::f32(&[], 0, 4).unwrap_err(), Error::NoTokens);
    assert_eq!(Hidden::f32(&[], 1, 0).unwrap_err(), Error::HiddenSizeZero);
}

#[test]
fn weights_negative_or_non_finite() {
    let opts = LossOptions {
        weights: Some(vec![1.0, -2.0]),
        ..LossOptions::default()
    };
    assert_eq!(
        opts.resolve(2).unwrap_err(),
        Error::NegativeWeight { row: 1, value: -2.0 }
    );
    let opts = LossOptions {
        weights: Some(vec![f32::INFINITY, 1.0]),
        ..LossOptions::default()
    };
    assert!(matches!(
        opts.resolve(2).unwrap_err(),
        Error::NonFiniteWeight { row: 0, .. }
    ));
}

#[test]
fn total_not_positive() {
    let opts = LossOptions::from(LossConfig {
        total: Some(0.0),
        ..LossConfig::default()
    });
    assert_eq!(opts.resolve(2).unwrap_err(), Error::TotalNotPositive { value: 0.0 });
    // every token masked and no total given: Σ w = 0
    let opts = LossOptions {
        weights: Some(vec![0.0, 0.0]),
        ..LossOptions::default()
    };
    assert_eq!(opts.resolve(2).unwrap_err(), Error::TotalNotPositive { value: 0.0 });
    let opts = LossOptions::from(LossConfig {
        total: Some(f32::NAN),
        ..LossConfig::default()
    });
    assert!(matches!(opts.resolve(2).unwrap_err(), Error::TotalNotPositive { .. }));
}

#[test]
fn temperature_not_positive_finite() {
    for t in [0.0, -1.0, f32::INFINITY, f32::NAN] {
        let opts = LossOptions::from(LossConfig {
            temperature: t,
            ..LossConfig::default()
        });
        assert!(
            matches!(opts.resolve(1).unwrap_err(), Error::InvalidTemperature { .. }),
            "τ = {t}"
        );
        let top = TopkOptions {
            temperature: t,
            ..TopkOptions::new(1)
        };
        assert!(
            matches!(top.check(10).unwrap_err(), Error::InvalidTemperature { .. }),
            "τ = {t}"
        );
    }
}

#[test]
fn gscale_not_positive_finite() {
    for g in [0.0, -4.0, f32::NAN] {
        let opts = LossOptions::from(LossConfig {
            gscale: Some(g),
            ..LossConfig::default()
        });
        assert!(
            matches!(opts.resolve(1).unwrap_err(), Error::InvalidGradScale { .. }),
            "gscale = {g}"
        );
    }
}

#[test]
fn default_gscale_bounds_the_f16_gradient() {
    let opts = LossOptions {
        weights: Some(vec![0.5, 2.0, 0.0]),
        ..LossOptions::default()
    };
    let r = opts.resolve(3).unwrap();
    assert_eq!(r.total, 2.5);
    assert_eq!(r.gscale, 16384.0 * 2.5 / 2.0);
    // |g| ≤ coef_t · 1 ≤ 2^14
    assert!(r.coef.iter().all(|&c| c <= 16384.0));
    assert_eq!(r.coef[2], 0.0);
}

#[test]
fn zero_budget() {
    let opts = LossOptions::from(LossConfig {
        budget_bytes: 0,
        ..LossConfig::default()
    });
    assert_eq!(opts.resolve(1).unwrap_err(), Error::BudgetZero);
    let top = TopkOptions {
        budget_bytes: 0,
        ..TopkOptions::new(1)
    };
    assert_eq!(top.check(10).unwrap_err(), Error::BudgetZero);
}

fn head_values() -> Vec<f32> {
    (0..V * HS).map(|i| (i % 7) as f32 * 0.25 - 0.75).collect()
}

#[test]
fn head_non_finite_or_past_f16_is_rejected_before_upload() {
    let mut w = head_values();
    w[3 * HS + 5] = f32::NAN;
    let backend = CpuBackend::new();
    let head = HeadWeights::new(HeadData::F32(&w), V, HS).unwrap();
    let e = Engine::new(&backend, &head, SliceOptions::default()).err().unwrap();
    assert!(matches!(e, Error::NonFiniteHead { row: 3, col: 5, .. }), "{e}");
    assert_eq!(backend.memory().peak, 0, "nothing may be allocated for a bad head");

    w[3 * HS + 5] = 70_000.0;
    let head = HeadWeights::new(HeadData::F32(&w), V, HS).unwrap();
    let e = Engine::new(&backend, &head, SliceOptions::default()).err().unwrap();
    assert_eq!(
        e,
        Error::HeadOutOfF16Range {
            row: 3,
            col: 5,
            value: 70_000.0
        }
    );
    assert!(e.to_string().contains("head[3][5] = 70000"), "{e}");

    let b: Vec<bf16> = (0..V * HS)
        .map(|i| bf16::from_f32(if i == 17 { 1e6 } else { 0.5 }))
        .collect();
    let head = HeadWeights::new(HeadData::Bf16(&b), V, HS).unwrap();
    let e = Engine::new(&backend, &head, SliceOptions::default()).err().unwrap();
    assert!(matches!(e, Error::HeadOutOfF16Range { row: 2, col: 1, .. }), "{e}");

    let h: Vec<f16> = (0..V * HS)
        .map(|i| if i == 9 { f16::INFINITY } else { f16::ONE })
        .collect();
    let head = HeadWeights::new(HeadData::F16(&h), V, HS).unwrap();
    let e = Engine::new(&backend, &head, SliceOptions::default()).err().unwrap();
    assert!(matches!(e, Error::NonFiniteHead { row: 1, col: 1, .. }), "{e}");
    assert_eq!(backend.memory().peak, 0);
}

#[test]
fn engine_rejects_mismatched_inputs_before_allocating_scratch() {
    let w = head_values();
    let backend = CpuBackend::new();
    let head = HeadWeights::new(HeadData::F32(&w), V, HS).unwrap();
    let mut engine = Engine::new(&backend, &head, SliceOptions::default()).unwrap();
    let head_bytes = backend.memory().current;

    let x = vec![0.5f32; 2 * (HS + 1)];
    let hidden = Hidden::f32(&x, 2, HS + 1).unwrap();
    let teacher = Teacher::new(&[1, 2], &[1.0, 1.0], 2, 1, V).unwrap();
    assert_eq!(
        engine.head_kl(&hidden, &teacher, &LossOptions::default()).unwrap_err(),
        Error::HiddenSizeMismatch {
            expected: HS,
            got: HS + 1
        }
    );

    let x = vec![0.5f32; 3 * HS];
    let hidden = Hidden::f32(&x, 3, HS).unwrap();
    assert_eq!(
        engine.head_kl(&hidden, &teacher, &LossOptions::default()).unwrap_err(),
        Error::LengthMismatch {
            field: headkl_core::error::Field::TeacherRows,
            expected: 3,
            got: 2
        }
    );

    // a teacher built for a larger vocabulary
    let wide = Teacher::new(&[1, 45, 2, 3], &[1.0; 4], 2, 2, 50).unwrap();
    let hidden = Hidden::f32(&x[..2 * HS], 2, HS).unwrap();
    assert_eq!(
        engine.head_kl(&hidden, &wide, &LossOptions::default()).unwrap_err(),
        Error::IdOutOfRange {
            row: 0,
            col: 1,
            id: 45,
            vocab: V
        }
    );
    assert_eq!(
        engine.topk(&hidden, &TopkOptions::new(41)).unwrap_err(),
        Error::KTooLarge {
            k: 41,
            vocab: V,
            max: V
        }
    );
    let tiny = LossOptions::from(LossConfig {
        budget_bytes: 64,
        ..LossConfig::default()
    });
    assert!(matches!(
        engine.head_kl(&hidden, &teacher, &tiny).unwrap_err(),
        Error::BudgetTooSmall { .. }
    ));
    assert_eq!(
        backend.memory().peak,
        head_bytes,
        "no scratch may be allocated for bad input"
    );
}

#[test]
fn nan_hidden_row_names_its_token() {
    let w = head_values();
    let backend = CpuBackend::new();
    let head = HeadWeights::new(HeadData::F32(&w), V, HS).unwrap();
    let mut engine = Engine::new(&backend, &head, SliceOptions::default()).unwrap();
    let mut x = vec![0.25f32; 40 * HS];
    x[37 * HS + 2] = f32::NAN;
    x[39 * HS] = f32::INFINITY;
    let hidden = Hidden::f32(&x, 40, HS).unwrap();
    let ids: Vec<u32> = (0..40).collect();
    let teacher = Teacher::new(&ids, &[1.0; 40], 40, 1, V).unwrap();
    let opts = LossOptions::from(LossConfig {
        max_rows_per_chunk: Some(16),
        ..LossConfig::default()
    });
    assert_eq!(
        engine.head_kl(&hidden, &teacher, &opts).unwrap_err(),
        Error::NonFiniteHidden { token: 37 }
    );
    let top = TopkOptions {
        max_rows_per_chunk: Some(16),
        ..TopkOptions::new(3)
    };
    assert_eq!(
        engine.topk(&hidden, &top).unwrap_err(),
        Error::NonFiniteHidden { token: 37 }
    );
}

#[test]
fn loss_terms_and_labels_are_checked_before_any_device_work() {
    use headkl_core::{LossTerms, NO_LABEL};
    let w = head_values();
    let backend = CpuBackend::new();
    let head = HeadWeights::new(HeadData::F32(&w), V, HS).unwrap();
    let mut engine = Engine::new(&backend, &head, SliceOptions::default()).unwrap();
    let head_bytes = backend.memory().peak;
    let x = vec![0.25f32; 2 * HS];
    let hidden = Hidden::f32(&x, 2, HS).unwrap();
    let teacher = Teacher::new(&[1, 2, 3, 4], &[1.0; 4], 2, 2, V).unwrap();
    let hard = |labels: Option<Vec<i64>>| LossOptions {
        config: LossConfig {
            terms: LossTerms {
                hard_weight: 0.5,
                ..LossTerms::default()
            },
            ..LossConfig::default()
        },
        labels,
        ..LossOptions::default()
    };
    assert_eq!(
        engine.head_kl(&hidden, &teacher, &hard(Some(vec![3, 40]))).unwrap_err(),
        Error::LabelOutOfRange {
            row: 1,
            label: 40,
            vocab: V
        }
    );
    assert_eq!(
        engine.head_kl(&hidden, &teacher, &hard(Some(vec![3]))).unwrap_err(),
        Error::LengthMismatch {
            field: headkl_core::Field::Labels,
            expected: 2,
            got: 1
        }
    );
    assert_eq!(
        engine.head_kl(&hidden, &teacher, &hard(None)).unwrap_err(),
        Error::HardWeightWithoutLabels { value: 0.5 }
    );
    let smoothing = LossOptions::from(LossConfig {
        terms: LossTerms {
            label_smoothing: 1.0,
            ..LossTerms::default()
        },
        ..LossConfig::default()
    });
    assert!(matches!(
        engine.head_kl(&hidden, &teacher, &smoothing).unwrap_err(),
        Error::InvalidLossOption {
            field: "label_smoothing",
            ..
        }
    ));
    let z = LossOptions::from(LossConfig {
        terms: LossTerms {
            z_loss: -1e-4,
            ..LossTerms::default()
        },
        ..LossConfig::default()
    });
    assert!(matches!(
        engine.head_kl(&hidden, &teacher, &z).unwrap_err(),
        Error::InvalidLossOption { field: "z_loss", .. }
    ));
    assert_eq!(backend.memory().peak, head_bytes, "no scratch for bad options");
    // A negative label is no label; labels resolve to the kernels' u32.
    let resolved = hard(Some(vec![-100, 7])).resolve(2).unwrap();
    assert_eq!(resolved.labels, vec![NO_LABEL, 7]);
    engine.head_kl(&hidden, &teacher, &hard(Some(vec![-100, 7]))).unwrap();
}

#[test]
fn teacher_forms_and_tail_modes_check_their_values() {
    use headkl_core::{TailMode, TeacherForm};
    let ids = [1i64, 2, 3, 4];
    let lp = |v: [f32; 4], tail| Teacher::with_form(&ids, &v, 2, 2, V, TeacherForm::Logprobs, tail);
    assert_eq!(
        lp([-1.0, 0.5, -1.0, -1.0], TailMode::Bucket).unwrap_err(),
        Error::InvalidLogProbability {
            row: 0,
            col: 1,
            value: 0.5
        }
    );
    assert!(matches!(
        lp([-1.0, -1.0, f32::NAN, -1.0], TailMode::Renormalize).unwrap_err(),
        Error::InvalidLogProbability { row: 1, col: 0, .. }
    ));
    // ln 0.7 twice: mass 1.4 is above 1 in bucket and none mode, fine in renormalize.
    let heavy = [0.7f32.ln(), 0.7f32.ln(), -3.0, -3.0];
    for tail in [TailMode::Bucket, TailMode::Unnormalized] {
        assert!(matches!(
            lp(heavy, tail).unwrap_err(),
            Error::TeacherMassAboveOne { row: 0, .. }
        ));
    }
    let renorm = lp(heavy, TailMode::Renormalize).unwrap();
    assert!((renorm.probs()[0] - 0.5).abs() < 1e-6);
    // -inf is probability 0; the bucket keeps the values as given.
    let kept = lp(
        [-f32::INFINITY, 0.5f32.ln(), 0.25f32.ln(), 0.25f32.ln()],
        TailMode::Bucket,
    )
    .unwrap();
    assert_eq!(kept.probs()[0], 0.0);
    assert!((kept.probs()[1] - 0.5).abs() < 1e-7 && (kept.probs()[2] - 0.25).abs() < 1e-7);
    assert_eq!(kept.tail(), TailMode::Bucket);
    // Rounding above 1 is allowed.
    let p = [0.5f32, 0.5000001, 0.25, 0.25];
    Teacher::with_form(&ids, &p, 2, 2, V, TeacherForm::Probs, TailMode::Unnormalized).unwrap();
}
