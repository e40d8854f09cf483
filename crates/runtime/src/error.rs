//! The runtime's one error type.

use crate::kind::BackendKind;

/// The caller's option a runtime error is about; each front end spells it
/// its own way (`--device` on the command line, `device=` in Python).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// The device index.
    Device,
    /// The devices a sharded run is spread over.
    Devices,
}

impl Field {
    /// The option as the `headkl` command spells it.
    pub fn flag(self) -> &'static str {
        match self {
            Field::Device => "--device",
            Field::Devices => "--devices",
        }
    }
}

/// Why a backend could not be chosen or opened.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The backend could not be opened: a bad setting, or a device that
    /// cannot start (`source` tells them apart).
    #[error("{kind}: {source}")]
    Start {
        /// The backend.
        kind: BackendKind,
        /// Why.
        source: headkl_core::Error,
    },
    /// The backend opened, but the engine could not be made on it (the
    /// head's upload).
    #[error("{source}")]
    Engine {
        /// Why.
        source: headkl_core::Error,
    },
    /// A device index or placement the backend does not have.
    #[error("{}: {message}", field.flag())]
    BadOption {
        /// The option.
        field: Field,
        /// What is wrong with it, naming the value.
        message: String,
    },
}

impl Error {
    pub(crate) fn option(field: Field, message: impl Into<String>) -> Self {
        Error::BadOption {
            field,
            message: message.into(),
        }
    }
}
