//! `headkl soak`: its options, and a short soak on a GPU backend.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use common::*;

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
