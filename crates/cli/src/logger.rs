//! The command's logger: what the libraries and the command log (`log`
//! crate) goes to stderr as one line per record. Info and above by default
//! (what `auto` picked, the device a job runs on); `--quiet` keeps warnings
//! and errors only, and the diagnostics the user switched on
//! (`HEADKL_TRACE`, `HEADKL_PIPELINE_STATS`:
//! [`headkl_core::DIAGNOSTICS_LOG_TARGET`]), printed as they are.

use std::sync::atomic::{AtomicBool, Ordering};

use headkl_core::DIAGNOSTICS_LOG_TARGET;
use log::{Level, LevelFilter, Log, Metadata, Record};

/// `--quiet`.
static QUIET: AtomicBool = AtomicBool::new(false);

struct StderrLogger;

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        let level = if QUIET.load(Ordering::Relaxed) && metadata.target() != DIAGNOSTICS_LOG_TARGET {
            Level::Warn
        } else {
            Level::Info
        };
        metadata.level() <= level
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        if record.target() == DIAGNOSTICS_LOG_TARGET {
            eprintln!("{}", record.args());
            return;
        }
        // The command's own informational lines carry their prefix
        // (`headkl:`, `bench:`); its warnings get `headkl: warning:`; a
        // library's lines get its crate's name. The input checks
        // (`headkl_files`: a teacher file's metadata) speak for the command.
        let crate_name = record.target().split("::").next().unwrap_or("");
        let own = matches!(crate_name, "headkl" | "headkl_cli" | "headkl_files");
        let level = match record.level() {
            Level::Error => "error: ",
            Level::Warn => "warning: ",
            Level::Info | Level::Debug | Level::Trace => "",
        };
        let prefix = match (own, level.is_empty()) {
            (true, true) => String::new(),
            (true, false) => "headkl: ".to_string(),
            (false, _) => format!("{crate_name}: "),
        };
        eprintln!("{prefix}{level}{}", record.args());
    }

    fn flush(&self) {}
}

/// Installs the logger: info and above, or warnings, errors and the
/// switched-on diagnostics only when `quiet`. A second call only changes
/// that.
pub fn install(quiet: bool) {
    static LOGGER: StderrLogger = StderrLogger;
    QUIET.store(quiet, Ordering::Relaxed);
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(LevelFilter::Info);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_keeps_warnings_and_asked_for_diagnostics() {
        install(true);
        assert!(!log::log_enabled!(Level::Info));
        assert!(log::log_enabled!(Level::Warn));
        assert!(log::log_enabled!(target: DIAGNOSTICS_LOG_TARGET, Level::Info));
        install(false);
        assert!(log::log_enabled!(Level::Info));
        assert!(!log::log_enabled!(Level::Debug));
    }
}
