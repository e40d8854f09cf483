//! `headkl loss --teacher-hidden --teacher-head`: the exact full-vocabulary
//! divergence against f64, and what it refuses.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::fs;

use headkl_core::{HeadData, HeadWeights, Hidden};
use safetensors::{Dtype, SafeTensors};

use common::*;

/// `loss --teacher-hidden TH --teacher-head TW`: the exact full-vocabulary
/// divergence from a teacher of another hidden size, against the f64
/// reference (the top-k mode at k = V with the teacher's softmax) for each
/// divergence; the terms it does not compute, the top-k file's options, a
/// teacher head over another vocabulary or other token counts are exit 2
/// naming the option or the file, and write nothing.
#[test]
fn loss_from_teacher_hidden_rows_matches_f64_and_refuses_what_it_cannot_do() {
    use headkl_core::Divergence;
    const THS: usize = 40;
    let f = Fixture::new("full-vocab");
    let t_head = values(VOCAB * THS, 11, 0.5);
    let t_hidden = values(NTOK * THS, 12, 1.0);
    write_st(
        &f.path("t_head.safetensors"),
        &[T("weight", Dtype::F32, vec![VOCAB, THS], f32s(&t_head))],
    );
    write_st(
        &f.path("t_hidden.safetensors"),
        &[T("hidden", Dtype::F32, vec![NTOK, THS], f32s(&t_hidden))],
    );
    let run = |head: &str, hidden: &str, extra: &[&str]| {
        let mut args = f.args("loss", "reference", "head.safetensors", "hidden.safetensors");
        args.extend([
            "--teacher-head",
            f.s(head),
            "--teacher-hidden",
            f.s(hidden),
            "--out",
            f.s("out.safetensors"),
        ]);
        args.extend(extra);
        headkl(&args)
    };
    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let hidden = Hidden::f32(&f.hidden, NTOK, HS).unwrap();
    let th = HeadWeights::new(HeadData::F32(&t_head), VOCAB, THS).unwrap();
    let tx = Hidden::f32(&t_hidden, NTOK, THS).unwrap();
    for (divergence, extra) in [
        (Divergence::Forward, vec![]),
        (Divergence::Reverse, vec!["--divergence", "reverse"]),
        (
            Divergence::Jsd { beta: 0.3 },
            vec!["--divergence", "jsd", "--beta", "0.3"],
        ),
    ] {
        let mut args = vec!["--temperature", "1.5"];
        args.extend(&extra);
        let o = run("t_head.safetensors", "t_hidden.safetensors", &args);
        assert_eq!(o.status.code(), Some(0), "{divergence:?}: {}", stderr(&o));
        let opts = divergence_at_tau_1_5(divergence);
        let want =
            headkl_reference::direct::head_kl_full_vocab_f64(&head, &hidden, (&th, &tx), &opts.resolve(NTOK).unwrap());
        let st_bytes = fs::read(f.path("out.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&st_bytes).unwrap();
        check_loss_file(&st, printed_mean(&o), &want);
        fs::remove_file(f.path("out.safetensors")).unwrap();
    }
    let labels: Vec<i64> = (0..NTOK as i64).collect();
    write_st(
        &f.path("labels.safetensors"),
        &[T("labels", Dtype::I64, vec![NTOK], i64s(&labels))],
    );
    let other_v = values((VOCAB + 1) * THS, 13, 0.5);
    write_st(
        &f.path("t_head_v.safetensors"),
        &[T("weight", Dtype::F32, vec![VOCAB + 1, THS], f32s(&other_v))],
    );
    write_st(
        &f.path("t_hidden_short.safetensors"),
        &[T(
            "hidden",
            Dtype::F32,
            vec![NTOK - 1, THS],
            f32s(&t_hidden[..(NTOK - 1) * THS]),
        )],
    );
    let mut nan_hidden = t_hidden.clone();
    nan_hidden[3 * THS + 7] = f32::NAN;
    write_st(
        &f.path("t_hidden_nan.safetensors"),
        &[T("hidden", Dtype::F32, vec![NTOK, THS], f32s(&nan_hidden))],
    );
    let labels_path = f.s("labels.safetensors");
    for (head, hidden, extra, needles) in [
        (
            "t_head.safetensors",
            "t_hidden.safetensors",
            vec!["--hard-weight", "1", "--labels", labels_path],
            vec!["--hard-weight"],
        ),
        (
            "t_head.safetensors",
            "t_hidden.safetensors",
            vec!["--z-loss", "0.01"],
            vec!["--z-loss"],
        ),
        (
            "t_head.safetensors",
            "t_hidden.safetensors",
            vec!["--softcap", "30"],
            vec!["--softcap"],
        ),
        (
            "t_head.safetensors",
            "t_hidden.safetensors",
            vec!["--tail", "bucket"],
            vec!["--tail"],
        ),
        (
            "t_head.safetensors",
            "t_hidden.safetensors",
            vec!["--teacher-form", "logprobs"],
            vec!["--teacher-form"],
        ),
        (
            "t_head_v.safetensors",
            "t_hidden.safetensors",
            vec![],
            vec!["t_head_v.safetensors", "V = 301"],
        ),
        (
            "t_head.safetensors",
            "t_hidden_short.safetensors",
            vec![],
            vec!["t_hidden_short.safetensors", "ntok = 4"],
        ),
        (
            "t_head.safetensors",
            "t_hidden_nan.safetensors",
            vec![],
            vec!["t_hidden_nan.safetensors", "row 3, column 7"],
        ),
        (
            "t_head.safetensors",
            "t_hidden.safetensors",
            vec!["--teacher", f.s("teacher.safetensors")],
            vec!["--teacher"],
        ),
    ] {
        let o = run(head, hidden, &extra);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
        for n in needles {
            assert!(stderr(&o).contains(n), "{extra:?}: {n} not in {}", stderr(&o));
        }
        assert!(!f.path("out.safetensors").exists(), "{extra:?} wrote its output");
    }
}
