//! The backend toolkit: what a backend implements and reads, beside the
//! user API at the crate root. A trainer needs none of it beyond the
//! names the root re-exports ([`Backend`] and what it reports, the options
//! a backend opens with); a backend author starts at [`Backend`] and
//! [`Launch`].
//!
//! - [`backend`]: the [`Backend`] trait, the driver kernels' descriptors,
//!   device information and memory figures;
//! - [`kernels`]: the kernel catalogue (one row a [`KernelId`]), the
//!   shaders and how each kernel is built; [`launch`]: one launch
//!   ([`Launch`], made from its table) and its checked parameter block;
//!   [`checks`]: each descriptor's checks; [`params`]: the parameter
//!   blocks the shaders read;
//! - [`gemm_choice`], [`glsl_tile`], [`wgmma_tile`], [`tune_cache`]: the
//!   GEMM kernels, their tiles, and the tune results a device keeps;
//! - [`host`]: host staging; [`queue`]: the queue family a device opens
//!   on; [`settings`]: the `HEADKL_*` variables and the options every
//!   backend opens with;
//! - [`chunking`], [`split`]: the token chunks and the dx GEMM's split-K;
//! - [`panic_message`]: a caught panic's text, for the errors that report
//!   one.
//!
//! - [`resident_kernels`], [`status`]: the device-resident kernels'
//!   descriptors and the status buffer's words they write (their entry
//!   points, `crate::resident`, use them).

pub mod backend;
pub mod checks;
pub mod chunking;
pub mod gemm_choice;
pub mod glsl_tile;
pub mod host;
pub mod kernels;
pub mod launch;
pub mod params;
pub mod queue;
pub mod resident_kernels;
pub mod settings;
pub mod split;
pub mod status;
pub mod tune_cache;
pub mod wgmma_tile;

pub use backend::{
    Backend, DeviceBuffer, DeviceInfo, DownloadsInFlight, GemmDesc, GemmRowStats, HeadLayout, KernelTime, KlDesc,
    KlFilter, MemoryStats, PendingDownload, RowStats, SumPartsDesc, TopkDesc, TransposeDesc, STATS_GROUP_COLS,
};
pub use chunking::{fold_workgroups, plan_chunks, ChunkPlan, ChunkTransfers, RowCost, Rows, MAX_WORKGROUPS_PER_DIM};
pub use gemm_choice::{ChoiceSource, CoopGemm, GemmChoice, KernelLimits, StagedTile};
pub use glsl_tile::GlslTile;
pub use kernels::{GemmKernel, KernelBuild, KernelId, KernelSource};
pub use launch::{Checked, Kernels, Launch};
pub use queue::{QueueChoice, QueueFamily};
pub use resident_kernels::{
    GatherRowsDesc, HeadGradOutDesc, HiddenInDesc, LabelsInDesc, LossOutDesc, RowCopyDesc, ShardRowsDesc, ShardStage,
    StatusDetailDesc, TeacherRowsDesc, TopkOutDesc, WeightStatsDesc, VIEW_ALIGN,
};
pub use settings::{CommonOptions, Env};
pub use split::DxSplit;
pub use tune_cache::TuneCache;
pub use wgmma_tile::{WgmmaFeed, WgmmaTile};

/// A caught panic's message (what `catch_unwind` or `JoinHandle::join`
/// returns), where it carries text.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
