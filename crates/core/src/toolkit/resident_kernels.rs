//! The device-resident kernels' descriptors (`shaders/resident_*.wgsl`):
//! what each computes, in the kernel catalogue's terms. Each is one
//! [`crate::toolkit::KernelId`] and one [`crate::toolkit::Launch`] variant, checked against
//! its buffers in `crate::toolkit::checks` like the driver's kernels, and dispatched
//! through [`Backend::dispatch`]. Offsets are in elements of the caller's
//! buffers; the status buffer is [`super::status`]'s. Their entry points
//! are `crate::resident`'s.

use crate::error::{Error, Result};
use crate::problem::terms::{TailMode, TeacherForm};
use crate::toolkit::backend::{Backend, GemmDesc};

/// Element type of hidden rows in a device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HiddenDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the top half of a binary32).
    Bf16,
}

impl HiddenDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            HiddenDtype::F32 => 4,
            HiddenDtype::F16 | HiddenDtype::Bf16 => 2,
        }
    }

    /// Its code in [`crate::toolkit::params::HiddenInParams::dtype`] (the shaders
    /// get the same as `DTYPE_*`).
    pub const fn code(self) -> u32 {
        match self {
            HiddenDtype::F32 => 0,
            HiddenDtype::F16 => 1,
            HiddenDtype::Bf16 => 2,
        }
    }
}

/// The weights' total and gradient scale, resolved on the device into the
/// status buffer's coefficient words; the first bad weight flagged. When
/// `total` is not positive the KL multiplier word is
/// [`super::status::FLAGGED_ROW`] (every row of the call is then flagged)
/// and the dx multiplier 0. Buffers `[weights, status]` (weights unread
/// without `has_weights`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightStatsDesc {
    /// Tokens of the call.
    pub rows: usize,
    /// Whether the weights buffer holds `[rows]` weights (else all 1).
    pub has_weights: bool,
    /// The caller's total (`None`: the weights' sum).
    pub total: Option<f32>,
    /// The caller's gradient scale (`None`: `2^14 · total / max w /
    /// grad_bound`).
    pub gscale: Option<f32>,
    /// τ.
    pub temperature: f32,
    /// [`crate::problem::terms::LossTerms::grad_bound`] at τ.
    pub grad_bound: f64,
}

/// A chunk of the caller's teacher rows checked, clamped and (in the
/// renormalize tail mode) renormalized into scratch, with each row's KL
/// coefficient into word 0 of the per-row inputs `[rows][2]`; bad rows
/// flagged. A bad row (zero probabilities), a row of bad weight, and every
/// row when the stats kernel found `total` not positive, get the
/// coefficient word [`super::status::FLAGGED_ROW`]. Buffers `[ids, probs,
/// weights, status, ids_out, probs_out, row_in]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TeacherRowsDesc {
    /// Rows of the chunk.
    pub rows: usize,
    /// Entries per row.
    pub k: usize,
    /// Real vocabulary size.
    pub vocab: usize,
    /// The chunk's first token.
    pub token0: usize,
    /// The chunk's first id in `ids`.
    pub ids_offset: usize,
    /// The chunk's first value in `probs`.
    pub probs_offset: usize,
    /// The chunk's first weight in `weights`.
    pub weights_offset: usize,
    /// Whether `weights` holds weights (else all 1).
    pub has_weights: bool,
    /// How `probs` holds the teacher's values.
    pub form: TeacherForm,
    /// The teacher's tail mode.
    pub tail: TailMode,
}

/// A chunk of the caller's labels checked into word 1 of the per-row
/// inputs `[rows][2]` ([`crate::problem::terms::NO_LABEL`] without labels, and for a bad
/// one, which is flagged and makes the row's coefficient word 0
/// [`super::status::FLAGGED_ROW`]). Buffers `[labels, status, row_in]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LabelsInDesc {
    /// Rows of the chunk.
    pub rows: usize,
    /// Real vocabulary size.
    pub vocab: usize,
    /// The chunk's first token.
    pub token0: usize,
    /// The chunk's first label in `labels`.
    pub labels_offset: usize,
    /// Whether `labels` holds labels.
    pub has_labels: bool,
}

