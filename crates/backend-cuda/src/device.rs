//! One CUDA device: its primary context (PyTorch's too), the stream every
//! call queues on, and what it offers ([`DeviceInfo`]).

use std::ffi::c_int;
use std::sync::atomic::{AtomicPtr, Ordering};

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUdevice_attribute as Attr};
use headkl_core::{DeviceInfo, Error, Result};

use crate::conv::{driver, BACKEND};

/// The oldest compute capability the kernels' PTX targets (`compute_80`).
pub const MIN_CAPABILITY: (i32, i32) = (8, 0);

/// Largest byte range one kernel binding may span: the kernels index in
/// 32 bits, as the Vulkan kernels do.
pub const MAX_BINDING_BYTES: u64 = (1 << 32) - 4;

/// A device's primary context and stream.
#[derive(Debug)]
pub struct Device {
    pub(crate) device: sys::CUdevice,
    pub(crate) context: sys::CUcontext,
    /// The stream the kernels queue on now: ours, or a caller's
    /// ([`Device::set_stream`]).
    stream: AtomicPtr<sys::CUstream_st>,
    /// The stream made at open, destroyed at drop (null only where open
    /// failed before making it).
    own_stream: sys::CUstream,
    /// The uploads' stream, beside it (always ours).
    pub(crate) copy_in: sys::CUstream,
    /// The downloads' stream (always ours): apart from the uploads', so a
    /// chunk's download, which waits for its last kernel, does not hold up
    /// the next chunk's upload queued after it (the copy engines run both
    /// directions at once).
    pub(crate) copy_out: sys::CUstream,
}

// SAFETY: CUDA handles may be used from any thread once the context is
// current there; every entry point binds it first (`Device::bind`), and the
// backend serializes its own state behind locks.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Device {
    /// Retains device `ordinal`'s primary context and makes its streams (a
    /// caller's stream comes later, through [`Device::set_stream`]).
    pub fn open(ordinal: usize) -> Result<Self> {
        init()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoDevice {
                backend: BACKEND,
                reason: format!("device {ordinal} asked for, {count} present"),
            });
        }
        let device = result::device::get(ordinal as c_int).map_err(|e| driver("cuDeviceGet", e))?;
        // SAFETY: `device` came from cuDeviceGet.
        let context =
            unsafe { result::primary_ctx::retain(device) }.map_err(|e| driver("retaining the primary context", e))?;
        let mut opened = Self {
            device,
            context,
            stream: AtomicPtr::new(std::ptr::null_mut()),
            own_stream: std::ptr::null_mut(),
            copy_in: std::ptr::null_mut(),
            copy_out: std::ptr::null_mut(),
        };
        opened.bind()?;
        opened.own_stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver("creating a stream", e))?;
        opened.stream.store(opened.own_stream, Ordering::Release);
        opened.copy_in = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver("creating the uploads' stream", e))?;
        opened.copy_out = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver("creating the downloads' stream", e))?;
        Ok(opened)
    }

    /// The stream the kernels queue on.
    pub fn stream(&self) -> sys::CUstream {
        self.stream.load(Ordering::Acquire)
    }

    /// Queues later kernels on `stream` (a caller's, in this context),
    /// after everything queued on the one used so far.
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of the device's primary context that
    /// outlives its use here (until the next `set_stream` or drop).
    pub unsafe fn set_stream(&self, stream: sys::CUstream) -> Result<()> {
        let old = self.stream();
        if old == stream {
            return Ok(());
        }
        self.bind()?;
        crate::transfer::Event::record(old)?.wait_on(stream)?;
        self.stream.store(stream, Ordering::Release);
        Ok(())
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context was retained by `open` and is released only
        // by drop.
        unsafe { result::ctx::set_current(self.context) }.map_err(|e| driver("making the context current", e))
    }

    /// Waits for everything queued on the three streams.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the streams are live while `self` is.
        unsafe {
            result::stream::synchronize(self.copy_in).map_err(|e| driver("waiting for the uploads", e))?;
            result::stream::synchronize(self.copy_out).map_err(|e| driver("waiting for the downloads", e))?;
            result::stream::synchronize(self.stream()).map_err(|e| driver("waiting for the kernels", e))
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        for copy in [self.copy_in, self.copy_out] {
            if !copy.is_null() {
                // SAFETY: our own stream, no longer used.
                let _ = unsafe { result::stream::synchronize(copy) };
                // SAFETY: as above.
                let _ = unsafe { result::stream::destroy(copy) };
            }
        }
        // A caller's stream is waited on (our work on it must end before
        // the context can go), never destroyed.
        // SAFETY: the stream is live (ours, or the caller's by contract).
        let _ = unsafe { result::stream::synchronize(self.stream()) };
        if !self.own_stream.is_null() {
            // SAFETY: our own stream, no longer used.
            let _ = unsafe { result::stream::destroy(self.own_stream) };
        }
        // SAFETY: releases the retain of `open`.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// Initializes the driver API once (after the loader found the driver).
pub fn init() -> Result<()> {
    crate::loader::load().map_err(|reason| Error::NoDevice {
        backend: BACKEND,
        reason,
    })?;
    result::init().map_err(|e| driver("cuInit", e))
}

/// Devices the driver lists.
pub fn device_count() -> Result<usize> {
    let count = result::device::get_count().map_err(|e| driver("cuDeviceGetCount", e))?;
    Ok(count.max(0) as usize)
}

fn attribute(device: sys::CUdevice, attr: Attr) -> Result<i32> {
    // SAFETY: `device` came from cuDeviceGet.
    unsafe { result::device::get_attribute(device, attr) }.map_err(|e| driver(format_args!("reading {attr:?}"), e))
}

/// The driver's CUDA version as `major.minor`.
pub fn driver_version() -> Result<String> {
    let mut version: c_int = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| driver("cuDriverGetVersion", e))?;
    Ok(format!("{}.{}", version / 1000, (version % 1000) / 10))
}

