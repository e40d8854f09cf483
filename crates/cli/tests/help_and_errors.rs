//! What every command shares: exit codes and messages, signals, help text,
//! `--quiet` and traces, and the README's install line.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::fs;
use std::process::Command;

use safetensors::Dtype;

use common::*;

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

#[test]
fn readme_says_how_to_install() {
    let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"));
    assert!(readme.contains("cargo install --path crates/cli"));
}
