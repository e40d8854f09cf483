//! `headkl._native.Engine`: a head uploaded once to the chosen backend (the
//! whole head, or one vocabulary shard of it), and the calls on host
//! memory: the loss with its gradient, the sharded loss's two phases, the
//! top-k and the gather. Each call releases the GIL while it runs; the
//! engine is behind a mutex, so calls from several threads take turns.

use std::sync::{Arc, Mutex, MutexGuard};

use headkl_core::shard::{HeadShard, LossStats};
use headkl_core::toolkit::settings::Env;
use headkl_core::{
    rescale_teacher, Backend, DeviceInfo, Engine, HeadWeights, Hidden, HiddenDtype, LossOptions, LossOutput,
    SliceOptions, Teacher, TopkOptions,
};
use headkl_runtime::{AnyEngine, BackendArg, BackendKind, HostShard, LossCall, LossTeacher, Selection, Settings};
use headkl_vulkan::VulkanBackend;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::cuda;
use crate::errors::{start, to_py, to_py_as};
use crate::memory::HostArray;
use crate::options::{loss_options, topk_options, TeacherReading};
use crate::shared::{self, LossBuffers, LossBuffersArg, SharedBuffers};

/// A host array spec as Python passes it: `(address, elements, dtype)`.
pub type Spec = (usize, usize, String);

/// One loss call on the held engine, whole or a shard's.
fn loss_into(held: &mut AnyEngine, call: LossCall<'_>, out: &mut LossOutput) -> PyResult<()> {
    held.engine().loss_into(call, out).map_err(to_py)
}

/// The teacher of a loss call: its top-k `(ids, values, k)`, or its own
/// hidden rows `(rows, teacher_hs)` for the exact full-vocabulary loss.
#[derive(FromPyObject)]
pub enum TeacherSpec {
    /// Top-k ids and values `[ntok][k]`.
    TopK(Spec, Spec, usize),
    /// Hidden rows `[ntok][teacher_hs]` through the teacher's head.
    Hidden(Spec, usize),
}

/// `backend=` as the package spells it.
pub fn backend_arg(backend: &str) -> PyResult<BackendArg> {
    BackendArg::parse(backend, false).map_err(|why| PyValueError::new_err(format!("backend={backend:?}: {why}")))
}

/// The engine a backend name and device index resolve to, opened with the
/// `HEADKL_*` settings, as the `headkl` command opens it; with why `auto`
/// chose it, where it did.
fn open(
    backend: &str,
    device: Option<usize>,
    head: &HeadWeights<'_>,
    shard: Option<HeadShard>,
) -> PyResult<(AnyEngine, Option<String>)> {
    let selection = Selection {
        backend: Some(backend_arg(backend)?),
        device,
    };
    let settings = Arc::new(Settings::from_env(&Env::process()).map_err(to_py)?);
    let target = headkl_runtime::resolve(selection, &settings).map_err(start)?;
    let engine = AnyEngine::open(&target, head, shard).map_err(start)?;
    Ok((engine, target.auto_reason.clone()))
}

/// The two-phase loss's shard, or why this engine has none.
fn shard(held: &mut AnyEngine) -> PyResult<&mut dyn HostShard> {
    held.shard()
        .ok_or_else(|| PyRuntimeError::new_err("this engine holds the whole head: the two-phase loss needs a shard"))
}

/// The teacher from ids and values read as `reading` says; with a teacher
/// temperature, the values are checked as given, then rescaled to the
/// loss's temperature (README "Loss terms").
fn topk_teacher(
    ids: &[i64],
    values: &[f32],
    (ntok, k, vocab): (usize, usize, usize),
    reading: TeacherReading,
    temperature: f32,
) -> headkl_core::Result<Teacher> {
    let given = Teacher::with_form(ids, values, ntok, k, vocab, reading.form, reading.tail)?;
    match reading.temperature {
        Some(from) if from != temperature => {
            let rescaled = rescale_teacher(values, k, reading.form, reading.tail, from, temperature)?;
            Teacher::with_form(ids, &rescaled, ntok, k, vocab, reading.form, reading.tail)
        }
        _ => Ok(given),
    }
}

