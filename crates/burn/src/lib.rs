//! headkl's distillation loss as a burn autodiff op, on burn's own wgpu
//! device and tensors. Everything the calls take and return is in
//! [`prelude`].
//!
//! ```no_run
//! use burn::prelude::Tensor;
//! use headkl_burn::prelude::*;
//!
//! # fn main() -> headkl_burn::Result<()> {
//! # let (vocab, hs, ntok) = (512, 64, 8);
//! # let w = vec![0.01f32; vocab * hs];
//! // One wgpu device for burn and headkl (headkl's features, queue family and alignment).
//! let shared = SharedDevice::open(&DeviceOptions::default())?;
//! let device = shared.device().autodiff();
//! let mut head = HeadKl::new(&shared, &HeadWeights::new(HeadData::F32(&w), vocab, hs)?, &OpenOptions::default())?;
//!
//! // The teacher's top-k, as burn tensors.
//! let teacher_hidden = Tensor::<2>::random([ntok, hs], burn::tensor::Distribution::Default, &device);
//! let top = head.topk(&teacher_hidden, &TopkOptions::new(16))?;
//! let teacher = Teacher { ids: top.ids, probs: top.probs };
//!
//! // The student's hidden rows, from its own layers; the loss is a node of burn's graph.
//! let hidden = Tensor::<2>::random([ntok, hs], burn::tensor::Distribution::Default, &device).require_grad();
//! let out = head.loss(&hidden, &teacher, None, &LossConfig::default())?;
//! let grads = out.loss.backward(); // dx into hidden's gradient, and on into the student's parameters
//! head.wait()?; // what the device flagged (bad teacher data), naming the call
//! # Ok(()) }
//! ```
//!
//! Nothing crosses to the host and nothing waits inside [`HeadKl::loss`] and
//! [`HeadKl::topk`]: burn's queued work is flushed, headkl's kernels are
//! submitted to the same queue, reading and writing burn's buffers where
//! they lie (see [`Binding`] for when a device copy is made instead).
//!
//! The head above is frozen: uploaded once, outside burn's graph. A
//! trainable head (a `Param`, or the input embedding's weight tied as the
//! head) goes to [`HeadKl::loss_with_head`] with the hidden rows on each
//! call: it is read again into the engine (a device copy, and a host wait
//! for its check), and the loss is a node with two parents, so backward
//! gives the head its gradient beside the rows'.
//!
//! Bad teacher data cannot slip into a step unseen: a row the device flags
//! has a NaN per-token loss (so the mean is NaN) and a zero gradient row,
//! and [`HeadKl::wait`] names the call; [`HeadKl::set_checked`] reports at
//! once instead.
//!
//! On a machine without a desktop session Mesa's Vulkan loader prints
//! `XDG_RUNTIME_DIR is invalid or not set`; set `XDG_RUNTIME_DIR` in the
//! environment that starts the trainer to quiet it (this library leaves the
//! environment alone).

mod bridge;
mod device;
mod engine;
mod error;
mod grad;
mod head;
pub mod unfused;

use std::ops::{Deref, DerefMut};
use std::sync::MutexGuard;

