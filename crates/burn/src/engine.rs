//! headkl's engine as [`crate::HeadKl`] and burn's graph share it: a loss
//! node of a trainable head's per-token loss makes one more loss call in
//! its backward step (`grad.rs`), so the engine, its staging buffers and
//! the calls since the last wait live behind one lock that both hold.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use burn::prelude::Tensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use headkl_core::{
    Backend, DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, HiddenDtype, LossConfig,
};
use headkl_wgpu::WgpuBackend;

use crate::bridge::{Binder, Binding, Flow, Primitive, Staging};
use crate::device::SharedDevice;
use crate::{contiguous, head, output, Result};

/// The state the lock guards.
pub(crate) struct Core {
    pub engine: Engine<WgpuBackend>,
    pub shared: SharedDevice,
    pub staging: Staging,
    /// Calls are numbered from 1; the next one's number.
    next_call: u64,
    /// The calls made since the last wait, and whether each gave its ids
    /// as signed integers.
    pub since_wait: Vec<(u64, &'static str, bool)>,
    /// Which head the planes hold: 0 for the one the engine was made
    /// with, else the number [`Core::new_version`] gave the call that
    /// read it.
    pub head_version: u64,
    last_version: u64,
    /// A backward step's failure, for the next wait.
    pub deferred: Option<crate::Error>,
}

/// The lock, as `HeadKl` and the graph's nodes hold it.
#[derive(Clone)]
pub(crate) struct SharedCore(Arc<Mutex<Core>>);

impl std::fmt::Debug for SharedCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedCore")
    }
}

impl SharedCore {
    pub fn new(engine: Engine<WgpuBackend>, shared: SharedDevice) -> Self {
        Self(Arc::new(Mutex::new(Core {
            engine,
            shared,
            staging: Staging::default(),
            next_call: 1,
            since_wait: Vec::new(),
            head_version: 0,
            last_version: 0,
            deferred: None,
        })))
    }

