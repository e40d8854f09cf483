//! The command's logger: what the libraries and the command log (`log`
//! crate) goes to stderr as one line per record. Info and above by default
//! (what `auto` picked, the device a job runs on, `HEADKL_TRACE`'s phases,
//! `HEADKL_PIPELINE_STATS`); `--quiet` keeps warnings and errors only.

use log::{Level, LevelFilter, Log, Metadata, Record};

struct StderrLogger;

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        // The command's own informational lines carry their prefix
        // (`headkl:`, `bench:`); its warnings get `headkl: warning:`; a
        // library's lines get its crate's name.
        let crate_name = record.target().split("::").next().unwrap_or("");
        let own = crate_name == "headkl" || crate_name == "headkl_cli";
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

/// Installs the logger: info and above, or warnings and errors only when
/// `quiet`. A second call only changes the level.
pub fn install(quiet: bool) {
    static LOGGER: StderrLogger = StderrLogger;
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(if quiet { LevelFilter::Warn } else { LevelFilter::Info });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_keeps_warnings_only() {
        install(true);
        assert!(!log::log_enabled!(Level::Info));
        assert!(log::log_enabled!(Level::Warn));
        install(false);
        assert!(log::log_enabled!(Level::Info));
        assert!(!log::log_enabled!(Level::Debug));
    }
}
