//! The PTX GEMM tiles (`headkl_core::toolkit::wgmma_tile`) on this backend: one
//! CUDA module of `shaders/gemm_wgmma.ptx` per device, made through
//! `VK_NVX_binary_import` on the first launch (the driver assembles the
//! PTX then), and its functions by entry point. The launches themselves
//! are recorded in the stream like any dispatch (`Stream::launch_ptx`).

use std::ffi::CString;
use std::sync::Arc;

use ash::vk;
use headkl_core::Result;
use headkl_ptx::PTX;

use crate::conv::{backend_error, vk_error};
use crate::device::Device;

/// The module and the functions made from it so far. Destroyed (functions
/// first) when dropped; it holds the device alive.
pub(crate) struct PtxModule {
    device: Arc<Device>,
    fns: ash::nvx::binary_import::DeviceFn,
    module: vk::CuModuleNVX,
    functions: Vec<(&'static str, vk::CuFunctionNVX)>,
}

impl PtxModule {
    /// Hands the PTX to the driver. `what` names the tile asking, for errors.
    pub(crate) fn new(device: &Arc<Device>, what: &str) -> Result<Self> {
        if !device.enabled.ptx {
            return Err(backend_error(format!(
                "{what}: the device was opened without VK_NVX_binary_import and bufferDeviceAddress \
                 (a caller's device, or one without them)"
            )));
        }
        let instance = &device.instance.raw;
        let handle = device.raw.handle();
        for name in [
            c"vkCreateCuModuleNVX",
            c"vkCreateCuFunctionNVX",
            c"vkCmdCuLaunchKernelNVX",
        ] {
            // SAFETY: valid instance and device; the name is nul-terminated.
            if unsafe { instance.get_device_proc_addr(handle, name.as_ptr()) }.is_none() {
                return Err(backend_error(format!(
                    "{what}: the driver has no {}",
                    name.to_string_lossy()
                )));
            }
        }
        let fns = ash::nvx::binary_import::Device::new(instance, &device.raw).fp().clone();
        let text = CString::new(PTX).map_err(|_| backend_error(format!("{what}: the PTX holds a nul byte")))?;
        let bytes = text.as_bytes_with_nul();
        let info = vk::CuModuleCreateInfoNVX::default().data(bytes);
        let mut module = vk::CuModuleNVX::null();
        // SAFETY: the extension is enabled on this device (checked above);
        // the create info points at the nul-terminated text, alive for the
        // call.
        let status = unsafe { (fns.create_cu_module_nvx)(handle, &info, std::ptr::null(), &mut module) };
        if status != vk::Result::SUCCESS {
            return Err(vk_error(
                status,
                &format!(
                    "{what}: vkCreateCuModuleNVX (the driver refused gemm_wgmma.ptx, sm_90a: an NVIDIA Hopper GPU)"
                ),
            ));
        }
        Ok(Self {
            device: Arc::clone(device),
            fns,
            module,
            functions: Vec::new(),
        })
    }

    /// The function of entry point `entry`, made on first use.
    pub(crate) fn function(&mut self, entry: &'static str) -> Result<vk::CuFunctionNVX> {
        if let Some(&(_, f)) = self.functions.iter().find(|(e, _)| *e == entry) {
            return Ok(f);
        }
        let name = CString::new(entry).map_err(|_| backend_error(format!("PTX entry {entry:?}")))?;
        let info = vk::CuFunctionCreateInfoNVX::default()
            .module(self.module)
            .name(name.as_c_str());
        let mut function = vk::CuFunctionNVX::null();
        // SAFETY: the module is alive and the name nul-terminated.
        let status = unsafe {
            (self.fns.create_cu_function_nvx)(self.device.raw.handle(), &info, std::ptr::null(), &mut function)
        };
        if status != vk::Result::SUCCESS {
            return Err(vk_error(status, &format!("vkCreateCuFunctionNVX({entry})")));
        }
        self.functions.push((entry, function));
        Ok(function)
    }