/// The teacher's fields in headkl's messages, and the arguments of
/// `HeadKLLoss.forward` that hold them.
const TEACHER_ARGUMENTS: &[(&str, &str)] = &[
    ("ids", "teacher_ids"),
    ("probs", "teacher_values"),
    ("logprobs", "teacher_values"),
];

/// A loss call's outputs, `dx` `[ntok][hs]` and the per-token losses, and
/// where asked the head's gradient `[vocab][hs]`.
struct LossArrays<'a> {
    dx: &'a mut [f32],
    loss: &'a mut [f32],
    head_grad: Option<&'a mut [f32]>,
}

impl LossArrays<'_> {
    /// Reads the optional labels and weights into `opts` and views the
    /// outputs; a `head_grad` array asks the call for the head's gradient
    /// (`LossConfig::head_grad`), of `head_len` elements (`vocab · hs`).
    ///
    /// # Safety
    /// The Python wrapper holds every tensor until the call returns and
    /// allocated `dx`, `loss` and `head_grad` for it alone.
    unsafe fn new(
        opts: &mut LossOptions,
        labels: Option<Spec>,
        weights: Option<Spec>,
        (dx, loss): (Spec, Spec),
        (head_grad, head_len): (Option<Spec>, usize),
    ) -> PyResult<Self> {
        let labels = labels.map(|s| HostArray::new("labels", s)).transpose()?;
        let weights = weights.map(|s| HostArray::new("weights", s)).transpose()?;
        let (dx, loss) = (HostArray::new("dx", dx)?, HostArray::new("loss", loss)?);
        let head_grad = head_grad.map(|s| HostArray::new("head_grad", s)).transpose()?;
        match (&head_grad, opts.config.head_grad) {
            (None, true) => {
                return Err(PyValueError::new_err(
                    "head_grad=True: the head's gradient needs an output array [vocab][hs] (float32)",
                ))
            }
            (Some(array), _) if array.elements() != head_len => {
                return Err(PyValueError::new_err(format!(
                    "head_grad: {} elements given for a head of {head_len} (vocab · hs)",
                    array.elements()
                )))
            }
            _ => opts.config.head_grad = head_grad.is_some(),
        }
        // SAFETY: per this function's contract.
        unsafe {
            opts.labels = labels.map(|l| l.i64s().map(<[i64]>::to_vec)).transpose()?;
            opts.weights = weights.map(|w| w.f32s().map(<[f32]>::to_vec)).transpose()?;
            Ok(Self {
                dx: dx.f32s_mut()?,
                loss: loss.f32s_mut()?,
                head_grad: head_grad.map(|h| h.f32s_mut()).transpose()?,
            })
        }
    }
}

/// A head on a device: `Engine(head, vocab, hs, backend, device,
/// shard)`, `shard` `(v0, v1, vocab)` for the rows `[v0, v1)` of a head
/// of `vocab` rows (then `head` holds those rows alone).
#[pyclass(module = "headkl._native", name = "Engine")]
pub struct PyEngine {
    held: Mutex<AnyEngine>,
    /// The last loss call's outputs, reused call to call.
    out: Mutex<LossOutput>,
    info: DeviceInfo,
    /// Why `auto` chose this device (`None`: a backend was named).
    auto_reason: Option<String>,
    vocab: usize,
    hs: usize,
    /// Buffers exported to CUDA (the Vulkan backend only).
    shared: Mutex<SharedBuffers>,
}

/// `mutex` locked; a panic inside the engine that poisoned it is an error.
fn lock<T>(mutex: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    mutex
        .lock()
        .map_err(|_| PyRuntimeError::new_err("an earlier call panicked inside the engine"))
}

