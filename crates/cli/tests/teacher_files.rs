//! Teacher files that know how they were made: `topk` records its options in
//! the file's metadata, and `loss` reads them back, refuses a teacher made
//! another way, and records its own.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::fs;

use headkl_core::{HeadData, HeadWeights, Hidden, LossConfig, LossOptions, Teacher};
use headkl_reference::direct::head_kl_f64;
use safetensors::{Dtype, SafeTensors};

use common::*;

/// The stored-teacher round trip of the README: `topk --logprobs` on the
/// teacher's hidden rows, then `loss --teacher-form logprobs --tail bucket
/// --labels … --hard-weight 0.5 --softcap 30 --z-loss 1e-4` for the student,
/// each against the f64 reference.
#[test]
fn stored_teacher_round_trip_matches_direct() {
    use headkl_core::{LossTerms, TailMode, TeacherForm};
    let f = Fixture::new("round-trip");
    let k = 16;
    let teacher_rows = values(NTOK * HS, 3, 1.0);
    write_st(
        &f.path("teacher_hidden.safetensors"),
        &[T("hidden", Dtype::F32, vec![NTOK, HS], f32s(&teacher_rows))],
    );
    let top = f.path("top.safetensors");
    let o = f.run(
        "topk",
        "head.safetensors",
        "teacher_hidden.safetensors",
        &["-k", "16", "--logprobs", "--out", top.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let bytes = fs::read(&top).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("logprobs").unwrap().shape(), &[NTOK, k]);
    let ids: Vec<i64> = pod_vec(st.tensor("ids").unwrap().data());
    let logprobs = tensor_f32(&st, "logprobs");
    // The log-probabilities are over the full vocabulary: the k hold less than all the mass.
    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let teacher_hidden = Hidden::f32(&teacher_rows, NTOK, HS).unwrap();
    let z = headkl_reference::direct::logits_f64(&head, &teacher_hidden, 1.0);
    for t in 0..NTOK {
        let row = &z[t * VOCAB..(t + 1) * VOCAB];
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        for q in 0..k {
            let want = row[ids[t * k + q] as usize] - lse;
            assert!(
                (f64::from(logprobs[t * k + q]) - want).abs() < 1e-5,
                "logprobs[{t}][{q}]"
            );
        }
        let mass: f64 = logprobs[t * k..(t + 1) * k].iter().map(|&v| f64::from(v).exp()).sum();
        assert!(mass < 0.99, "row {t}: the k hold {mass}, no tail to bucket");
    }

    let labels: Vec<i64> = vec![3, -100, 299, 0, 17];
    write_st(
        &f.path("labels.safetensors"),
        &[T("labels", Dtype::I64, vec![NTOK], i64s(&labels))],
    );
    let o = f.loss(
        "top.safetensors",
        &[
            "--teacher-form",
            "logprobs",
            "--tail",
            "bucket",
            "--labels",
            f.s("labels.safetensors"),
            "--hard-weight",
            "0.5",
            "--softcap",
            "30",
            "--z-loss",
            "1e-4",
            "--logit-scale",
            "1.5",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let mean = printed_mean(&o);
    let bytes = fs::read(f.path("out.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for name in ["loss", "lse", "soft", "hard"] {
        assert_eq!(st.tensor(name).unwrap().shape(), &[NTOK], "{name}");
    }
    let hidden = Hidden::f32(&f.hidden, NTOK, HS).unwrap();
    let teacher = Teacher::with_form(&ids, &logprobs, NTOK, k, VOCAB, TeacherForm::Logprobs, TailMode::Bucket).unwrap();
    let opts = LossOptions {
        config: LossConfig {
            terms: LossTerms {
                hard_weight: 0.5,
                softcap: Some(30.0),
                z_loss: 1e-4,
                logit_scale: 1.5,
                ..LossTerms::default()
            },
            ..LossConfig::default()
        },
        labels: Some(labels),
        ..LossOptions::default()
    };
    let want = head_kl_f64(&head, &hidden, &teacher, &opts.resolve(NTOK).unwrap());
    check_loss_file(&st, mean, &want);
    for (name, want) in [("lse", &want.lse), ("soft", &want.soft), ("hard", &want.hard)] {
        let got = tensor_f32(&st, name);
        for (t, (&g, &w)) in got.iter().zip(want.iter()).enumerate() {
            assert!(
                (f64::from(g) - w).abs() <= 1e-4 * w.abs().max(1.0),
                "{name}[{t}]: {g} vs {w}"
            );
        }
    }
    // The token without a label has no hard part.
    assert_eq!(tensor_f32(&st, "hard")[1], 0.0);
    // Without a hard term the file has no soft and hard parts, and lse all the same.
    let o = f.loss("top.safetensors", &["--teacher-form", "logprobs", "--tail", "none"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let bytes = fs::read(f.path("out.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert!(st.tensor("soft").is_err() && st.tensor("hard").is_err());
    assert_eq!(st.tensor("lse").unwrap().shape(), &[NTOK]);
}

#[test]
fn topk_records_how_the_teacher_was_made() {
    let f = Fixture::new("meta-topk");
    let o = f.topk("t.safetensors", &["--temperature", "2"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let m = metadata(&f.path("t.safetensors"));
    for (key, want) in [
        ("headkl.format", "1"),
        ("headkl.temperature", "2"),
        ("headkl.k", "4"),
        ("headkl.vocab", "300"),
        ("headkl.hs", "24"),
        ("headkl.ntok", "5"),
        ("headkl.renormalized", "true"),
        ("headkl.softcap", "none"),
        ("headkl.head.tensor", "weight"),
    ] {
        assert_eq!(m.get(key).map(String::as_str), Some(want), "{key}: {m:?}");
    }
    assert!(m["headkl.head.file"].ends_with("head.safetensors"), "{m:?}");
    let hash = &m["headkl.head.hash"];
    assert!(
        hash.starts_with("fold64:") && hash.len() == "fold64:".len() + 16,
        "{hash}"
    );
    // The same head gives the same hash; another head another one.
    let o = f.topk("t2.safetensors", &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(&metadata(&f.path("t2.safetensors"))["headkl.head.hash"], hash);
}

/// A teacher stored at τ = 1 and read with `--teacher-temperature 1` at
/// `--temperature 2` gives the loss of the teacher made at τ = 2 (its top-k
/// renormalized: the rescaling is exact there); without it the file's
/// temperature is refused, naming the option to pass.
#[test]
fn teacher_temperature_reads_a_teacher_made_at_another_one() {
    let f = Fixture::new("teacher-tau");
    for (out, tau) in [("t1.safetensors", "1"), ("t2.safetensors", "2")] {
        let o = f.topk(out, &["--temperature", tau, "--logprobs"]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    }
    let mean = |teacher: &str, extra: &[&str]| {
        let mut args = vec!["--temperature", "2", "--teacher-form", "logprobs"];
        args.extend(extra);
        let o = f.loss(teacher, &args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        printed_mean(&o)
    };
    let direct = mean("t2.safetensors", &[]);
    let rescaled = mean("t1.safetensors", &["--teacher-temperature", "1"]);
    assert!(
        (direct - rescaled).abs() <= 1e-5 * direct.abs(),
        "{direct} vs {rescaled}"
    );
    let o = f.loss("t1.safetensors", &["--temperature", "2", "--teacher-form", "logprobs"]);
    assert_input_error(&o, &["temperature 1", "--temperature is 2"]);
    let o = f.loss(
        "t1.safetensors",
        &[
            "--temperature",
            "2",
            "--teacher-form",
            "logprobs",
            "--teacher-temperature",
            "3",
        ],
    );
    assert_input_error(&o, &["temperature 1", "--teacher-temperature is 3"]);
    let o = f.loss(
        "t1.safetensors",
        &[
            "--teacher-form",
            "logprobs",
            "--teacher-temperature",
            "-1",
            "--allow-teacher-mismatch",
        ],
    );
    assert_input_error(&o, &["--teacher-temperature", "-1"]);
}

#[test]
fn loss_refuses_a_teacher_made_another_way() {
    let f = Fixture::new("meta-loss");
    let o = f.topk("t.safetensors", &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // Made at τ = 1, used at τ = 2: both values named, exit 2, no output.
    let o = f.loss("t.safetensors", &["--temperature", "2"]);
    assert_input_error(
        &o,
        &[
            "t.safetensors",
            "temperature 1",
            "--temperature is 2",
            "--allow-teacher-mismatch",
        ],
    );
    assert!(!f.path("out.safetensors").exists());
    // Another head of the same shape: named by its hash.
    let other: Vec<f32> = f.head.iter().map(|v| v * 0.5).collect();
    write_st(
        &f.path("other_head.safetensors"),
        &[T("weight", Dtype::F32, vec![VOCAB, HS], f32s(&other))],
    );
    let mut args = f.args("loss", "reference", "other_head.safetensors", "hidden.safetensors");
    args.extend(["--teacher", f.s("t.safetensors"), "--out", f.s("out.safetensors")]);
    let o = headkl(&args);
    assert_input_error(&o, &["made from head", "other_head.safetensors", "fold64:"]);
    // The override runs it, with a warning naming the mismatch.
    args.push("--allow-teacher-mismatch");
    let o = headkl(&args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("headkl: warning: ") && stderr(&o).contains("made from head"),
        "{}",
        stderr(&o)
    );
    // The matching run passes, quietly.
    let o = f.loss("t.safetensors", &["--quiet"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stderr(&o), "", "--quiet printed something");
}

#[test]
fn teacher_without_metadata_works_with_a_note_and_loss_records_its_mean() {
    let f = Fixture::new("meta-none");
    let o = f.loss("teacher.safetensors", &["--temperature", "1.5", "--total", "4"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let err = stderr(&o);
    // The command's own line (the check is headkl-files', which speaks
    // for the command): no crate name in front.
    let notes = err
        .lines()
        .filter(|l| l.starts_with("headkl: ") && l.contains("no headkl metadata"))
        .count();
    assert_eq!(notes, 1, "{err}");
    let m = metadata(&f.path("out.safetensors"));
    let printed = printed_mean(&o);
    let saved: f64 = m["headkl.mean"].parse().unwrap();
    assert!((saved - printed).abs() <= 1e-5 * printed.abs(), "{saved} vs {printed}");
    assert_eq!(m["headkl.temperature"], "1.5");
    assert_eq!(m["headkl.total"], "4");
    assert_eq!(m["headkl.k"], K.to_string());
    assert!(m["headkl.teacher.file"].ends_with("teacher.safetensors"), "{m:?}");
    assert_eq!(m["headkl.weights.file"], "none");
    assert!(m["headkl.gscale"].parse::<f32>().is_ok_and(|g| g > 0.0), "{m:?}");
    // --quiet drops the note as well.
    let o = f.loss("teacher.safetensors", &["--quiet"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
}
