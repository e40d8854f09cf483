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
    let text = e.to_string();
    exception(&e, text)
}

/// [`to_py`] with the message's leading field named as the Python
/// argument that held it (`ids[3][1] = …` → `teacher_ids[3][1] = …`).
pub fn to_py_as(e: Error, names: &[(&str, &str)]) -> PyErr {
    let text = e.to_string();
    let renamed = names.iter().find_map(|(field, argument)| {
        text.strip_prefix(field)
            .filter(|rest| rest.starts_with(['[', ':', ' ']))
            .map(|rest| format!("{argument}{rest}"))
    });
    exception(&e, renamed.unwrap_or(text))
}

fn exception(e: &Error, text: String) -> PyErr {
    match e.kind() {
        ErrorKind::Input | ErrorKind::Setting => PyValueError::new_err(text),
        ErrorKind::Device => DeviceError::new_err(text),
        ErrorKind::Internal => PyRuntimeError::new_err(text),
    }
}

/// A backend that could not be opened, a bad backend option, or an
/// engine that could not be made.
pub fn start(e: headkl_runtime::Error) -> PyErr {
    use headkl_runtime::{Error as RuntimeError, Field};
    match e {
        RuntimeError::Start { kind, source } => match source.kind() {
            ErrorKind::Setting | ErrorKind::Input => PyValueError::new_err(format!("{kind}: {source}")),
            _ => DeviceError::new_err(format!("{kind} could not start: {source}")),
        },
        RuntimeError::BadOption { field, message } => {
            let argument = match field {
                Field::Device => "device",
                Field::Devices => "devices",
            };
            PyValueError::new_err(format!("{argument}: {message}"))
        }
        RuntimeError::Engine { source } => to_py(source),
    }
}
