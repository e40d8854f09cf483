//! The test harness every backend's tests share: the settings a test runs
//! with, a logger, opening a backend or skipping it, and the per-backend
//! record `scripts/test.sh` prints after `cargo test`.
//!
//! libtest captures what a passing test prints, so a `SKIP` line or a
//! suite's summary would never be seen after a plain `cargo test`. Each
//! conformance test (and each skip) therefore also appends one line to a
//! file under the build folder (`target/<profile>/headkl-tests/`), and the
//! README's test command (`scripts/test.sh`) prints one line per backend
//! from those files once the tests are done.

use std::io::Write;
use std::path::PathBuf;

use headkl_core::toolkit::Env;

use super::{CaseOutcome, SuiteReport, SuiteSettings};

/// The environment a test harness reads its settings from, after giving
/// the process a private runtime folder where `XDG_RUNTIME_DIR` is unset
/// (so Mesa does not complain on every enumeration) and installing the
/// harness's logger. Each consumer parses its own section from it
/// (`VulkanOptions::from_env`, `OpenOptions::from_env`, [`harness_suite`]);
/// a setting that does not parse fails the test: a typo in `HEADKL_GEMM`
/// must not pass.
pub fn harness_env() -> Env {
    ensure_runtime_dir();
    install_logger();
    Env::process()
}

/// The suite's settings for a test harness ([`harness_env`]); panics on a
/// value that does not parse.
pub fn harness_suite() -> SuiteSettings {
    match SuiteSettings::from_env(&harness_env()) {
        Ok(s) => s,
        Err(e) => panic!("bad setting: {e}"),
    }
}

/// Opens a backend for a test: on failure says `SKIP <name>: <error>`
/// (on stderr, past libtest's capture, and in the record
/// `scripts/test.sh` prints) and returns `None`, unless `HEADKL_REQUIRE`
/// (a comma list) names the backend, in which case it panics (the test
/// fails).
pub fn open_or_skip<B>(backend_name: &str, open: impl FnOnce() -> headkl_core::Result<B>) -> Option<B> {
    // Before `open` enumerates anything (see `harness_env`).
    let settings = harness_suite();
    match open() {
        Ok(b) => Some(b),
        Err(e) => {
            if settings.requires(backend_name) {
                panic!("{backend_name} is required (HEADKL_REQUIRE) but could not start: {e}");
            }
            let reason = one_line(&e.to_string());
            // `std::io::stderr()` written directly is not captured by
            // libtest (only the print macros are), so this shows in a plain
            // `cargo test` run.
            let _ = writeln!(std::io::stderr(), "SKIP {backend_name}: {reason}");
            record(&format!("{backend_name}\tskipped\t{reason}"));
            None
        }
    }
}

/// A conformance test's run, the part every such test shares: opens the
/// backend (or skips it: `None`), runs `suite` on it with each failure
/// logged as it comes, logs the summary as `conformance <label>: …` and
/// records the run as `part` for `scripts/test.sh`. The caller judges the
/// report.
pub(crate) fn run_recorded<B>(
    backend_name: &str,
    open: impl FnOnce() -> headkl_core::Result<B>,
    label: &str,
    part: &str,
    suite: impl FnOnce(&B, &mut dyn FnMut(&CaseOutcome)) -> SuiteReport,
) -> Option<SuiteReport> {
    let backend = open_or_skip(backend_name, open)?;
    let report = suite(&backend, &mut |o| {
        if !o.passed {
            log::error!("FAIL {}: {}\n    {}", o.name, o.description, o.message);
        }
    });
    log::info!("conformance {label}: {}", report.summary());
    record_ran(&report.backend, &report.device, part, report.passed, report.cases);
    Some(report)
}