    /// Records a launch of `function` on `cmd`: `params` (the parameter
    /// block, by value) then `addresses` (the buffers), `grid` blocks of
    /// `threads`.
    ///
    /// # Safety
    /// `cmd` is recording on this module's device, and every address is of
    /// a buffer that outlives the command buffer's execution.
    pub(crate) unsafe fn record(
        &self,
        cmd: vk::CommandBuffer,
        function: vk::CuFunctionNVX,
        params: &[u8],
        addresses: &[u64; 3],
        grid: (u32, u32),
        threads: u32,
    ) {
        let values: [*const std::ffi::c_void; 4] = [
            params.as_ptr().cast(),
            (&addresses[0] as *const u64).cast(),
            (&addresses[1] as *const u64).cast(),
            (&addresses[2] as *const u64).cast(),
        ];
        let info = vk::CuLaunchInfoNVX::default()
            .function(function)
            .grid_dim_x(grid.0)
            .grid_dim_y(grid.1)
            .grid_dim_z(1)
            .block_dim_x(threads)
            .block_dim_y(1)
            .block_dim_z(1)
            .shared_mem_bytes(0)
            .params(&values);
        // SAFETY: the caller's contract; the parameter values are read
        // while recording, and `values` and what it points at outlive it.
        unsafe { (self.fns.cmd_cu_launch_kernel_nvx)(cmd, &info) };
    }
}

impl Drop for PtxModule {
    fn drop(&mut self) {
        let handle = self.device.raw.handle();
        // SAFETY: the backend finished its queued work before dropping this
        // (VulkanBackend's drop order); functions go before their module.
        unsafe {
            for &(_, f) in &self.functions {
                (self.fns.destroy_cu_function_nvx)(handle, f, std::ptr::null());
            }
            (self.fns.destroy_cu_module_nvx)(handle, self.module, std::ptr::null());
        }
    }
}

impl crate::VulkanBackend {
    /// Records PTX tile `tile`'s GEMM of `layout` on `[a, b, c]` (checked
    /// by core into `params`), timed under `label`: the copy tiles as one
    /// launch of a block per C tile and split-K part, as the SPIR-V tiles
    /// place their workgroups; the bulk tiles through their pack kernels
    /// (`crate::bulk`).
    pub(crate) fn ptx_dispatch(
        &self,
        tile: headkl_core::toolkit::WgmmaTile,
        layout: headkl_core::toolkit::HeadLayout,
        [a, b, c]: [&crate::memory::VulkanBuffer; 3],
        desc: &headkl_core::toolkit::GemmDesc,
        params: headkl_core::toolkit::params::GemmParams,
        label: &'static str,
    ) -> Result<()> {
        let what = headkl_core::toolkit::CoopGemm::Wgmma(tile).to_string();
        if desc.b_layout != layout {
            return Err(backend_error(format!(
                "{what}: {} is built for {layout:?}, asked for {:?}",
                tile.entry(layout),
                desc.b_layout
            )));
        }
        for buffer in [a, b, c] {
            self.check_device(buffer, label)?;
        }
        if desc.m == 0 || desc.n == 0 {
            return Ok(());
        }
        if tile.feed == headkl_core::toolkit::WgmmaFeed::Bulk {
            return self.bulk_dispatch(tile, layout, [a, b, c], &params, label);
        }
        let addresses = [a.device_address()?, b.device_address()?, c.device_address()?];
        let count = desc.workgroups_for_tile(headkl_core::toolkit::CoopGemm::Wgmma(tile).tile());
        let grid = headkl_core::toolkit::fold_workgroups(count);
        let params = params.with_grid(grid.0);
        let launch = PtxLaunch {
            entry: tile.entry(layout),
            params: bytemuck::bytes_of(&params),
            addresses,
            grid,
            threads: tile.invocations(),
        };
        self.ptx_launch(&what, &launch, &[a.into(), b.into(), c.into()], label)
    }

    /// Records one launch of an entry point of the PTX module (made here
    /// on first use; `what` names the tile asking, for errors), in the
    /// stream, timed under `label`. `bindings` are the buffers `addresses`
    /// point into.
    pub(crate) fn ptx_launch(
        &self,
        what: &str,
        launch: &PtxLaunch<'_>,
        bindings: &[crate::command::Binding],
        label: &'static str,
    ) -> Result<()> {
        let mut module = self
            .ptx
            .lock()
            .map_err(|_| backend_error("the PTX module's lock was poisoned by a panic"))?;
        if module.is_none() {
            let made = PtxModule::new(&self.device, what).map_err(|e| match self.coop.as_ref() {
                Some(plan) if plan.choice.uses_ptx() => {
                    let cache = self.options.common.gemm_sources.tune_cache.as_deref();
                    let said = crate::tile_faults::mark(cache, &self.device.caps, plan.choice, &e.to_string());
                    crate::tile_faults::explained(e, &said)
                }
                _ => e,
            })?;
            *module = Some(made);
        }
        let Some(module) = module.as_mut() else {
            return Err(backend_error(format!("{what}: no PTX module")));
        };
        let function = module.function(launch.entry)?;
        let module = &*module;
        self.stream()?.launch(bindings, label, |cmd| {
            // SAFETY: the stream records on this backend's device; the
            // buffers are alive and the stream keeps them referenced until
            // its submission finishes (`compute_uses`, and the engine holds
            // them across the call; the pack buffers live as long as the
            // backend).
            unsafe {
                module.record(
                    cmd,
                    function,
                    launch.params,
                    &launch.addresses,
                    launch.grid,
                    launch.threads,
                )
            }
        })
    }
}

/// One launch of a PTX entry point: its parameter block, the three buffer
/// addresses after it, and its grid of `threads`-thread blocks.
pub(crate) struct PtxLaunch<'a> {
    pub(crate) entry: &'static str,
    pub(crate) params: &'a [u8],
    pub(crate) addresses: [u64; 3],
    pub(crate) grid: (u32, u32),
    pub(crate) threads: u32,
}
