//! headkl-core: the distillation loss's shapes, validation and errors, the
//! vocabulary slicing and token chunking math, the kernel traits a backend
//! implements, and the driver ([`Engine`]) written once over them.
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
//! The teacher is renormalized over its k (no tail bin); the student's
//! softmax is over the full vocabulary.

#![warn(missing_docs)]

pub mod backend;
pub mod checks;
pub mod chunking;
pub mod driver;
pub mod error;
pub mod gemm_choice;
pub mod glsl_tile;
pub mod head;
pub mod host;
pub mod kernels;
pub mod launch;
pub mod params;
pub mod problem;
pub mod queue;
pub mod resident;
mod scratch;
pub mod settings;
pub mod slicing;
pub mod split;
pub mod tune_cache;

pub use backend::{
    Backend, ConvertDesc, DeviceBuffer, DeviceInfo, DownloadsInFlight, GemmDesc, HeadLayout, KernelTime, KlDesc,
    MemoryStats, PendingDownload, SumPartsDesc, TopkDesc,
};
pub use chunking::{fold_workgroups, plan_chunks, ChunkPlan, RowCost, MAX_WORKGROUPS_PER_DIM};
pub use driver::{Engine, LossOutput, SliceOptions, TopK};
pub use error::{Error, Result};
pub use gemm_choice::{ChoiceSource, CoopGemm, GemmChoice, KernelLimits, StagedTile};
pub use glsl_tile::GlslTile;
pub use head::{HeadData, HeadWeights};
pub use kernels::{GemmKernel, KernelBuild, KernelId, KernelSource};
pub use launch::{Checked, Kernels, Launch};
pub use problem::{
    check_k, Hidden, HiddenData, LossOptions, ResolvedLoss, Teacher, TopkOptions, DEFAULT_BUDGET_BYTES, MAX_K,
};
pub use queue::{QueueChoice, QueueFamily};
pub use resident::{
    DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, HiddenDtype, ResidentBackend, ResidentKernel,
};
pub use settings::{CommonOptions, Env};
pub use slicing::{slice_vocab, VocabSlice, SLICE_ROWS};
pub use split::DxSplit;
pub use tune_cache::TuneCache;

/// Alignment of every padded device extent (token rows, hidden columns,
/// vocabulary columns): the 16×16 matrix-unit tile edge. GEMM kernels may
/// read and write whole 16×16 tiles.
pub const ALIGN: usize = 16;

/// `x` rounded up to a multiple of `to`.
pub const fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}
