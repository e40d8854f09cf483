//! CUDA tensors on the CUDA backend: the engine runs on the tensors' own
//! memory (their device addresses, as `CudaBuffer`s it borrows for the
//! call) and queues on PyTorch's current stream, so there is no copy, no
//! shared buffer, no semaphore and no host wait: PyTorch's next kernels on
//! that stream follow headkl's in order. The outputs are tensors Python
//! allocated with PyTorch's allocator.
//!
//! Rows the device flags (a bad id, weight or label) get a NaN loss and a
//! zero dx row in the call's outputs; the typed error naming the row comes
//! from `synchronize` (a wait inside every step is what this path avoids).

use headkl_core::{DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, LossOptions, TopkOptions};
use headkl_cuda::{CudaBackend, CudaBuffer};
use headkl_runtime::AnyEngine;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::to_py;
use crate::options::TeacherReading;
use crate::shared::{hidden_dtype, refuse_host_only, LossBuffers};

/// A tensor's memory as Python passes it: `(address, bytes)`.
pub type Device = (u64, u64);

/// The CUDA engine over the whole head, or why this one is not.
pub fn cuda_whole(held: &mut AnyEngine) -> Result<&mut Engine<CudaBackend>, String> {
    if held.shard().is_some() {
        return Err("a vocabulary shard runs through host copies".into());
    }
    let kind = held.engine().info().backend;
    held.whole_on::<CudaBackend>()
        .ok_or_else(|| format!("the {kind} backend does not run on CUDA tensors"))
}

/// Borrows a tensor's memory for one call.
///
/// # Safety
///
/// `(address, bytes)` must be live device memory of the engine's CUDA
/// device that PyTorch keeps (and does not reuse) until the work queued on
/// its current stream is done: the Python side holds the tensors for the
/// call and the stream orders any reuse after headkl's kernels.
unsafe fn borrow((address, bytes): Device) -> CudaBuffer {
    // SAFETY: the caller's contract.
    unsafe { CudaBuffer::borrowed(address, bytes) }
}

/// Queues later work on PyTorch's `stream`.
fn on_stream(engine: &Engine<CudaBackend>, stream: u64) -> PyResult<()> {
    // SAFETY: `stream` is `torch.cuda.current_stream().cuda_stream` of the
    // engine's device (the Python side checks the device), a stream of the
    // primary context PyTorch and the backend share; PyTorch keeps its
    // streams alive for the process.
    unsafe { engine.backend().set_stream(stream) }.map_err(to_py)
}

/// The loss on CUDA tensors, queued on `stream`; `head_grad` the head's
/// gradient f32 `[V][hs]`, where the head is trainable.
pub fn head_kl(
    engine: &mut Engine<CudaBackend>,
    (ntok, k, dtype): (usize, usize, &str),
    t: &LossBuffers<Device>,
    head_grad: Option<Device>,
    (opts, reading): (&LossOptions, &TeacherReading),
    stream: u64,
) -> PyResult<()> {
    refuse_host_only(opts, reading)?;
    on_stream(engine, stream)?;
    // SAFETY: each borrow is of a tensor the Python side holds for this call.
    let (hidden, ids, values, loss, dx) = unsafe {
        (
            borrow(t.hidden),
            borrow(t.ids),
            borrow(t.values),
            borrow(t.loss),
            borrow(t.dx),
        )
    };
    // SAFETY: as above.
    let weights = t.weights.map(|w| unsafe { borrow(w) });
    // SAFETY: as above.
    let labels = t.labels.map(|l| unsafe { borrow(l) });
    // SAFETY: as above.
    let head_grad = head_grad.map(|g| unsafe { borrow(g) });
    let mut config = opts.config;
    config.head_grad = head_grad.is_some();
    let device_opts = DeviceLossOptions {
        config,
        weights: weights.as_ref(),
        labels: labels.as_ref(),
        accumulate_dx: false,
        terms_out: None,
        head_grad_out: head_grad.as_ref(),
    };
    let teacher = DeviceTeacher {
        ids: &ids,
        probs: &values,
        k,
        form: reading.form,
        tail: reading.tail,
    };
    let out = DeviceLossOutput { loss: &loss, dx: &dx };
    let hidden = DeviceHidden {
        buffer: &hidden,
        dtype: hidden_dtype(dtype)?,
    };
    engine
        .head_kl_device(ntok, &hidden, &teacher, &out, &device_opts)
        .map_err(to_py)
}

/// Reads a trainable head again into the engine's planes, on `stream`:
/// `write(address, first_row, rows, ld)`, the Python side, writes head rows
/// `first_row..first_row + rows` as f16 into the plane at device address
/// `address` (rows `ld` halves apart; its pad columns and rows keep their
/// zeros) with PyTorch's kernels on the same stream, so the head is
/// converted straight into the planes, with no copy of it in between. No
/// row norms (the CUDA backend's dx GEMM has no block filter to read them)
/// and no wait: `on_stream` queues the writes behind the engine's earlier
/// calls, and its later calls run behind them on the same stream.
pub fn refill_head(engine: &mut Engine<CudaBackend>, write: &Bound<'_, PyAny>, stream: u64) -> PyResult<()> {
    on_stream(engine, stream)?;
    let mut raised = None;
    let filled = engine.refill_device_head_queued(|_, plane| {
        let args = (plane.buffer.device_ptr(), plane.first_row, plane.rows, plane.hs_padded);
        write.call1(args).map(drop).map_err(|e| {
            raised = Some(e);
            headkl_core::Error::Backend {
                backend: "cuda",
                message: "writing the head's planes raised in Python".into(),
            }
        })
    });
    match raised {
        Some(e) => Err(e),
        None => filled.map_err(to_py),
    }
}

/// The exact top-k on CUDA tensors `(hidden, ids, values)`: ids u32 and
/// values f32 `[ntok][k]`.
pub fn topk(
    engine: &mut Engine<CudaBackend>,
    (ntok, dtype): (usize, &str),
    (hidden, ids, values): (Device, Device, Device),
    opts: &TopkOptions,
    stream: u64,
) -> PyResult<()> {
    on_stream(engine, stream)?;
    // SAFETY: tensors the Python side holds for this call.
    let (hidden, ids, values) = unsafe { (borrow(hidden), borrow(ids), borrow(values)) };
    let hidden = DeviceHidden {
        buffer: &hidden,
        dtype: hidden_dtype(dtype)?,
    };
    engine.topk_device(ntok, &hidden, &ids, &values, opts).map_err(to_py)
}

/// The log-probabilities at ids (u32 `[ntok][k]`, `0xffffffff` none) on
/// CUDA tensors, and each row's lse.
pub fn gather(
    engine: &mut Engine<CudaBackend>,
    (ntok, dtype): (usize, &str),
    (hidden, ids, logprobs, lse): (Device, Device, Device, Device),
    opts: &TopkOptions,
    stream: u64,
) -> PyResult<()> {
    on_stream(engine, stream)?;
    // SAFETY: tensors the Python side holds for this call.
    let (hidden, ids, logprobs, lse) = unsafe { (borrow(hidden), borrow(ids), borrow(logprobs), borrow(lse)) };
    let hidden = DeviceHidden {
        buffer: &hidden,
        dtype: hidden_dtype(dtype)?,
    };
    engine
        .logprobs_at_device(ntok, &hidden, &ids, (&logprobs, &lse), opts)
        .map_err(to_py)
}

/// An error for Python where the engine is not on CUDA.
pub fn not_cuda(why: String) -> PyErr {
    PyValueError::new_err(why)
}
