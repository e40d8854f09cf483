//! headkl's errors as Python exceptions: bad input and bad settings are
//! `ValueError` (the message names the argument and its value), a device
//! that fails is `headkl.DeviceError`, a broken contract `RuntimeError`.

use headkl_core::{Error, ErrorKind};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyErr;

create_exception!(
    headkl,
    DeviceError,
    PyRuntimeError,
    "The device or its driver failed (out of memory, lost, missing a feature)."
);

/// The exception for `e`.
pub fn to_py(e: Error) -> PyErr {
    match e.kind() {
        ErrorKind::Input | ErrorKind::Setting => PyValueError::new_err(e.to_string()),
        ErrorKind::Device => DeviceError::new_err(e.to_string()),
        ErrorKind::Internal => PyRuntimeError::new_err(e.to_string()),
    }
}

/// A backend that could not be opened, or a bad backend option.
pub fn start(e: headkl_cli::embed::RunError) -> PyErr {
    use headkl_cli::embed::RunError;
    match e {
        RunError::Start(kind, source) => match source.kind() {
            ErrorKind::Setting | ErrorKind::Input => PyValueError::new_err(format!("{kind}: {source}")),
            _ => DeviceError::new_err(format!("{kind} could not start: {source}")),
        },
        RunError::Job(e) => PyValueError::new_err(e.to_string()),
    }
}
