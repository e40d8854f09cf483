//! `headkl loss` with a top-k teacher file: weights, reductions, divergences,
//! the ignore mask, the loss terms' bad inputs, the GPU backends, the
//! printed mean and the dx block filter.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::fs;

use headkl_core::{HeadData, HeadWeights, Hidden, LossConfig, LossOptions, Teacher};
use headkl_reference::direct::head_kl_f64;
use headkl_reference::Tolerance;
use safetensors::{Dtype, SafeTensors};

use common::*;

#[test]
fn loss_matches_direct_with_weights() {
    let f = Fixture::new("loss");
    let weights = [1.0f32, 0.0, 2.0, 0.5, 1.0];
    write_st(
        &f.path("w.safetensors"),
        &[T("weights", Dtype::F32, vec![NTOK], f32s(&weights))],
    );
    let o = f.loss(
        "teacher.safetensors",
        &["--weights", f.s("w.safetensors"), "--temperature", "1.5"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let mean = printed_mean(&o);
    let bytes = fs::read(f.path("out.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("loss").unwrap().shape(), &[NTOK]);
    assert_eq!(st.tensor("grad").unwrap().shape(), &[NTOK, HS]);
    let loss = tensor_f32(&st, "loss");
    let grad = tensor_f32(&st, "grad");

    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let hidden = Hidden::f32(&f.hidden, NTOK, HS).unwrap();
    let teacher = Teacher::from_i64(&f.ids, &f.probs, NTOK, K, VOCAB).unwrap();
    let opts = LossOptions {
        config: LossConfig {
            temperature: 1.5,
            ..LossConfig::default()
        },
        weights: Some(weights.to_vec()),
        ..LossOptions::default()
    };
    let want = head_kl_f64(&head, &hidden, &teacher, &opts.resolve(NTOK).unwrap());
    let tol = Tolerance::default();
    tol.check_loss(&loss, mean, &want).unwrap();
    tol.check_dx_rows(&grad, &want.dx, Some(HS)).unwrap();
    // The masked token has zero gradient.
    assert!(grad[HS..2 * HS].iter().all(|&g| g == 0.0));
}

/// `--reduction sum` and `batchmean` print the weighted sum of the
/// per-token losses over 1 and over ntok, and scale the gradient with it
/// (against the mean's, same weights); `none` prints the sum too. A total
/// beside a reduction other than the mean, or an unknown reduction, is
/// exit 2 naming `--reduction`.
#[test]
fn loss_reductions_set_the_denominator() {
    let f = Fixture::new("reduction");
    let weights = [1.0f32, 0.0, 2.0, 0.5, 1.0];
    let sum_w: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    write_st(
        &f.path("w.safetensors"),
        &[T("weights", Dtype::F32, vec![NTOK], f32s(&weights))],
    );
    let run = |reduction: &str, prefix: &str| {
        let o = f.loss(
            "teacher.safetensors",
            &["--weights", f.s("w.safetensors"), "--reduction", reduction],
        );
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
        let value: f64 = stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} in stdout: {stdout}"))
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let bytes = fs::read(f.path("out.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let meta = metadata(&f.path("out.safetensors"));
        assert_eq!(meta.get("headkl.reduction").map(String::as_str), Some(reduction));
        (value, tensor_f32(&st, "grad"), tensor_f32(&st, "loss"))
    };
    let (mean, grad_mean, per_token) = run("mean", "mean loss: ");
    let weighted: f64 = per_token
        .iter()
        .zip(&weights)
        .map(|(&l, &w)| f64::from(l) * f64::from(w))
        .sum();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
    assert!(
        close(mean * sum_w, weighted),
        "mean {mean} · Σw {sum_w} against Σ w·L {weighted}"
    );
    for (reduction, prefix, over) in [
        ("sum", "sum loss: ", 1.0),
        ("batchmean", "batchmean loss: ", NTOK as f64),
        ("none", "sum loss: ", 1.0),
    ] {
        let (value, grad, _) = run(reduction, prefix);
        assert!(
            close(value, weighted / over),
            "{reduction}: {value}, want {}",
            weighted / over
        );
        // dx scales as the loss does.
        let factor = sum_w / over;
        for (g, m) in grad.iter().zip(&grad_mean) {
            let want = f64::from(*m) * factor;
            assert!(
                (f64::from(*g) - want).abs() <= 1e-3 * want.abs().max(1e-6),
                "{reduction}: dx {g}, want {want}"
            );
        }
    }
    let o = f.loss("teacher.safetensors", &["--reduction", "sum", "--total", "2"]);
    assert_input_error(&o, &["--reduction", "total = 2", "sum"]);
    // clap's own refusal: exit 2, the option and the values named.
    let o = f.loss("teacher.safetensors", &["--reduction", "elementwise"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--reduction") && stderr(&o).contains("batchmean"),
        "{}",
        stderr(&o)
    );
}

/// `--divergence reverse` and `--divergence jsd --beta 0.3` (bucket tail)
/// against the f64 reference, recorded in the output's metadata; a bad
/// divergence, β out of range and `--beta` without `jsd` are exit 2
/// naming the option.
#[test]
fn loss_divergences_match_direct_and_bad_values_name_the_option() {
    use headkl_core::{Divergence, TailMode, TeacherForm};
    let f = Fixture::new("divergence");
    // The k hold 70% of each row's mass, the rest the bucket's.
    let probs: Vec<f32> = f.probs.iter().map(|p| p * 0.7).collect();
    f.write_teacher("partial.safetensors", &f.ids, &probs);
    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let hidden = Hidden::f32(&f.hidden, NTOK, HS).unwrap();
    let teacher = Teacher::with_form(&f.ids, &probs, NTOK, K, VOCAB, TeacherForm::Probs, TailMode::Bucket).unwrap();
    let forward: f64 = {
        let o = f.loss("partial.safetensors", &["--tail", "bucket"]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        printed_mean(&o)
    };
    for (divergence, extra) in [
        (Divergence::Reverse, vec!["--divergence", "reverse"]),
        (
            Divergence::Jsd { beta: 0.3 },
            vec!["--divergence", "jsd", "--beta", "0.3"],
        ),
    ] {
        let mut args = vec!["--tail", "bucket", "--temperature", "1.5"];
        args.extend(&extra);
        let o = f.loss("partial.safetensors", &args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let mean = printed_mean(&o);
        assert!(
            (mean - forward).abs() > 1e-3,
            "{divergence:?}: {mean} is the forward loss"
        );
        let bytes = fs::read(f.path("out.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let opts = divergence_at_tau_1_5(divergence);
        let want = head_kl_f64(&head, &hidden, &teacher, &opts.resolve(NTOK).unwrap());
        check_loss_file(&st, mean, &want);
        let meta = metadata(&f.path("out.safetensors"));
        assert_eq!(
            meta.get("headkl.divergence").map(String::as_str),
            Some(divergence.name())
        );
        assert_eq!(
            meta.get("headkl.beta").map(String::as_str),
            extra.get(3).copied(),
            "β is recorded for the JSD alone"
        );
    }
    for (args, needles) in [
        (vec!["--divergence", "jsd", "--beta", "1.5"], vec!["--beta", "1.5"]),
        (vec!["--divergence", "reverse", "--beta", "0.2"], vec!["--beta", "jsd"]),
        (vec!["--divergence", "backward"], vec!["--divergence", "backward"]),
    ] {
        let o = f.loss("partial.safetensors", &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        for n in needles {
            assert!(stderr(&o).contains(n), "{args:?}: {n} not in {}", stderr(&o));
        }
    }
}

/// `--ignore-mask` drops the tokens whose label is ignored (−100, or the
/// `--ignore-index`) from the soft term too: the same loss and dx as
/// weights of 0 there, the hard term off. Without labels it is exit 2
/// naming `--ignore-mask`.
#[test]
fn ignore_mask_equals_zero_weights_on_the_ignored_tokens() {
    let f = Fixture::new("ignore-mask");
    let labels: [i64; NTOK] = [5, -100, 17, 9, 40];
    write_st(
        &f.path("labels.safetensors"),
        &[T("labels", Dtype::I64, vec![NTOK], i64s(&labels))],
    );
    // Token 1 (−100) and, with --ignore-index 9, token 3.
    write_st(
        &f.path("w.safetensors"),
        &[T("weights", Dtype::F32, vec![NTOK], f32s(&[1.0, 0.0, 1.0, 0.0, 1.0]))],
    );
    let run = |extra: &[&str]| {
        let o = f.loss("teacher.safetensors", extra);
        assert_eq!(o.status.code(), Some(0), "{extra:?}: {}", stderr(&o));
        let mean = printed_mean(&o);
        let bytes = fs::read(f.path("out.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        (mean, tensor_f32(&st, "grad"))
    };
    let labels_path = f.s("labels.safetensors");
    let (masked, masked_dx) = run(&["--labels", labels_path, "--ignore-mask", "--ignore-index", "9"]);
    let (weighted, weighted_dx) = run(&["--weights", f.s("w.safetensors")]);
    let (plain, _) = run(&[]);
    assert!(
        (masked - weighted).abs() <= 1e-6 * weighted.abs(),
        "{masked} vs {weighted}"
    );
    assert!((masked - plain).abs() > 1e-4, "the mask changed nothing: {masked}");
    assert_eq!(masked_dx, weighted_dx);
    assert!(masked_dx[HS..2 * HS]
        .iter()
        .chain(&masked_dx[3 * HS..4 * HS])
        .all(|&g| g == 0.0));
    let o = f.loss("teacher.safetensors", &["--ignore-mask"]);
    assert_input_error(&o, &["--ignore-mask", "labels"]);
}

/// Every bad loss-term input: a one-line typed error, exit 2, no output.
#[test]
fn bad_loss_term_inputs_exit_2_and_write_nothing() {
    let f = Fixture::new("bad-terms");
    let labels = |name: &str, v: &[i64]| {
        write_st(&f.path(name), &[T("labels", Dtype::I64, vec![v.len()], i64s(v))]);
        f.s(name)
    };
    let big = labels("big.safetensors", &[0, 1, 300, 2, 3]);
    let short = labels("short.safetensors", &[0, 1, 2]);
    let good = labels("good.safetensors", &[0, 1, 2, 3, -1]);
    let lp_positive: Vec<f32> = (0..NTOK * K).map(|i| if i == 6 { 0.25 } else { -2.0 }).collect();
    write_st(
        &f.path("lp_bad.safetensors"),
        &[
            T("ids", Dtype::I64, vec![NTOK, K], i64s(&f.ids)),
            T("logprobs", Dtype::F32, vec![NTOK, K], f32s(&lp_positive)),
        ],
    );
    // Rows of the fixture's teacher hold more than 1 in all: fine renormalized, not as a share.
    let out = f.path("out.safetensors");
    let cases: Vec<(Vec<&str>, &str, Vec<&str>)> = vec![
        (
            vec!["--labels", big, "--hard-weight", "0.5"],
            "teacher.safetensors",
            vec!["labels", "300", "out of range"],
        ),
        (
            vec!["--labels", short, "--hard-weight", "0.5"],
            "teacher.safetensors",
            vec!["labels", "3 labels"],
        ),
        (
            vec!["--hard-weight", "0.5"],
            "teacher.safetensors",
            vec!["--hard-weight", "labels"],
        ),
        (
            vec!["--labels", good, "--hard-weight", "-1"],
            "teacher.safetensors",
            vec!["--hard-weight", "-1"],
        ),
        (
            vec!["--labels", good, "--hard-weight", "1", "--label-smoothing", "1"],
            "teacher.safetensors",
            vec!["--label-smoothing", "[0, 1)"],
        ),
        (
            vec!["--softcap", "0"],
            "teacher.safetensors",
            vec!["--softcap", "positive"],
        ),
        (vec!["--softcap", "inf"], "teacher.safetensors", vec!["--softcap"]),
        (
            vec!["--logit-scale", "0"],
            "teacher.safetensors",
            vec!["--logit-scale", "positive"],
        ),
        (
            vec!["--logit-scale", "-2"],
            "teacher.safetensors",
            vec!["--logit-scale"],
        ),
        (vec!["--z-loss", "NaN"], "teacher.safetensors", vec!["--z-loss"]),
        (
            vec!["--soft-weight", "-0.5"],
            "teacher.safetensors",
            vec!["--soft-weight"],
        ),
        (
            vec!["--teacher-form", "logprobs"],
            "lp_bad.safetensors",
            vec!["logprobs", "0.25", "≤ 0"],
        ),
        (
            vec!["--teacher-form", "logprobs"],
            "teacher.safetensors",
            vec!["logprobs"],
        ),
        (
            vec!["--tail", "bucket"],
            "teacher.safetensors",
            vec!["probs", "above 1", "bucket"],
        ),
        (
            vec!["--tail", "none"],
            "teacher.safetensors",
            vec!["probs", "above 1", "none"],
        ),
    ];
    for (extra, teacher, needles) in cases {
        let _ = fs::remove_file(&out);
        let o = f.loss(teacher, &extra);
        assert_input_error(&o, &needles);
        assert!(!out.exists(), "{extra:?}: an output was written");
    }
    // A bad --tail or --teacher-form value is a usage error: exit 2 too.
    let o = f.loss("teacher.safetensors", &["--tail", "ghost"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(!out.exists());
    // topk's softcap is checked the same way.
    let top = f.path("top.safetensors");
    let o = f.run(
        "topk",
        "head.safetensors",
        "hidden.safetensors",
        &["-k", "3", "--softcap", "-2", "--out", top.to_str().unwrap()],
    );
    assert_input_error(&o, &["--softcap", "-2"]);
    assert!(!top.exists());
}

/// `loss` on each GPU backend against the reference; skipped with a printed
/// reason when the backend cannot start, unless HEADKL_REQUIRE names it.
#[test]
fn loss_on_gpu_backends() {
    let f = Fixture::new("gpu");
    for backend in ["wgpu", "vulkan"] {
        let out = f.path(&format!("{backend}.safetensors"));
        let o = f.run_on(
            backend,
            "loss",
            "head.safetensors",
            "hidden.safetensors",
            &["--teacher", f.s("teacher.safetensors"), "--out", out.to_str().unwrap()],
        );
        if !ran(backend, &o) {
            continue;
        }
        let bytes = fs::read(&out).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
        let hidden = Hidden::f32(&f.hidden, NTOK, HS).unwrap();
        let teacher = Teacher::from_i64(&f.ids, &f.probs, NTOK, K, VOCAB).unwrap();
        let opts = LossOptions::default();
        let want = head_kl_f64(&head, &hidden, &teacher, &opts.resolve(NTOK).unwrap());
        check_loss_file(&st, loss_mean(&st), &want);
    }
}

/// The mean loss prints six significant digits, not f64's seventeen.
#[test]
fn mean_loss_prints_meaningful_digits() {
    let f = Fixture::new("digits");
    let o = f.loss("teacher.safetensors", &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let value = out
        .lines()
        .find_map(|l| l.strip_prefix("mean loss: "))
        .unwrap_or_else(|| panic!("{out}"));
    let digits = value
        .trim_start_matches(['0', '.'])
        .chars()
        .filter(char::is_ascii_digit)
        .count();
    assert_eq!(digits, 6, "{value}");
    assert!(value.parse::<f64>().is_ok_and(|m| m > 0.0), "{value}");
}

#[test]
fn weights_tensor_is_named_by_an_option() {
    let f = Fixture::new("wtensor");
    let w = [1.0f32, 0.0, 2.0, 0.5, 1.0];
    write_st(&f.path("w.safetensors"), &[T("mask", Dtype::F32, vec![NTOK], f32s(&w))]);
    let o = f.loss("teacher.safetensors", &["--weights", f.s("w.safetensors")]);
    assert_input_error(&o, &["w.safetensors", "`weights`", "mask"]);
    let o = f.loss(
        "teacher.safetensors",
        &["--weights", f.s("w.safetensors"), "--weights-tensor", "mask"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(metadata(&f.path("out.safetensors"))["headkl.weights.file"].ends_with("w.safetensors"));
}

#[test]
fn the_dx_block_filter_reports_what_it_skipped_and_bad_values_are_refused() {
    let f = Fixture::new("filter");
    let o = f.loss("teacher.safetensors", &["--filter-eps", "auto"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("dx block filter (ε = 3.0517578e-5): skipped"),
        "no filter line:\n{out}"
    );
    // A value the parser refuses: exit 2, naming the option.
    let bad = f.loss("teacher.safetensors", &["--filter-eps", "nan"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
    assert!(stderr(&bad).contains("--filter-eps"), "{}", stderr(&bad));
    // The prior's order needs the lm data's prior.
    let b = bench_once(&[
        "--backend",
        "reference",
        "--shape",
        "8:512:64:8",
        "--vocab-order",
        "prior",
        "--yes",
    ]);
    assert_input_error(&b, &["--vocab-order", "--data lm"]);
    // A vocabulary-order file that is not a permutation of the head's
    // vocabulary: exit 2, naming the option, the file and what is wrong.
    let dir = std::env::temp_dir().join(format!("headkl-vocab-order-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bench_with = |text: &str| {
        let path = dir.join("order.txt");
        std::fs::write(&path, text).unwrap();
        bench_once(&[
            "--backend",
            "reference",
            "--shape",
            "8:16:64:8",
            "--vocab-order",
            path.to_str().unwrap(),
            "--yes",
        ])
    };
    let twice: String = (0..16).map(|i| format!("{} ", i.min(14))).collect();
    assert_input_error(&bench_with(&twice), &["--vocab-order", "order.txt", "given twice"]);
    assert_input_error(
        &bench_with("0 1 2"),
        &["--vocab-order", "order.txt", "3 token ids", "V = 16"],
    );
    assert_input_error(&bench_with("0 x"), &["--vocab-order", "order.txt", "position 1"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
