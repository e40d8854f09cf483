//! Bad input files get a one-line error naming the file, tensor and problem
//! with exit code 2, and a failed run leaves the output alone; half-precision
//! inputs are read.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::fs;

use half::f16;
use headkl_core::{HeadData, HeadWeights, Hidden, LossOptions, Teacher};
use headkl_reference::direct::{head_kl_f64, topk_f64};
use headkl_reference::Tolerance;
use safetensors::{Dtype, SafeTensors};

use common::*;

#[test]
fn corrupt_and_truncated_files() {
    let f = Fixture::new("corrupt");
    let mut bytes = 24u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"weight\": this is junk}");
    fs::write(f.path("corrupt.safetensors"), &bytes).unwrap();
    let o = f.topk3("corrupt.safetensors", "hidden.safetensors", &[]);
    assert_input_error(&o, &["corrupt.safetensors", "not a valid safetensors"]);

    let good = fs::read(f.path("hidden.safetensors")).unwrap();
    fs::write(f.path("cut.safetensors"), &good[..good.len() - 7]).unwrap();
    let o = f.topk3("head.safetensors", "cut.safetensors", &[]);
    assert_input_error(&o, &["cut.safetensors", "truncated"]);

    fs::write(f.path("tiny.safetensors"), [1u8, 2]).unwrap();
    let o = f.loss("tiny.safetensors", &[]);
    assert_input_error(&o, &["tiny.safetensors", "truncated"]);
    assert!(!f.path("o.safetensors").exists());
}

