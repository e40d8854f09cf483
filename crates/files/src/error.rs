//! The crate's one error type: what is wrong with an input, naming its file
//! and tensor (or the option that named it), on one line.

use std::path::{Path, PathBuf};

use headkl_core::{Error as CoreError, ErrorKind};
use thiserror::Error;

/// `text` with its control characters escaped (`\n`, `\u{1b}`): an error is
/// one line, whatever a file's tensor names or metadata hold.
pub fn one_line(text: String) -> String {
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

/// Whether a core error is about the input or a setting (fixable by the
/// user) rather than the device or a bug: the core classifies each error
/// where it is defined ([`CoreError::kind`]).
pub fn is_validation(e: &CoreError) -> bool {
    match e.kind() {
        ErrorKind::Input | ErrorKind::Setting => true,
        ErrorKind::Device | ErrorKind::Internal => false,
    }
}

/// What reading or checking an input can fail with. Every variant but
/// [`FilesError::Device`] is bad input ([`FilesError::is_input`]): the
/// `headkl` command exits 2 with the message as it is.
#[derive(Debug, Error)]
pub enum FilesError {
    /// A whole input file is unusable (missing, truncated, corrupt, or its
    /// metadata does not match the run).
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
    /// An option's value does not fit the inputs (a core error that
    /// [`crate::sources::Sources`] traces to an option, not a file).
    #[error("{option}: {problem}")]
    Option {
        /// The option, as written on the command line.
        option: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A core error that is not about the input (the device failed, or a
    /// bug), met while doing `context`.
    #[error("{context}: {source}")]
    Device {
        /// What was being done.
        context: String,
        /// The core's error.
        source: CoreError,
    },
}

impl FilesError {
    /// Whether the error is the input's (a file, tensor or option the user
    /// can fix) rather than the device's.
    pub fn is_input(&self) -> bool {
        match self {
            FilesError::File { .. } | FilesError::Tensor { .. } | FilesError::Option { .. } => true,
            FilesError::Device { .. } => false,
        }
    }

    /// A problem with the whole of `file`.
    pub fn file(file: &Path, problem: impl Into<String>) -> Self {
        FilesError::File {
            file: file.to_path_buf(),
            problem: one_line(problem.into()),
        }
    }

    /// A problem with tensor `tensor` of `file`.
    pub fn tensor(file: &Path, tensor: &str, problem: impl Into<String>) -> Self {
        FilesError::Tensor {
            file: file.to_path_buf(),
            tensor: one_line(tensor.to_string()),
            problem: one_line(problem.into()),
        }
    }

    /// A problem with an option's value.
    pub fn option(option: &'static str, problem: impl Into<String>) -> Self {
        FilesError::Option {
            option,
            problem: one_line(problem.into()),
        }
    }

    /// A device-side failure while doing `context`.
    pub fn device(context: impl Into<String>, source: CoreError) -> Self {
        FilesError::Device {
            context: context.into(),
            source,
        }
    }

    /// A core error found in tensor `tensor` of `file`: input when it is a
    /// validation error, a device error otherwise.
    pub fn in_tensor(source: CoreError, file: &Path, tensor: &str) -> Self {
        if is_validation(&source) {
            Self::tensor(file, tensor, source.to_string())
        } else {
            Self::device(format!("{}: tensor `{tensor}`", file.display()), source)
        }
    }

    /// A core error caused by option `option`: input when it is a
    /// validation error, a device error otherwise.
    pub fn in_option(source: CoreError, option: &'static str) -> Self {
        if is_validation(&source) {
            Self::option(option, source.to_string())
        } else {
            Self::device(option, source)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_errors_are_input_and_device_errors_are_not() {
        let bad_id = CoreError::IdOutOfRange {
            row: 1,
            col: 2,
            id: 900,
            vocab: 300,
        };
        let e = FilesError::in_tensor(bad_id, Path::new("t.safetensors"), "ids");
        assert!(e.is_input());
        let text = e.to_string();
        assert!(
            text.contains("t.safetensors") && text.contains("`ids`") && text.contains("900"),
            "{text}"
        );

        let oom = CoreError::OutOfMemory {
            bytes: 1 << 30,
            what: "logits",
        };
        let e = FilesError::in_tensor(oom, Path::new("t.safetensors"), "ids");
        assert!(!e.is_input());
        assert!(e.to_string().contains("out of device memory"));
        assert!(!FilesError::in_option(CoreError::DeviceLost("gone".into()), "--budget").is_input());
        assert!(FilesError::in_option(CoreError::BudgetZero, "--budget").is_input());
    }

    #[test]
    fn messages_are_one_line() {
        let e = FilesError::tensor(Path::new("t.safetensors"), "a\nb", "bad \u{1b}[31m value");
        assert_eq!(e.to_string(), "t.safetensors: tensor `a\\nb`: bad \\u{1b}[31m value");
        assert_eq!(one_line("plain".into()), "plain");
    }
}
