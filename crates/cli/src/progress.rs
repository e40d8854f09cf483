//! Progress on stderr: on a terminal, an indicatif bar with the elapsed
//! time and an estimate of what is left; nothing when stderr is not a
//! terminal (a log, a pipe, CI) or with `--quiet`.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// `--quiet`: no progress bars even on a terminal.
static QUIET: AtomicBool = AtomicBool::new(false);

/// Turns progress bars off for the rest of the process (`--quiet`).
pub fn set_quiet(quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
}

/// Whether bars are drawn: stderr is a terminal and `--quiet` is off.
pub fn shown() -> bool {
    !QUIET.load(Ordering::Relaxed) && std::io::stderr().is_terminal()
}

/// A progress report over `total` steps.
pub struct Progress {
    bar: ProgressBar,
    interactive: bool,
}

impl Progress {
    /// Starts a report over `total` steps, labelled `label`.
    pub fn new(label: impl Into<String>, total: u64) -> Self {
        Self::with_template(
            label.into(),
            total,
            "{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} (about {eta} left) {msg}",
        )
    }

    /// A report over `total` steps whose time left is the caller's, in its
    /// [`Progress::message`] (indicatif's own estimate knows nothing before
    /// the first step ends, and then counts a first step's one-off costs).
    pub fn new_estimated(label: impl Into<String>, total: u64) -> Self {
        Self::with_template(
            label.into(),
            total,
            "{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}",
        )
    }

    /// A report drawn with indicatif's `template` when bars are shown.
    fn with_template(label: String, total: u64, template: &str) -> Self {
        let interactive = shown();
        let bar = if interactive {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template(template) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_prefix(label);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        } else {
            ProgressBar::hidden()
        };
        Self { bar, interactive }
    }

    /// Sets the message shown beside the bar (what is running now).
    pub fn message(&self, msg: impl Into<String>) {
        self.bar.set_message(msg.into());
    }

    /// Prints a line above the bar (or plainly, without a terminal): for
    /// what must be seen either way, such as a failure.
    pub fn println(&self, line: impl AsRef<str>) {
        if self.interactive {
            self.bar.println(line);
        } else {
            eprintln!("{}", line.as_ref());
        }
    }

    /// One step done (`what` names it, for callers that log it).
    pub fn inc(&mut self, _what: &str) {
        self.bar.inc(1);
    }

    /// `n` steps done.
    pub fn inc_by(&mut self, n: u64) {
        self.bar.inc(n);
    }

    /// A callback that advances the bar by the steps it is given: for
    /// [`headkl_core::Engine::set_progress`], which reports each chunk.
    pub fn callback(&self) -> headkl_core::ProgressCallback {
        let bar = self.bar.clone();
        Box::new(move |n| bar.inc(n as u64))
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::Progress;

    #[test]
    fn the_callback_advances_the_bar() {
        let p = Progress::new("test", 10);
        let callback = p.callback();
        callback(3);
        callback(4);
        assert_eq!(p.bar.position(), 7);
    }
}
