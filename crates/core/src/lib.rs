//! headkl-core: the distillation loss's shapes, validation and errors, the
//! vocabulary slicing, and the engine ([`Engine`]) written once over any
//! backend. What a backend implements and reads (the [`Backend`] trait, the
//! kernel catalogue, launches, parameter blocks, GEMM tiles, settings) is
//! [`toolkit`]; the root is what a trainer uses.
//!
//! The math (DESIGN §1): per token, with `s = x·Wᵀ/τ` and
//! `log p_S = s − logsumexp(s)`,
//!
//! ```text
//! L_t = Σ_k p_T,k · (log p_T,k − log p_S,id_k)
//! L   = Σ_t w_t L_t / total
//! dx_t = (w_t / (τ·total)) · Σ_j (p_S,j − p_T,j) · W_j
//! ```
//!
//! By default the teacher is renormalized over its k (no tail bin); the
//! student's softmax is over the full vocabulary. [`problem::terms`] adds the other
//! tail modes, teacher log-probabilities, a hard-label term, the z-loss and
//! a logit softcap (the README's "Loss terms").
//!
//! # Use it from Rust
//!
//! `Cargo.toml`: `headkl-core` (this crate) and one backend crate:
//! `headkl-reference` (the CPU backend, accumulating in f64; no GPU
//! needed), `headkl-wgpu` (`headkl_wgpu::WgpuBackend`) or `headkl-vulkan`
//! (`headkl_vulkan::VulkanBackend`). An [`Engine`] uploads the head once; then each call
//! takes host slices and returns host vectors:
//!
//! ```
//! use headkl_core::{Engine, HeadData, HeadWeights, Hidden, LossOptions, LossOutput, SliceOptions, Teacher, TopkOptions};
//! use headkl_reference::CpuBackend;
//!
//! let (vocab, hs, ntok, k) = (1000, 64, 8, 16);
//! let w: Vec<f32> = (0..vocab * hs).map(|i| ((i * 7 % 13) as f32 - 6.0) / 32.0).collect(); // [V][hs]
//! let teacher_x: Vec<f32> = (0..ntok * hs).map(|i| ((i * 5 % 11) as f32 - 5.0) / 8.0).collect(); // [ntok][hs]
//! let student_x: Vec<f32> = teacher_x.iter().map(|v| v * 0.9).collect();
//!
//! let head = HeadWeights::new(HeadData::F32(&w), vocab, hs)?; // or HeadData::F16 / Bf16
//! let mut engine = Engine::new(CpuBackend::new(), &head, SliceOptions::default())?;
//!
//! // The teacher's top-k: ids by descending logit, probabilities over the k.
//! let top = engine.topk(&Hidden::f32(&teacher_x, ntok, hs)?, &TopkOptions::new(k))?;
//!
//! // The student's loss against it, into buffers a training loop keeps.
//! let teacher = Teacher::new(&top.ids, &top.probs, ntok, k, vocab)?;
//! let mut out = LossOutput::default();
//! engine.head_kl_into(&Hidden::f32(&student_x, ntok, hs)?, &teacher, &LossOptions::default(), &mut out)?;
//! assert_eq!((out.loss.len(), out.dx.len()), (ntok, ntok * hs)); // per-token loss, ∂mean/∂x
//! assert!(out.mean.is_finite() && out.mean >= 0.0);
//! # Ok::<(), headkl_core::Error>(())
//! ```
//!
//! On a GPU only the backend changes (`WgpuBackend::open(None)` or
//! `VulkanBackend::open(None)` take the first device that can run headkl,
//! `Some(i)` the i-th as `headkl devices` lists them):
//!
//! ```text
//! let backend = headkl_vulkan::VulkanBackend::open(None)?; // or headkl_wgpu::WgpuBackend::open(None)?
//! let mut engine = Engine::new(backend, &head, SliceOptions::default())?;
//! ```

#![warn(missing_docs)]

mod align;
pub mod engine;
pub mod error;
pub mod problem;
pub mod resident;
pub mod shard;
pub mod toolkit;

pub use align::{round_up, ALIGN};
pub use engine::head::{HeadData, HeadWeights};
pub use engine::head_planes::{DevicePlane, UploadTimes};
pub use engine::{check_full_vocab_terms, check_gather_ids, Engine, Gathered, LossOutput, ProgressCallback, TopK};
pub use error::{DriverError, Error, ErrorKind, Field, Result};
pub use problem::filter::FilterStats;
pub use problem::floats::FloatSlice;
pub use problem::grad_type::{GradType, GradValues};
pub use problem::shape::Shape;
pub use problem::slicing::{slice_vocab, SliceOptions, VocabSlice, SLICE_ROWS};
pub use problem::terms::{
    rescale_teacher, Divergence, LossTerms, TailMode, TeacherForm, MASS_TOLERANCE, NO_LABEL, PROB_FLOOR,
};
pub use problem::vocab_order::VocabOrder;
pub use problem::{
    check_k, Hidden, HiddenData, LossConfig, LossOptions, Reduction, ResolvedLoss, Teacher, TopkOptions,
    DEFAULT_BUDGET_BYTES, DEFAULT_IGNORE_INDEX, MAX_K,
};
pub use resident::{DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, HiddenDtype, ResidentBackend};
pub use toolkit::settings::DIAGNOSTICS_LOG_TARGET;
// What a caller of the engine meets from the toolkit: the backend bound
// and what it reports, the options a backend opens with, the chunk plan
// and the dx split it may set.
pub use toolkit::{
    Backend, ChoiceSource, ChunkPlan, CommonOptions, DeviceBuffer, DeviceInfo, DxSplit, GemmChoice, KernelTime,
    MemoryStats, QueueChoice,
};