impl PyEngine {
    fn held(&self) -> PyResult<MutexGuard<'_, AnyEngine>> {
        lock(&self.held)
    }

    fn shared(&self) -> PyResult<MutexGuard<'_, SharedBuffers>> {
        lock(&self.shared)
    }

    /// Runs `call` on the Vulkan engine and its shared buffers with the GIL
    /// released, the hidden rows' dtype `dtype` parsed.
    fn on_shared<T: Send>(
        &self,
        py: Python<'_>,
        dtype: &str,
        call: impl FnOnce(&mut Engine<VulkanBackend>, &SharedBuffers, HiddenDtype) -> PyResult<T> + Send,
    ) -> PyResult<T> {
        let dtype = shared::hidden_dtype(dtype)?;
        let mut held = self.held()?;
        let engine = vulkan_whole(&mut held).map_err(PyRuntimeError::new_err)?;
        let shared = self.shared()?;
        let shared = &*shared;
        py.detach(|| call(engine, shared, dtype))
    }

    /// Runs a loss call with the GIL released on the held engines and the
    /// reused outputs, then copies `dx`, the per-token losses and (where
    /// given) the head's gradient out: returns the reduced loss.
    fn loss_call(
        &self,
        py: Python<'_>,
        arrays: LossArrays<'_>,
        call: impl FnOnce(&mut AnyEngine, &mut LossOutput) -> PyResult<()> + Send,
    ) -> PyResult<f64> {
        let (mut held, mut out) = (self.held()?, lock(&self.out)?);
        let (held, out) = (&mut *held, &mut *out);
        py.detach(|| -> PyResult<f64> {
            if arrays.head_grad.is_none() {
                // A frozen head's call keeps no gradient buffer from an
                // earlier trainable one.
                out.head_grad = Vec::new();
            }
            call(held, out)?;
            copy_out(out, arrays)?;
            Ok(out.mean)
        })
    }

    fn hidden<'a>(&self, spec: Spec, ntok: usize) -> PyResult<Hidden<'a>> {
        let x = HostArray::new("hidden", spec)?;
        // SAFETY: the Python wrapper holds the tensor until the call returns.
        let data = unsafe { x.hidden()? };
        Hidden::new(data, ntok, self.hs).map_err(to_py)
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (head, vocab, hs, backend, device=None, shard=None))]
    fn new(
        py: Python<'_>,
        head: Spec,
        vocab: usize,
        hs: usize,
        backend: &str,
        device: Option<usize>,
        shard: Option<(usize, usize, usize)>,
    ) -> PyResult<Self> {
        let head = HostArray::new("weight", head)?;
        // SAFETY: the Python wrapper holds the weight tensor for the call;
        // the engine copies it to the device before returning.
        let data = unsafe { head.head()? };
        let shard = shard
            .map(|(v0, v1, total)| HeadShard::new(v0, v1, total))
            .transpose()
            .map_err(to_py)?;
        let backend = backend.to_owned();
        let (mut held, auto_reason) = py.detach(move || -> PyResult<(AnyEngine, Option<String>)> {
            let weights = HeadWeights::new(data, vocab, hs).map_err(to_py)?;
            open(&backend, device, &weights, shard)
        })?;
        let info = held.engine().info().clone();
        Ok(Self {
            held: Mutex::new(held),
            out: Mutex::new(LossOutput::default()),
            info,
            auto_reason,
            vocab: shard.map_or(vocab, |s| s.vocab()),
            hs,
            shared: Mutex::new(SharedBuffers::default()),
        })
    }

    /// The device: backend, name, type, driver and whether it has matrix units.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("backend", self.info.backend)?;
        d.set_item("name", &self.info.device_name)?;
        d.set_item("type", &self.info.device_type)?;
        d.set_item("driver", &self.info.driver)?;
        d.set_item("matrix_units", self.info.matrix_units)?;
        d.set_item("gemm", self.info.gemm.clone())?;
        d.set_item("auto_reason", self.auto_reason.clone())?;
        Ok(d)
    }

    /// The loss and its gradient against `teacher`: a top-k teacher `(ids,
    /// values, k)`, or for the exact full-vocabulary loss the teacher's own
    /// hidden rows `(teacher_hidden, teacher_hs)` `[ntok][teacher_hs]`
    /// (through the head `set_teacher_head` uploaded). Writes `out` `(dx,
    /// loss)`, `dx` `[ntok][hs]` (f32) and the per-token losses `loss`
    /// `[ntok]`, and with `head_grad` (f32 `[vocab][hs]`) the head's
    /// gradient `∂loss/∂W` (the reduced loss's, as `dx` is; the student's
    /// head alone); returns the reduced loss.
    #[allow(clippy::too_many_arguments, reason = "one array an argument, as Python passes them")]
    #[pyo3(signature = (hidden, ntok, teacher, labels, weights, out, options, head_grad=None))]
    fn head_kl(
        &self,
        py: Python<'_>,
        hidden: Spec,
        ntok: usize,
        teacher: TeacherSpec,
        labels: Option<Spec>,
        weights: Option<Spec>,
        out: (Spec, Spec),
        options: &Bound<'_, PyDict>,
        head_grad: Option<Spec>,
    ) -> PyResult<f64> {
        let (mut opts, reading) = loss_options(options)?;
        let hidden = self.hidden(hidden, ntok)?;
        let head_len = self.vocab * self.hs;
        // SAFETY: the Python wrapper holds every tensor until the call
        // returns and allocated `dx`, `loss` and `head_grad` for it alone.
        let arrays = unsafe { LossArrays::new(&mut opts, labels, weights, out, (head_grad, head_len))? };
        match teacher {
            TeacherSpec::TopK(ids, values, k) => {
                let ids = HostArray::new("teacher_ids", ids)?;
                let values = HostArray::new("teacher_values", values)?;
                // SAFETY: as above, for the teacher's arrays.
                let (ids, values) = unsafe { (ids.i64s()?, values.f32s()?) };
                let vocab = self.vocab;
                self.loss_call(py, arrays, |held, out| {
                    let teacher = topk_teacher(ids, values, (ntok, k, vocab), reading, opts.config.temperature)
                        .map_err(|e| to_py_as(e, TEACHER_ARGUMENTS))?;
                    loss_into(held, LossCall::new(&hidden, LossTeacher::TopK(&teacher), &opts), out)
                })
            }
            TeacherSpec::Hidden(rows, teacher_hs) => {
                let rows = HostArray::new("teacher_hidden", rows)?;
                // SAFETY: as above, for the teacher's rows.
                let rows = unsafe { rows.hidden()? };
                let teacher = Hidden::new(rows, ntok, teacher_hs).map_err(to_py)?;
                self.loss_call(py, arrays, |held, out| {
                    loss_into(held, LossCall::new(&hidden, LossTeacher::Hidden(&teacher), &opts), out)
                })
            }
        }
    }

    /// Uploads the teacher's head `[vocab][hs]` for the full-vocabulary loss.
    fn set_teacher_head(&self, py: Python<'_>, head: Spec, vocab: usize, hs: usize) -> PyResult<()> {
        let head = HostArray::new("teacher_weight", head)?;
        // SAFETY: the Python wrapper holds the tensor for the call; the
        // engine copies it to the device before returning.
        let data = unsafe { head.head()? };
        let mut held = self.held()?;
        let held = &mut *held;
        py.detach(|| -> PyResult<()> {
            let weights = HeadWeights::new(data, vocab, hs).map_err(to_py)?;
            held.engine()
                .set_teacher_head(&weights, SliceOptions::default())
                .map_err(to_py)
        })
    }

    /// Phase one of the sharded loss (`teacher_topk` as in `head_kl`): writes
    /// this shard's `lse`, `lse1` and `soft_part` `[ntok]` (what the
    /// collective merges).
    #[allow(clippy::too_many_arguments, reason = "one array an argument, as Python passes them")]
    #[pyo3(signature = (hidden, ntok, teacher_topk, weights, lse, lse1, soft_part, options))]
    fn loss_partials(
        &self,
        py: Python<'_>,
        hidden: Spec,
        ntok: usize,
        teacher_topk: (Spec, Spec, usize),
        weights: Option<Spec>,
        lse: Spec,
        lse1: Spec,
        soft_part: Spec,
        options: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let (mut opts, reading) = loss_options(options)?;
        let hidden = self.hidden(hidden, ntok)?;
        let (ids, values, k) = teacher_topk;
        let [ids, values, lse, lse1, soft_part] = [
            ("teacher_ids", ids),
            ("teacher_values", values),
            ("lse", lse),
            ("lse1", lse1),
            ("soft_part", soft_part),
        ]
        .map(|(what, spec)| HostArray::new(what, spec));
        let weights = weights.map(|s| HostArray::new("weights", s)).transpose()?;
        // SAFETY: as in `head_kl`.
        let (ids, values, weights, outs) = unsafe {
            (
                ids?.i64s()?,
                values?.f32s()?,
                weights.map(|w| w.f32s()).transpose()?,
                [lse?.f32s_mut()?, lse1?.f32s_mut()?, soft_part?.f32s_mut()?],
            )
        };
        opts.weights = weights.map(<[f32]>::to_vec);
        let vocab = self.vocab;
        let mut held = self.held()?;
        let held = &mut *held;
        py.detach(|| -> PyResult<()> {
            let teacher = topk_teacher(ids, values, (ntok, k, vocab), reading, opts.config.temperature)
                .map_err(|e| to_py_as(e, TEACHER_ARGUMENTS))?;
            let parts = shard(held)?.loss_partials(&hidden, &teacher, &opts).map_err(to_py)?;
            for (out, part) in outs.into_iter().zip([&parts.lse, &parts.lse1, &parts.soft_part]) {
                copy_into(out, part, "partials")?;
            }
            Ok(())
        })
    }

    /// Phase two of the sharded loss from the merged statistics: writes
    /// `out` `(dx, loss)`, this shard's part of `dx` (the collective sums
    /// it) and the per-token losses; returns the reduced loss (the whole
    /// loss's, on every shard).
    #[allow(clippy::too_many_arguments, reason = "one array an argument, as Python passes them")]
    #[pyo3(signature = (hidden, ntok, lse, lse1, soft_part, out))]
    fn loss_finish(
        &self,
        py: Python<'_>,
        hidden: Spec,
        ntok: usize,
        lse: Spec,
        lse1: Spec,
        soft_part: Spec,
        out: (Spec, Spec),
    ) -> PyResult<f64> {
        let hidden = self.hidden(hidden, ntok)?;
        let stats = [("lse", lse), ("lse1", lse1), ("soft_part", soft_part)].map(|(w, s)| HostArray::new(w, s));
        let (dx, loss) = out;
        let dx = HostArray::new("dx", dx)?;
        let loss = HostArray::new("loss", loss)?;
        // SAFETY: as in `head_kl`.
        let (stats, arrays) = unsafe {
            let [a, b, c] = stats;
            (
                LossStats {
                    lse: a?.f32s()?.to_vec(),
                    lse1: b?.f32s()?.to_vec(),
                    soft_part: c?.f32s()?.to_vec(),
                },
                LossArrays {
                    dx: dx.f32s_mut()?,
                    loss: loss.f32s_mut()?,
                    head_grad: None,
                },
            )
        };
        self.loss_call(py, arrays, |held, out| {
            shard(held)?.loss_finish(&hidden, &stats, out).map_err(to_py)
        })
    }

    /// The exact top-k: writes `ids` (int64) and `probs` `[ntok][k]`, and
    /// the full-vocabulary log-probabilities where `logprobs` is given.
    #[allow(clippy::too_many_arguments, reason = "one array an argument, as Python passes them")]
    #[pyo3(signature = (hidden, ntok, k, ids, probs, logprobs, options))]
    fn topk(
        &self,
        py: Python<'_>,
        hidden: Spec,
        ntok: usize,
        k: usize,
        ids: Spec,
        probs: Spec,
        logprobs: Option<Spec>,
        options: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let mut opts: TopkOptions = topk_options(k, options)?;
        opts.logprobs = logprobs.is_some();
        let hidden = self.hidden(hidden, ntok)?;
        let ids = HostArray::new("ids", ids)?;
        let probs = HostArray::new("probs", probs)?;
        let logprobs = logprobs.map(|s| HostArray::new("logprobs", s)).transpose()?;
        // SAFETY: as in `head_kl`.
        let (ids, probs, logprobs) = unsafe {
            (
                ids.i64s_mut()?,
                probs.f32s_mut()?,
                logprobs.map(|l| l.f32s_mut()).transpose()?,
            )
        };
        let mut held = self.held()?;
        let held = &mut *held;
        py.detach(|| -> PyResult<()> {
            let top = held.engine().topk(&hidden, &opts).map_err(to_py)?;
            if ids.len() != top.ids.len() {
                return Err(PyRuntimeError::new_err("ids: wrong length for the top-k"));
            }
            for (o, &i) in ids.iter_mut().zip(&top.ids) {
                *o = i64::from(i);
            }
            copy_into(probs, &top.probs, "probs")?;
            if let Some(lp) = logprobs {
                copy_into(lp, &top.logprobs, "logprobs")?;
            }
            Ok(())
        })
    }

    /// The log-probabilities at the given ids (`ids` int64 `[ntok][k]`, a
    /// negative id is none and reads `-inf`): writes `logprobs` `[ntok][k]`
    /// and `lse` `[ntok]`.
    #[allow(clippy::too_many_arguments, reason = "one array an argument, as Python passes them")]
    #[pyo3(signature = (hidden, ntok, ids, k, logprobs, lse, options))]
    fn gather(
        &self,
        py: Python<'_>,
        hidden: Spec,
        ntok: usize,
        ids: Spec,
        k: usize,
        logprobs: Spec,
        lse: Spec,
        options: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let opts = topk_options(k, options)?;
        let hidden = self.hidden(hidden, ntok)?;
        let ids = HostArray::new("ids", ids)?;
        let logprobs = HostArray::new("logprobs", logprobs)?;
        let lse = HostArray::new("lse", lse)?;
        // SAFETY: as in `head_kl`.
        let (ids, logprobs, lse) = unsafe { (ids.i64s()?, logprobs.f32s_mut()?, lse.f32s_mut()?) };
        let mut held = self.held()?;
        let held = &mut *held;
        py.detach(|| -> PyResult<()> {
            let got = held.engine().logprobs_at(&hidden, ids, &opts).map_err(to_py)?;
            copy_into(logprobs, &got.logprobs, "logprobs")?;
            copy_into(lse, &got.lse, "lse")
        })
    }

    /// The device memory headkl holds: `(now, peak)` bytes (head, scratch
    /// and shared buffers); `reset_peak` restarts the peak count.
    #[pyo3(signature = (reset_peak=false))]
    fn memory(&self, reset_peak: bool) -> PyResult<(u64, u64)> {
        let mut held = self.held()?;
        let engine = held.engine();
        let stats = engine.memory();
        if reset_peak {
            engine.reset_peak_memory();
        }
        Ok((stats.current, stats.peak))
    }

    /// `None` where CUDA tensors can go zero-copy on this engine, else why not.
    fn interop(&self) -> PyResult<Option<String>> {
        let mut held = self.held()?;
        Ok(vulkan_whole(&mut held).err())
    }

    /// The device's UUID (16 bytes), to match it with a CUDA device.
    fn device_uuid(&self) -> PyResult<Vec<u8>> {
        let mut held = self.held()?;
        let engine = vulkan_whole(&mut held).map_err(PyRuntimeError::new_err)?;
        Ok(engine.backend().device_uuid().to_vec())
    }

    /// Exports a device buffer of `bytes` bytes: `(handle, fd, allocation
    /// bytes)`; the fd is the caller's (CUDA's import takes it over).
    fn export_buffer(&self, bytes: u64) -> PyResult<(usize, i32, u64)> {
        let mut held = self.held()?;
        let engine = vulkan_whole(&mut held).map_err(PyRuntimeError::new_err)?;
        self.shared()?.export(engine.backend(), bytes)
    }

    /// Frees an exported buffer once the device is done with it.
    fn free_buffer(&self, py: Python<'_>, handle: usize) -> PyResult<()> {
        let mut held = self.held()?;
        let engine = vulkan_whole(&mut held).map_err(PyRuntimeError::new_err)?;
        py.detach(|| engine.backend().finish()).map_err(to_py)?;
        self.shared()?.free(handle);
        Ok(())
    }

    /// An fd of the shared timeline semaphore (the caller's).
    fn export_timeline(&self) -> PyResult<i32> {
        use std::os::fd::IntoRawFd;
        let mut held = self.held()?;
        let engine = vulkan_whole(&mut held).map_err(PyRuntimeError::new_err)?;
        Ok(engine.backend().export_timeline().map_err(to_py)?.into_raw_fd())
    }

    /// The loss on shared buffers (handles from `export_buffer`), `buffers`
    /// `(hidden, ids, values, weights, labels, loss, dx)`, `shape` `(ntok,
    /// k, hidden dtype)`: waits on the timeline for `wait` and signals
    /// `signal` when done (`timeline` `(wait, signal)`); returns at once.
    #[pyo3(signature = (shape, buffers, options, timeline))]
    fn head_kl_shared(
        &self,
        py: Python<'_>,
        shape: (usize, usize, String),
        buffers: LossBuffersArg<usize>,
        options: &Bound<'_, PyDict>,
        timeline: (u64, u64),
    ) -> PyResult<()> {
        let (ntok, k, dtype) = shape;
        let (opts, reading) = loss_options(options)?;
        let buffers = LossBuffers::from(buffers);
        self.on_shared(py, &dtype, |engine, shared, dtype| {
            shared::head_kl(engine, shared, (ntok, k, dtype), &buffers, (&opts, &reading), timeline)
        })
    }

    /// The top-k on shared buffers, `buffers` `(hidden, ids, values)`:
    /// `ids` u32, `values` f32 `[ntok][k]`, probabilities, or
    /// log-probabilities with `logprobs`. `shape` and `timeline` as in
    /// `head_kl_shared`.
    #[pyo3(signature = (shape, buffers, logprobs, options, timeline))]
    fn topk_shared(
        &self,
        py: Python<'_>,
        shape: (usize, usize, String),
        buffers: (usize, usize, usize),
        logprobs: bool,
        options: &Bound<'_, PyDict>,
        timeline: (u64, u64),
    ) -> PyResult<()> {
        let (ntok, k, dtype) = shape;
        let mut opts = topk_options(k, options)?;
        opts.logprobs = logprobs;
        self.on_shared(py, &dtype, |engine, shared, dtype| {
            shared::topk(engine, shared, (ntok, dtype), buffers, &opts, timeline)
        })
    }

    /// The gather on shared buffers, `buffers` `(hidden, ids, logprobs,
    /// lse)`: `ids` u32 `[ntok][k]`, `0xffffffff` none; `logprobs` f32
    /// `[ntok][k]`, `lse` f32 `[ntok]`. `shape` and `timeline` as in
    /// `head_kl_shared`.
    #[pyo3(signature = (shape, buffers, options, timeline))]
    fn gather_shared(
        &self,
        py: Python<'_>,
        shape: (usize, usize, String),
        buffers: (usize, usize, usize, usize),
        options: &Bound<'_, PyDict>,
        timeline: (u64, u64),
    ) -> PyResult<()> {
        let (ntok, k, dtype) = shape;
        let opts = topk_options(k, options)?;
        self.on_shared(py, &dtype, |engine, shared, dtype| {
            shared::gather(engine, shared, (ntok, dtype), buffers, &opts, timeline)
        })
    }

    /// The loss on CUDA tensors by `(address, bytes)`, on the CUDA
    /// backend, queued on `stream` (PyTorch's current one); `shape` and
    /// `tensors` as in `head_kl_shared`, and `head_grad` the head's
    /// gradient f32 `[V][hs]` where the head is trainable. Returns once the
    /// work is queued.
    #[pyo3(signature = (shape, tensors, options, stream, head_grad=None))]
    fn head_kl_cuda(
        &self,
        py: Python<'_>,
        shape: (usize, usize, String),
        tensors: LossBuffersArg<cuda::Device>,
        options: &Bound<'_, PyDict>,
        stream: u64,
        head_grad: Option<cuda::Device>,
    ) -> PyResult<()> {
        let (ntok, k, dtype) = shape;
        let (opts, reading) = loss_options(options)?;
        let tensors = LossBuffers::from(tensors);
        let mut held = self.held()?;
        let engine = cuda::cuda_whole(&mut held).map_err(cuda::not_cuda)?;
        py.detach(|| {
            cuda::head_kl(
                engine,
                (ntok, k, &dtype),
                &tensors,
                head_grad,
                (&opts, &reading),
                stream,
            )
        })
    }

    /// Reads the head again into the engine's planes on the device, queued
    /// on `stream`: `write(address, first_row, rows, ld)` writes each
    /// plane's rows as f16 ([`cuda::refill_head`]).
    fn refill_head_cuda(&self, write: &Bound<'_, PyAny>, stream: u64) -> PyResult<()> {
        let mut held = self.held()?;
        let engine = cuda::cuda_whole(&mut held).map_err(cuda::not_cuda)?;
        cuda::refill_head(engine, write, stream)
    }

    /// The top-k on CUDA tensors `(hidden, ids, values)` by `(address,
    /// bytes)`, queued on `stream`; `shape` `(ntok, k, hidden dtype)`.
    #[pyo3(signature = (shape, tensors, logprobs, options, stream))]
    fn topk_cuda(
        &self,
        py: Python<'_>,
        shape: (usize, usize, String),
        tensors: (cuda::Device, cuda::Device, cuda::Device),
        logprobs: bool,
        options: &Bound<'_, PyDict>,
        stream: u64,
    ) -> PyResult<()> {
        let (ntok, k, dtype) = shape;
        let mut opts = topk_options(k, options)?;
        opts.logprobs = logprobs;
        let mut held = self.held()?;
        let engine = cuda::cuda_whole(&mut held).map_err(cuda::not_cuda)?;
        py.detach(|| cuda::topk(engine, (ntok, &dtype), tensors, &opts, stream))
    }

    /// The gather on CUDA tensors `(hidden, ids, logprobs, lse)` by
    /// `(address, bytes)`, queued on `stream`; `shape` `(ntok, k, hidden
    /// dtype)`.
    #[pyo3(signature = (shape, tensors, options, stream))]
    fn gather_cuda(
        &self,
        py: Python<'_>,
        shape: (usize, usize, String),
        tensors: (cuda::Device, cuda::Device, cuda::Device, cuda::Device),
        options: &Bound<'_, PyDict>,
        stream: u64,
    ) -> PyResult<()> {
        let (ntok, k, dtype) = shape;
        let opts = topk_options(k, options)?;
        let mut held = self.held()?;
        let engine = cuda::cuda_whole(&mut held).map_err(cuda::not_cuda)?;
        py.detach(|| cuda::gather(engine, (ntok, &dtype), tensors, &opts, stream))
    }

    /// Waits for the device and raises what the last zero-copy or CUDA
    /// call flagged.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let mut held = self.held()?;
        if let Ok(engine) = cuda::cuda_whole(&mut held) {
            return py.detach(|| engine.wait_device().map_err(to_py));
        }
        match vulkan_whole(&mut held) {
            Ok(engine) => py.detach(|| shared::synchronize(engine)),
            Err(_) => Ok(()),
        }
    }
}