/// A chunk of hidden rows (f32, f16 or bf16, `[rows][cols]` dense from
/// `src_offset`) into the padded f16 GEMM operand `[rows_padded][ld]`: each
/// value rounded to nearest f16, zeros outside `rows × cols`. Values past
/// f16's range become ±inf and NaN stays NaN, which the row kernels then
/// flag. The device-resident paths read the caller's rows with it, the
/// host path its f32 rows once uploaded (f16 and bf16 rows it packs on
/// the host). Buffers `[src, dst]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HiddenInDesc {
    /// Real rows.
    pub rows: usize,
    /// Real columns (the hidden size).
    pub cols: usize,
    /// Row stride of `dst`.
    pub ld: usize,
    /// Rows written in `dst`.
    pub rows_padded: usize,
    /// The chunk's first element in `src`.
    pub src_offset: usize,
    /// `src`'s element type.
    pub dtype: HiddenDtype,
}

impl HiddenInDesc {
    /// A whole f32 source from its first element: `rows` real rows of
    /// `cols` into `rows_padded` rows of stride `ld`.
    pub const fn f32(rows: usize, cols: usize, ld: usize, rows_padded: usize) -> Self {
        HiddenInDesc {
            rows,
            cols,
            ld,
            rows_padded,
            src_offset: 0,
            dtype: HiddenDtype::F32,
        }
    }
}

/// A chunk's loss (and optionally lse, soft and hard) and dx (scaled by the
/// status buffer's dx multiplier; overwritten or accumulated) into the
/// caller's buffers; a token with non-finite logits flagged. A flagged row
/// (its loss word [`super::status::FLAGGED_ROW`]'s bits) gets NaN loss and
/// terms, and counts as non-finite logits only if its lse word is not
/// finite. Buffers `[loss_chunk, dx_chunk, status, loss, dx, terms]`
/// (terms unread without `write_terms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossOutDesc {
    /// Rows of the chunk.
    pub rows: usize,
    /// Hidden size.
    pub hs: usize,
    /// Row stride of `dx_chunk`.
    pub ld: usize,
    /// The chunk's first token.
    pub token0: usize,
    /// The chunk's first element of `loss` (and row of `terms`).
    pub loss_offset: usize,
    /// The chunk's first element of `dx`.
    pub dx_offset: usize,
    /// Add into `dx` instead of overwriting it.
    pub accumulate: bool,
    /// Write `[lse, soft, hard]` per token into `terms`.
    pub write_terms: bool,
}

/// One piece of the head's gradient (`rows` f32 rows, `ld` apart) into the
/// caller's `[V][hs]` buffer from element `dst_offset`, scaled by the
/// status buffer's dx multiplier. Buffers `[piece, status, dst]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadGradOutDesc {
    /// Rows of the piece copied (the head's rows in it).
    pub rows: usize,
    /// Hidden size: elements per row of `dst`.
    pub hs: usize,
    /// Row stride of `piece` (≥ hs).
    pub ld: usize,
    /// First element of `dst` written.
    pub dst_offset: usize,
}

/// A chunk's top-k ids and probabilities into the caller's buffers; a
/// token with non-finite logits flagged. Buffers `[ids_chunk, probs_chunk,
/// status, ids, probs]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopkOutDesc {
    /// Rows of the chunk.
    pub rows: usize,
    /// Entries per row.
    pub k: usize,
    /// The chunk's first token.
    pub token0: usize,
    /// The chunk's first element of `ids`.
    pub ids_offset: usize,
    /// The chunk's first element of `probs`.
    pub probs_offset: usize,
}

/// The device-resident gather's steps around the top-k kernel's gather
/// mode ([`crate::engine::Engine::logprobs_at_device`]): `GatherIn` copies a
/// chunk's ids from the caller's u32 `[ntok][k]` into the kernel's
/// `[rows][k + 1]` rows (none, `0xffffffff`, stays none; an id at or past
/// V is flagged as [`crate::toolkit::status::S_ID_RANGE`] and becomes
/// none; the last column is none, for the lse); `GatherOut` copies the
/// kernel's values out, the k log-probabilities into the caller's
/// `[ntok][k]` and the lse into `[ntok]`, flagging a token whose logits
/// were not finite. Buffers `[ids, status, ids_chunk]` and
/// `[values_chunk, status, logprobs, lse]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherRowsDesc {
    /// Rows of the chunk.
    pub rows: usize,
    /// Ids per token.
    pub k: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// The chunk's first token.
    pub token0: usize,
    /// The chunk's first element of the caller's ids.
    pub ids_offset: usize,
    /// The chunk's first element of the caller's log-probabilities.
    pub out_offset: usize,
}