#[test]
fn missing_tensor_names_file_and_tensor() {
    let f = Fixture::new("missing");
    let o = f.topk3(
        "head.safetensors",
        "hidden.safetensors",
        &["--head-tensor", "lm_head.weight"],
    );
    assert_input_error(&o, &["head.safetensors", "`lm_head.weight`", "not found", "weight"]);
    // The other way round: the named tensor is found.
    f.write_head("shard.safetensors", "lm_head.weight");
    let o = f.topk3(
        "shard.safetensors",
        "hidden.safetensors",
        &["--head-tensor", "lm_head.weight"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn wrong_dtype_and_shape() {
    let f = Fixture::new("dtype");
    write_st(
        &f.path("head_i32.safetensors"),
        &[T("weight", Dtype::I32, vec![VOCAB, HS], vec![0u8; VOCAB * HS * 4])],
    );
    write_st(
        &f.path("head_1d.safetensors"),
        &[T("weight", Dtype::F32, vec![VOCAB * HS], f32s(&f.head))],
    );
    for (file, needles) in [
        (
            "head_i32.safetensors",
            vec!["head_i32.safetensors", "`weight`", "dtype I32"],
        ),
        (
            "head_1d.safetensors",
            vec!["head_1d.safetensors", "`weight`", "expected 2 dimensions"],
        ),
    ] {
        let o = f.topk3(file, "hidden.safetensors", &[]);
        assert_input_error(&o, &needles);
    }
    // Teacher ids as F32, probs of the wrong shape.
    write_st(
        &f.path("t_f32ids.safetensors"),
        &[
            T("ids", Dtype::F32, vec![NTOK, K], f32s(&[1.0; NTOK * K])),
            T("probs", Dtype::F32, vec![NTOK, K], f32s(&f.probs)),
        ],
    );
    assert_input_error(
        &f.loss("t_f32ids.safetensors", &[]),
        &["t_f32ids.safetensors", "`ids`", "dtype F32"],
    );
    write_st(
        &f.path("t_shape.safetensors"),
        &[
            T("ids", Dtype::I64, vec![NTOK, K], i64s(&f.ids)),
            T("probs", Dtype::F32, vec![NTOK, K - 1], f32s(&f.probs[..NTOK * (K - 1)])),
        ],
    );
    assert_input_error(
        &f.loss("t_shape.safetensors", &[]),
        &["t_shape.safetensors", "`probs`", "shape"],
    );
    // Weights of the wrong length and a negative weight.
    write_st(
        &f.path("w_len.safetensors"),
        &[T("weights", Dtype::F32, vec![NTOK + 1], f32s(&[1.0; NTOK + 1]))],
    );
    assert_input_error(
        &f.loss("teacher.safetensors", &["--weights", f.s("w_len.safetensors")]),
        &["w_len.safetensors", "`weights`"],
    );
    write_st(
        &f.path("w_neg.safetensors"),
        &[T("weights", Dtype::F32, vec![NTOK], f32s(&[1.0, 1.0, -2.0, 1.0, 1.0]))],
    );
    assert_input_error(
        &f.loss("teacher.safetensors", &["--weights", f.s("w_neg.safetensors")]),
        &["w_neg.safetensors", "`weights`", "negative"],
    );
}

#[test]
fn hidden_size_mismatch() {
    let f = Fixture::new("hs");
    write_st(
        &f.path("hidden25.safetensors"),
        &[T(
            "hidden",
            Dtype::F32,
            vec![NTOK, HS + 1],
            f32s(&values(NTOK * (HS + 1), 3, 1.0)),
        )],
    );
    let o = f.topk3("head.safetensors", "hidden25.safetensors", &[]);
    assert_input_error(&o, &["hidden25.safetensors", "`hidden`", "hs = 25", "hs = 24"]);
}

#[test]
fn bad_teacher_ids_and_probs() {
    let f = Fixture::new("teacher");
    let mut ids = f.ids.clone();
    ids[6] = VOCAB as i64 + 5;
    f.write_teacher("t_range.safetensors", &ids, &f.probs);
    assert_input_error(
        &f.loss("t_range.safetensors", &[]),
        &["t_range.safetensors", "`ids`", "out of range", "305"],
    );
    let mut ids = f.ids.clone();
    ids[3] = -1;
    f.write_teacher("t_neg.safetensors", &ids, &f.probs);
    assert_input_error(&f.loss("t_neg.safetensors", &[]), &["t_neg.safetensors", "`ids`", "-1"]);
    let mut ids = f.ids.clone();
    ids[K + 1] = ids[K];
    f.write_teacher("t_dup.safetensors", &ids, &f.probs);
    assert_input_error(
        &f.loss("t_dup.safetensors", &[]),
        &["t_dup.safetensors", "`ids`", "twice"],
    );
    let mut probs = f.probs.clone();
    probs[2] = -0.5;
    f.write_teacher("t_negp.safetensors", &f.ids, &probs);
    assert_input_error(
        &f.loss("t_negp.safetensors", &[]),
        &["t_negp.safetensors", "`probs`", "negative"],
    );
    let mut probs = f.probs.clone();
    probs[9] = f32::NAN;
    f.write_teacher("t_nan.safetensors", &f.ids, &probs);
    assert_input_error(
        &f.loss("t_nan.safetensors", &[]),
        &["t_nan.safetensors", "`probs`", "not finite"],
    );
}

#[test]
fn k_above_2048() {
    let f = Fixture::new("bigk");
    // A head wide enough that only the 2048 limit is in the way.
    let vocab = 2100;
    write_st(
        &f.path("wide.safetensors"),
        &[T(
            "weight",
            Dtype::F32,
            vec![vocab, HS],
            f32s(&values(vocab * HS, 4, 0.5)),
        )],
    );
    let o = f.run(
        "topk",
        "wide.safetensors",
        "hidden.safetensors",
        &["-k", "2049", "--out", f.s("o.safetensors")],
    );
    assert_input_error(&o, &["-k", "2049", "2048"]);
    let k = 2049;
    let ids: Vec<i64> = (0..NTOK * k).map(|i| (i % k) as i64).collect();
    let probs = vec![1.0f32; NTOK * k];
    f.write_teacher("t_bigk.safetensors", &ids, &probs);
    let o = f.run(
        "loss",
        "wide.safetensors",
        "hidden.safetensors",
        &["--teacher", f.s("t_bigk.safetensors"), "--out", f.s("o.safetensors")],
    );
    assert_input_error(&o, &["t_bigk.safetensors", "`ids`", "2049", "2048"]);
}

#[test]
fn bad_options_and_head_values() {
    let f = Fixture::new("opts");
    assert_input_error(
        &f.loss("teacher.safetensors", &["--temperature", "0"]),
        &["--temperature"],
    );
    assert_input_error(&f.loss("teacher.safetensors", &["--budget", "0"]), &["--budget"]);
    let mut head = f.head.clone();
    head[HS * 7 + 3] = f32::INFINITY;
    write_st(
        &f.path("head_inf.safetensors"),
        &[T("weight", Dtype::F32, vec![VOCAB, HS], f32s(&head))],
    );
    let o = f.topk3("head_inf.safetensors", "hidden.safetensors", &[]);
    assert_input_error(&o, &["head_inf.safetensors", "`weight`", "head[7][3]"]);
}

#[test]
fn non_finite_hidden_row_is_named() {
    let f = Fixture::new("nanrow");
    let mut hidden = f.hidden.clone();
    hidden[3 * HS + 1] = f32::NAN;
    write_st(
        &f.path("h_nan.safetensors"),
        &[T("hidden", Dtype::F32, vec![NTOK, HS], f32s(&hidden))],
    );
    let o = f.run(
        "loss",
        "head.safetensors",
        "h_nan.safetensors",
        &["--teacher", f.s("teacher.safetensors"), "--out", f.s("o.safetensors")],
    );
    assert_input_error(&o, &["h_nan.safetensors", "`hidden`", "hidden[3]"]);
    assert!(!f.path("o.safetensors").exists());
}

#[test]
fn failed_run_does_not_clobber_output() {
    let f = Fixture::new("clobber");
    let out = f.path("out.safetensors");
    fs::write(&out, b"previous good result").unwrap();
    let mut ids = f.ids.clone();
    ids[0] = 100_000;
    f.write_teacher("t_bad.safetensors", &ids, &f.probs);
    let o = f.loss("t_bad.safetensors", &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(fs::read(&out).unwrap(), b"previous good result");
    let leftovers: Vec<String> = fs::read_dir(&f.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    // An output that names an input is refused before anything runs.
    let o = f.loss_into("teacher.safetensors", f.s("hidden.safetensors"), &[]);
    assert_input_error(&o, &["--out", "hidden.safetensors"]);
}

/// BF16 hidden rows (what models emit) are read by `loss`, and give the
/// reference's result on the same values.
#[test]
fn bf16_hidden_rows_are_read() {
    let f = Fixture::new("bf16-hidden");
    let rows: Vec<half::bf16> = f.hidden.iter().map(|&v| half::bf16::from_f32(v)).collect();
    write_st(
        &f.path("hbf.safetensors"),
        &[T(
            "hidden",
            Dtype::BF16,
            vec![NTOK, HS],
            bytemuck::cast_slice(&rows).to_vec(),
        )],
    );
    let out = f.path("loss.safetensors");
    let o = f.run(
        "loss",
        "head.safetensors",
        "hbf.safetensors",
        &["--teacher", f.s("teacher.safetensors"), "--out", out.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let bytes = fs::read(&out).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let values: Vec<f32> = rows.iter().map(|v| v.to_f32()).collect();
    let hidden = Hidden::f32(&values, NTOK, HS).unwrap();
    let teacher = Teacher::from_i64(&f.ids, &f.probs, NTOK, K, VOCAB).unwrap();
    let want = head_kl_f64(&head, &hidden, &teacher, &LossOptions::default().resolve(NTOK).unwrap());
    check_loss_file(&st, loss_mean(&st), &want);
}

#[test]
fn f16_hidden_and_bf16_head_are_read() {
    let f = Fixture::new("halves");
    let hidden16: Vec<f16> = f.hidden.iter().map(|&v| f16::from_f32(v)).collect();
    write_st(
        &f.path("h16.safetensors"),
        &[T(
            "x",
            Dtype::F16,
            vec![NTOK, HS],
            bytemuck::cast_slice(&hidden16).to_vec(),
        )],
    );
    let head_bf: Vec<half::bf16> = f.head.iter().map(|&v| half::bf16::from_f32(v)).collect();
    write_st(
        &f.path("hbf.safetensors"),
        &[T(
            "weight",
            Dtype::BF16,
            vec![VOCAB, HS],
            bytemuck::cast_slice(&head_bf).to_vec(),
        )],
    );
    let o = f.run(
        "topk",
        "hbf.safetensors",
        "h16.safetensors",
        &["--hidden-tensor", "x", "-k", "5", "--out", f.s("o.safetensors")],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let bytes = fs::read(f.path("o.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let probs = tensor_f32(&st, "probs");
    let head = HeadWeights::new(HeadData::Bf16(&head_bf), VOCAB, HS).unwrap();
    let hidden = Hidden::f16(&hidden16, NTOK, HS).unwrap();
    let want = topk_f64(&head, &hidden, 5, 1.0);
    let ids: Vec<i64> = pod_vec(st.tensor("ids").unwrap().data());
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    Tolerance::default().check_topk(&ids, &probs, &want).unwrap();
}
