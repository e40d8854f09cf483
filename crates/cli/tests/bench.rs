//! `headkl bench` (unsharded): the JSON report and plot, the loss options,
//! the device-resident rows, `--all`, and the refusal of hours of CPU work.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::fs;

use common::*;

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
