//! headkl's distillation loss as a burn autodiff op, on burn's own wgpu
//! device and tensors.
//!
//! ```no_run
//! use burn::prelude::*;
//! use headkl_burn::{DeviceOptions, HeadKl, LossOptions, SharedDevice, Teacher};
//! use headkl_core::{HeadData, HeadWeights, TopkOptions};
//!
//! # fn main() -> headkl_core::Result<()> {
//! # let (vocab, hs, ntok) = (512, 64, 8);
//! # let w = vec![0.01f32; vocab * hs];
//! // One wgpu device for burn and headkl (headkl's features, queue family and alignment).
//! let shared = SharedDevice::open(&DeviceOptions::default())?;
//! let device = shared.device().autodiff();
//! let mut head = HeadKl::new(&shared, &HeadWeights::new(HeadData::F32(&w), vocab, hs)?, &Default::default())?;
//!
//! // The teacher's top-k, as burn tensors.
//! let teacher_hidden = Tensor::<2>::random([ntok, hs], burn::tensor::Distribution::Default, &device);
//! let top = head.topk(&teacher_hidden, &TopkOptions::new(16))?;
//! let teacher = Teacher { ids: top.ids, probs: top.probs };
//!
//! // The student's hidden rows, from its own layers; the loss is a node of burn's graph.
//! let hidden = Tensor::<2>::random([ntok, hs], burn::tensor::Distribution::Default, &device).require_grad();
//! let out = head.loss(&hidden, &teacher, None, &LossOptions::default())?;
//! let grads = out.loss.backward(); // dx into hidden's gradient, and on into the student's parameters
//! head.wait()?; // bad teacher data on the device comes back here as headkl's typed error
//! # Ok(()) }
//! ```
//!
//! Nothing crosses to the host and nothing waits inside [`HeadKl::loss`] and
//! [`HeadKl::topk`]: burn's queued work is flushed, headkl's kernels are
//! submitted to the same queue, reading and writing burn's buffers where
//! they lie (see [`Binding`] for when a device copy is made instead).

mod bridge;
mod device;
mod grad;
pub mod unfused;

use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::backend::Cube;
use burn::backend::TensorMetadata;
use burn::prelude::{Int, Tensor};
use burn::tensor::{DType, Device, FloatDType, IntDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use headkl_core::{
    DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, Error, Field, HeadWeights, HiddenDtype,
    Result, SliceOptions, TopkOptions, DEFAULT_BUDGET_BYTES,
};
use headkl_wgpu::{OpenOptions, WgpuBackend};

pub use bridge::Binding;
pub use device::{device_descriptor, DeviceOptions, SharedDevice, BIND_ALIGN};

use bridge::{Binder, Flow, Fused, Staging};

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

/// Options of [`HeadKl::loss`] (headkl's `DeviceLossOptions` without the
/// buffers).
#[derive(Clone, Debug)]
pub struct LossOptions {
    /// Temperature τ (default 1).
    pub temperature: f32,
    /// The weight the mean divides by; `None`: `Σ w_t` (`ntok` without
    /// weights), summed on the device.
    pub total: Option<f32>,
    /// Scale of the f16 gradient; `None`: headkl's default, on the device.
    pub gscale: Option<f32>,
    /// Device-memory budget of headkl's scratch, in bytes.
    pub budget_bytes: u64,
    /// Test knob: at most this many tokens per chunk.
    pub max_rows_per_chunk: Option<usize>,
}

impl Default for LossOptions {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            total: None,
            gscale: None,
            budget_bytes: DEFAULT_BUDGET_BYTES,
            max_rows_per_chunk: None,
        }
    }
}

/// What [`HeadKl::loss`] returns.
#[derive(Clone, Debug)]
pub struct LossOutput {
    /// The mean loss `Σ_t w_t L_t / total`, shape `[1]`. On an autodiff
    /// device with `hidden` tracked, `loss.backward()` puts
    /// `dx · upstream` into `hidden`'s gradient.
    pub loss: Tensor<1>,
    /// The per-token loss `L_t` (unweighted), f32 `[ntok]`; outside the
    /// graph (no gradient flows through it).
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
}

/// headkl's engine on a [`SharedDevice`], holding the head (uploaded once).
pub struct HeadKl {
    engine: Engine<WgpuBackend>,
    shared: SharedDevice,
    staging: Staging,
    vocab: usize,
    hs: usize,
    last: Binding,
}

fn check_device(field: &'static str, device: &Device, expected: &Device) -> Result<()> {
    if device == expected {
        return Ok(());
    }
    Err(Error::DeviceBuffer {
        field,
        reason: format!("is on {device:?}; headkl runs on {expected:?}"),
    })
}

