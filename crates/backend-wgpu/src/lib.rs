//! headkl-wgpu: the wgpu backend of headkl.
//!
//! It runs the shared WGSL kernels in `shaders/` (see `shaders/README.md`)
//! on any Vulkan, Metal or DX12 adapter with f16 shaders. The GEMM runs on
//! cooperative matrices (`gemm_coop.wgsl`) where the adapter offers the
//! 16×16×16 f16×f16→f32 shape and a fixed subgroup size, and on the tiled
//! fallback (`gemm_tiled.wgsl`) everywhere else.
//!
//! Module map: `adapter` (listing and choosing adapters), `device`
//! (opening one, device errors), `stream` (batched dispatches, timing),
//! `transfer` (uploads, downloads), `backend` (the `Backend` impl),
//! `kernels` (the catalogue's pipelines), `buffer` (buffers and shared state).
//!
//! This crate reads no environment: [`OpenOptions`] says which adapter,
//! whether to force the tiled GEMM or keep bounds checks, and which
//! matrix-unit GEMM kernels run ([`OpenOptions::from_env`] builds them
//! from `HEADKL_DEVICE`, `HEADKL_NO_COOPMAT`, `HEADKL_CHECKED` and
//! `HEADKL_GEMM`; without a choice, the tune cache's entry for the adapter,
//! else [`DEFAULT_GEMM`]).

mod adapter;
mod backend;
mod buffer;
mod device;
mod external;
mod kernels;
mod queue;
mod readback;
mod stream;
mod transfer;

pub use adapter::{choose_adapter, enumerate};
pub use buffer::WgpuBuffer;
pub use device::{OpenOptions, WgpuBackend, DEFAULT_GEMM};
pub use queue::request_device;

/// The name this backend reports in [`headkl_core::DeviceInfo::backend`] and
/// errors.
pub const BACKEND: &str = "wgpu";

/// `headkl_core::Error::Backend` from this backend.
fn backend_error(message: impl Into<String>) -> headkl_core::Error {
    headkl_core::Error::Backend {
        backend: BACKEND,
        message: message.into(),
    }
}

/// `headkl_core::Error::Driver` from this backend: `message`, with wgpu's
/// own error kept as the source.
fn driver_error(
    message: impl Into<String>,
    error: impl std::error::Error + Send + Sync + 'static,
) -> headkl_core::Error {
    headkl_core::Error::Driver {
        backend: BACKEND,
        message: message.into(),
        source: headkl_core::DriverError::new(error),
    }
}
