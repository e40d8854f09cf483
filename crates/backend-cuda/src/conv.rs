//! CUDA's and cuBLASLt's errors as headkl's: out-of-memory and a lost or
//! poisoned context get their own variants, the rest keep the driver's
//! error as their source.

use cudarc::cublaslt::result::CublasError;
use cudarc::driver::sys::cudaError_enum as E;
use cudarc::driver::DriverError;
use headkl_core::error::DriverError as Source;
use headkl_core::Error;

/// The backend's name in errors and reports.
pub const BACKEND: &str = "cuda";

/// Whether a driver error leaves the context unusable (an illegal address,
/// a failed launch, an ECC error: every later call fails too).
pub fn is_sticky(e: &DriverError) -> bool {
    matches!(
        e.0,
        E::CUDA_ERROR_ILLEGAL_ADDRESS
            | E::CUDA_ERROR_LAUNCH_FAILED
            | E::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | E::CUDA_ERROR_MISALIGNED_ADDRESS
            | E::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | E::CUDA_ERROR_INVALID_PC
            | E::CUDA_ERROR_HARDWARE_STACK_ERROR
            | E::CUDA_ERROR_ECC_UNCORRECTABLE
            | E::CUDA_ERROR_CONTEXT_IS_DESTROYED
            | E::CUDA_ERROR_LAUNCH_TIMEOUT
    )
}

/// A driver call that failed while headkl was doing `what`.
pub fn driver(what: impl std::fmt::Display, e: DriverError) -> Error {
    if is_sticky(&e) {
        return Error::DeviceLost(format!("cuda: {what}: {e}"));
    }
    Error::Driver {
        backend: BACKEND,
        message: what.to_string(),
        source: Source::new(e),
    }
}

/// An allocation of `bytes` for `label` that failed.
pub fn alloc(label: &'static str, bytes: u64, e: DriverError) -> Error {
    match e.0 {
        E::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory { bytes, what: label },
        _ => driver(format_args!("allocating {bytes} bytes for {label}"), e),
    }
}

/// A cuBLASLt call that failed while headkl was doing `what`.
pub fn cublas(what: impl std::fmt::Display, e: CublasError) -> Error {
    Error::Driver {
        backend: BACKEND,
        message: what.to_string(),
        source: Source::new(e),
    }
}
