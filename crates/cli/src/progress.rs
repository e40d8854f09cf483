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
        let interactive = shown();
        let bar = if interactive {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template(
                "{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} (about {eta} left) {msg}",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_prefix(label.into());
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        } else {
            ProgressBar::hidden()
        };
        Self { bar, interactive }
    }

    /// A report over `total` steps whose time left is the caller's, in its
    /// [`Progress::message`] (indicatif's own estimate knows nothing before
    /// the first step ends, and then counts a first step's one-off costs).
    pub fn new_estimated(label: impl Into<String>, total: u64) -> Self {
        let interactive = shown();
        let bar = if interactive {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}") {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_prefix(label.into());
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

/// Row ranges `[start, end)` that split `ntok` rows into about 20 pieces
/// of at least `min_rows` each, so a long job shows progress while each
/// call stays large enough to keep the device busy. One piece when the
/// bar is not shown: the result does not depend on it either way.
pub fn pieces(ntok: usize, min_rows: usize) -> Vec<(usize, usize)> {
    split(ntok, min_rows, shown())
}

fn split(ntok: usize, min_rows: usize, shown: bool) -> Vec<(usize, usize)> {
    let per = if shown {
        ntok.div_ceil(20).max(min_rows).max(1)
    } else {
        ntok.max(1)
    };
    (0..ntok).step_by(per).map(|a| (a, (a + per).min(ntok))).collect()
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn pieces_cover_every_row_once() {
        assert_eq!(split(1000, 256, false), vec![(0, 1000)]);
        assert_eq!(
            split(1000, 256, true),
            vec![(0, 256), (256, 512), (512, 768), (768, 1000)]
        );
        let big = split(100_000, 256, true);
        assert_eq!(big.len(), 20);
        assert!(big.windows(2).all(|w| w[0].1 == w[1].0));
        assert_eq!((big[0].0, big[19].1), (0, 100_000));
        assert!(split(0, 256, true).is_empty());
    }
}