    /// The state (a call that panicked leaves it usable: every field is
    /// consistent between calls).
    pub fn lock(&self) -> MutexGuard<'_, Core> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A loss call's inputs, converted (ids as 32-bit words, probabilities and
/// weights f32) but not yet bound.
#[derive(Clone, Debug)]
pub(crate) struct LossInputs {
    pub ntok: usize,
    pub k: usize,
    pub hidden: Primitive,
    pub hdtype: HiddenDtype,
    pub ids: Primitive,
    pub probs: Primitive,
    pub weights: Option<Primitive>,
    /// The ids were signed (a −1 is reported as −1).
    pub signed: bool,
}

/// What a loss call wrote: the per-token loss f32 `[ntok]`, dx f32
/// `[ntok][hs]`, with `head_grad` the head's gradient f32 `[V][hs]`, and
/// how the tensors were bound.
pub(crate) struct LossCubes {
    pub loss: CubeTensor,
    pub dx: CubeTensor,
    pub head_grad: Option<CubeTensor>,
    pub binding: Binding,
}

impl Core {
    /// A number for a head read from a tensor.
    pub fn new_version(&mut self) -> u64 {
        self.last_version += 1;
        self.last_version
    }

    /// Numbers a call whose work was submitted.
    pub fn submitted(&mut self, what: &'static str, signed: bool) {
        self.since_wait.push((self.next_call, what, signed));
        self.next_call += 1;
    }

    /// Refuses the head's gradient where its f32 `[V][hs]` is past one
    /// binding, as the device-resident loss does (before anything is
    /// recorded or read).
    pub fn check_head_grad_fits(&self) -> Result<()> {
        let (vocab, hs) = (self.engine.vocab(), self.engine.hs());
        let info = self.engine.backend().info();
        let bytes = (vocab as u64).saturating_mul(hs as u64).saturating_mul(4);
        if bytes > info.max_binding_bytes.min(info.max_buffer_bytes) {
            return Err(headkl_core::Error::HeadGradUnsupported {
                entry: "a trainable head at this size (its f32 gradient is past the device's largest binding)",
                hint: "keep the head frozen (HeadKl::loss), or use headkl's host call (Engine::head_kl), which returns it",
            }
            .into());
        }
        Ok(())
    }

    /// Rewrites the engine's head planes from `plain` (outside any graph;
    /// its shape the engine's) and records it as head `version`: the
    /// values checked and the rows' norms read (one host read), the
    /// planes written by device copies. The bytes copied.
    pub fn read_head(&mut self, plain: &Tensor<2>, version: u64) -> Result<u64> {
        let prepared = head::prepare(plain.clone())?;
        let shared = &self.shared;
        let mut bytes = 0u64;
        self.engine.refill_device_head(&prepared.norms, |_, plane| {
            bytes += head::fill_plane(&prepared.w16, plane, shared)?;
            Ok(())
        })?;
        self.head_version = version;
        Ok(bytes)
    }

    /// One device-resident loss call (`what` names it in [`crate::Calls`]):
    /// burn's queued work flushed, the inputs bound in place or copied,
    /// headkl's kernels submitted to the same queue; with `head_grad`, the
    /// head's gradient into a fresh burn tensor. Nothing waits.
    pub fn loss_call(
        &mut self,
        what: &'static str,
        inputs: &LossInputs,
        config: LossConfig,
        head_grad: bool,
    ) -> Result<LossCubes> {
        let (ntok, k) = (inputs.ntok, inputs.k);
        let (vocab, hs) = (self.engine.vocab(), self.engine.hs());
        let mut stats = Binding::default();
        let h_cube = contiguous(crate::bridge::resolve_float(&inputs.hidden), &mut stats);
        let ids_cube = contiguous(crate::bridge::resolve_int(&inputs.ids), &mut stats);
        let probs_cube = contiguous(crate::bridge::resolve_float(&inputs.probs), &mut stats);
        let w_cube = inputs
            .weights
            .as_ref()
            .map(|w| contiguous(crate::bridge::resolve_float(w), &mut stats));
        let loss_cube = output(&h_cube, Shape::new([ntok]), DType::F32);
        let dx_cube = output(&h_cube, Shape::new([ntok, hs]), DType::F32);
        let dw_cube = head_grad.then(|| output(&h_cube, Shape::new([vocab, hs]), DType::F32));

        let (nk, nh) = ((ntok * k) as u64, (ntok * hs) as u64);
        let hidden_bytes = nh * inputs.hdtype.bytes() as u64;
        let mut binder = Binder::new(self.shared.wgpu_device(), self.shared.queue(), &mut self.staging, stats);
        let backend = self.engine.backend();
        let h_view = binder.bind(backend, "hidden", &h_cube, hidden_bytes, Flow::In)?;
        let ids_view = binder.bind(backend, "teacher.ids", &ids_cube, nk * 4, Flow::In)?;
        let probs_view = binder.bind(backend, "teacher.probs", &probs_cube, nk * 4, Flow::In)?;
        let w_view = match &w_cube {
            Some(c) => Some(binder.bind(backend, "weights", c, ntok as u64 * 4, Flow::In)?),
            None => None,
        };
        let loss_view = binder.bind(backend, "loss", &loss_cube, ntok as u64 * 4, Flow::Out)?;
        let dx_view = binder.bind(backend, "dx", &dx_cube, nh * 4, Flow::Out)?;
        let dw_view = match &dw_cube {
            Some(c) => Some(binder.bind(backend, "head_grad", c, (vocab * hs) as u64 * 4, Flow::Out)?),
            None => None,
        };
        binder.submit_inputs(&h_cube)?;
        let result = self.engine.head_kl_device(
            ntok,
            &DeviceHidden {
                buffer: &h_view,
                dtype: inputs.hdtype,
            },
            &DeviceTeacher::new(&ids_view, &probs_view, k),
            &DeviceLossOutput {
                loss: &loss_view,
                dx: &dx_view,
            },
            &DeviceLossOptions {
                config,
                weights: w_view.as_ref(),
                head_grad_out: dw_view.as_ref(),
                ..DeviceLossOptions::default()
            },
        );
        let binding = binder.finish();
        result?;
        self.submitted(what, inputs.signed);
        Ok(LossCubes {
            loss: loss_cube,
            dx: dx_cube,
            head_grad: dw_cube,
            binding,
        })
    }
}
