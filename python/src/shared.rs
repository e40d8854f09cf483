//! The zero-copy path for CUDA tensors: buffers the Vulkan backend exports
//! as opaque fds (CUDA maps them, torch sees them as CUDA tensors), the
//! backend's shared timeline semaphore (CUDA signals it once the inputs are
//! written and waits on it before reading the outputs), and the loss run on
//! those buffers with `Engine::head_kl_device`: no byte goes through the
//! host and the host never waits inside a step.

use std::os::fd::IntoRawFd;

use headkl_core::{
    DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, HiddenDtype, LossOptions, TopkOptions,
};
use headkl_vulkan::{VulkanBackend, VulkanBuffer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::to_py;
use crate::options::TeacherReading;

/// The exported buffers, by the handle Python holds (a freed one leaves
/// `None` behind, so handles stay stable).
#[derive(Default)]
pub struct SharedBuffers {
    buffers: Vec<Option<VulkanBuffer>>,
}

impl SharedBuffers {
    /// Exports a buffer of `bytes` bytes: its handle, the fd (the caller,
    /// CUDA's import, takes it over) and the bytes allocated behind it.
    pub fn export(&mut self, backend: &VulkanBackend, bytes: u64) -> PyResult<(usize, i32, u64)> {
        let exported = backend.export_buffer(bytes, "shared with CUDA").map_err(to_py)?;
        self.buffers.push(Some(exported.buffer));
        Ok((
            self.buffers.len() - 1,
            exported.fd.into_raw_fd(),
            exported.allocation_bytes,
        ))
    }

    /// Frees a buffer (after the device is done with it).
    pub fn free(&mut self, handle: usize) {
        if let Some(slot) = self.buffers.get_mut(handle) {
            *slot = None;
        }
    }

    fn get(&self, what: &str, handle: usize) -> PyResult<&VulkanBuffer> {
        self.buffers
            .get(handle)
            .and_then(Option::as_ref)
            .ok_or_else(|| PyValueError::new_err(format!("{what}: no shared buffer {handle}")))
    }
}

/// The arrays of one loss call on the device, each by where it lives: a
/// shared buffer's handle here, a CUDA tensor's `(address, bytes)` on the
/// CUDA backend (`crate::cuda`).
pub struct LossBuffers<T> {
    pub hidden: T,
    pub ids: T,
    pub values: T,
    pub weights: Option<T>,
    pub labels: Option<T>,
    pub loss: T,
    pub dx: T,
}

/// `LossBuffers` as Python passes them: `(hidden, ids, values, weights,
/// labels, loss, dx)`.
pub type LossBuffersArg<T> = (T, T, T, Option<T>, Option<T>, T, T);

impl<T> From<LossBuffersArg<T>> for LossBuffers<T> {
    fn from((hidden, ids, values, weights, labels, loss, dx): LossBuffersArg<T>) -> Self {
        Self {
            hidden,
            ids,
            values,
            weights,
            labels,
            loss,
            dx,
        }
    }
}

/// Parses `float32`, `float16`, `bfloat16`.
pub fn hidden_dtype(name: &str) -> PyResult<HiddenDtype> {
    crate::memory::Dtype::parse(name)
        .ok()
        .and_then(crate::memory::Dtype::hidden)
        .ok_or_else(|| PyValueError::new_err(format!("hidden: dtype {name} is not a float")))
}

/// What the device path does not take, named (the Python side sends those
/// calls through the host path).
pub fn refuse_host_only(opts: &LossOptions, reading: &TeacherReading) -> PyResult<()> {
    let refuse = |what: &str| Err(PyValueError::new_err(format!("{what}: not on the zero-copy path")));
    if reading.temperature.is_some() {
        return refuse("teacher_temperature");
    }
    if opts.ignore_mask {
        return refuse("ignore_mask");
    }
    Ok(())
}

/// One loss call on the shared buffers: waits for the shared timeline to
/// reach `wait` (CUDA wrote the inputs), runs the loss, and signals `signal`
/// once it is done. Errors the device flags (a bad id, a non-finite row)
/// are checked at the next call's start or at `synchronize`.
#[allow(
    clippy::too_many_arguments,
    reason = "the call's shape, buffers, options and timeline values"
)]
pub fn head_kl(
    engine: &mut Engine<VulkanBackend>,
    shared: &SharedBuffers,
    (ntok, k, dtype): (usize, usize, HiddenDtype),
    b: &LossBuffers<usize>,
    (opts, reading): (&LossOptions, &TeacherReading),
    timeline: (u64, u64),
) -> PyResult<()> {
    refuse_host_only(opts, reading)?;
    let hidden = begin(engine, shared, b.hidden, dtype)?;
    let device_opts = DeviceLossOptions {
        config: opts.config,
        weights: b.weights.map(|h| shared.get("weights", h)).transpose()?,
        labels: b.labels.map(|h| shared.get("labels", h)).transpose()?,
        accumulate_dx: false,
        terms_out: None,
        head_grad_out: None,
    };
    let teacher = DeviceTeacher {
        ids: shared.get("teacher_ids", b.ids)?,
        probs: shared.get("teacher_values", b.values)?,
        k,
        form: reading.form,
        tail: reading.tail,
    };
    let out = DeviceLossOutput {
        loss: shared.get("loss", b.loss)?,
        dx: shared.get("dx", b.dx)?,
    };
    around_call(timeline, engine, |engine| {
        engine.head_kl_device(ntok, &hidden, &teacher, &out, &device_opts)
    })
}

