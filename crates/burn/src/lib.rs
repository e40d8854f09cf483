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
mod error;
mod grad;
pub mod unfused;

use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::backend::Cube;
use burn::backend::TensorMetadata;
use burn::prelude::{Int, Tensor};
use burn::tensor::{activation, DType, Device, FloatDType, IntDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use headkl_core::{
    DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, HeadWeights, HiddenDtype, LossConfig,
    Reduction, SliceOptions, TopkOptions,
};
use headkl_wgpu::{OpenOptions, WgpuBackend};

pub use bridge::Binding;
pub use device::{device_descriptor, DeviceOptions, SharedDevice, BIND_ALIGN};
pub use error::{Calls, Error, Result};
/// headkl's library, for what the prelude leaves out.
pub use headkl_core;
/// headkl's wgpu backend, for its options.
pub use headkl_wgpu;

use bridge::{Binder, Flow, Primitive, Staging};
use grad::Upstream;

/// Everything headkl-burn's calls take and return, in one `use` (not the
/// crate's `Result` alias, which would shadow the standard one in a glob
/// import: name it `headkl_burn::Result`).
pub mod prelude {
    pub use crate::{
        device_descriptor, Binding, Calls, DeviceOptions, Error, HeadKl, LossOutput, SharedDevice, Teacher, TopK,
        BIND_ALIGN,
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

/// What [`HeadKl::loss`] returns. A row the device flags (a bad teacher
/// row or weight) has a NaN `per_token` entry, so `loss` is NaN, and a
/// zero `dx` row: it contributes nothing to the gradient.
#[derive(Clone, Debug)]
pub struct LossOutput {
    /// The mean loss `Σ_t w_t L_t / total`, shape `[1]`. On an autodiff
    /// device with `hidden` tracked, `loss.backward()` puts
    /// `dx · upstream` into `hidden`'s gradient.
    pub loss: Tensor<1>,
    /// The per-token loss `L_t` (unweighted), f32 `[ntok]`: PyTorch's
    /// `reduction="none"`. With `hidden` tracked it is a node of the graph
    /// too: a reduction of the caller's own backpropagates `∂L_t/∂x_t`
    /// times its upstream into row t, for every row of positive weight
    /// (a row of weight 0 or a flagged row gets none).
    pub per_token: Tensor<1>,
    /// `∂loss/∂hidden`, f32 `[ntok][hs]`, outside the graph.
    pub dx: Tensor<2>,
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

/// headkl's engine on a [`SharedDevice`], holding the head (uploaded once).
pub struct HeadKl {
    engine: Engine<WgpuBackend>,
    shared: SharedDevice,
    staging: Staging,
    vocab: usize,
    hs: usize,
    last: Binding,
    /// Calls are numbered from 1; the next one's number.
    next_call: u64,
    /// The calls made since the last wait, and whether each gave its ids
    /// as signed integers.
    since_wait: Vec<(u64, &'static str, bool)>,
    checked: bool,
}

/// f16's largest finite value, as headkl's head check uses it.
const F16_MAX: f32 = 65504.0;

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
        Ok(Self {
            engine,
            shared: shared.clone(),
            staging: Staging::default(),
            vocab: head.vocab(),
            hs: head.hs(),
            last: Binding::default(),
            next_call: 1,
            since_wait: Vec::new(),
            checked: false,
        })
    }

    /// headkl's engine with the head `w` (`[vocab][hs]`, f32, f16 or bf16),
    /// a burn tensor (a `Param`'s value, say) on `shared`'s device: rounded
    /// to f16 and copied into headkl's planes on the device, with no host
    /// copy of it. The host reads whether a value is not finite or past
    /// f16's range (then the first one, as headkl's error naming its row
    /// and column) and the rows' norms (`[vocab]` f32, for the dx block
    /// filter). [`HeadKl::last_binding`] reports the copy.
    pub fn from_tensor(shared: &SharedDevice, w: &Tensor<2>, options: &OpenOptions) -> Result<Self> {
        let [vocab, hs] = w.dims();
        check_device("head", &w.device(), &shared.device())?;
        if !matches!(w.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(dtype_error("head", w.dtype(), "f32, f16 or bf16"));
        }
        if vocab == 0 {
            return Err(headkl_core::Error::VocabZero.into());
        }
        if hs == 0 {
            return Err(headkl_core::Error::HiddenSizeZero.into());
        }
        // The tensor outside any graph: the head is frozen.
        let plain: Tensor<2> = Tensor::from_primitive::<Cube>(bridge::float_parts(w.clone(), "head")?.inner);
        let w32 = plain.clone().cast(FloatDType::F32);
        let bad = w32.clone().abs().greater_elem(F16_MAX).bool_or(w32.clone().is_nan());
        if bad.clone().any().into_scalar::<bool>() {
            let at = bad.int().reshape([vocab * hs]).argmax(0).into_scalar::<i64>() as usize;
            let value = w32.reshape([vocab * hs]).slice(at..at + 1).into_scalar::<f32>();
            let (row, col) = (at / hs, at % hs);
            let e = if value.is_finite() {
                headkl_core::Error::HeadOutOfF16Range { row, col, value }
            } else {
                headkl_core::Error::NonFiniteHead { row, col, value }
            };
            return Err(e.into());
        }
        let w16 = plain.cast(FloatDType::F16);
        let norms = w16
            .clone()
            .cast(FloatDType::F32)
            .powi_scalar(2)
            .sum_dim(1)
            .sqrt()
            .reshape([vocab])
            .into_data()
            .try_to_vec::<f32>()
            .map_err(|e| bridge::backend_error("the head's row norms", format!("{e:?}")))?;

        let device = shared.device();
        let handles = (shared.wgpu_device(), shared.queue());
        let mut copied_bytes = 0u64;
        let backend = shared.backend(options)?;
        let engine = Engine::from_device_head(backend, (vocab, hs), SliceOptions::default(), &norms, |_, plane| {
            let rows = plane.first_row..plane.first_row + plane.rows;
            let part = w16.clone().slice([rows, 0..hs]);
            let padded = Tensor::<2>::zeros([plane.padded_rows, plane.hs_padded], &device)
                .cast(FloatDType::F16)
                .slice_assign([0..plane.rows, 0..hs], part);
            let inner = bridge::float_parts(padded, "head")?.inner;
            let cube = contiguous(bridge::resolve_float(&inner), &mut Binding::default());
            let bytes = (plane.padded_rows * plane.hs_padded * 2) as u64;
            bridge::copy_into(&cube, handles, plane.buffer.raw(), plane.buffer.offset(), bytes)?;
            copied_bytes += bytes;
            Ok(())
        })?;
        Ok(Self {
            engine,
            shared: shared.clone(),
            staging: Staging::default(),
            vocab,
            hs,
            last: Binding {
                in_place: 0,
                copied: 1,
                copied_bytes,
            },
            next_call: 1,
            since_wait: Vec::new(),
            checked: false,
        })
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

    /// headkl's engine (its backend, timing and trace switches).
    pub fn engine(&mut self) -> &mut Engine<WgpuBackend> {
        &mut self.engine
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
    pub fn wait(&mut self) -> Result<()> {
        let calls = std::mem::take(&mut self.since_wait);
        let signed = calls.iter().any(|&(_, _, signed)| signed);
        self.engine.wait_device().map_err(|source| Error::OnDevice {
            calls: Calls {
                calls: calls.iter().map(|&(n, what, _)| (n, what)).collect(),
            },
            source: as_given(source, signed),
        })
    }

    /// Numbers a call whose work was submitted; in checked mode, waits.
    fn submitted(&mut self, what: &'static str, signed: bool) -> Result<()> {
        self.since_wait.push((self.next_call, what, signed));
        self.next_call += 1;
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
    /// against `teacher`, with optional token `weights` (`[ntok]`; 0 masks
    /// a token). Returns burn tensors; where `hidden` is a tracked tensor
    /// of an autodiff device, `out.loss.backward()` delivers `dx` scaled by
    /// the upstream gradient into `hidden`'s gradient, and `out.per_token`
    /// is tracked as well. Shapes, dtypes and devices are checked before
    /// anything is recorded. Bad teacher data is checked on the device,
    /// with no host wait: a flagged row's `per_token` entry is NaN (so is
    /// `loss`) and its gradient 0, and [`HeadKl::wait`] names the call and
    /// the row.
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
        let (hdtype, float_dtype) = hidden_dtype(hidden.dtype())?;
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

        let mut stats = Binding::default();
        let h_cube = contiguous(bridge::resolve_float(&parts.inner), &mut stats);
        let ids_cube = contiguous(bridge::resolve_int(&ids), &mut stats);
        let probs_cube = contiguous(bridge::resolve_float(&probs), &mut stats);
        let w_cube = w.as_ref().map(|w| contiguous(bridge::resolve_float(w), &mut stats));
        let loss_cube = output(&h_cube, Shape::new([ntok]), DType::F32);
        let dx_cube = output(&h_cube, Shape::new([ntok, self.hs]), DType::F32);

        let (nk, nh) = ((ntok * k) as u64, (ntok * self.hs) as u64);
        let mut binder = Binder::new(self.shared.wgpu_device(), self.shared.queue(), &mut self.staging, stats);
        let backend = self.engine.backend();
        let h_view = binder.bind(backend, "hidden", &h_cube, nh * hdtype.bytes() as u64, Flow::In)?;
        let ids_view = binder.bind(backend, "teacher.ids", &ids_cube, nk * 4, Flow::In)?;
        let probs_view = binder.bind(backend, "teacher.probs", &probs_cube, nk * 4, Flow::In)?;
        let w_view = match &w_cube {
            Some(c) => Some(binder.bind(backend, "weights", c, ntok as u64 * 4, Flow::In)?),
            None => None,
        };
        let loss_view = binder.bind(backend, "loss", &loss_cube, ntok as u64 * 4, Flow::Out)?;
        let dx_view = binder.bind(backend, "dx", &dx_cube, nh * 4, Flow::Out)?;
        binder.submit_inputs(&h_cube)?;
        let result = self.engine.head_kl_device(
            ntok,
            &DeviceHidden {
                buffer: &h_view,
                dtype: hdtype,
            },
            &DeviceTeacher::new(&ids_view, &probs_view, k),
            &DeviceLossOutput {
                loss: &loss_view,
                dx: &dx_view,
            },
            &DeviceLossOptions {
                config: *opts,
                weights: w_view.as_ref(),
                ..DeviceLossOptions::default()
            },
        );
        let bound = binder.finish();
        result?;
        self.last = bound;
        self.submitted("loss", signed)?;

        let per_token: Tensor<1> = bridge::float_tensor(loss_cube)?;
        let dx: Tensor<2> = bridge::float_tensor(dx_cube)?;
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
        let Some((ad, strategy)) = parts.autodiff else {
            return Ok(LossOutput {
                loss: mean,
                per_token,
                dx,
            });
        };
        // dx row t is w_t/total · ∂L_t/∂x_t: the per-token node's factor
        // is total/w_t (0 where w_t is not positive: those rows are masked).
        let factor = match (&w, total) {
            (None, total) => Tensor::<1>::full([ntok], total.unwrap_or(ntok as f32), &expected),
            (Some(w), total) => {
                let total = match total {
                    Some(t) => Tensor::<1>::full([1], t, &expected),
                    None => w.clone().sum(),
                };
                let masked = w.clone().lower_equal_elem(0.0).bool_or(w.clone().is_nan());
                (w.clone().recip() * total).mask_fill(masked, 0.0)
            }
        };
        let dx_inner = bridge::float_parts(dx.clone(), "dx")?.inner;
        let loss = grad::attach(
            ad.clone(),
            strategy,
            dx_inner.clone(),
            Upstream::Scalar,
            float_dtype,
            bridge::float_parts(mean, "loss")?.inner,
        );
        let per_token = grad::attach(
            ad,
            strategy,
            dx_inner,
            Upstream::PerRow {
                factor: Box::new(bridge::float_parts(factor, "per_token")?.inner),
                ntok,
            },
            float_dtype,
            bridge::float_parts(per_token, "per_token")?.inner,
        );
        Ok(LossOutput { loss, per_token, dx })
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
        let mut binder = Binder::new(self.shared.wgpu_device(), self.shared.queue(), &mut self.staging, stats);
        let backend = self.engine.backend();
        let bytes = (ntok * self.hs * hdtype.bytes()) as u64;
        let h_view = binder.bind(backend, "hidden", &h_cube, bytes, Flow::In)?;
        let ids_view = binder.bind(backend, "ids", &ids_cube, nk * 4, Flow::Out)?;
        let values_view = binder.bind(backend, "probs", &values_cube, nk * 4, Flow::Out)?;
        binder.submit_inputs(&h_cube)?;
        let result = self.engine.topk_device(
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
        self.last = bound;
        self.submitted("topk", false)?;
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