use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::backend::Cube;
use burn::backend::TensorMetadata;
use burn::prelude::{Int, Tensor};
use burn::tensor::{activation, DType, Device, FloatDType, IntDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use headkl_core::{DeviceHidden, Engine, HeadWeights, HiddenDtype, LossConfig, Reduction, SliceOptions, TopkOptions};
use headkl_wgpu::{OpenOptions, WgpuBackend};

pub use bridge::Binding;
pub use device::{device_descriptor, DeviceOptions, SharedDevice, BIND_ALIGN};
pub use error::{Calls, Error, Result};
/// headkl's library, for what the prelude leaves out.
pub use headkl_core;
/// headkl's wgpu backend, for its options.
pub use headkl_wgpu;

use bridge::{AdTensor, Binder, Flow, Primitive};
use engine::{Core, LossInputs, SharedCore};
use grad::{HeadGradOf, PerTokenHead, Upstream};

/// Everything headkl-burn's calls take and return, in one `use` (not the
/// crate's `Result` alias, which would shadow the standard one in a glob
/// import: name it `headkl_burn::Result`).
pub mod prelude {
    pub use crate::{
        device_descriptor, Binding, Calls, DeviceOptions, EngineGuard, Error, HeadKl, LossOutput, SharedDevice,
        Teacher, TopK, BIND_ALIGN,
    };
    pub use headkl_core::{Divergence, HeadData, HeadWeights, LossConfig, LossTerms, Reduction, TopkOptions};
    pub use headkl_wgpu::OpenOptions;
}

/// The name errors of this crate carry.
pub const BACKEND: &str = "burn";

/// The teacher's top-k as burn tensors: ids (any int dtype; i32 and u32
/// are read in place, others converted on the device) and probabilities
/// (f32 read in place; f16/bf16 converted), `[ntok][k]` each. The
/// probabilities need not sum to 1: they are renormalized on the device.
#[derive(Clone, Debug)]
pub struct Teacher {
    /// Ids `[ntok][k]`.
    pub ids: Tensor<2, Int>,
    /// Probabilities `[ntok][k]`.
    pub probs: Tensor<2>,
}

/// What [`HeadKl::loss`] and [`HeadKl::loss_with_head`] return. A row the
/// device flags (a bad teacher row or weight) has a NaN `per_token` entry,
/// so `loss` is NaN, and a zero `dx` row: it contributes nothing to the
/// gradient (nor to the head's).
#[derive(Clone, Debug)]
pub struct LossOutput {
    /// The mean loss `Σ_t w_t L_t / total`, shape `[1]`. On an autodiff
    /// device with `hidden` tracked, `loss.backward()` puts
    /// `dx · upstream` into `hidden`'s gradient (and, with a trainable
    /// head, `head_grad · upstream` into the head's).
    pub loss: Tensor<1>,
    /// The per-token loss `L_t` (unweighted), f32 `[ntok]`: PyTorch's
    /// `reduction="none"`. With `hidden` tracked it is a node of the graph
    /// too: a reduction of the caller's own backpropagates `∂L_t/∂x_t`
    /// times its upstream into row t, for every row of positive weight
    /// (a row of weight 0 or a flagged row gets none). With a trainable
    /// head, the head gets `Σ_t u_t ∂L_t/∂W` over those rows for an
    /// upstream `u`, which costs two more loss calls in the backward step.
    pub per_token: Tensor<1>,
    /// `∂loss/∂hidden`, f32 `[ntok][hs]`, outside the graph.
    pub dx: Tensor<2>,
    /// With a trainable head ([`HeadKl::loss_with_head`], the head
    /// tracked): `∂loss/∂W`, f32 `[V][hs]`, outside the graph; `None`
    /// for a frozen head.
    pub head_grad: Option<Tensor<2>>,
}

/// The teacher's top-k from [`HeadKl::topk`].
#[derive(Clone, Debug)]
pub struct TopK {
    /// Ids `[ntok][k]` (i32), by descending logit.
    pub ids: Tensor<2, Int>,
    /// Probabilities `[ntok][k]` (f32), the softmax over the k at τ.
    pub probs: Tensor<2>,
    /// With [`TopkOptions::logprobs`]: the log-probabilities `[ntok][k]`
    /// (f32) over the full vocabulary at τ, as a stored teacher holds them.
    pub logprobs: Option<Tensor<2>>,
}

/// A trainable head, checked: its primitive, its float dtype, and its
/// graph node where it is tracked.
struct HeadParts {
    inner: Primitive,
    dtype: FloatDType,
    tracked: Option<(AdTensor, burn::backend::GradientCheckpointingStrategy)>,
}

/// headkl's engine on a [`SharedDevice`], holding the head: uploaded once
/// for a frozen head ([`HeadKl::loss`]), read again from the head tensor
/// by each call for a trainable one ([`HeadKl::loss_with_head`]).
pub struct HeadKl {
    /// The engine, shared with the graph's nodes of a trainable head.
    core: SharedCore,
    shared: SharedDevice,
    vocab: usize,
    hs: usize,
    last: Binding,
    checked: bool,
}

/// [`HeadKl::engine`]'s hold on headkl's engine. The engine is locked
/// while this lives: drop it before the next call and before a backward
/// step through a trainable head's per-token loss.
pub struct EngineGuard<'a>(MutexGuard<'a, Core>);

