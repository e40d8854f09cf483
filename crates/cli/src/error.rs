//! The command's one error type and how each kind maps to an exit code:
//! bad input (a file, a tensor, an option) exits 2, a device or I/O failure
//! exits 1. An input's error ([`FilesError`], from `headkl-files`) becomes
//! the same kind here with the same text.

use std::path::{Path, PathBuf};

use headkl_core::Error as CoreError;
use headkl_files::FilesError;
use thiserror::Error;

pub(crate) use headkl_files::error::is_validation;

/// Exit code for bad input: a file, tensor or option the user can fix.
pub const EXIT_INPUT: u8 = 2;
/// Exit code for everything else: device, I/O, failed checks.
pub const EXIT_FAILURE: u8 = 1;

/// Everything a `headkl` subcommand can fail with.
#[derive(Debug, Error)]
pub enum CliError {
    /// An input's problem (a file, a tensor, an option: exit 2) or a
    /// device failure met while doing something (exit 1), with
    /// `headkl-files`' text.
    #[error(transparent)]
    Files(#[from] FilesError),
    /// Writing an output file failed.
    #[error("{}: {problem}", file.display())]
    Output {
        /// The output file.
        file: PathBuf,
        /// What went wrong.
        problem: String,
    },
    /// A `HEADKL_*` setting (or an option handed to a backend) that cannot
    /// be used: exit 2, like a bad option.
    #[error("{0}")]
    Setting(CoreError),
    /// A backend could not be opened.
    #[error("cannot start the {backend} backend: {source}")]
    Start {
        /// The backend.
        backend: &'static str,
        /// Why.
        source: CoreError,
    },
    /// `headkl check` found failures or could not start a required backend.
    #[error("{0}")]
    CheckFailed(String),
    /// One of the command's own threads panicked: a bug, not the input.
    #[error("{what} panicked: {message}")]
    Panicked {
        /// Which thread.
        what: String,
        /// The panic's message.
        message: String,
    },
}

impl CliError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Files(e) if e.is_input() => EXIT_INPUT,
            CliError::Setting(_) => EXIT_INPUT,
            CliError::Files(_)
            | CliError::Start { .. }
            | CliError::Output { .. }
            | CliError::CheckFailed(_)
            | CliError::Panicked { .. } => EXIT_FAILURE,
        }
    }

    /// A problem with the whole of `file`.
    pub fn file(file: &Path, problem: impl Into<String>) -> Self {
        FilesError::file(file, problem).into()
    }

    /// A problem with an option's value.
    pub fn option(option: &'static str, problem: impl Into<String>) -> Self {
        FilesError::option(option, problem).into()
    }

    /// Thread `what` panicked with `payload` (what `JoinHandle::join`
    /// returns): exit 1 with the panic's message.
    pub fn panicked(what: impl Into<String>, payload: Box<dyn std::any::Any + Send>) -> Self {
        let message = headkl_core::toolkit::panic_message(&*payload);
        CliError::Panicked {
            what: what.into(),
            message,
        }
    }

    /// A device-side failure while doing `context`.
    pub fn device(context: impl Into<String>, source: CoreError) -> Self {
        FilesError::device(context, source).into()
    }

    /// A backend that did not open: a bad setting (exit 2) when the error is
    /// about the input, else a start failure (exit 1).
    pub fn start(backend: &'static str, source: CoreError) -> Self {
        if is_validation(&source) {
            CliError::Setting(source)
        } else {
            CliError::Start { backend, source }
        }
    }

    /// A core error caused by option `option`: input when it is a validation
    /// error, a device error otherwise.
    pub fn from_core_in_option(source: CoreError, option: &'static str) -> Self {
        FilesError::in_option(source, option).into()
    }
}

/// Joins scoped threads in the order given: each thread's result, or for
/// one that panicked, [`CliError::panicked`] under `name(index)`.
pub(crate) fn join_in_order<T, C: FromIterator<Result<T, CliError>>>(
    threads: Vec<std::thread::ScopedJoinHandle<'_, Result<T, CliError>>>,
    name: impl Fn(usize) -> String,
) -> C {
    threads
        .into_iter()
        .enumerate()
        .map(|(i, thread)| {
            thread
                .join()
                .unwrap_or_else(|payload| Err(CliError::panicked(name(i), payload)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_thread_is_a_failure_with_its_message_not_bad_input() {
        let payload = std::thread::spawn(|| panic!("shard ran out of {}", "luck"))
            .join()
            .unwrap_err();
        let e = CliError::panicked("shard 1's thread", payload);
        assert_eq!(e.exit_code(), EXIT_FAILURE);
        assert_eq!(e.to_string(), "shard 1's thread panicked: shard ran out of luck");
        let payload = std::thread::spawn(|| std::panic::panic_any(7u8)).join().unwrap_err();
        assert_eq!(
            CliError::panicked("t", payload).to_string(),
            "t panicked: a panic without a message"
        );
    }

    #[test]
    fn an_input_error_keeps_its_text_and_exits_2_and_a_device_error_exits_1() {
        let t = Path::new("t.safetensors");
        let bad_id = CoreError::IdOutOfRange {
            row: 1,
            col: 2,
            id: 900,
            vocab: 300,
        };
        let oom = CoreError::OutOfMemory {
            bytes: 1 << 30,
            what: "logits",
        };
        for files in [
            FilesError::file(t, "truncated"),
            FilesError::in_tensor(bad_id, t, "ids"),
            FilesError::in_option(CoreError::BudgetZero, "--budget"),
            FilesError::in_tensor(oom, t, "ids"),
            FilesError::in_option(CoreError::DeviceLost("gone".into()), "--budget"),
        ] {
            let (text, input) = (files.to_string(), files.is_input());
            let e = CliError::from(files);
            assert_eq!(e.to_string(), text);
            assert_eq!(e.exit_code(), if input { EXIT_INPUT } else { EXIT_FAILURE }, "{text}");
        }
        assert_eq!(
            CliError::from_core_in_option(CoreError::DeviceLost("gone".into()), "--budget").exit_code(),
            EXIT_FAILURE
        );
        assert_eq!(
            CliError::from_core_in_option(CoreError::BudgetZero, "--budget").exit_code(),
            EXIT_INPUT
        );
    }
}