/// One per-row step of a vocabulary shard's device-resident two-phase loss
/// ([`crate::shard::ShardEngine::loss_partials_device`] and
/// [`crate::shard::ShardEngine::loss_finish_device`]), around the
/// unchanged loss kernel. Buffers `[loss_chunk, stats, partials, ids,
/// probs, row_in, status]`: the loss kernel's `[rows][4]`, the merged
/// statistics and a shard's partials (both `[ntok][3]`: lse at τ, lse at
/// τ = 1, the teacher's in-shard terms), the chunk's teacher entries
/// `[rows][k]` (global ids as `teacher_rows` writes them, then local), the
/// loss kernel's per-row inputs and the status buffer; each step reads
/// and writes only the buffers its [`ShardStage`] names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardRowsDesc {
    /// The step.
    pub stage: ShardStage,
    /// Rows of the chunk.
    pub rows: usize,
    /// Teacher entries per row (at most the shard's width).
    pub k: usize,
    /// The shard's first row.
    pub v0: usize,
    /// One past its last row.
    pub v1: usize,
    /// The chunk's first token.
    pub token0: usize,
    /// The partials step also writes the lse at τ = 1 (τ is 1, so one
    /// loss-kernel run gives both).
    pub lse1_too: bool,
}

/// The steps of [`ShardRowsDesc`], in the order a chunk runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardStage {
    /// Phase one, before the loss kernel: the teacher's entries in the
    /// shard get local ids; the others become probability-0 entries (on
    /// the row's first in-shard column, or column 0), so the loss kernel's
    /// soft term sums the in-shard entries only. Writes `ids`, `probs`.
    Map,
    /// Phase one, after the loss kernel at τ = 1 on the scaled logits:
    /// `partials[t] = [lse_s, (lse_s), soft − mass·lse_s]` with the kernel's
    /// lse and soft term and the row's in-shard mass; a non-finite lse is
    /// flagged. Reads `loss_chunk`, `probs`; writes `partials`, `status`.
    Partials,
    /// Phase one, after the loss kernel at τ: its lse (at τ = 1) into
    /// `partials[t][1]`. Reads `loss_chunk`; writes `partials`.
    Lse1,
    /// Phase two, before the loss kernel: with `α = max(exp(lse_s − lse),
    /// 2^-40)` (the shard's own lse in `partials`, the merged one in
    /// `stats`), in-shard entries get local ids and probability `q/α`, the
    /// others duplicate the row's first in-shard entry (an identical
    /// gradient write) or become probability 0 on column 0, and the row's
    /// coefficient becomes `c·α` (a flagged row's
    /// [`super::status::FLAGGED_ROW`] stays): the kernel's gradient is
    /// then the global `c·(p_S − q)`. Reads `stats`, `partials`; writes
    /// `ids`, `probs`, `row_in`.
    MapFinish,
    /// Phase two, after the loss kernel: each row of `loss_chunk` becomes
    /// `[soft_part + lse, lse1, soft_part + lse, 0]` from `stats` (a
    /// non-finite row, bad logits or a flagged row, is left as the kernel
    /// wrote it), for `loss_out`. Reads `stats`; writes `loss_chunk`.
    Loss,
}

impl ShardStage {
    /// Its code in [`crate::toolkit::params::ShardRowsParams::stage`] (the shader's
    /// `STAGE_*` constants).
    pub const fn code(self) -> u32 {
        match self {
            ShardStage::Map => 0,
            ShardStage::Partials => 1,
            ShardStage::Lse1 => 2,
            ShardStage::MapFinish => 3,
            ShardStage::Loss => 4,
        }
    }

    /// Every step.
    pub const ALL: [ShardStage; 5] = [
        ShardStage::Map,
        ShardStage::Partials,
        ShardStage::Lse1,
        ShardStage::MapFinish,
        ShardStage::Loss,
    ];

    /// The shader's name for it (`STAGE_` and this).
    pub const fn name(self) -> &'static str {
        match self {
            ShardStage::Map => "MAP",
            ShardStage::Partials => "PARTIALS",
            ShardStage::Lse1 => "LSE1",
            ShardStage::MapFinish => "MAP_FINISH",
            ShardStage::Loss => "LOSS",
        }
    }
}

/// The first bad teacher row, weight or label flagged in a call, described
/// in the status buffer's detail words. Buffers `[ids, probs, weights,
/// status, labels]` (weights and labels unread without them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatusDetailDesc {
    /// Tokens of the call.
    pub rows: usize,
    /// Teacher entries per row.
    pub k: usize,
    /// Whether `weights` holds weights.
    pub has_weights: bool,
    /// How `probs` holds the teacher's values.
    pub form: TeacherForm,
    /// The teacher's tail mode.
    pub tail: TailMode,
    /// Whether `labels` holds labels.
    pub has_labels: bool,
}

