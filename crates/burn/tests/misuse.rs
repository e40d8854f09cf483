//! What a burn user gets wrong, and bad teacher data: typed errors in the
//! caller's terms before anything is recorded, and, for what only the
//! device can see, a step that a README-shaped loop (loss, backward,
//! optimizer step, then `wait`) applies without the bad rows.

use burn::module::{Module, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::Tensor;
use burn::tensor::{FloatDType, TensorData};
use headkl_burn::prelude::*;

mod common;

use common::{host_f32, open_case, Case};

#[test]
fn misuse_is_a_typed_error_in_the_callers_terms() {
    let Some((case, device, mut head)) = open_case(7) else {
        return;
    };
    let teacher = case.teacher(&device);
    let opts = LossConfig::default();

    let wide = Tensor::<2>::zeros([case.shape.ntok, case.shape.hs + 1], &device);
    let e = head.loss(&wide, &teacher, None, &opts).expect_err("hs");
    assert_eq!(e, Error::HiddenWidth { got: 41, head: 40 });

    let short = case.hidden(&device).slice([0..case.shape.ntok - 1, 0..case.shape.hs]);
    let e = head.loss(&short, &teacher, None, &opts).expect_err("rows");
    assert_eq!(e.to_string(), "hidden has 18 rows, teacher.ids 19");

    let narrow = Teacher {
        ids: teacher.ids.clone(),
        probs: teacher.probs.clone().slice([0..case.shape.ntok, 0..case.shape.k - 1]),
    };
    let e = head
        .loss(&case.hidden(&device), &narrow, None, &opts)
        .expect_err("probs");
    assert_eq!(
        e.to_string(),
        "teacher.ids is [19][8], teacher.probs [19][7]: they must match"
    );

    let w = Tensor::<1>::ones([case.shape.ntok + 2], &device);
    let e = head
        .loss(&case.hidden(&device), &teacher, Some(&w), &opts)
        .expect_err("weights");
    assert_eq!(e.to_string(), "hidden has 19 rows, weights 21");

    let f64_rows = case.hidden(&device).cast(FloatDType::F64);
    let e = head.loss(&f64_rows, &teacher, None, &opts).expect_err("dtype");
    assert!(matches!(e, Error::Dtype { input: "hidden", .. }), "{e}");

    let e = head
        .loss(
            &case.hidden(&device),
            &teacher,
            None,
            &LossConfig {
                temperature: 0.0,
                ..LossConfig::default()
            },
        )
        .expect_err("temperature");
    assert!(
        matches!(e, Error::Headkl(headkl_core::Error::InvalidTemperature { .. })),
        "{e}"
    );

    // A tensor on another device: both named briefly.
    let other = SharedDevice::open(&DeviceOptions::default()).expect("second device");
    let elsewhere = case.hidden(&other.device());
    let e = head.loss(&elsewhere, &teacher, None, &opts).expect_err("device");
    let message = e.to_string();
    assert!(matches!(e, Error::Device { input: "hidden", .. }), "{e}");
    assert!(
        !message.contains("Device<") && message.len() < 160,
        "a device named at length: {message}"
    );

    // Nothing was recorded by the refused calls: no call to name.
    head.wait().expect("nothing was submitted");
}

/// A student whose parameter is the hidden rows themselves.
#[derive(Module, Debug)]
struct Rows {
    x: Param<Tensor<2>>,
}

/// One bad input of the table below.
#[derive(Clone, Copy, Debug)]
enum Bad {
    IdEqualToVocab,
    IdMinusOne,
    DuplicateId,
    NanProbability,
    NegativeProbability,
    NanWeight,
    AllWeightsZero,
}

const ROW: usize = 5;

impl Bad {
    /// The teacher ids (signed), probabilities and weights with the fault.
    fn plant(self, case: &Case) -> (Vec<i32>, Vec<f32>, Option<Vec<f32>>) {
        let mut ids: Vec<i32> = case.ids.iter().map(|&i| i as i32).collect();
        let mut probs = case.probs.clone();
        let mut weights = None;
        let k = case.shape.k;
        match self {
            Bad::IdEqualToVocab => ids[ROW * k + 2] = case.shape.vocab as i32,
            Bad::IdMinusOne => ids[ROW * k + 2] = -1,
            Bad::DuplicateId => ids[ROW * k + 3] = ids[ROW * k + 1],
            Bad::NanProbability => probs[ROW * k] = f32::NAN,
            Bad::NegativeProbability => probs[ROW * k + 3] = -0.5,
            Bad::NanWeight => {
                let mut w = vec![1.0; case.shape.ntok];
                w[ROW] = f32::NAN;
                weights = Some(w);
            }
            Bad::AllWeightsZero => weights = Some(vec![0.0; case.shape.ntok]),
        }
        (ids, probs, weights)
    }

    /// Whether headkl's error is the one this fault gives.
    fn reported(self, e: &headkl_core::Error, vocab: usize) -> bool {
        use headkl_core::Error as E;
        match self {
            Bad::IdEqualToVocab => {
                matches!(e, E::IdOutOfRange { row: ROW, col: 2, id, .. } if *id == vocab as i64)
            }
            Bad::IdMinusOne => matches!(
                e,
                E::IdOutOfRange {
                    row: ROW,
                    col: 2,
                    id: -1,
                    ..
                }
            ),
            Bad::DuplicateId => matches!(e, E::DuplicateId { row: ROW, .. }),
            Bad::NanProbability => matches!(e, E::NonFiniteProbability { row: ROW, col: 0, .. }),
            Bad::NegativeProbability => matches!(e, E::NegativeProbability { row: ROW, col: 3, .. }),
            Bad::NanWeight => matches!(e, E::NonFiniteWeight { row: ROW, .. }),
            Bad::AllWeightsZero => matches!(e, E::TotalNotPositive { .. }),
        }
    }
}

#[test]
fn a_bad_teacher_row_contributes_nothing_to_the_step_a_readme_loop_applies() {
    let Some((case, device, mut head)) = open_case(11) else {
        return;
    };
    let device = device.autodiff();
    let hs = case.shape.hs;
    let cases = [
        Bad::IdEqualToVocab,
        Bad::IdMinusOne,
        Bad::DuplicateId,
        Bad::NanProbability,
        Bad::NegativeProbability,
        Bad::NanWeight,
        Bad::AllWeightsZero,
    ];
    for (n, bad) in cases.into_iter().enumerate() {
        let (ids, probs, weights) = bad.plant(&case);
        let teacher = case.teacher_of(ids, probs, &device);
        let w = weights.map(|w| Tensor::<1>::from_data(TensorData::new(w, [case.shape.ntok]), &device));

        // The loop: loss, backward, the optimizer's step, then wait.
        let mut student = Rows {
            x: Param::from_tensor(case.hidden(&device)),
        };
        let before = host_f32(student.x.val());
        let mut optim = AdamConfig::new().init();
        let out = head
            .loss(&student.x.val(), &teacher, w.as_ref(), &LossConfig::default())
            .unwrap_or_else(|e| panic!("{bad:?}: the call is recorded: {e}"));
        let loss = host_f32(out.loss.clone());
        let per_token = host_f32(out.per_token.clone());
        let grads = out.loss.backward();
        let grad = host_f32(student.x.val().grad(&grads).expect("a gradient"));
        let params = GradientsParams::from_grads(grads, &student);
        student = optim.step(1e-2, student, params);
        let after = host_f32(student.x.val());
        let e = head.wait().expect_err("the device flagged it");

        // Reported, naming the call (one per case, numbered from 1).
        match &e {
            Error::OnDevice { calls, source } => {
                assert_eq!(calls.calls, vec![(n as u64 + 1, "loss")], "{bad:?}: {e}");
                assert!(bad.reported(source, case.shape.vocab), "{bad:?}: {e}");
            }
            other => panic!("{bad:?}: {other}"),
        }
        assert!(e.to_string().starts_with(&format!("loss call {}: ", n + 1)), "{e}");
        if matches!(bad, Bad::IdMinusOne) {
            assert!(e.to_string().contains("= -1 "), "the id as given: {e}");
        }
        // Not silent: the step's loss is NaN.
        assert!(loss[0].is_nan(), "{bad:?}: the loss is {}", loss[0]);
        // Nothing of the flagged rows reaches the gradient or the step.
        let flagged: Vec<usize> = match bad {
            Bad::AllWeightsZero => (0..case.shape.ntok).collect(),
            _ => vec![ROW],
        };
        for &r in &flagged {
            let row = r * hs..(r + 1) * hs;
            assert!(
                grad[row.clone()].iter().all(|&g| g == 0.0),
                "{bad:?}: row {r}'s gradient"
            );
            assert_eq!(after[row.clone()], before[row], "{bad:?}: the step moved row {r}");
            if !matches!(bad, Bad::AllWeightsZero) {
                assert!(per_token[r].is_nan(), "{bad:?}: per_token[{r}] = {}", per_token[r]);
            }
        }
        // The other rows still learn.
        if !matches!(bad, Bad::AllWeightsZero) {
            assert!(per_token.iter().enumerate().all(|(t, l)| t == ROW || l.is_finite()));
            assert!(
                grad.iter().enumerate().any(|(i, &g)| i / hs != ROW && g != 0.0),
                "{bad:?}: no row learns"
            );
        }
    }
}

#[test]
fn checked_mode_reports_before_the_step_and_unwaited_calls_are_named() {
    let Some((case, device, mut head)) = open_case(12) else {
        return;
    };
    let (ids, probs, _) = Bad::DuplicateId.plant(&case);
    let bad = case.teacher_of(ids, probs, &device);
    let good = case.teacher(&device);
    let opts = LossConfig::default();

    // Two calls without a wait between: the error names both.
    head.loss(&case.hidden(&device), &good, None, &opts).expect("call 1");
    head.loss(&case.hidden(&device), &bad, None, &opts).expect("call 2");
    let e = head.wait().expect_err("flagged");
    assert!(e.to_string().starts_with("one of calls 1–2 (loss, loss)"), "{e}");
    head.wait().expect("the status is cleared");

    // Checked mode: the call itself returns the error.
    head.set_checked(true);
    head.loss(&case.hidden(&device), &good, None, &opts)
        .expect("call 3 is clean");
    let e = head.loss(&case.hidden(&device), &bad, None, &opts).expect_err("call 4");
    assert!(e.to_string().starts_with("loss call 4: "), "{e}");
}
