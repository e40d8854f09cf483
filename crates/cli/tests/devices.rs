//! `headkl devices` and device selection: the auto row, a device that does
//! not exist, a backend that cannot start, and a quiet end when the reader
//! goes away.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::process::Command;

use common::*;

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
    // No Vulkan driver, and no CUDA device visible where CUDA is installed.
    let no_driver = [
        ("VK_ICD_FILENAMES", "/nonexistent/icd.json"),
        ("VK_DRIVER_FILES", "/nonexistent/icd.json"),
        ("CUDA_VISIBLE_DEVICES", ""),
    ];
    for backend in ["cuda", "wgpu", "vulkan"] {
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
    assert!(out.contains("on 1 backend(s)") && out.contains("3 skipped"), "{out}");
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
    for b in ["cuda", "vulkan", "wgpu", "reference"] {
        assert!(rows.iter().any(|r| r["backend"] == b), "no row for {b}: {v}");
    }
    let o = headkl(&["devices"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("auto picks"));
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