impl Deref for EngineGuard<'_> {
    type Target = Engine<WgpuBackend>;

    fn deref(&self) -> &Self::Target {
        &self.0.engine
    }
}

impl DerefMut for EngineGuard<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0.engine
    }
}

/// A device as a message names it: burn's debug form without its wrapper.
fn brief(device: &Device) -> String {
    let full = format!("{device:?}");
    let inner = full
        .strip_prefix("Device<")
        .and_then(|s| s.strip_suffix('>'))
        .unwrap_or(&full);
    match inner.strip_prefix("Autodiff { device: ") {
        Some(rest) => format!("{} (autodiff)", rest.split(", checkpointing").next().unwrap_or(rest)),
        None => inner.to_string(),
    }
}

fn check_device(input: &'static str, device: &Device, expected: &Device) -> Result<()> {
    if device == expected {
        return Ok(());
    }
    Err(Error::Device {
        input,
        device: brief(device),
        expected: brief(expected),
    })
}

fn dtype_error(input: &'static str, dtype: DType, expected: &'static str) -> Error {
    Error::Dtype {
        input,
        dtype: format!("{dtype:?}"),
        expected,
    }
}

fn hidden_dtype(dtype: DType) -> Result<(HiddenDtype, FloatDType)> {
    match dtype {
        DType::F32 => Ok((HiddenDtype::F32, FloatDType::F32)),
        DType::F16 => Ok((HiddenDtype::F16, FloatDType::F16)),
        DType::BF16 => Ok((HiddenDtype::Bf16, FloatDType::BF16)),
        other => Err(dtype_error("hidden", other, "f32, f16 or bf16")),
    }
}

/// A float input as f32 (a device conversion where it is not).
fn as_f32(inner: Primitive, input: &'static str) -> Result<Primitive> {
    match inner.dtype {
        DType::F32 => Ok(inner),
        DType::F16 | DType::BF16 | DType::F64 => Ok(Cube::float_cast(inner, FloatDType::F32)),
        other => Err(dtype_error(input, other, "a float tensor")),
    }
}

/// Whether ids of `dtype` are signed (a −1 among them is reported as −1).
fn signed_ids(dtype: DType) -> bool {
    matches!(dtype, DType::I64 | DType::I32 | DType::I16 | DType::I8)
}

/// Ids as 32-bit words (i32 and u32 as they are; other ints converted).
fn as_u32_words(inner: Primitive) -> Result<Primitive> {
    match inner.dtype {
        DType::I32 | DType::U32 => Ok(inner),
        DType::I64 | DType::U64 | DType::I16 | DType::U16 | DType::I8 | DType::U8 => {
            Ok(Cube::int_cast(inner, IntDType::I32))
        }
        other => Err(dtype_error("teacher.ids", other, "an int tensor")),
    }
}

/// An id the device read as a 32-bit word, as the caller gave it.
fn signed_id(id: i64) -> i64 {
    // The device saw the two's-complement word of the caller's i32.
    i64::from(id as u32 as i32)
}

/// headkl's error for what the device flagged, with ids as the caller
/// gave them.
fn as_given(error: headkl_core::Error, signed: bool) -> headkl_core::Error {
    use headkl_core::Error as E;
    if !signed {
        return error;
    }
    match error {
        E::IdOutOfRange { row, col, id, vocab } => E::IdOutOfRange {
            row,
            col,
            id: signed_id(id),
            vocab,
        },
        E::DuplicateId { row, id, first, second } => E::DuplicateId {
            row,
            id: signed_id(id),
            first,
            second,
        },
        other => other,
    }
}

fn contiguous(t: CubeTensor, binding: &mut Binding) -> CubeTensor {
    if t.is_contiguous() {
        return t;
    }
    binding.copied += 1;
    binding.copied_bytes += (t.shape().num_elements() * t.dtype.size()) as u64;
    burn_cubecl::kernel::into_contiguous(t)
}

