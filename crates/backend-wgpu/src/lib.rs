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
//! Environment:
//! - `HEADKL_DEVICE=<index>`: the adapter [`WgpuBackend::open`] picks with
//!   `None` (an index into [`enumerate`]'s list).
//! - `HEADKL_NO_COOPMAT=1`: the tiled GEMM even where matrix units exist.
//! - `HEADKL_CHECKED=1`: every kernel built with naga's runtime bounds checks
//!   (by default the GEMMs are built without them: every index they form is
//!   in range for the extents core validated).
//! - `HEADKL_GEMM`: the matrix-unit GEMM kernels
//!   ([`headkl_core::tuning`]); without it, the tune cache's entry for the
//!   adapter (`headkl tune`), else [`DEFAULT_GEMM`].

mod adapter;
mod backend;
mod buffer;
mod device;
mod external;
mod kernels;
mod stream;
mod transfer;

pub use adapter::enumerate;
pub use buffer::WgpuBuffer;
pub use device::{OpenOptions, WgpuBackend, DEFAULT_GEMM};

/// The name this backend reports in [`headkl_core::DeviceInfo::backend`] and
/// errors.
pub const BACKEND: &str = "wgpu";

/// Whether an environment flag is set to something other than empty, `0`
/// or `false`.
fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// `headkl_core::Error::Backend` from this backend.
fn backend_error(message: impl Into<String>) -> headkl_core::Error {
    headkl_core::Error::Backend {
        backend: BACKEND,
        message: message.into(),
    }
}