fn check_dims(field: Field, got: [usize; 2], expected: [usize; 2]) -> Result<()> {
    if got == expected {
        return Ok(());
    }
    Err(Error::LengthMismatch {
        field,
        expected: expected[0] * expected[1],
        got: got[0] * got[1],
    })
}

fn hidden_dtype(dtype: DType) -> Result<(HiddenDtype, FloatDType)> {
    match dtype {
        DType::F32 => Ok((HiddenDtype::F32, FloatDType::F32)),
        DType::F16 => Ok((HiddenDtype::F16, FloatDType::F16)),
        DType::BF16 => Ok((HiddenDtype::Bf16, FloatDType::BF16)),
        other => Err(Error::DeviceBuffer {
            field: "hidden",
            reason: format!("has dtype {other:?}; headkl reads f32, f16 or bf16"),
        }),
    }
}

/// A float input as f32 (a device conversion where it is not).
fn as_f32(inner: Fused, field: &'static str) -> Result<Fused> {
    match inner.dtype {
        DType::F32 => Ok(inner),
        DType::F16 | DType::BF16 | DType::F64 => Ok(Cube::float_cast(inner, FloatDType::F32)),
        other => Err(Error::DeviceBuffer {
            field,
            reason: format!("has dtype {other:?}; expected a float tensor"),
        }),
    }
}