/// A fresh f32/i32 cubecl tensor of `shape` like `like` (its client and
/// device), for headkl to write.
fn output(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    let bytes = shape.num_elements() * dtype.size();
    let handle = like.client.empty(bytes);
    CubeTensor::new_contiguous(like.client.clone(), like.device.clone(), shape, handle, dtype)
}

impl HeadKl {
    /// headkl's engine on `shared`'s device with `head` uploaded (any
    /// dtype headkl reads). `options` are headkl's backend options (GEMM
    /// choice, bounds checks; the adapter and queue are the device's).
    pub fn new(shared: &SharedDevice, head: &HeadWeights<'_>, options: &OpenOptions) -> Result<Self> {
        let backend = shared.backend(options)?;
        let engine = Engine::new(backend, head, SliceOptions::default())?;
        Ok(Self::around(engine, shared, Binding::default()))
    }

    fn around(engine: Engine<WgpuBackend>, shared: &SharedDevice, last: Binding) -> Self {
        Self {
            vocab: engine.vocab(),
            hs: engine.hs(),
            core: SharedCore::new(engine, shared.clone()),
            shared: shared.clone(),
            last,
            checked: false,
        }
    }

    /// headkl's engine with the head `w` (`[vocab][hs]`, f32, f16 or bf16),
    /// a burn tensor (a `Param`'s value, say) on `shared`'s device: rounded
    /// to f16 and copied into headkl's planes on the device, with no host
    /// copy of it. The host reads whether a value is not finite or past
    /// f16's range (then the first one, as headkl's error naming its row
    /// and column) and the rows' norms (`[vocab]` f32, for the dx block
    /// filter). [`HeadKl::last_binding`] reports the copy. The tensor is
    /// read once, outside any graph: [`HeadKl::loss`] treats the head as
    /// frozen; [`HeadKl::loss_with_head`] takes it (or its later values)
    /// as a trainable head.
    pub fn from_tensor(shared: &SharedDevice, w: &Tensor<2>, options: &OpenOptions) -> Result<Self> {
        let ([vocab, hs], parts) = head::check(w, shared)?;
        let prepared = head::prepare(head::plain(parts.inner))?;
        let mut copied_bytes = 0u64;
        let backend = shared.backend(options)?;
        let engine = Engine::from_device_head(
            backend,
            (vocab, hs),
            SliceOptions::default(),
            &prepared.norms,
            |_, plane| {
                copied_bytes += head::fill_plane(&prepared.w16, plane, shared)?;
                Ok(())
            },
        )?;
        let last = Binding {
            in_place: 0,
            copied: 1,
            copied_bytes,
        };
        Ok(Self::around(engine, shared, last))
    }

    /// The head's vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The head's hidden size.
    pub fn hs(&self) -> usize {
        self.hs
    }

    /// The device this head runs on.
    pub fn shared(&self) -> &SharedDevice {
        &self.shared
    }

    /// How the last call's tensors reached headkl.
    pub fn last_binding(&self) -> Binding {
        self.last
    }

