//! The CUDA C kernels (`shaders/cuda`, PTX from headkl-ptx): one module
//! loaded per device (the driver compiles the PTX for the device it runs
//! on), an entry point a catalogue kernel, launched with core's parameter
//! block by value and the buffers' addresses in binding order.

use std::collections::HashMap;
use std::ffi::{c_void, CString};

use cudarc::driver::result;
use cudarc::driver::sys;
use headkl_core::toolkit::{fold_workgroups, GemmKernel, KernelId};
use headkl_core::{Error, Result};

use crate::conv::{driver, BACKEND};

/// The row statistics kernel that follows a cuBLASLt logits GEMM asked for
/// them (`shaders/cuda/small.cuh`): not a catalogue kernel.
pub const ROW_STATS_ENTRY: &str = "gemm_row_stats";

/// The kernel that writes a device GEMM alpha from a status word
/// (`shaders/cuda/resident.cuh`): not a catalogue kernel.
pub const ALPHA_WORD_ENTRY: &str = "gemm_alpha_word";

/// [`ALPHA_WORD_ENTRY`]'s parameter block (`AlphaWordParams` in the CUDA
/// C): the alpha is `factor` times f32 word `word` of its first buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AlphaWordParams {
    pub factor: f32,
    pub word: u32,
    pub pad: [u32; 2],
}

/// Threads per block of every kernel but `status_detail` (core's
/// `ROW_WORKGROUP`, the kernels' `WG`).
pub const BLOCK: u32 = headkl_core::toolkit::kernels::ROW_WORKGROUP;

/// The loaded module and its entry points.
#[derive(Debug)]
pub struct Module {
    module: sys::CUmodule,
    functions: HashMap<&'static str, sys::CUfunction>,
}

// SAFETY: module and function handles are plain driver handles, usable
// from any thread with the context current (the backend binds it first).
unsafe impl Send for Module {}
// SAFETY: as above; the map is read-only after load.
unsafe impl Sync for Module {}

impl Module {
    /// Loads the PTX (the context must be current) and finds every
    /// catalogue kernel's entry point but the GEMMs'.
    pub fn load() -> Result<Self> {
        let text = CString::new(headkl_ptx::kernels::PTX).map_err(|_| Error::Backend {
            backend: BACKEND,
            message: "the kernels' PTX holds a NUL byte".into(),
        })?;
        // SAFETY: a NUL-terminated PTX image; the context is current.
        let module = unsafe { result::module::load_data(text.as_ptr() as *const c_void) }.map_err(|e| {
            let hint = match e.0 {
                sys::cudaError_enum::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
                    " (the driver is older than the PTX: headkl's kernels need an NVIDIA driver for CUDA 12.8 or later, 570+)"
                }
                _ => "",
            };
            driver(format_args!("loading the kernels' PTX{hint}"), e)
        })?;
        let mut loaded = Self {
            module,
            functions: HashMap::new(),
        };
        let names = KernelId::ALL
            .into_iter()
            .filter(|id| id.gemm_layout().is_none())
            .map(KernelId::name)
            .chain([ROW_STATS_ENTRY, ALPHA_WORD_ENTRY]);
        for name in names {
            let c_name = CString::new(name).map_err(|_| Error::Backend {
                backend: BACKEND,
                message: format!("entry name {name:?}"),
            })?;
            // SAFETY: the module is loaded; the name is NUL-terminated.
            let f = unsafe { result::module::get_function(loaded.module, c_name) }
                .map_err(|e| driver(format_args!("finding kernel {name} in the PTX"), e))?;
            loaded.functions.insert(name, f);
        }
        Ok(loaded)
    }

    /// The entry point `name`.
    pub fn function(&self, name: &str) -> Result<sys::CUfunction> {
        self.functions.get(name).copied().ok_or_else(|| Error::Backend {
            backend: BACKEND,
            message: format!("no kernel {name} in the PTX"),
        })
    }

    /// Queues `name` on `stream` over `workgroups` blocks of `threads`
    /// (folded as core folds them, the block's `grid_x` already set for
    /// it by `params(grid_x)`), with `buffers`' addresses after the block.
    pub fn launch(
        &self,
        name: &str,
        stream: sys::CUstream,
        workgroups: u64,
        threads: u32,
        params: impl FnOnce(u32) -> Vec<u8>,
        buffers: &[u64],
    ) -> Result<()> {
        let f = self.function(name)?;
        let (x, y) = fold_workgroups(workgroups);
        let block = params(x);
        // The driver reads each argument through a pointer: the block's
        // bytes, then each address.
        let mut args: Vec<*mut c_void> = Vec::with_capacity(1 + buffers.len());
        args.push(block.as_ptr() as *mut c_void);
        for address in buffers {
            args.push(address as *const u64 as *mut c_void);
        }
        // SAFETY: `f` takes the block by value and one pointer per buffer,
        // as the catalogue's bindings (a test holds the PTX's parameter
        // lists to it); the buffers were checked against the descriptor by
        // `Launch::check`; `block` and `buffers` outlive the call, which
        // copies the arguments.
        unsafe { result::launch_kernel(f, (x, y, 1), (threads, 1, 1), 0, stream, &mut args) }
            .map_err(|e| driver(format_args!("launching {name} ({workgroups} blocks)"), e))
    }
}

/// Threads per block of catalogue kernel `id`.
pub fn threads(id: KernelId) -> u32 {
    id.build(GemmKernel::Tiled).invocations
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded by `load`, unloaded once (the context is current:
        // the backend drops this while bound).
        let _ = unsafe { result::module::unload(self.module) };
    }
}