/// Where a view of a caller's buffer, or a window of one, may start: the
/// largest storage-binding offset alignment Vulkan allows
/// (minStorageBufferOffsetAlignment), in bytes.
pub const VIEW_ALIGN: u64 = 256;

/// A backend that can run the device-resident entry points
/// ([`crate::engine::Engine::head_kl_device`], [`crate::engine::Engine::topk_device`]) on
/// buffers the caller owns. Their kernels go through
/// [`Backend::dispatch`] like the driver's.
///
/// A caller's buffer is the backend's buffer type wrapping the caller's
/// device buffer with a byte offset and length (a view); the backend binds
/// exactly that view, so a view must start at a multiple of [`VIEW_ALIGN`]
/// bytes and its length must be a multiple of 4.
pub trait ResidentBackend: Backend {
    /// Bytes a buffer (or a view of a caller's buffer) spans.
    fn buffer_len(&self, buffer: &Self::Buffer) -> u64;

    /// Byte offset of a view inside the caller's buffer (0 for the
    /// backend's own buffers).
    fn buffer_offset(&self, buffer: &Self::Buffer) -> u64;

    /// Submits everything recorded so far to the device without waiting.
    fn submit(&self) -> Result<()>;

    /// `len` bytes of `buffer` from byte `offset`, as a buffer a kernel can
    /// bind on its own, where the backend makes such windows: how a
    /// resident output larger than one binding (a large head's f32
    /// gradient) is written a binding at a time. `None` where the backend
    /// cannot (the default) or the range is not inside `buffer`; a window
    /// lives no longer than the call that binds it.
    fn window(&self, buffer: &Self::Buffer, offset: u64, len: u64) -> Option<Self::Buffer> {
        let _ = (buffer, offset, len);
        None
    }

    /// Whether [`Self::copy_rows`] and [`Self::gemm_scaled_by_word`] run
    /// here, on windows of one buffer bound together (a GEMM reading two
    /// windows of the caller's buffer and writing a third: raw device
    /// pointers may; wgpu refuses a buffer bound for reading and writing
    /// at once). Where they do, the resident call builds the head's
    /// gradient in the caller's buffer itself, scaled by its GEMMs, and a
    /// large head's in one GEMM per part of the vocabulary, its inputs
    /// parked in that buffer, rather than one per chunk of rows.
    fn defers_head_grad(&self) -> bool {
        false
    }

    /// Queues a strided copy of rows of bytes from `src` to `dst` (which
    /// must not overlap), in order with the kernels around it.
    fn copy_rows(&self, src: &Self::Buffer, dst: &Self::Buffer, desc: &RowCopyDesc) -> Result<()> {
        let _ = (src, dst, desc);
        Err(Error::MissingFeature(format!(
            "{}: device copies of rows",
            self.info().backend
        )))
    }

    /// [`crate::toolkit::Kernels::gemm`] with its alpha multiplied, on the
    /// device, by the f32 word `word` of `scale` (the status buffer's dx
    /// multiplier), read when the GEMM runs.
    fn gemm_scaled_by_word(
        &self,
        (a, b, c): (&Self::Buffer, &Self::Buffer, &Self::Buffer),
        desc: &GemmDesc,
        (scale, word): (&Self::Buffer, usize),
    ) -> Result<()> {
        let _ = (a, b, c, desc, scale, word);
        Err(Error::MissingFeature(format!(
            "{}: a GEMM whose alpha is read from the device",
            self.info().backend
        )))
    }
}

/// Rows of bytes copied on the device from one buffer to another
/// ([`ResidentBackend::copy_rows`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowCopyDesc {
    /// Rows copied.
    pub rows: usize,
    /// Bytes of each row.
    pub row_bytes: usize,
    /// Byte offset of the first source row.
    pub src_offset: u64,
    /// Bytes from one source row to the next.
    pub src_pitch: usize,
    /// Byte offset of the first destination row.
    pub dst_offset: u64,
    /// Bytes from one destination row to the next.
    pub dst_pitch: usize,
}

impl RowCopyDesc {
    /// A contiguous run of `bytes` bytes, as one row.
    pub fn run(bytes: usize, src_offset: u64, dst_offset: u64) -> Self {
        Self {
            rows: 1,
            row_bytes: bytes,
            src_offset,
            src_pitch: bytes,
            dst_offset,
            dst_pitch: bytes,
        }
    }