/// Panics unless `report` ran `cases` cases (`<what> cases run`) and all
/// passed (`<n> <what> case(s) failed:` and a `name: message` line each).
pub(crate) fn assert_all_passed(report: &SuiteReport, cases: usize, what: &str) {
    assert_eq!(report.cases, cases, "{what} cases run");
    let failed = report.failure_lines();
    assert!(
        failed.is_empty(),
        "{} {what} case(s) failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// Records that a conformance test ran `part` on `backend` (`device`):
/// `passed` of `cases` cases.
fn record_ran(backend: &str, device: &str, part: &str, passed: usize, cases: usize) {
    record(&format!(
        "{backend}\tran\t{}\t{part}\t{passed}\t{cases}",
        one_line(device)
    ));
}

/// Tabs and line breaks would break the record's columns.
fn one_line(s: &str) -> String {
    s.replace(['\t', '\n', '\r'], " ")
}

/// Where the records go: `headkl-tests/` in the profile's folder of the
/// build (a test binary runs from `target/<profile>/deps/`).
fn record_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    if deps.file_name()? != "deps" {
        return None; // not a cargo test binary (e.g. a doc test): no record
    }
    Some(deps.parent()?.join("headkl-tests"))
}

/// Appends `line` to this process's record file. Best effort: a record
/// that cannot be written costs the summary a line, never a test.
fn record(line: &str) {
    let Some(dir) = record_dir() else { return };
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let path = dir.join(format!("{}.tsv", std::process::id()));
    if let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        // One write per line: lines of the process's parallel tests do not
        // interleave.
        let _ = file.write_all(format!("{line}\n").as_bytes());
    }
}

/// The harness's logger: each record as one line through `eprintln!`, so
/// libtest shows it for a failing test or with `--nocapture`. Info and
/// above; `HEADKL_TRACE`'s lines are info.
struct HarnessLogger;

impl log::Log for HarnessLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            eprintln!("{}: {}", record.target(), record.args());
        }
    }

    fn flush(&self) {}
}

/// Installs [`HarnessLogger`] unless the process has a logger already.
fn install_logger() {
    static LOGGER: HarnessLogger = HarnessLogger;
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}

/// Gives the process a private runtime folder when `XDG_RUNTIME_DIR` is
/// unset or unusable, before anything loads Vulkan: Mesa's drivers print
/// "error: XDG_RUNTIME_DIR is invalid or not set" on every enumeration
/// otherwise, which reads like a headkl error on a headless machine. The
/// folder is `headkl-runtime-<uid or user>` under the temp folder, mode 0700.
/// It sets `XDG_RUNTIME_DIR`, so only a program's entry (the `headkl`
/// command) or a test harness calls it, before threads that read the
/// environment start; the libraries never do.
pub fn ensure_runtime_dir() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let usable = std::env::var_os("XDG_RUNTIME_DIR")
            .filter(|d| !d.is_empty())
            .is_some_and(|d| std::path::Path::new(&d).is_dir());
        if usable {
            return;
        }
        let owner = std::env::var("USER").unwrap_or_else(|_| "user".into());
        let dir = std::env::temp_dir().join(format!("headkl-runtime-{owner}"));
        if make_private_dir(&dir).is_ok() {
            // Edition 2021: `set_var` is safe to call; done once, early.
            std::env::set_var("XDG_RUNTIME_DIR", &dir);
        }
    });
}

fn make_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                // A link, or a folder others can read, is not a private one
                // (another user's 0700 folder is unwritable to us: Mesa then
                // just says so, as without this).
                let meta = std::fs::symlink_metadata(dir)?;
                if meta.is_dir() && meta.permissions().mode() & 0o077 == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::other("runtime folder is not private"))
                }
            }
            Err(e) => Err(e),
        }
    }
    #[cfg(not(unix))]
    {
        std::fs::create_dir_all(dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn runtime_dir_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("headkl-settings-rt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let dir = base.join("mine");
        make_private_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
        // Made already and still private: fine; readable by others: refused.
        make_private_dir(&dir).unwrap();
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(make_private_dir(&open).is_err());
        let _ = std::fs::remove_dir_all(&base);
    }
}
