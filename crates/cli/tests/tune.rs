//! `headkl tune` and the `HEADKL_GEMM` setting: what stops them is named.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::process::Command;

use common::*;

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
    // The CUDA backend times cuBLASLt's candidates itself: refused, with
    // why, before anything opens (so the same here and on an NVIDIA GPU).
    let o = headkl(&["tune", "--backend", "cuda"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--backend") && stderr(&o).contains("cuBLASLt"),
        "{}",
        stderr(&o)
    );

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
