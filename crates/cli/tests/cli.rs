//! Runs the `headkl` binary: every bad input gets a one-line error naming the
//! file, tensor and problem with exit code 2; the happy paths match
//! `headkl_reference::direct`; outputs are never clobbered by a failed run.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::f16;
use headkl_core::{HeadData, HeadWeights, Hidden, LossConfig, LossOptions, Teacher};
use headkl_reference::direct::{head_kl_f64, topk_f64, DirectLoss};
use headkl_reference::Tolerance;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

const VOCAB: usize = 300;
const HS: usize = 24;
const NTOK: usize = 5;
const K: usize = 4;

/// A fresh directory for one test.
fn temp_dir(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "headkl-cli-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// One tensor to write: name, dtype, shape, bytes.
struct T(&'static str, Dtype, Vec<usize>, Vec<u8>);

fn f32s(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn i64s(v: &[i64]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn write_st(path: &Path, tensors: &[T]) {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|t| (t.0, TensorView::new(t.1, t.2.clone(), &t.3).unwrap()))
        .collect();
    fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Deterministic values without ties (an LCG), scaled to `a`.
fn values(n: usize, seed: u64, a: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
        })
        .collect()
}

/// The small problem every test uses.
struct Fixture {
    dir: PathBuf,
    head: Vec<f32>,
    hidden: Vec<f32>,
    ids: Vec<i64>,
    probs: Vec<f32>,
}

impl Fixture {
    fn new(tag: &str) -> Self {
        let dir = temp_dir(tag);
        let head = values(VOCAB * HS, 1, 0.5);
        let hidden = values(NTOK * HS, 2, 1.0);
        let ids: Vec<i64> = (0..NTOK * K).map(|i| ((i * 37 + 11) % VOCAB) as i64).collect();
        let probs: Vec<f32> = (0..NTOK * K).map(|i| 0.1 + (i % 7) as f32 * 0.05).collect();
        let f = Self {
            dir,
            head,
            hidden,
            ids,
            probs,
        };
        f.write_head("head.safetensors", "weight");
        write_st(
            &f.path("hidden.safetensors"),
            &[T("hidden", Dtype::F32, vec![NTOK, HS], f32s(&f.hidden))],
        );
        f.write_teacher("teacher.safetensors", &f.ids, &f.probs);
        f
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn write_head(&self, name: &str, tensor: &'static str) {
        write_st(
            &self.path(name),
            &[T(tensor, Dtype::F32, vec![VOCAB, HS], f32s(&self.head))],
        );
    }

    fn write_teacher(&self, name: &str, ids: &[i64], probs: &[f32]) -> PathBuf {
        let p = self.path(name);
        write_st(
            &p,
            &[
                T("ids", Dtype::I64, vec![NTOK, ids.len() / NTOK], i64s(ids)),
                T("probs", Dtype::F32, vec![NTOK, probs.len() / NTOK], f32s(probs)),
            ],
        );
        p
    }

    /// The arguments of `headkl <command>` on `backend` with the head and
    /// hidden rows of files `head` and `hidden` in this directory.
    fn args<'a>(&self, command: &'a str, backend: &'a str, head: &str, hidden: &str) -> Vec<&'a str> {
        vec![
            command,
            "--backend",
            backend,
            "--head",
            self.s(head),
            "--hidden",
            self.s(hidden),
        ]
    }

    /// Runs `headkl <command>` on the reference with files `head` and
    /// `hidden` of this directory, then `extra`.
    fn run(&self, command: &str, head: &str, hidden: &str, extra: &[&str]) -> Output {
        self.run_on("reference", command, head, hidden, extra)
    }

    /// [`Fixture::run`] on `backend`.
    fn run_on(&self, backend: &str, command: &str, head: &str, hidden: &str, extra: &[&str]) -> Output {
        let mut args = self.args(command, backend, head, hidden);
        args.extend(extra);
        headkl(&args)
    }

    /// Runs `headkl loss` on the reference with `teacher` and extra args.
    fn loss(&self, teacher: &str, extra: &[&str]) -> Output {
        self.loss_into(teacher, self.s("out.safetensors"), extra)
    }

    /// [`Fixture::loss`] into the file at path `out`.
    fn loss_into(&self, teacher: &str, out: &str, extra: &[&str]) -> Output {
        let mut args = vec!["--teacher", self.s(teacher), "--out", out];
        args.extend(extra);
        self.run("loss", "head.safetensors", "hidden.safetensors", &args)
    }

    /// Runs `headkl topk -k 3` on the reference with files `head` and
    /// `hidden` into `o.safetensors`, then `extra`.
    fn topk3(&self, head: &str, hidden: &str, extra: &[&str]) -> Output {
        let mut args = vec!["-k", "3", "--out", self.s("o.safetensors")];
        args.extend(extra);
        self.run("topk", head, hidden, &args)
    }

    fn s(&self, name: &str) -> &'static str {
        // Leaked: tests are short-lived and this keeps argument lists simple.
        Box::leak(self.path(name).to_str().unwrap().to_string().into_boxed_str())
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn headkl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_headkl"))
        .args(args)
        .env_remove("HEADKL_BACKEND")
        .env_remove("HEADKL_DEVICE")
        .env_remove("HEADKL_CASES")
        .env_remove("HEADKL_SEED")
        .output()
        .unwrap()
}

/// Runs `headkl bench` with `args`, one timed call and no warm-up.
fn bench_once(args: &[&str]) -> Output {
    headkl(&[&["bench"], args, &["--iters", "1", "--warmup", "0"]].concat())
}

/// A JSON file's value.
fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit 2, a one-line error containing every needle, no panic.
/// The `mean loss: ` line a `loss` run printed, as a number.
fn printed_mean(o: &Output) -> f64 {
    let stdout = String::from_utf8_lossy(&o.stdout);
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("mean loss: "))
        .unwrap_or_else(|| panic!("no mean loss in stdout: {stdout}"))
        .trim()
        .parse()
        .unwrap()
}

/// Checks a `loss` output file's `loss` (with `mean`, the run's mean) and
/// `grad` against the f64 answer.
fn check_loss_file(st: &SafeTensors<'_>, mean: f64, want: &DirectLoss) {
    let tol = Tolerance::default();
    tol.check_loss(&tensor_f32(st, "loss"), mean, want).unwrap();
    tol.check_dx_rows(&tensor_f32(st, "grad"), &want.dx, Some(HS)).unwrap();
}

/// The mean of a `loss` output file's per-token `loss`.
fn loss_mean(st: &SafeTensors<'_>) -> f64 {
    tensor_f32(st, "loss").iter().map(|&l| f64::from(l)).sum::<f64>() / NTOK as f64
}

/// The divergence tests' options: `divergence` at τ = 1.5.
fn divergence_at_tau_1_5(divergence: headkl_core::Divergence) -> LossOptions {
    LossOptions::from(LossConfig {
        temperature: 1.5,
        terms: headkl_core::LossTerms {
            divergence,
            ..headkl_core::LossTerms::default()
        },
        ..LossConfig::default()
    })
}

fn assert_input_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "expected exit 2, stderr:\n{err}");
    assert!(!err.contains("panicked"), "panic:\n{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("headkl: error:"))
        .unwrap_or_else(|| panic!("no error line:\n{err}"));
    for n in needles {
        assert!(line.contains(n), "error line lacks {n:?}: {line}");
    }
    println!("{line}");
}

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
fn device_that_does_not_exist_exits_2_and_a_backend_that_cannot_start_exits_1() {
    let f = Fixture::new("nostart");
    let loss = |backend: &str, envs: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_headkl"));
        c.args(f.args("loss", backend, "head.safetensors", "hidden.safetensors"))
            .args([
                "--device",
                "97",
                "--teacher",
                f.s("teacher.safetensors"),
                "--out",
                f.s("o.safetensors"),
            ]);
        c.env_remove("HEADKL_DEVICE").env_remove("HEADKL_BACKEND");
        for (k, v) in envs {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    for backend in ["wgpu", "vulkan", "reference"] {
        let o = loss(backend, &[]);
        let err = stderr(&o);
        if o.status.code() == Some(1) && err.contains(&format!("cannot start the {backend} backend")) {
            // No device at all (no Vulkan loader): nothing to count against.
            assert!(!required(backend), "{backend} is required: {err}");
            continue;
        }
        assert_input_error(&o, &["--device", "97"]);
        // `check` naming the backend fails the same way.
        let o = headkl(&["check", "--backend", backend, "--device", "97", "--cases", "0"]);
        assert_input_error(&o, &["--device", "97"]);
    }
    // auto with a device no backend has.
    let o = headkl(&["devices"]);
    assert_eq!(o.status.code(), Some(0));
    let o = headkl(&["check", "--device", "97", "--cases", "0"]);
    assert_input_error(&o, &["--device", "97"]);
    // A backend with no device to start (the Vulkan loader finds no driver):
    // exit 1 with the reason, and `check` counts it skipped, not passed.
    let no_driver = [
        ("VK_ICD_FILENAMES", "/nonexistent/icd.json"),
        ("VK_DRIVER_FILES", "/nonexistent/icd.json"),
    ];
    for backend in ["wgpu", "vulkan"] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_headkl"));
        c.args(f.args("loss", backend, "head.safetensors", "hidden.safetensors"))
            .args(["--teacher", f.s("teacher.safetensors"), "--out", f.s("o.safetensors")]);
        for (k, v) in no_driver {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{backend}: {err}");
        assert!(err.contains(&format!("cannot start the {backend} backend")), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_headkl"))
        .args(["check", "--cases", "0"])
        .envs(no_driver)
        .env_remove("HEADKL_REQUIRE")
        .env_remove("HEADKL_BACKEND")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(0), "{out}\n{}", stderr(&o));
    assert!(out.contains("on 1 backend(s)") && out.contains("2 skipped"), "{out}");
    let o = Command::new(env!("CARGO_BIN_EXE_headkl"))
        .args(["check", "--cases", "0"])
        .envs(no_driver)
        .env("HEADKL_REQUIRE", "vulkan")
        .env_remove("HEADKL_BACKEND")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(!f.path("o.safetensors").exists());
}

/// Whether a run on `backend` is to be checked: false, with the reason
/// printed, when the backend could not start and `HEADKL_REQUIRE` does not
/// name it; otherwise the run must have exited 0.
fn ran(backend: &str, o: &Output) -> bool {
    let err = stderr(o);
    if o.status.code() == Some(1) && err.contains("cannot start") && !required(backend) {
        println!("{backend}: skipped, cannot start: {}", err.trim());
        return false;
    }
    assert_eq!(o.status.code(), Some(0), "{backend}: {err}");
    true
}

/// Whether `HEADKL_REQUIRE` (of the test run) names `backend`.
fn required(backend: &str) -> bool {
    headkl_reference::conformance::harness_suite().requires(backend)
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

/// Copies little-endian tensor bytes into a vector (the data may be
/// unaligned).
fn pod_vec<P: bytemuck::Pod>(data: &[u8]) -> Vec<P> {
    let mut v = vec![P::zeroed(); data.len() / std::mem::size_of::<P>()];
    bytemuck::cast_slice_mut::<P, u8>(&mut v).copy_from_slice(data);
    v
}

fn tensor_f32(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32);
    pod_vec(t.data())
}

/// A `topk` output's ids (I64 `[NTOK][k]`, as u32) and probabilities.
fn read_topk(path: &Path, k: usize) -> (Vec<u32>, Vec<f32>) {
    let bytes = fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids_t = st.tensor("ids").unwrap();
    assert_eq!(ids_t.dtype(), Dtype::I64);
    assert_eq!(ids_t.shape(), &[NTOK, k]);
    let ids: Vec<i64> = pod_vec(ids_t.data());
    let ids = ids.iter().map(|&i| u32::try_from(i).unwrap()).collect();
    (ids, tensor_f32(&st, "probs"))
}

#[test]
fn topk_matches_direct() {
    let f = Fixture::new("topk");
    let o = f.topk_k("top.safetensors", 7, &["--temperature", "0.8"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (ids, probs) = read_topk(&f.path("top.safetensors"), 7);
    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let hidden = Hidden::f32(&f.hidden, NTOK, HS).unwrap();
    let want = topk_f64(&head, &hidden, 7, 0.8);
    Tolerance::default().check_topk(&ids, &probs, &want).unwrap();
}

/// `topk --logit-scale 2 --temperature 1.6` is the top-k of 2·z/1.6, the
/// reference's at τ = 0.8, and the file records the scale; a scale that is
/// not positive is exit 2 naming `--logit-scale`.
#[test]
fn topk_logit_scale_matches_direct() {
    let f = Fixture::new("topk-scale");
    let out = f.path("top.safetensors");
    let run = |scale: &str| f.topk_k("top.safetensors", 7, &["--temperature", "1.6", "--logit-scale", scale]);
    let o = run("2");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (ids, probs) = read_topk(&out, 7);
    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let hidden = Hidden::f32(&f.hidden, NTOK, HS).unwrap();
    Tolerance::default()
        .check_topk(&ids, &probs, &topk_f64(&head, &hidden, 7, 0.8))
        .unwrap();
    assert_eq!(metadata(&out).get("headkl.logit_scale").map(String::as_str), Some("2"));
    assert_input_error(&run("0"), &["--logit-scale", "logit_scale = 0"]);
}

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
            headkl_reference::direct::head_kl_full_vocab_f64(&head, &hidden, &th, &tx, &opts.resolve(NTOK).unwrap());
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

#[test]
fn devices_json_marks_one_auto_row() {
    let o = headkl(&["devices", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = v["devices"].as_array().unwrap();
    assert!(rows
        .iter()
        .any(|r| r["backend"] == "reference" && r["runnable"] == true));
    assert_eq!(rows.iter().filter(|r| r["auto"] == true).count(), 1, "{v}");
    assert!(v["auto"]["reason"].as_str().is_some_and(|r| !r.is_empty()));
    // Every backend shows up: with devices, or with one row saying why not.
    for b in ["vulkan", "wgpu", "reference"] {
        assert!(rows.iter().any(|r| r["backend"] == b), "no row for {b}: {v}");
    }
    let o = headkl(&["devices"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("auto picks"));
}

#[test]
fn check_on_reference_passes() {
    let o = headkl(&["check", "--backend", "reference", "--cases", "2", "--seed", "5"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(0), "stdout:\n{out}\nstderr:\n{}", stderr(&o));
    assert!(out.contains("reference") && out.contains("passed"), "{out}");
}

/// On a GPU backend `check` also runs the device-resident cases: two more
/// drawn ones per `--cases 2` and the resident error cases, so it counts
/// more cases than the reference's host-only suite.
#[test]
fn check_on_gpu_backends_runs_the_resident_cases() {
    let reference = headkl(&["check", "--backend", "reference", "--cases", "2"]);
    let count = |o: &std::process::Output| -> usize {
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let line = out
            .lines()
            .find(|l| l.starts_with("all "))
            .unwrap_or_else(|| panic!("{out}"));
        line.split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line}"))
    };
    let host_cases = count(&reference);
    for backend in ["wgpu", "vulkan"] {
        let o = headkl(&["check", "--backend", backend, "--cases", "2"]);
        if !ran(backend, &o) {
            continue;
        }
        assert!(
            count(&o) > host_cases + 2,
            "{backend}: {} cases, host suite {host_cases}",
            count(&o)
        );
    }
}

#[test]
fn bench_writes_json_and_plot() {
    let dir = temp_dir("bench");
    let json = dir.join("b.json");
    let svg = dir.join("b.svg");
    let o = headkl(&[
        "bench",
        "--backend",
        "reference",
        "--shape",
        "8:512:64:8",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = read_json(&json);
    let run = &v["runs"][0];
    assert_eq!(run["backend"], "reference");
    assert_eq!(run["shape"]["vocab"], 512);
    let jobs = run["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 2);
    for j in jobs {
        let median = j["median_ms"].as_f64().unwrap();
        assert!(median > 0.0 && j["min_ms"].as_f64().unwrap() <= median, "{j}");
        assert!(j["max_ms"].as_f64().unwrap() >= median, "{j}");
        assert!(j["tflops"].as_f64().unwrap() > 0.0, "{j}");
        assert!(j.get("peak_extra_bytes").is_some() && j.get("kernels").is_some() && j.get("gpu_ms").is_some());
    }
    let svg_text = fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg") && svg_text.contains("head_kl") && svg_text.contains("topk"));
    assert!(String::from_utf8_lossy(&o.stdout).contains("TFLOP/s"));
    let _ = fs::remove_dir_all(dir);
}

/// `bench` takes head_kl's loss options: cross-entropy alone (`--soft-weight
/// 0 --hard-weight 1 --labels random`) and a divergence run and are
/// recorded in the JSON; a hard weight without labels, `--beta` beside
/// another divergence and loss options beside `--shards` are exit 2 naming
/// the option.
#[test]
fn bench_takes_the_loss_options() {
    let dir = temp_dir("bench-terms");
    let json = dir.join("b.json");
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "--backend",
            "reference",
            "--shape",
            "8:512:64:8",
            "--json",
            json.to_str().unwrap(),
        ];
        args.extend(extra);
        bench_once(&args)
    };
    for (extra, key, want) in [
        (
            vec!["--soft-weight", "0", "--hard-weight", "1", "--labels", "random"],
            "hard_weight",
            serde_json::json!(1.0),
        ),
        (
            vec!["--divergence", "jsd", "--beta", "0.25"],
            "beta",
            serde_json::json!(0.25),
        ),
    ] {
        let o = bench(&extra);
        assert_eq!(o.status.code(), Some(0), "{extra:?}: {}", stderr(&o));
        let v = read_json(&json);
        assert_eq!(v[key], want, "{extra:?}: {v}");
        let head_kl = &v["runs"][0]["jobs"][0];
        assert!(head_kl["median_ms"].as_f64().unwrap() > 0.0, "{head_kl}");
    }
    // `--gather` adds the gather job's row.
    let o = bench(&["--gather"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = read_json(&json);
    let jobs: Vec<&str> = v["runs"][0]["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["job"].as_str().unwrap())
        .collect();
    assert_eq!(jobs, ["head_kl", "topk", "gather"], "{v}");
    // `--teacher-hs N` adds the full-vocabulary loss's row (the filter is
    // the top-k rows' alone); it takes no hard term.
    let o = bench(&["--teacher-hs", "24", "--divergence", "reverse", "--filter-eps", "auto"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = read_json(&json);
    assert_eq!(v["teacher_hs"], serde_json::json!(24), "{v}");
    let full = &v["runs"][0]["jobs"][2];
    assert_eq!(full["job"], "head_kl_full_vocab", "{v}");
    assert!(full["median_ms"].as_f64().unwrap() > 0.0, "{full}");
    let o = bench(&["--teacher-hs", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--teacher-hs"), "{}", stderr(&o));
    for (extra, needle) in [
        (
            vec!["--teacher-hs", "24", "--hard-weight", "1", "--labels", "random"],
            "--teacher-hs",
        ),
        (vec!["--hard-weight", "1"], "--hard-weight"),
        (vec!["--beta", "0.5"], "--beta"),
        (vec!["--soft-weight", "-1"], "--soft-weight"),
        (vec!["--divergence", "reverse", "--shards", "2"], "--shards"),
    ] {
        let o = bench(&extra);
        assert_input_error(&o, &[needle]);
    }
    let _ = fs::remove_dir_all(dir);
}

/// `bench --resident`: the device-resident rows beside the host path's, on
/// each GPU backend (skipped with a printed reason when one cannot start,
/// unless HEADKL_REQUIRE names it); on the reference an option error.
#[test]
fn bench_resident_beside_host() {
    assert_input_error(
        &headkl(&["bench", "--backend", "reference", "--resident", "--shape", "8:512:64:8"]),
        &["--resident", "reference"],
    );
    let required = std::env::var("HEADKL_REQUIRE").unwrap_or_default();
    let dir = temp_dir("bench-resident");
    for backend in ["wgpu", "vulkan"] {
        let json = dir.join(format!("{backend}.json"));
        let o = headkl(&[
            "bench",
            "--backend",
            backend,
            "--resident",
            "--shape",
            "16:512:64:8",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            json.to_str().unwrap(),
        ]);
        let err = stderr(&o);
        let must = required.split(',').any(|r| r.trim() == backend);
        if o.status.code() == Some(1) && err.contains("cannot start") && !must {
            println!("{backend}: skipped, cannot start: {}", err.trim());
            continue;
        }
        assert_eq!(o.status.code(), Some(0), "{backend}: {err}");
        let v = read_json(&json);
        let jobs = v["runs"][0]["jobs"].as_array().unwrap().clone();
        let names: Vec<(String, String)> = jobs
            .iter()
            .map(|j| {
                (
                    j["job"].as_str().unwrap_or("").to_string(),
                    j["path"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect();
        for want in [
            ("head_kl", "host"),
            ("topk", "host"),
            ("head_kl", "resident"),
            ("topk", "resident"),
        ] {
            assert!(
                names.iter().any(|(j, p)| j == want.0 && p == want.1),
                "{backend}: no {want:?} row in {names:?}"
            );
        }
        for j in &jobs {
            assert!(j["median_ms"].as_f64().unwrap() > 0.0, "{j}");
        }
        assert!(String::from_utf8_lossy(&o.stdout).contains("head_kl (resident)"));
    }
    let _ = fs::remove_dir_all(dir);
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

/// `tune` and `HEADKL_GEMM`: what stops them is named, with exit 2 for a bad
/// option or setting; on a device without matrix units there is nothing to
/// tune (lavapipe in CI), which `tune` says instead of timing the tiled GEMM.
#[test]
fn tune_and_gemm_settings_name_what_is_wrong() {
    assert_input_error(
        &headkl(&["tune", "--backend", "reference"]),
        &["--backend", "no matrix units"],
    );
    let o = headkl(&["tune", "--shape", "4096:100:5120"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("N = 100 must be a positive multiple of 16"),
        "{}",
        stderr(&o)
    );
    let o = headkl(&["tune", "--kernels", "direct,staged:bk24"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("bk must be 16, 32 or 64"), "{}", stderr(&o));

    // A bad setting is exit 2 before any backend is touched, and fails
    // `check` (it is not a backend that "cannot start").
    for args in [
        &["check", "--cases", "0"][..],
        &["devices"][..],
        &["check", "--backend", "vulkan"][..],
    ] {
        let with_setting = |name: &str, value: &str| {
            Command::new(env!("CARGO_BIN_EXE_headkl"))
                .args(args)
                .env(name, value)
                .output()
                .unwrap()
        };
        let o = with_setting("HEADKL_GEMM", "staged:bk24");
        assert_input_error(&o, &["HEADKL_GEMM = \"staged:bk24\": bk must be 16, 32 or 64"]);
        let o = with_setting("HEADKL_GEMM", "garbage");
        assert_input_error(&o, &["HEADKL_GEMM", "garbage"]);
        // A GLSL tile the build does not make; the variable that is gone.
        let o = with_setting("HEADKL_GEMM", "logits=glsl:bm96.bk32.s2");
        assert_input_error(&o, &["HEADKL_GEMM", "glsl:bm96.bk32.s2", "not a GLSL tile"]);
        let o = with_setting("HEADKL_GLSL_GEMM", "bm128.bk64.s1");
        assert_input_error(&o, &["HEADKL_GLSL_GEMM", "HEADKL_GEMM=logits=glsl:"]);
    }
    for backend in ["wgpu", "vulkan"] {
        let o = headkl(&["tune", "--backend", backend, "--no-save"]);
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "{err}");
        if o.status.code() == Some(0) {
            // A device with matrix units: a table and a pick.
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.contains("best: logits="), "{out}");
        } else {
            assert_input_error(&o, &["--backend", "nothing to tune"]);
        }
    }
}

/// `tune --ceiling`: the report runs the Vulkan backend's GLSL kernels,
/// which only a build with the `ceiling` feature holds; another backend, a
/// build without them, or a device without matrix units (lavapipe in CI),
/// is a usage error (exit 2) that says why.
#[test]
fn ceiling_report_needs_vulkan_matrix_units() {
    assert_input_error(
        &headkl(&["tune", "--backend", "wgpu", "--ceiling"]),
        &["--ceiling", "--backend vulkan"],
    );
    if !headkl_vulkan::CEILING_BUILT {
        assert_input_error(
            &headkl(&["tune", "--backend", "vulkan", "--ceiling"]),
            &["--ceiling", "--features ceiling"],
        );
        return;
    }
    let must = std::env::var("HEADKL_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .any(|r| r.trim() == "vulkan");
    let o = headkl(&[
        "tune",
        "--backend",
        "vulkan",
        "--ceiling",
        "--shape",
        "256:1024:256",
        "--iters",
        "1",
    ]);
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    if o.status.code() == Some(1) && err.contains("cannot start") && !must {
        println!("vulkan: skipped, cannot start: {}", err.trim());
        return;
    }
    if o.status.code() == Some(0) {
        // A device with matrix units: both layouts, every part.
        let out = String::from_utf8_lossy(&o.stdout);
        for needle in [
            "ceiling logits",
            "ceiling dx",
            "(a) multiply-adds from registers",
            "(e) the GEMM",
        ] {
            assert!(out.contains(needle), "{needle}: {out}");
        }
        assert!(!out.contains("FAILED"), "{out}");
    } else {
        assert_input_error(&o, &["--ceiling", "no matrix-unit ceiling"]);
    }
}

/// The exit codes: each is the user's to fix, so exit 2 with a
/// message that says what is wrong.
#[test]
fn first_hour_exit_codes_and_messages() {
    let f = Fixture::new("exit2");
    let topk = |head: &str, out: &str, extra: &[&str]| {
        let mut args = vec!["-k", "3", "--out", out];
        args.extend(extra);
        f.run("topk", head, "hidden.safetensors", &args)
    };
    // --out into a folder that does not exist, and --out naming a folder.
    let missing = f.s("no_such_folder/o.safetensors");
    assert_input_error(
        &topk("head.safetensors", missing, &[]),
        &["no_such_folder", "does not exist"],
    );
    assert_input_error(&topk("head.safetensors", f.s(""), &[]), &["is a folder"]);
    // --head naming a folder.
    fs::create_dir_all(f.path("some_dir")).unwrap();
    assert_input_error(
        &topk("some_dir", f.s("o.safetensors"), &[]),
        &["some_dir", "is a folder"],
    );
    // A negative temperature parses, and is rejected with the range message.
    let o = topk("head.safetensors", f.s("o.safetensors"), &["--temperature", "-1"]);
    assert_input_error(&o, &["--temperature", "-1"]);
    assert!(!stderr(&o).contains("unexpected argument"), "{}", stderr(&o));
    let o = f.loss("teacher.safetensors", &["--temperature", "-1"]);
    assert_input_error(&o, &["--temperature", "-1"]);
    // A head stored [hs][V] gets a hint.
    write_st(
        &f.path("head_t.safetensors"),
        &[T("weight", Dtype::F32, vec![HS, VOCAB], f32s(&f.head))],
    );
    assert_input_error(
        &topk("head_t.safetensors", f.s("o.safetensors"), &[]),
        &["looks transposed"],
    );
    // A bad setting, whatever the subcommand.
    let o = Command::new(env!("CARGO_BIN_EXE_headkl"))
        .args(f.args("topk", "reference", "head.safetensors", "hidden.safetensors"))
        .args(["-k", "3", "--out", f.s("o.safetensors")])
        .env("HEADKL_NO_COOPMAT", "maybe")
        .output()
        .unwrap();
    assert_input_error(&o, &["HEADKL_NO_COOPMAT", "maybe"]);
    let left: Vec<String> = fs::read_dir(&f.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp") || n == "o.safetensors")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// SIGINT or SIGTERM while `topk` runs: the temporary output goes with the
/// process, which ends by the signal.
#[cfg(unix)]
#[test]
fn interrupt_removes_the_temporary_output() {
    use std::os::unix::process::ExitStatusExt;
    use std::time::{Duration, Instant};
    let f = Fixture::new("sigint");
    // About 34 GFLOP of top-k on the reference: seconds, so the signal lands
    // mid-run.
    let (vocab, hs, ntok) = (16_384, 512, 2048);
    write_st(
        &f.path("big_head.safetensors"),
        &[T(
            "weight",
            Dtype::F32,
            vec![vocab, hs],
            f32s(&values(vocab * hs, 7, 0.05)),
        )],
    );
    write_st(
        &f.path("big_hidden.safetensors"),
        &[T(
            "hidden",
            Dtype::F32,
            vec![ntok, hs],
            f32s(&values(ntok * hs, 8, 1.0)),
        )],
    );
    for signal in [libc::SIGINT, libc::SIGTERM] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_headkl"))
            .args(["topk", "--backend", "reference", "--head", f.s("big_head.safetensors")])
            .args([
                "--hidden",
                f.s("big_hidden.safetensors"),
                "-k",
                "8",
                "--out",
                f.s("big.safetensors"),
            ])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let temps = || -> Vec<String> {
            fs::read_dir(&f.dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".tmp"))
                .collect()
        };
        let start = Instant::now();
        while temps().is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no temporary output appeared"
            );
            assert!(
                child.try_wait().unwrap().is_none(),
                "topk ended before its output was made"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // SAFETY: sending a signal to our own child process.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
        let status = child.wait().unwrap();
        assert_eq!(
            status.signal(),
            Some(signal),
            "topk finished before the signal: {status:?}"
        );
        assert!(
            temps().is_empty(),
            "temporary output left after signal {signal}: {:?}",
            temps()
        );
        assert!(!f.path("big.safetensors").exists());
    }
}

/// `headkl devices --json | head -1`: the reader goes away; headkl ends
/// quietly (by SIGPIPE, as `cat` does), without a panic.
#[cfg(unix)]
#[test]
fn closed_stdout_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let mut child = Command::new(env!("CARGO_BIN_EXE_headkl"))
        .args(["devices", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{err}");
    assert!(
        o.status.code() == Some(0) || o.status.signal() == Some(libc::SIGPIPE),
        "{:?}: {err}",
        o.status
    );
}

/// Mesa's "XDG_RUNTIME_DIR is invalid or not set" does not reach the user.
#[test]
fn no_runtime_dir_noise() {
    let o = Command::new(env!("CARGO_BIN_EXE_headkl"))
        .arg("devices")
        .env_remove("XDG_RUNTIME_DIR")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stderr(&o).contains("XDG_RUNTIME_DIR"), "{}", stderr(&o));
}

/// `bench --all --resident` runs what can run and says what it leaves out:
/// the GPU backends' host and resident jobs, the CPU reference's host jobs
/// only (it has no device buffers), one table and one JSON report.
#[test]
fn bench_all_resident_leaves_out_only_the_references_resident_jobs() {
    let dir = temp_dir("benchall-resident");
    let json = dir.join("all.json");
    let o = bench_once(&[
        "--all",
        "--resident",
        "--shape",
        "16:512:64:8",
        "--json",
        json.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("reference: no device buffers"), "{err}");
    let v = read_json(&json);
    let runs = v["runs"].as_array().unwrap();
    let paths = |backend: &str| -> Option<Vec<String>> {
        let run = runs.iter().find(|r| r["backend"] == backend)?;
        Some(
            run["jobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|j| format!("{} {}", j["job"].as_str().unwrap(), j["path"].as_str().unwrap()))
                .collect(),
        )
    };
    assert_eq!(
        paths("reference"),
        Some(vec!["head_kl host".to_string(), "topk host".to_string()]),
        "{v}"
    );
    for backend in ["wgpu", "vulkan"] {
        match paths(backend) {
            Some(p) => assert!(
                ["head_kl host", "topk host", "head_kl resident", "topk resident"]
                    .iter()
                    .all(|want| p.iter().any(|have| have == want)),
                "{backend}: {p:?}"
            ),
            None => assert!(!required(backend), "{backend} required but not run: {err}"),
        }
    }
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("reference") && out.contains("TFLOP/s"), "{out}");
    let _ = fs::remove_dir_all(dir);
}

/// `bench --all` runs one shape on every backend, labels the reference's
/// time as CPU time, and auto never benches a software rasterizer.
#[test]
fn bench_all_runs_one_shape_and_auto_skips_software_devices() {
    let dir = temp_dir("benchall");
    let json = dir.join("all.json");
    let o = bench_once(&["--all", "--json", json.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = read_json(&json);
    let runs = v["runs"].as_array().unwrap();
    assert!(runs.iter().any(|r| r["backend"] == "reference"), "{v}");
    for r in runs {
        assert_eq!(r["shape"], runs[0]["shape"], "shapes differ: {v}");
        if r["backend"] == "reference" {
            assert!(
                r["jobs"].as_array().unwrap().iter().all(|j| j["tflops_from"] == "cpu"),
                "{r}"
            );
        }
    }
    for backend in ["wgpu", "vulkan"] {
        if required(backend) {
            assert!(runs.iter().any(|r| r["backend"] == backend), "{backend} required: {v}");
        }
    }
    let plain = dir.join("auto.json");
    let o = bench_once(&["--json", plain.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = read_json(&plain);
    let run = &v["runs"][0];
    assert!(
        run["backend"] == "reference" || run["device_type"] != "cpu",
        "auto benched a software device: {run}"
    );
    let _ = fs::remove_dir_all(dir);
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
fn readme_says_how_to_install() {
    let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"));
    assert!(readme.contains("cargo install --path crates/cli"));
}

// ---- Teacher files that know how they were made ----

/// The `__metadata__` of a safetensors file.
fn metadata(path: &Path) -> std::collections::HashMap<String, String> {
    let bytes = fs::read(path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap_or_default()
}

impl Fixture {
    /// Runs `headkl topk` on the reference into `out` with extra args.
    fn topk(&self, out: &str, extra: &[&str]) -> Output {
        self.topk_k(out, K, extra)
    }

    /// Runs `headkl topk -k k` on the reference with extra args.
    fn topk_k(&self, out: &str, k: usize, extra: &[&str]) -> Output {
        let k = k.to_string();
        let mut args = vec!["-k", &k, "--out", self.s(out)];
        args.extend(extra);
        self.run("topk", "head.safetensors", "hidden.safetensors", &args)
    }
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
        stderr(&o).contains("warning") && stderr(&o).contains("made from head"),
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
    let notes = err.lines().filter(|l| l.contains("no headkl metadata")).count();
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

// ---- Help, quiet, bench on a slow device, devices ----

#[test]
fn short_help_is_short_and_long_help_has_the_policy() {
    for sub in ["topk", "loss", "bench", "devices", "check", "tune"] {
        let short = String::from_utf8_lossy(&headkl(&[sub, "-h"]).stdout).into_owned();
        let long = String::from_utf8_lossy(&headkl(&[sub, "--help"]).stdout).into_owned();
        assert!(
            !short.contains("Vulkan with matrix units"),
            "{sub} -h has the policy:\n{short}"
        );
        assert!(
            long.contains("Vulkan with matrix units"),
            "{sub} --help lacks the policy:\n{long}"
        );
        assert!(short.lines().count() < long.lines().count(), "{sub}");
    }
    let top = String::from_utf8_lossy(&headkl(&["-h"]).stdout).into_owned();
    assert!(!top.contains("HEADKL_GEMM"), "{top}");
    let top_long = String::from_utf8_lossy(&headkl(&["--help"]).stdout).into_owned();
    assert!(top_long.contains("HEADKL_GEMM"), "{top_long}");
}

#[test]
fn auto_lines_go_through_the_logger_and_quiet_drops_them() {
    let f = Fixture::new("quiet");
    let run = |quiet: bool| {
        let mut args = vec![
            "topk",
            "--head",
            f.s("head.safetensors"),
            "--hidden",
            f.s("hidden.safetensors"),
            "-k",
            "3",
            "--out",
            f.s("q.safetensors"),
        ];
        if quiet {
            args.push("--quiet");
        }
        // auto's pick: its line is informational.
        Command::new(env!("CARGO_BIN_EXE_headkl"))
            .args(&args)
            .env("HEADKL_BACKEND", "auto")
            .env_remove("HEADKL_DEVICE")
            .output()
            .unwrap()
    };
    let loud = run(false);
    assert_eq!(loud.status.code(), Some(0), "{}", stderr(&loud));
    assert!(stderr(&loud).contains("auto picked"), "{}", stderr(&loud));
    assert!(stderr(&loud).contains("running on"), "{}", stderr(&loud));
    let quiet = run(true);
    assert_eq!(quiet.status.code(), Some(0), "{}", stderr(&quiet));
    assert_eq!(stderr(&quiet), "", "--quiet printed something");
}

#[test]
fn bench_refuses_hours_on_the_cpu_reference_before_making_data() {
    let start = std::time::Instant::now();
    let o = headkl(&["bench", "--backend", "reference", "--shape", "A"]);
    let secs = start.elapsed().as_secs_f64();
    assert_input_error(&o, &["bench reference at 4096:248320:5120:64", "--yes", "of compute"]);
    let err = stderr(&o);
    assert!(err.contains("host"), "no memory figure: {err}");
    // Refused from the calibration, before the 2.5 GB of data exist.
    assert!(!err.contains("generating"), "{err}");
    assert!(secs < 60.0, "took {secs:.1} s to refuse");
}

#[test]
fn devices_shows_no_binding_limit_for_the_cpu_reference() {
    let o = headkl(&["devices", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = v["devices"].as_array().unwrap();
    let row = rows.iter().find(|r| r["backend"] == "reference").unwrap();
    assert!(row["max_binding_bytes"].is_null(), "{row}");
    let o = headkl(&["devices", "--backend", "reference"]);
    let table = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(!table.contains("2.0 GiB"), "{table}");
}

#[test]
fn trace_asked_for_shows_even_when_quiet() {
    let f = Fixture::new("trace");
    let out = f.path("out.safetensors");
    let o = Command::new(env!("CARGO_BIN_EXE_headkl"))
        .args(f.args("loss", "reference", "head.safetensors", "hidden.safetensors"))
        .args([
            "--quiet",
            "--teacher",
            f.s("teacher.safetensors"),
            "--out",
            out.to_str().unwrap(),
        ])
        .env("HEADKL_TRACE", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let err = stderr(&o);
    // Only the asked-for lines, as they always read: no note, no "running on".
    assert!(err.lines().any(|l| l.starts_with("trace head_kl: ")), "{err}");
    assert!(err.lines().all(|l| l.starts_with("trace ")), "{err}");
}

/// Tensor names, dtypes and shapes of a safetensors file, sorted.
fn layout(path: &Path) -> Vec<(String, String, Vec<usize>)> {
    let bytes = fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, format!("{:?}", t.dtype()), t.shape().to_vec()))
        .collect();
    v.sort();
    v
}

/// `loss --shards N` and `topk --shards N` write the unsharded commands'
/// files (same tensors, dtypes, shapes and metadata keys) with the same
/// values within the suite's tolerances; an option the shards do not take
/// is exit 2 naming it.
#[test]
fn sharded_loss_and_topk_write_the_unsharded_files() {
    let f = Fixture::new("shards");
    // `command` with `extra` into file `name`, on `shards` shards where given.
    let run_into = |command: &str, extra: &[&str], name: &str, shards: Option<&str>| {
        let out = f.path(name);
        let mut args = extra.to_vec();
        args.extend(["--out", out.to_str().unwrap()]);
        if let Some(n) = shards {
            args.extend(["--shards", n]);
        }
        let o = f.run(command, "head.safetensors", "hidden.safetensors", &args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        out
    };
    let run_loss = |name: &str, shards: Option<&str>| {
        let teacher = ["--teacher", f.s("teacher.safetensors"), "--temperature", "2"];
        run_into("loss", &teacher, name, shards)
    };
    let one = run_loss("one.safetensors", None);
    let read = |p: &Path| {
        let bytes = fs::read(p).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        (tensor_f32(&st, "loss"), tensor_f32(&st, "lse"), tensor_f32(&st, "grad"))
    };
    let (loss1, lse1, grad1) = read(&one);
    let keys = |p: &Path| {
        let mut k: Vec<String> = metadata(p).into_keys().collect();
        k.sort();
        k
    };
    for n in ["2", "3"] {
        let sharded = run_loss(&format!("loss{n}.safetensors"), Some(n));
        assert_eq!(layout(&sharded), layout(&one), "--shards {n}: tensors");
        assert_eq!(keys(&sharded), keys(&one), "--shards {n}: metadata keys");
        let (loss, lse, grad) = read(&sharded);
        for (t, (a, b)) in loss.iter().zip(&loss1).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (b.abs() + 0.1),
                "--shards {n}: loss[{t}] {a} vs {b}"
            );
        }
        for (t, (a, b)) in lse.iter().zip(&lse1).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (b.abs() + 1.0),
                "--shards {n}: lse[{t}] {a} vs {b}"
            );
        }
        let err: f32 = grad
            .iter()
            .zip(&grad1)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        let norm: f32 = grad1.iter().map(|b| b * b).sum::<f32>().sqrt();
        assert!(err <= 3e-3 * norm, "--shards {n}: grad error {err} of {norm}");
    }

    let run_topk = |name: &str, shards: Option<&str>| run_into("topk", &["-k", "8", "--logprobs"], name, shards);
    let one = run_topk("top1.safetensors", None);
    let sharded = run_topk("top3.safetensors", Some("3"));
    // Spread over two backends (the reference has one device: twice).
    let spread = f.path("spread.safetensors");
    let o = f.loss_into(
        "teacher.safetensors",
        spread.to_str().unwrap(),
        &["--shards", "3", "--devices", "0,0"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(layout(&spread), layout(&f.path("loss3.safetensors")));
    let o = f.run(
        "topk",
        "head.safetensors",
        "hidden.safetensors",
        &[
            "-k",
            "4",
            "--shards",
            "2",
            "--devices",
            "1",
            "--out",
            f.s("never.safetensors"),
        ],
    );
    assert_input_error(&o, &["--devices"]);
    assert_eq!(layout(&sharded), layout(&one));
    assert_eq!(keys(&sharded), keys(&one));
    let (b1, b3) = (fs::read(&one).unwrap(), fs::read(&sharded).unwrap());
    let (s1, s3) = (
        SafeTensors::deserialize(&b1).unwrap(),
        SafeTensors::deserialize(&b3).unwrap(),
    );
    assert_eq!(s1.tensor("ids").unwrap().data(), s3.tensor("ids").unwrap().data());
    for name in ["probs", "logprobs"] {
        for (a, b) in tensor_f32(&s3, name).iter().zip(&tensor_f32(&s1, name)) {
            assert!((a - b).abs() <= 1e-5 * (b.abs() + 1.0), "{name}: {a} vs {b}");
        }
    }

    let o = f.loss("teacher.safetensors", &["--z-loss", "1e-4", "--shards", "2"]);
    assert_input_error(&o, &["--z-loss", "sharded"]);
    // The count is refused by the one parser every subcommand's --shards
    // shares (clap's usage error: exit 2, naming the option and the range).
    for args in [&["--shards", "0"][..], &["--shards", "257"][..]] {
        let o = f.loss("teacher.safetensors", args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("--shards") && err.contains("1 to 256"), "{err}");
    }
    let o = headkl(&["bench", "--backend", "reference", "--shards", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("1 to 256"), "{}", stderr(&o));
}

/// `bench --shards 2` times both jobs sharded beside the unsharded rows,
/// in one run.
#[test]
fn bench_shards_reports_beside_unsharded() {
    let o = bench_once(&["--backend", "reference", "--shape", "64:4096:256:16", "--shards", "2"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for row in ["head_kl ", "topk ", "head_kl (sharded)", "topk (sharded)"] {
        assert!(out.contains(row), "no {row} row in:\n{out}");
    }
}

/// `--shards 3 --devices 0,0` runs the sharded rows on threads, one engine
/// each on the devices listed (here the one device twice); a device the
/// backend lacks is refused, and `--devices` needs `--shards`.
#[test]
fn bench_shards_on_devices_run_on_threads() {
    let args = ["--backend", "reference", "--shape", "64:4096:256:16", "--shards", "3"];
    let o = bench_once(&[&args[..], &["--devices", "0,0"]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for row in [
        "head_kl ",
        "topk ",
        "head_kl (sharded, threads)",
        "topk (sharded, threads)",
    ] {
        assert!(out.contains(row), "no {row} row in:\n{out}");
    }
    assert!(!out.contains("head_kl (sharded) "), "the in-turn row ran too:\n{out}");
    assert!(
        stderr(&o).contains("3 shards of the head on 2 device(s), one thread each"),
        "{}",
        stderr(&o)
    );
    let far = bench_once(&[&args[..], &["--devices", "0,1"]].concat());
    assert_eq!(far.status.code(), Some(2), "{}", stderr(&far));
    assert!(stderr(&far).contains("--devices"), "{}", stderr(&far));
    let alone = bench_once(&["--backend", "reference", "--devices", "0"]);
    assert_eq!(alone.status.code(), Some(2), "{}", stderr(&alone));
    assert!(stderr(&alone).contains("--shards"), "{}", stderr(&alone));
}

/// `--shards 2 --resident` on a GPU backend adds head_kl's two phases on
/// device buffers beside the unsharded resident row.
#[test]
fn bench_shards_resident_reports_the_device_two_phase_row() {
    for backend in ["vulkan", "wgpu"] {
        let o = bench_once(&[
            "--backend",
            backend,
            "--resident",
            "--shape",
            "64:4096:256:16",
            "--shards",
            "2",
        ]);
        if !ran(backend, &o) {
            continue;
        }
        let out = String::from_utf8_lossy(&o.stdout);
        for row in ["head_kl (resident)", "head_kl (sharded resident)", "head_kl (sharded)"] {
            assert!(out.contains(row), "{backend}: no {row} row in:\n{out}");
        }
        return;
    }
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

/// `soak`: bad counts are exit 2 naming the option, before any backend is
/// opened; a short soak on the first GPU backend that starts passes, with
/// a line per path.
#[test]
fn soak_checks_its_options_and_a_short_soak_passes() {
    assert_input_error(&headkl(&["soak", "--calls", "0"]), &["--calls", "at least 1"]);
    assert_input_error(
        &headkl(&["soak", "--calls", "5", "--warmup", "5"]),
        &["--warmup", "below --calls (5)"],
    );
    assert_input_error(
        &headkl(&["soak", "--threads", "2", "--thread-calls", "0"]),
        &["--thread-calls"],
    );
    assert_input_error(
        &headkl(&["soak", "--backend", "reference", "--calls", "3", "--warmup", "1"]),
        &["--backend", "reference"],
    );
    let o = headkl(&[
        "soak",
        "--backend",
        "vulkan",
        "--shape",
        "8:512:32:4",
        "--calls",
        "30",
        "--warmup",
        "5",
        "--threads",
        "2",
        "--thread-calls",
        "3",
    ]);
    let err = stderr(&o);
    if o.status.code() == Some(1)
        && err.contains("cannot start")
        && !std::env::var("HEADKL_REQUIRE").is_ok_and(|r| r.contains("vulkan"))
    {
        eprintln!("soak: vulkan cannot start here (skipped): {err}");
        return;
    }
    assert_eq!(o.status.code(), Some(0), "soak failed:\n{err}");
    for path in ["soak: host ", "soak: resident ", "soak: threads "] {
        assert!(err.contains(path), "no `{path}` line:\n{err}");
    }
    assert!(String::from_utf8_lossy(&o.stdout).contains("soak: passed"));
}