    /// That the rows lie inside buffers of `src_len` and `dst_len` bytes,
    /// each row within its pitch, with every offset, pitch and length a
    /// multiple of 4 (the words kernels read); the typed error naming the
    /// field otherwise.
    pub fn check(&self, src_len: u64, dst_len: u64) -> Result<()> {
        let bad = |field: &'static str, value: u128, reason: &str| Error::BadDescriptor {
            kernel: "copy_rows",
            field,
            value,
            reason: reason.into(),
        };
        let words = [
            ("row_bytes", self.row_bytes as u64),
            ("src_offset", self.src_offset),
            ("src_pitch", self.src_pitch as u64),
            ("dst_offset", self.dst_offset),
            ("dst_pitch", self.dst_pitch as u64),
        ];
        for (field, value) in words {
            if value % 4 != 0 {
                return Err(bad(field, u128::from(value), "not a multiple of 4 bytes"));
            }
        }
        if self.rows > 1 && (self.src_pitch < self.row_bytes || self.dst_pitch < self.row_bytes) {
            return Err(bad(
                "src_pitch",
                self.src_pitch as u128,
                "rows overlap (a pitch below row_bytes)",
            ));
        }
        let end = |offset: u64, pitch: usize| {
            let rows = self.rows.saturating_sub(1) as u128;
            u128::from(offset) + rows * pitch as u128 + self.row_bytes as u128
        };
        if self.rows > 0 && end(self.src_offset, self.src_pitch) > u128::from(src_len) {
            return Err(bad("src", u128::from(src_len), "the rows run past the buffer"));
        }
        if self.rows > 0 && end(self.dst_offset, self.dst_pitch) > u128::from(dst_len) {
            return Err(bad("dst", u128::from(dst_len), "the rows run past the buffer"));
        }
        Ok(())
    }
}

/// A shared reference to a resident backend is one.
impl<T: ResidentBackend + ?Sized> ResidentBackend for &T {
    fn buffer_len(&self, buffer: &Self::Buffer) -> u64 {
        (**self).buffer_len(buffer)
    }
    fn buffer_offset(&self, buffer: &Self::Buffer) -> u64 {
        (**self).buffer_offset(buffer)
    }
    fn submit(&self) -> Result<()> {
        (**self).submit()
    }
    fn window(&self, buffer: &Self::Buffer, offset: u64, len: u64) -> Option<Self::Buffer> {
        (**self).window(buffer, offset, len)
    }
    fn defers_head_grad(&self) -> bool {
        (**self).defers_head_grad()
    }
    fn copy_rows(&self, src: &Self::Buffer, dst: &Self::Buffer, desc: &RowCopyDesc) -> Result<()> {
        (**self).copy_rows(src, dst, desc)
    }
    fn gemm_scaled_by_word(
        &self,
        buffers: (&Self::Buffer, &Self::Buffer, &Self::Buffer),
        desc: &GemmDesc,
        scale: (&Self::Buffer, usize),
    ) -> Result<()> {
        (**self).gemm_scaled_by_word(buffers, desc, scale)
    }
}

/// The floor on a shard's softmax share `α = exp(lse_s − lse)` in phase two:
/// `q/α` stays far inside f32, and what the floor changes, `c·α·p ≤ c·2^-40`,
/// is below the f16 gradient's resolution.
pub const ALPHA_FLOOR: f64 = 1.0 / (1u64 << 40) as f64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_copies_are_checked_against_both_buffers() {
        let strided = RowCopyDesc {
            rows: 3,
            row_bytes: 8,
            src_offset: 4,
            src_pitch: 16,
            dst_offset: 0,
            dst_pitch: 8,
        };
        // Source: 4 + 2·16 + 8 = 44 bytes; destination 3·8 = 24.
        assert!(strided.check(44, 24).is_ok());
        let field = |r: Result<()>| match r {
            Err(Error::BadDescriptor { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(strided.check(43, 24)), "src");
        assert_eq!(field(strided.check(44, 23)), "dst");
        let odd = RowCopyDesc {
            src_offset: 2,
            ..strided
        };
        assert_eq!(field(odd.check(1 << 20, 1 << 20)), "src_offset");
        let overlapping = RowCopyDesc {
            src_pitch: 4,
            ..strided
        };
        assert_eq!(field(overlapping.check(1 << 20, 1 << 20)), "src_pitch");
        let none = RowCopyDesc { rows: 0, ..strided };
        assert!(none.check(0, 0).is_ok(), "no rows reach nothing");
        assert!(RowCopyDesc::run(12, 4, 0).check(16, 12).is_ok());
        assert_eq!(field(RowCopyDesc::run(12, 8, 0).check(16, 12)), "src");
    }
}
