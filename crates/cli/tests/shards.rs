//! `--shards N`: `loss` and `topk` write the unsharded files, and `bench`
//! reports the sharded rows beside the unsharded ones.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::fs;
use std::path::Path;

use safetensors::SafeTensors;

use common::*;

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