/// The Vulkan engine over the whole head, or why the zero-copy path
/// cannot run on this one.
fn vulkan_whole(held: &mut AnyEngine) -> Result<&mut Engine<VulkanBackend>, String> {
    let kind = held.engine().info().backend;
    if held.shard().is_some() && kind == BackendKind::Vulkan.name() {
        return Err("a vocabulary shard runs through host copies".into());
    }
    match held.whole_on::<VulkanBackend>() {
        Some(e) => e.backend().interop().map(|()| e).map_err(|e| e.to_string()),
        None if kind == BackendKind::Reference.name() => Err("the reference backend runs on the CPU".into()),
        None => Err(format!(
            "the {kind} backend cannot share memory with CUDA (Vulkan only)"
        )),
    }
}

fn copy_into(out: &mut [f32], from: &[f32], what: &str) -> PyResult<()> {
    if out.len() != from.len() {
        return Err(PyRuntimeError::new_err(format!(
            "{what}: {} elements given for {}",
            out.len(),
            from.len()
        )));
    }
    out.copy_from_slice(from);
    Ok(())
}

fn copy_out(out: &LossOutput, arrays: LossArrays<'_>) -> PyResult<()> {
    copy_into(arrays.dx, &out.dx, "dx")?;
    copy_into(arrays.loss, &out.loss, "loss")?;
    match arrays.head_grad {
        Some(head_grad) => copy_into(head_grad, &out.head_grad, "head_grad"),
        None => Ok(()),
    }
}