/// Checks the previous call's flags (it has run by now: its inputs were
/// signalled before this call), then views the hidden rows.
fn begin<'a>(
    engine: &mut Engine<VulkanBackend>,
    shared: &'a SharedBuffers,
    hidden: usize,
    dtype: HiddenDtype,
) -> PyResult<DeviceHidden<'a, VulkanBuffer>> {
    engine.wait_device().map_err(to_py)?;
    Ok(DeviceHidden {
        buffer: shared.get("hidden", hidden)?,
        dtype,
    })
}

/// Runs `call` between a wait for `wait` on the shared timeline and a
/// signal of `signal`; the signal is given whatever happened (CUDA waits
/// for it, and a call that failed before the device must not leave it
/// waiting forever).
fn around_call(
    (wait, signal): (u64, u64),
    engine: &mut Engine<VulkanBackend>,
    call: impl FnOnce(&mut Engine<VulkanBackend>) -> headkl_core::Result<()>,
) -> PyResult<()> {
    engine.backend().wait_timeline(wait).map_err(to_py)?;
    let ran = call(engine);
    let signalled = engine.backend().signal_timeline(signal);
    ran.map_err(to_py)?;
    signalled.map_err(to_py)
}

/// The exact top-k on shared buffers: ids u32 and probabilities (or the
/// full-vocabulary log-probabilities) f32 `[ntok][k]`.
pub fn topk(
    engine: &mut Engine<VulkanBackend>,
    shared: &SharedBuffers,
    (ntok, dtype): (usize, HiddenDtype),
    (hidden, ids, values): (usize, usize, usize),
    opts: &TopkOptions,
    timeline: (u64, u64),
) -> PyResult<()> {
    let hidden = begin(engine, shared, hidden, dtype)?;
    let (ids, values) = (shared.get("ids", ids)?, shared.get("values", values)?);
    around_call(timeline, engine, |engine| {
        engine.topk_device(ntok, &hidden, ids, values, opts)
    })
}

/// The log-probabilities at given ids (u32 `[ntok][k]`, `0xffffffff`
/// none) on shared buffers, and each row's lse.
pub fn gather(
    engine: &mut Engine<VulkanBackend>,
    shared: &SharedBuffers,
    (ntok, dtype): (usize, HiddenDtype),
    (hidden, ids, logprobs, lse): (usize, usize, usize, usize),
    opts: &TopkOptions,
    timeline: (u64, u64),
) -> PyResult<()> {
    let hidden = begin(engine, shared, hidden, dtype)?;
    let ids = shared.get("ids", ids)?;
    let outs = (shared.get("logprobs", logprobs)?, shared.get("lse", lse)?);
    around_call(timeline, engine, |engine| {
        engine.logprobs_at_device(ntok, &hidden, ids, outs, opts)
    })
}

/// Waits for every call on the device and returns what it flagged.
pub fn synchronize(engine: &mut Engine<VulkanBackend>) -> PyResult<()> {
    engine.wait_device().map_err(to_py)
}
