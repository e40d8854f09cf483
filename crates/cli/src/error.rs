//! The command's one error type and how each kind maps to an exit code:
//! bad input (a file, a tensor, an option) exits 2, a device or I/O failure
//! exits 1.

use std::path::{Path, PathBuf};

use headkl_core::{Error as CoreError, ErrorKind};
use thiserror::Error;

/// Exit code for bad input: a file, tensor or option the user can fix.
pub const EXIT_INPUT: u8 = 2;
/// Exit code for everything else: device, I/O, failed checks.
pub const EXIT_FAILURE: u8 = 1;

/// `text` with its control characters escaped (`\n`, `\u{1b}`): an error is
/// one line, whatever a file's tensor names or metadata hold.
fn one_line(text: String) -> String {
    if !text.chars().any(char::is_control) {
        return text;
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Everything a `headkl` subcommand can fail with.
#[derive(Debug, Error)]
pub enum CliError {
    /// A whole input file is unusable (missing, truncated, corrupt).
    #[error("{}: {problem}", file.display())]
    File {
        /// The file.
        file: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// One tensor of an input file is unusable (missing, wrong dtype or
    /// shape, bad values).
    #[error("{}: tensor `{tensor}`: {problem}", file.display())]
    Tensor {
        /// The file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A command-line option has a value the job cannot use.
    #[error("{option}: {problem}")]
    Option {
        /// The option, as written on the command line.
        option: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// The device failed (out of memory, lost, missing feature, no device).
    #[error("{context}: {source}")]
    Device {
        /// What was being done.
        context: String,
        /// The backend's error.
        source: CoreError,
    },
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
            CliError::File { .. } | CliError::Tensor { .. } | CliError::Option { .. } | CliError::Setting(_) => {
                EXIT_INPUT
            }
            CliError::Device { .. }
            | CliError::Start { .. }
            | CliError::Output { .. }
            | CliError::CheckFailed(_)
            | CliError::Panicked { .. } => EXIT_FAILURE,
        }
    }

    /// A problem with tensor `tensor` of `file`.
    pub fn tensor(file: &Path, tensor: &str, problem: impl Into<String>) -> Self {
        CliError::Tensor {
            file: file.to_path_buf(),
            tensor: one_line(tensor.to_string()),
            problem: one_line(problem.into()),
        }
    }

    /// A problem with the whole of `file`.
    pub fn file(file: &Path, problem: impl Into<String>) -> Self {
        CliError::File {
            file: file.to_path_buf(),
            problem: one_line(problem.into()),
        }
    }

    /// A problem with an option's value.
    pub fn option(option: &'static str, problem: impl Into<String>) -> Self {
        CliError::Option {
            option,
            problem: one_line(problem.into()),
        }
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
        CliError::Device {
            context: context.into(),
            source,
        }
    }

    /// A core error found in tensor `tensor` of `file`: input when it is a
    /// validation error, a device error otherwise.
    pub fn from_core_in_tensor(source: CoreError, file: &Path, tensor: &str) -> Self {
        if is_validation(&source) {
            Self::tensor(file, tensor, source.to_string())
        } else {
            Self::device(format!("{}: tensor `{tensor}`", file.display()), source)
        }
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
        if is_validation(&source) {
            Self::option(option, source.to_string())
        } else {
            Self::device(option, source)
        }
    }
}

/// Whether a core error is about the input or a setting (fixable by the
/// user, exit 2) rather than the device or a bug (exit 1): the core
/// classifies each error where it is defined ([`CoreError::kind`]).
pub fn is_validation(e: &CoreError) -> bool {
    match e.kind() {
        ErrorKind::Input | ErrorKind::Setting => true,
        ErrorKind::Device | ErrorKind::Internal => false,
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
    fn validation_errors_exit_2_and_device_errors_exit_1() {
        let bad_id = CoreError::IdOutOfRange {
            row: 1,
            col: 2,
            id: 900,
            vocab: 300,
        };
        let e = CliError::from_core_in_tensor(bad_id, Path::new("t.safetensors"), "ids");
        assert_eq!(e.exit_code(), EXIT_INPUT);
        let text = e.to_string();
        assert!(
            text.contains("t.safetensors") && text.contains("`ids`") && text.contains("900"),
            "{text}"
        );

        let oom = CoreError::OutOfMemory {
            bytes: 1 << 30,
            what: "logits",
        };
        let e = CliError::from_core_in_tensor(oom, Path::new("t.safetensors"), "ids");
        assert_eq!(e.exit_code(), EXIT_FAILURE);
        assert!(e.to_string().contains("out of device memory"));
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
