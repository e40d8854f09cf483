//! `headkl gather`: the on-policy round trip `topk` → `gather` → `loss`
//! against f64, sharded and unsharded.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::fs;

use headkl_core::{HeadData, HeadWeights, Hidden};
use headkl_reference::direct::topk_f64;
use headkl_reference::Tolerance;
use safetensors::{Dtype, SafeTensors};

use common::*;

/// On-policy distillation's round trip: `topk` of the student, `gather` of
/// the teacher at those ids, then `loss --divergence reverse --teacher-form
/// logprobs`; the loss is the reverse KL on the student's top-k, both
/// sides renormalized over it, computed here in f64 from the logits. Ids
/// past V are exit 2 naming the ids tensor.
#[test]
fn topk_gather_reverse_loss_round_trip_matches_f64() {
    let f = Fixture::new("gather");
    let teacher_hidden = values(NTOK * HS, 9, 1.0);
    write_st(
        &f.path("teacher_hidden.safetensors"),
        &[T("hidden", Dtype::F32, vec![NTOK, HS], f32s(&teacher_hidden))],
    );
    let tau = "1.5";
    let o = f.topk("student_top.safetensors", &["--temperature", tau]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let gather = |ids: &str, out: &str| {
        f.run(
            "gather",
            "head.safetensors",
            "teacher_hidden.safetensors",
            &["--ids", f.s(ids), "--temperature", tau, "--out", f.s(out)],
        )
    };
    let o = gather("student_top.safetensors", "teacher_at.safetensors");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = f.loss(
        "teacher_at.safetensors",
        &[
            "--temperature",
            tau,
            "--teacher-form",
            "logprobs",
            "--divergence",
            "reverse",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let mean = printed_mean(&o);
    let loss = tensor_f32(
        &SafeTensors::deserialize(&fs::read(f.path("out.safetensors")).unwrap()).unwrap(),
        "loss",
    );
    // The f64 reverse KL from the logits.
    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let student = headkl_reference::direct::logits_f64(&head, &Hidden::f32(&f.hidden, NTOK, HS).unwrap(), 1.5);
    let teacher = headkl_reference::direct::logits_f64(&head, &Hidden::f32(&teacher_hidden, NTOK, HS).unwrap(), 1.5);
    let top = topk_f64(&head, &Hidden::f32(&f.hidden, NTOK, HS).unwrap(), K, 1.5);
    let log_softmax = |row: &[f64]| {
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        row.iter().map(|v| v - lse).collect::<Vec<f64>>()
    };
    let mut want = Vec::with_capacity(NTOK);
    for t in 0..NTOK {
        let (ls, lt) = (
            log_softmax(&student[t * VOCAB..(t + 1) * VOCAB]),
            log_softmax(&teacher[t * VOCAB..(t + 1) * VOCAB]),
        );
        let ids = &top.ids[t * K..(t + 1) * K];
        let renorm = |l: &[f64]| {
            let v: Vec<f64> = ids.iter().map(|&j| l[j as usize]).collect();
            let z = v.iter().map(|x| x.exp()).sum::<f64>().ln();
            v.into_iter().map(|x| x - z).collect::<Vec<f64>>()
        };
        let (qs, qt) = (renorm(&ls), renorm(&lt));
        want.push(qs.iter().zip(&qt).map(|(a, b)| a.exp() * (a - b)).sum::<f64>());
    }
    Tolerance::default()
        .check_loss(&loss, mean, &headkl_reference::direct::DirectLoss::of_losses(want))
        .unwrap();
    // The gather's own file: the student's ids, log-probabilities ≤ 0, an lse a token.
    let st_bytes = fs::read(f.path("teacher_at.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    assert_eq!(st.tensor("lse").unwrap().shape(), &[NTOK]);
    let unsharded = tensor_f32(&st, "logprobs");
    assert!(unsharded.iter().all(|&v| v <= 0.0));
    // Vocabulary-parallel: three shards' partials merged give the same file.
    let o = f.run(
        "gather",
        "head.safetensors",
        "teacher_hidden.safetensors",
        &[
            "--ids",
            f.s("student_top.safetensors"),
            "--temperature",
            tau,
            "--shards",
            "3",
            "--out",
            f.s("sharded_at.safetensors"),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let sharded_bytes = fs::read(f.path("sharded_at.safetensors")).unwrap();
    let sharded = SafeTensors::deserialize(&sharded_bytes).unwrap();
    for name in ["logprobs", "lse"] {
        for (a, b) in tensor_f32(&sharded, name).iter().zip(&tensor_f32(&st, name)) {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{name}: sharded {a}, unsharded {b}"
            );
        }
    }
    let bad: Vec<i64> = vec![VOCAB as i64; NTOK * K];
    write_st(
        &f.path("bad_ids.safetensors"),
        &[T("ids", Dtype::I64, vec![NTOK, K], i64s(&bad))],
    );
    let o = gather("bad_ids.safetensors", "never.safetensors");
    assert_input_error(&o, &["bad_ids.safetensors", "ids", "300"]);
    assert!(!f.path("never.safetensors").exists());
}
