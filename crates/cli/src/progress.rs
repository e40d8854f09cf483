//! Progress on stderr: an indicatif bar on a terminal; otherwise (a log, a
//! CI job) one line about every 10%, so long runs still show progress.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress report over `total` steps.
pub struct Progress {
    bar: ProgressBar,
    label: String,
    total: u64,
    done: u64,
    /// Next decile to print when there is no terminal.
    next_decile: u64,
    interactive: bool,
    started: Instant,
}

impl Progress {
    /// Starts a report over `total` steps, labelled `label`.
    pub fn new(label: impl Into<String>, total: u64) -> Self {
        let interactive = std::io::stderr().is_terminal();
        let label = label.into();
        let bar = if interactive {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}") {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_prefix(label.clone());
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        } else {
            ProgressBar::hidden()
        };
        Self {
            bar,
            label,
            total,
            done: 0,
            next_decile: 1,
            interactive,
            started: Instant::now(),
        }
    }

    /// Sets the message shown beside the bar (what is running now).
    pub fn message(&self, msg: impl Into<String>) {
        self.bar.set_message(msg.into());
    }

    /// Prints a line above the bar (or plainly, without a terminal).
    pub fn println(&self, line: impl AsRef<str>) {
        if self.interactive {
            self.bar.println(line);
        } else {
            eprintln!("{}", line.as_ref());
        }
    }

    /// One step done; `what` names it for the log lines.
    pub fn inc(&mut self, what: &str) {
        self.done += 1;
        self.bar.inc(1);
        if self.interactive || self.total == 0 {
            return;
        }
        // Print when crossing each 10% mark (or every step for short runs).
        let reached = self.done * 10 / self.total;
        if reached >= self.next_decile || self.done == self.total {
            self.next_decile = reached + 1;
            eprintln!(
                "{}: {}/{} ({}%) {:.1}s {}",
                self.label,
                self.done,
                self.total,
                self.done * 100 / self.total,
                self.started.elapsed().as_secs_f64(),
                what
            );
        }
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
