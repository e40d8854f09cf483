//! `headkl check`: the conformance suite on the reference and the GPU backends.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use common::*;

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