/// Ids as 32-bit words (i32 and u32 as they are; other ints converted).
fn as_u32_words(inner: Fused) -> Result<Fused> {
    match inner.dtype {
        DType::I32 | DType::U32 => Ok(inner),
        DType::I64 | DType::U64 | DType::I16 | DType::U16 | DType::I8 | DType::U8 => {
            Ok(Cube::int_cast(inner, IntDType::I32))
        }
        other => Err(Error::DeviceBuffer {
            field: "ids",
            reason: format!("has dtype {other:?}; expected an int tensor"),
        }),
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

    /// Checked mode: every call waits and returns the device's error at
    /// once (for debugging; normally [`HeadKl::wait`] once per step).
    pub fn set_checked(&mut self, on: bool) {
        self.engine.set_checked(on);
    }

    /// Waits for the device and reports bad teacher data any call since
    /// the last wait met (an id out of range or repeated, a bad
    /// probability or weight, non-finite logits) as headkl's typed error
    /// naming the token.
    pub fn wait(&mut self) -> Result<()> {
        self.engine.wait_device()
    }

    fn check_hidden(&self, hidden: &Tensor<2>) -> Result<usize> {
        let [ntok, hs] = hidden.dims();
        if hs != self.hs {
            return Err(Error::HiddenSizeMismatch {
                expected: self.hs,
                got: hs,
            });
        }
        if ntok == 0 {
            return Err(Error::NoTokens);
        }
        check_device("hidden", &hidden.device(), &self.shared.device())?;
        Ok(ntok)
    }

    /// The distillation loss of `hidden` (`[ntok][hs]`, f32/f16/bf16)
    /// against `teacher`, with optional token `weights` (`[ntok]`; 0 masks
    /// a token). Returns burn tensors; where `hidden` is a tracked tensor
    /// of an autodiff device, `out.loss.backward()` delivers `dx` scaled by
    /// the upstream gradient into `hidden`'s gradient. Shapes, dtypes and
    /// devices are checked before anything is recorded; bad teacher data
    /// on the device comes back from [`HeadKl::wait`].
    pub fn loss(
        &mut self,
        hidden: &Tensor<2>,
        teacher: &Teacher,
        weights: Option<&Tensor<1>>,
        opts: &LossOptions,
    ) -> Result<LossOutput> {
        let ntok = self.check_hidden(hidden)?;
        let [ids_rows, k] = teacher.ids.dims();
        check_dims(Field::Ids, [ids_rows, k], [ntok, k])?;
        headkl_core::check_k(k, self.vocab)?;
        check_dims(Field::Probs, teacher.probs.dims(), [ntok, k])?;
        let expected = self.shared.device();
        check_device("ids", &teacher.ids.device(), &expected)?;
        check_device("probs", &teacher.probs.device(), &expected)?;
        if let Some(w) = weights {
            let [n] = w.dims();
            if n != ntok {
                return Err(Error::LengthMismatch {
                    field: Field::Weights,
                    expected: ntok,
                    got: n,
                });
            }
            check_device("weights", &w.device(), &expected)?;
        }
        let (hdtype, float_dtype) = hidden_dtype(hidden.dtype())?;

        let parts = bridge::float_parts(hidden.clone(), "hidden")?;
        let ids = as_u32_words(bridge::int_inner(teacher.ids.clone(), "ids")?)?;
        let probs = as_f32(bridge::float_parts(teacher.probs.clone(), "probs")?.inner, "probs")?;
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
        let mut binder = Binder::new(self.shared.wgpu_device(), self.shared.queue(), &mut self.staging);
        let backend = self.engine.backend();
        let h_view = binder.bind(backend, "hidden", &h_cube, nh * hdtype.bytes() as u64, Flow::In)?;
        let ids_view = binder.bind(backend, "ids", &ids_cube, nk * 4, Flow::In)?;
        let probs_view = binder.bind(backend, "probs", &probs_cube, nk * 4, Flow::In)?;
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
            &DeviceTeacher {
                ids: &ids_view,
                probs: &probs_view,
                k,
            },
            &DeviceLossOutput {
                loss: &loss_view,
                dx: &dx_view,
            },
            &DeviceLossOptions {
                temperature: opts.temperature,
                weights: w_view.as_ref(),
                total: opts.total,
                gscale: opts.gscale,
                accumulate_dx: false,
                budget_bytes: opts.budget_bytes,
                max_rows_per_chunk: opts.max_rows_per_chunk,
                ..DeviceLossOptions::default()
            },
        );
        let bound = binder.finish();
        result?;
        self.last = Binding {
            in_place: bound.in_place,
            copied: stats.copied + bound.copied,
            copied_bytes: stats.copied_bytes + bound.copied_bytes,
        };

        let per_token: Tensor<1> = bridge::float_tensor(loss_cube)?;
        let dx: Tensor<2> = bridge::float_tensor(dx_cube)?;
        let weighted = match &w {
            Some(w) => per_token.clone() * Tensor::<1>::from_primitive::<Cube>(w.clone()),
            None => per_token.clone(),
        };
        let sum = weighted.sum();
        let mean = match (opts.total, &w) {
            (Some(total), _) => sum.div_scalar(total),
            (None, Some(w)) => sum / Tensor::<1>::from_primitive::<Cube>(w.clone()).sum(),
            (None, None) => sum.div_scalar(ntok as f32),
        };
        let loss = match parts.autodiff {
            Some((ad, strategy)) => {
                let mean = bridge::float_parts(mean, "loss")?.inner;
                let dx_inner = bridge::float_parts(dx.clone(), "dx")?.inner;
                grad::attach(ad, strategy, dx_inner, float_dtype, mean)
            }
            None => mean,
        };
        Ok(LossOutput { loss, per_token, dx })
    }

    /// The teacher's exact top-k of `hidden` (`[ntok][hs]`): ids i32 and
    /// probabilities f32 `[ntok][k]`, as burn tensors on the same device.
    pub fn topk(&mut self, hidden: &Tensor<2>, opts: &TopkOptions) -> Result<TopK> {
        let ntok = self.check_hidden(hidden)?;
        opts.check(self.vocab)?;
        let k = opts.k;
        let (hdtype, _) = hidden_dtype(hidden.dtype())?;
        let parts = bridge::float_parts(hidden.clone(), "hidden")?;
        let mut stats = Binding::default();
        let h_cube = contiguous(bridge::resolve_float(&parts.inner), &mut stats);
        let ids_cube = output(&h_cube, Shape::new([ntok, k]), DType::I32);
        let probs_cube = output(&h_cube, Shape::new([ntok, k]), DType::F32);
        let nk = (ntok * k) as u64;
        let mut binder = Binder::new(self.shared.wgpu_device(), self.shared.queue(), &mut self.staging);
        let backend = self.engine.backend();
        let bytes = (ntok * self.hs * hdtype.bytes()) as u64;
        let h_view = binder.bind(backend, "hidden", &h_cube, bytes, Flow::In)?;
        let ids_view = binder.bind(backend, "ids", &ids_cube, nk * 4, Flow::Out)?;
        let probs_view = binder.bind(backend, "probs", &probs_cube, nk * 4, Flow::Out)?;
        binder.submit_inputs(&h_cube)?;
        let result = self.engine.topk_device(
            ntok,
            &DeviceHidden {
                buffer: &h_view,
                dtype: hdtype,
            },
            &ids_view,
            &probs_view,
            opts,
        );
        let bound = binder.finish();
        result?;
        self.last = Binding {
            in_place: bound.in_place,
            copied: stats.copied + bound.copied,
            copied_bytes: stats.copied_bytes + bound.copied_bytes,
        };
        Ok(TopK {
            ids: bridge::int_tensor(ids_cube)?,
            probs: bridge::float_tensor(probs_cube)?,
        })
    }
}
