//! What the `headkl` command's integration tests share: running the binary,
//! temporary folders, the small problem every test uses written as
//! safetensors files, and readers and checks of the outputs.
//!
//! The tests run the `headkl` binary: every bad input gets a one-line error
//! naming the file, tensor and problem with exit code 2; the happy paths match
//! `headkl_reference::direct`; outputs are never clobbered by a failed run.

#![allow(
    dead_code,
    reason = "each test file is its own crate and uses only some of these helpers"
)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use headkl_core::{LossConfig, LossOptions};
use headkl_reference::direct::DirectLoss;
use headkl_reference::Tolerance;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

pub const VOCAB: usize = 300;
pub const HS: usize = 24;
pub const NTOK: usize = 5;
pub const K: usize = 4;

/// A fresh directory for one test.
pub fn temp_dir(tag: &str) -> PathBuf {
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
pub struct T(pub &'static str, pub Dtype, pub Vec<usize>, pub Vec<u8>);

pub fn f32s(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub fn i64s(v: &[i64]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub fn write_st(path: &Path, tensors: &[T]) {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|t| (t.0, TensorView::new(t.1, t.2.clone(), &t.3).unwrap()))
        .collect();
    fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Deterministic values without ties (an LCG), scaled to `a`.
pub fn values(n: usize, seed: u64, a: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
        })
        .collect()
}

/// The small problem every test uses.
pub struct Fixture {
    pub dir: PathBuf,
    pub head: Vec<f32>,
    pub hidden: Vec<f32>,
    pub ids: Vec<i64>,
    pub probs: Vec<f32>,
}

impl Fixture {
    pub fn new(tag: &str) -> Self {
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

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn write_head(&self, name: &str, tensor: &'static str) {
        write_st(
            &self.path(name),
            &[T(tensor, Dtype::F32, vec![VOCAB, HS], f32s(&self.head))],
        );
    }

    pub fn write_teacher(&self, name: &str, ids: &[i64], probs: &[f32]) -> PathBuf {
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
    pub fn args<'a>(&self, command: &'a str, backend: &'a str, head: &str, hidden: &str) -> Vec<&'a str> {
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
    pub fn run(&self, command: &str, head: &str, hidden: &str, extra: &[&str]) -> Output {
        self.run_on("reference", command, head, hidden, extra)
    }

    /// [`Fixture::run`] on `backend`.
    pub fn run_on(&self, backend: &str, command: &str, head: &str, hidden: &str, extra: &[&str]) -> Output {
        let mut args = self.args(command, backend, head, hidden);
        args.extend(extra);
        headkl(&args)
    }

    /// Runs `headkl loss` on the reference with `teacher` and extra args.
    pub fn loss(&self, teacher: &str, extra: &[&str]) -> Output {
        self.loss_into(teacher, self.s("out.safetensors"), extra)
    }

    /// [`Fixture::loss`] into the file at path `out`.
    pub fn loss_into(&self, teacher: &str, out: &str, extra: &[&str]) -> Output {
        let mut args = vec!["--teacher", self.s(teacher), "--out", out];
        args.extend(extra);
        self.run("loss", "head.safetensors", "hidden.safetensors", &args)
    }

    /// Runs `headkl topk -k 3` on the reference with files `head` and
    /// `hidden` into `o.safetensors`, then `extra`.
    pub fn topk3(&self, head: &str, hidden: &str, extra: &[&str]) -> Output {
        let mut args = vec!["-k", "3", "--out", self.s("o.safetensors")];
        args.extend(extra);
        self.run("topk", head, hidden, &args)
    }

    pub fn s(&self, name: &str) -> &'static str {
        // Leaked: tests are short-lived and this keeps argument lists simple.
        Box::leak(self.path(name).to_str().unwrap().to_string().into_boxed_str())
    }

    /// Runs `headkl topk` on the reference into `out` with extra args.
    pub fn topk(&self, out: &str, extra: &[&str]) -> Output {
        self.topk_k(out, K, extra)
    }

    /// Runs `headkl topk -k k` on the reference with extra args.
    pub fn topk_k(&self, out: &str, k: usize, extra: &[&str]) -> Output {
        let k = k.to_string();
        let mut args = vec!["-k", &k, "--out", self.s(out)];
        args.extend(extra);
        self.run("topk", "head.safetensors", "hidden.safetensors", &args)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

pub fn headkl(args: &[&str]) -> Output {
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
pub fn bench_once(args: &[&str]) -> Output {
    headkl(&[&["bench"], args, &["--iters", "1", "--warmup", "0"]].concat())
}

/// A JSON file's value.
pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The `mean loss: ` line a `loss` run printed, as a number.
pub fn printed_mean(o: &Output) -> f64 {
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
pub fn check_loss_file(st: &SafeTensors<'_>, mean: f64, want: &DirectLoss) {
    let tol = Tolerance::default();
    tol.check_loss(&tensor_f32(st, "loss"), mean, want).unwrap();
    tol.check_dx_rows(&tensor_f32(st, "grad"), &want.dx, Some(HS)).unwrap();
}

/// The mean of a `loss` output file's per-token `loss`.
pub fn loss_mean(st: &SafeTensors<'_>) -> f64 {
    tensor_f32(st, "loss").iter().map(|&l| f64::from(l)).sum::<f64>() / NTOK as f64
}

/// The divergence tests' options: `divergence` at τ = 1.5.
pub fn divergence_at_tau_1_5(divergence: headkl_core::Divergence) -> LossOptions {
    LossOptions::from(LossConfig {
        temperature: 1.5,
        terms: headkl_core::LossTerms {
            divergence,
            ..headkl_core::LossTerms::default()
        },
        ..LossConfig::default()
    })
}

/// Exit 2, a one-line error containing every needle, no panic.
pub fn assert_input_error(o: &Output, needles: &[&str]) {
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

/// Whether a run on `backend` is to be checked: false, with the reason
/// printed, when the backend could not start and `HEADKL_REQUIRE` does not
/// name it; otherwise the run must have exited 0.
pub fn ran(backend: &str, o: &Output) -> bool {
    let err = stderr(o);
    if o.status.code() == Some(1) && err.contains("cannot start") && !required(backend) {
        println!("{backend}: skipped, cannot start: {}", err.trim());
        return false;
    }
    assert_eq!(o.status.code(), Some(0), "{backend}: {err}");
    true
}

/// Whether `HEADKL_REQUIRE` (of the test run) names `backend`.
pub fn required(backend: &str) -> bool {
    headkl_conformance::harness_suite().requires(backend)
}

/// Copies little-endian tensor bytes into a vector (the data may be
/// unaligned).
pub fn pod_vec<P: bytemuck::Pod>(data: &[u8]) -> Vec<P> {
    let mut v = vec![P::zeroed(); data.len() / std::mem::size_of::<P>()];
    bytemuck::cast_slice_mut::<P, u8>(&mut v).copy_from_slice(data);
    v
}

pub fn tensor_f32(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32);
    pod_vec(t.data())
}

/// A `topk` output's ids (I64 `[NTOK][k]`, as u32) and probabilities.
pub fn read_topk(path: &Path, k: usize) -> (Vec<u32>, Vec<f32>) {
    let bytes = fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids_t = st.tensor("ids").unwrap();
    assert_eq!(ids_t.dtype(), Dtype::I64);
    assert_eq!(ids_t.shape(), &[NTOK, k]);
    let ids: Vec<i64> = pod_vec(ids_t.data());
    let ids = ids.iter().map(|&i| u32::try_from(i).unwrap()).collect();
    (ids, tensor_f32(&st, "probs"))
}

/// The `__metadata__` of a safetensors file.
pub fn metadata(path: &Path) -> std::collections::HashMap<String, String> {
    let bytes = fs::read(path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap_or_default()
}