/// cuBLASLt's version as `major.minor.patch`.
pub fn cublaslt_version() -> String {
    // SAFETY: a query with no arguments, after the loader found the library.
    let v = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
    format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
}

/// What device `ordinal` offers.
pub fn info(ordinal: usize) -> Result<DeviceInfo> {
    let device = result::device::get(ordinal as c_int).map_err(|e| driver("cuDeviceGet", e))?;
    let name = result::device::get_name(device).map_err(|e| driver("cuDeviceGetName", e))?;
    // SAFETY: `device` came from cuDeviceGet.
    let memory = unsafe { result::device::total_mem(device) }.map_err(|e| driver("cuDeviceTotalMem", e))? as u64;
    let major = attribute(device, Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(device, Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let warp = attribute(device, Attr::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?;
    let integrated = attribute(device, Attr::CU_DEVICE_ATTRIBUTE_INTEGRATED)? != 0;
    let unusable = ((major, minor) < MIN_CAPABILITY).then(|| {
        format!(
            "compute capability {major}.{minor}: headkl's CUDA kernels need {}.{} (Ampere) or later",
            MIN_CAPABILITY.0, MIN_CAPABILITY.1
        )
    });
    Ok(DeviceInfo {
        backend: BACKEND,
        device_name: name,
        driver: format!(
            "NVIDIA CUDA {} (driver API), cuBLASLt {}, compute capability {major}.{minor}",
            driver_version()?,
            cublaslt_version()
        ),
        device_type: if integrated { "integrated" } else { "discrete" }.to_string(),
        matrix_units: true,
        gemm: Some("cuBLASLt (f16 x f16 -> f32)".to_string()),
        queue: None,
        matrix_shapes: vec![(16, 8, 16)],
        shader_f16: true,
        subgroup_size: Some(warp as u32),
        max_binding_bytes: MAX_BINDING_BYTES,
        max_buffer_bytes: memory,
        memory_bytes: Some(memory),
        unusable,
    })
}

/// Every device's [`info`], or why none can be listed.
pub fn enumerate() -> Result<Vec<DeviceInfo>> {
    init()?;
    (0..device_count()?).map(info).collect()
}