    /// headkl's engine (its backend, timing and trace switches), locked
    /// while the guard lives ([`EngineGuard`]).
    pub fn engine(&mut self) -> EngineGuard<'_> {
        EngineGuard(self.core.lock())
    }

    /// Checked mode: every call waits for the device and returns what it
    /// flagged at once, before the caller's optimizer step (a host wait
    /// per call: for debugging, or for data not yet trusted).
    pub fn set_checked(&mut self, on: bool) {
        self.checked = on;
    }

    /// Waits for the device and reports what it flagged in the calls made
    /// since the last wait (an id out of range or repeated, a bad
    /// probability or weight, a `total` that is not positive, non-finite
    /// logits) as [`Error::OnDevice`], naming the calls and the token.
    /// A backward step whose call for a trainable head's gradient failed
    /// is reported first, as [`Error::Backward`].
    pub fn wait(&mut self) -> Result<()> {
        let mut core = self.core.lock();
        let calls = std::mem::take(&mut core.since_wait);
        let deferred = core.deferred.take();
        let signed = calls.iter().any(|&(_, _, signed)| signed);
        let flagged = core.engine.wait_device().map_err(|source| Error::OnDevice {
            calls: Calls {
                calls: calls.iter().map(|&(n, what, _)| (n, what)).collect(),
            },
            source: as_given(source, signed),
        });
        match deferred {
            Some(e) => {
                if let Err(also) = flagged {
                    log::error!("headkl-burn: {also}");
                }
                Err(e)
            }
            None => flagged,
        }
    }

    /// In checked mode, waits (after a call's work was submitted).
    fn after_call(&mut self) -> Result<()> {
        if self.checked {
            self.wait()?;
        }
        Ok(())
    }

    fn check_hidden(&self, hidden: &Tensor<2>) -> Result<usize> {
        let [ntok, hs] = hidden.dims();
        if hs != self.hs {
            return Err(Error::HiddenWidth { got: hs, head: self.hs });
        }
        if ntok == 0 {
            return Err(headkl_core::Error::NoTokens.into());
        }
        check_device("hidden", &hidden.device(), &self.shared.device())?;
        Ok(ntok)
    }

    /// The distillation loss of `hidden` (`[ntok][hs]`, f32/f16/bf16)
    /// against `teacher` through the engine's head, frozen: with optional
    /// token `weights` (`[ntok]`; 0 masks a token). Returns burn tensors;
    /// where `hidden` is a tracked tensor of an autodiff device,
    /// `out.loss.backward()` delivers `dx` scaled by the upstream gradient
    /// into `hidden`'s gradient, and `out.per_token` is tracked as well.
    /// Shapes, dtypes and devices are checked before anything is
    /// recorded. Bad teacher data is checked on the device, with no host
    /// wait: a flagged row's `per_token` entry is NaN (so is `loss`) and
    /// its gradient 0, and [`HeadKl::wait`] names the call and the row.
    ///
    /// `opts` is headkl's [`LossConfig`], as every path takes it: τ, the
    /// reduction into `loss` (PyTorch's `reduction`: `none` returns the sum
    /// in `loss`, and `per_token` holds the losses; dx is the reduced
    /// loss's gradient), the terms (the hard term needs labels, which this
    /// call does not take), the dx block filter, the scratch budget.
    pub fn loss(
        &mut self,
        hidden: &Tensor<2>,
        teacher: &Teacher,
        weights: Option<&Tensor<1>>,
        opts: &LossConfig,
    ) -> Result<LossOutput> {
        self.loss_through(hidden, None, teacher, weights, opts)
    }

    /// [`HeadKl::loss`] through a trainable head: `head` (`[vocab][hs]`,
    /// f32/f16/bf16, the engine's shape, on its device) is the head's value
    /// now, a `Param`'s value or a weight tied to the input embedding, and
    /// a second parent of the loss in burn's graph. `loss.backward()` then
    /// puts `∂loss/∂W · upstream` into `head`'s gradient (in its dtype) beside
    /// `dx · upstream` into `hidden`'s; a tied weight gets the sum of both
    /// uses, as burn adds them. `out.head_grad` holds `∂loss/∂W` (f32).
    ///
    /// The head is read again on every call: checked (a value that is not
    /// finite or past f16's range is headkl's error naming its row and
    /// column), rounded to f16 and copied into the engine's planes on the
    /// device. That costs a device copy of the f16 head and a host wait:
    /// the check and the rows' norms (`[vocab]` f32) are read back in one
    /// read, and the engine lets its work in flight finish before it
    /// rewrites the planes. Every call, not
    /// only when the head changed: in training it changes with every
    /// optimizer step, and burn cannot say cheaply that a tensor still
    /// holds the values last read (an optimizer may update a buffer in
    /// place). The engine keeps the head read last, so later
    /// [`HeadKl::loss`] and [`HeadKl::topk`] calls use it.
    ///
    /// The head's gradient `[V][hs]` f32 must fit in one binding of the
    /// device (headkl's `HeadGradUnsupported` otherwise, before anything
    /// is read). A head outside the graph (untracked) is read as well and
    /// gets no gradient, at no further cost. Backpropagating
    /// `out.per_token` into the head makes two more loss calls in the
    /// backward step (the head gets `Σ_t u_t ∂L_t/∂W` for the upstream
    /// `u`, over rows of positive weight; a failure is reported by the
    /// next [`HeadKl::wait`], even in checked mode).
    pub fn loss_with_head(
        &mut self,
        hidden: &Tensor<2>,
        head: &Tensor<2>,
        teacher: &Teacher,
        weights: Option<&Tensor<1>>,
        opts: &LossConfig,
    ) -> Result<LossOutput> {
        self.loss_through(hidden, Some(head), teacher, weights, opts)
    }

    fn loss_through(
        &mut self,
        hidden: &Tensor<2>,
        head: Option<&Tensor<2>>,
        teacher: &Teacher,
        weights: Option<&Tensor<1>>,
        opts: &LossConfig,
    ) -> Result<LossOutput> {
        let (ntok, k) = self.check_loss_inputs(hidden, teacher, weights)?;
        let expected = self.shared.device();
        let (hdtype, float_dtype) = hidden_dtype(hidden.dtype())?;
        let head = match head {
            Some(w) => Some(self.check_head(w)?),
            None => None,
        };
        let trained = head.as_ref().is_some_and(|h| h.tracked.is_some());
        let signed = signed_ids(teacher.ids.dtype());

        let parts = bridge::float_parts(hidden.clone(), "hidden")?;
        let ids = as_u32_words(bridge::int_inner(teacher.ids.clone(), "teacher.ids")?)?;
        let probs = as_f32(
            bridge::float_parts(teacher.probs.clone(), "teacher.probs")?.inner,
            "teacher.probs",
        )?;
        let w = match weights {
            Some(w) => Some(as_f32(bridge::float_parts(w.clone(), "weights")?.inner, "weights")?),
            None => None,
        };
        let inputs = LossInputs {
            ntok,
            k,
            hidden: parts.inner.clone(),
            hdtype,
            ids,
            probs,
            weights: w.clone(),
            signed,
        };

        let mut core = self.core.lock();
        let mut head_read = None;
        if let Some(h) = &head {
            if trained {
                core.check_head_grad_fits()?;
            }
            // The options that fail on the host fail before the head is read.
            opts.check(false)?;
            opts.total_for(ntok)?;
            let version = core.new_version();
            let bytes = core.read_head(&head::plain(h.inner.clone()), version)?;
            head_read = Some((version, bytes));
        }
        let cubes = core.loss_call("loss", &inputs, *opts, trained);
        drop(core);
        let cubes = cubes?;
        let mut bound = cubes.binding;
        if let Some((_, bytes)) = head_read {
            bound.copied += 1;
            bound.copied_bytes += bytes;
        }
        self.last = bound;
        self.after_call()?;

        let per_token: Tensor<1> = bridge::float_tensor(cubes.loss)?;
        let dx: Tensor<2> = bridge::float_tensor(cubes.dx)?;
        let head_grad: Option<Tensor<2>> = cubes.head_grad.map(bridge::float_tensor).transpose()?;
        let w = w.map(Tensor::<1>::from_primitive::<Cube>);
        let weighted = match &w {
            Some(w) => per_token.clone() * w.clone(),
            None => per_token.clone(),
        };
        let sum = weighted.sum();
        // The denominator the reduction sets (the device checked that a
        // given total comes with the mean alone).
        let total = match opts.reduction {
            Reduction::Mean => opts.total,
            Reduction::Sum | Reduction::None => Some(1.0),
            Reduction::BatchMean => Some(ntok as f32),
        };
        let mean = match (total, &w) {
            (Some(total), _) => sum.div_scalar(total),
            (None, Some(w)) => sum / w.clone().sum(),
            (None, None) => sum.div_scalar(ntok as f32),
        };
        // The graph the outputs join: none, the rows' (a frozen head), or
        // the rows' and the head's (rows outside the graph are an untracked
        // leaf there).
        let tracked_head = head.and_then(|h| h.tracked.map(|(ad, strategy)| (ad, strategy, h.inner, h.dtype)));
        let trainable = match (tracked_head, &head_grad, head_read) {
            (Some(h), Some(dw), Some((version, _))) => Some((h, dw.clone(), version)),
            _ => None,
        };
        let (rows_ad, strategy, trainable) = match (parts.autodiff, trainable) {
            (None, None) => {
                return Ok(LossOutput {
                    loss: mean,
                    per_token,
                    dx,
                    head_grad,
                })
            }
            (Some((ad, strategy)), trainable) => (ad, strategy, trainable),
            (None, Some(t)) => (AdTensor::new(parts.inner.clone()), t.0 .1, Some(t)),
        };
        // dx row t is w_t/total · ∂L_t/∂x_t: the per-token node's factor
        // is total/w_t (0 where w_t is not positive: those rows are masked).
        let unweighted_total = total.unwrap_or(ntok as f32);
        let weighted = match &w {
            None => None,
            Some(w) => {
                let total = match total {
                    Some(t) => Tensor::<1>::full([1], t, &expected),
                    None => w.clone().sum(),
                };
                let masked = w.clone().lower_equal_elem(0.0).bool_or(w.clone().is_nan());
                Some((w.clone(), total, masked))
            }
        };
        let factor = match &weighted {
            None => Tensor::<1>::full([ntok], unweighted_total, &expected),
            Some((w, total, masked)) => (w.clone().recip() * total.clone()).mask_fill(masked.clone(), 0.0),
        };
        let dx_inner = bridge::float_parts(dx.clone(), "dx")?.inner;
        let per_row = Upstream::PerRow {
            factor: Box::new(bridge::float_parts(factor, "per_token")?.inner),
            ntok,
        };
        let mean_inner = bridge::float_parts(mean, "loss")?.inner;
        let per_token_inner = bridge::float_parts(per_token, "per_token")?.inner;

        let Some(((head_ad, _, head_inner, head_dtype), dw, version)) = trainable else {
            // A frozen head: the rows are the nodes' one parent.
            let loss = grad::attach(
                rows_ad.clone(),
                strategy,
                dx_inner.clone(),
                Upstream::Scalar,
                float_dtype,
                mean_inner,
            );
            let per_token = grad::attach(rows_ad, strategy, dx_inner, per_row, float_dtype, per_token_inner);
            return Ok(LossOutput {
                loss,
                per_token,
                dx,
                head_grad,
            });
        };
        // The rows the per-token node gives a gradient (positive weight).
        let mask = match weighted {
            Some((_, _, masked)) => masked.bool_not().float(),
            None => Tensor::<1>::ones([ntok], &expected),
        };
        let dw_inner = bridge::float_parts(dw, "head_grad")?.inner;
        let per_token_head = PerTokenHead {
            core: self.core.clone(),
            inputs,
            config: *opts,
            head: head_inner,
            version,
            mask: bridge::float_parts(mask, "per_token")?.inner,
        };
        let loss = grad::attach_trainable(
            (rows_ad.clone(), head_ad.clone()),
            strategy,
            (dx_inner.clone(), Upstream::Scalar, float_dtype),
            (HeadGradOf::Call(Box::new(dw_inner)), head_dtype),
            mean_inner,
        );
        let per_token = grad::attach_trainable(
            (rows_ad, head_ad),
            strategy,
            (dx_inner, per_row, float_dtype),
            (HeadGradOf::PerToken(Box::new(per_token_head)), head_dtype),
            per_token_inner,
        );
        Ok(LossOutput {
            loss,
            per_token,
            dx,
            head_grad,
        })
    }

    /// The rows, the teacher and the weights of a loss call checked against
    /// each other and the engine's device: `(ntok, k)`.
    fn check_loss_inputs(
        &self,
        hidden: &Tensor<2>,
        teacher: &Teacher,
        weights: Option<&Tensor<1>>,
    ) -> Result<(usize, usize)> {
        let ntok = self.check_hidden(hidden)?;
        let [ids_rows, k] = teacher.ids.dims();
        if ids_rows != ntok {
            return Err(Error::Rows {
                input: "teacher.ids",
                rows: ids_rows,
                hidden: ntok,
            });
        }
        let probs_dims = teacher.probs.dims();
        if probs_dims != [ids_rows, k] {
            return Err(Error::TeacherShape {
                ids: [ids_rows, k],
                probs: probs_dims,
            });
        }
        headkl_core::check_k(k, self.vocab)?;
        let expected = self.shared.device();
        check_device("teacher.ids", &teacher.ids.device(), &expected)?;
        check_device("teacher.probs", &teacher.probs.device(), &expected)?;
        if let Some(w) = weights {
            let [n] = w.dims();
            if n != ntok {
                return Err(Error::Rows {
                    input: "weights",
                    rows: n,
                    hidden: ntok,
                });
            }
            check_device("weights", &w.device(), &expected)?;
        }
        Ok((ntok, k))
    }

    /// A trainable head checked against the engine's: shape, device,
    /// dtype; taken apart, with its graph node where it is tracked.
    fn check_head(&self, w: &Tensor<2>) -> Result<HeadParts> {
        let (dims, parts) = head::check(w, &self.shared)?;
        if dims != [self.vocab, self.hs] {
            return Err(Error::HeadShape {
                got: dims,
                expected: [self.vocab, self.hs],
            });
        }
        let (_, dtype) = hidden_dtype(w.dtype()).map_err(|_| dtype_error("head", w.dtype(), "f32, f16 or bf16"))?;
        Ok(HeadParts {
            inner: parts.inner,
            dtype,
            tracked: parts.autodiff.filter(|(ad, _)| ad.is_tracked()),
        })
    }

    /// The teacher's exact top-k of `hidden` (`[ntok][hs]`): ids i32 and
    /// probabilities f32 `[ntok][k]`, as burn tensors on the same device;
    /// with [`TopkOptions::logprobs`], the log-probabilities too.
    pub fn topk(&mut self, hidden: &Tensor<2>, opts: &TopkOptions) -> Result<TopK> {
        let ntok = self.check_hidden(hidden)?;
        opts.check(self.vocab)?;
        let k = opts.k;
        let (hdtype, _) = hidden_dtype(hidden.dtype())?;
        let parts = bridge::float_parts(hidden.clone(), "hidden")?;
        let mut stats = Binding::default();
        let h_cube = contiguous(bridge::resolve_float(&parts.inner), &mut stats);
        let ids_cube = output(&h_cube, Shape::new([ntok, k]), DType::I32);
        let values_cube = output(&h_cube, Shape::new([ntok, k]), DType::F32);
        let nk = (ntok * k) as u64;
        let mut guard = self.core.lock();
        let core = &mut *guard;
        let mut binder = Binder::new(core.shared.wgpu_device(), core.shared.queue(), &mut core.staging, stats);
        let backend = core.engine.backend();
        let bytes = (ntok * self.hs * hdtype.bytes()) as u64;
        let h_view = binder.bind(backend, "hidden", &h_cube, bytes, Flow::In)?;
        let ids_view = binder.bind(backend, "ids", &ids_cube, nk * 4, Flow::Out)?;
        let values_view = binder.bind(backend, "probs", &values_cube, nk * 4, Flow::Out)?;
        binder.submit_inputs(&h_cube)?;
        let result = core.engine.topk_device(
            ntok,
            &DeviceHidden {
                buffer: &h_view,
                dtype: hdtype,
            },
            &ids_view,
            &values_view,
            opts,
        );
        let bound = binder.finish();
        result?;
        core.submitted("topk", false);
        drop(guard);
        self.last = bound;
        self.after_call()?;
        let ids = bridge::int_tensor(ids_cube)?;
        let values: Tensor<2> = bridge::float_tensor(values_cube)?;
        if !opts.logprobs {
            return Ok(TopK {
                ids,
                probs: values,
                logprobs: None,
            });
        }
        // The softmax over the k of the full-vocabulary log-probabilities.
        Ok(TopK {
            ids,
            probs: activation::softmax(values.clone(), 1),
            logprobs: Some(values),
        })
    }
}
