//! The uniform-parameter blocks of the shared WGSL kernels in `shaders/`,
//! byte for byte. Both GPU backends fill these; the shaders get the same
//! structs at `@group(0) @binding(0)` from [`ParamBlock::wgsl`] (WGSL has no
//! include). Every field is 4 bytes and each block
//! is a multiple of 16 bytes, so the std140 and std430 layouts agree.
//! Blocks are made only by the descriptor checks (`crate::toolkit::checks`), which
//! refuse extents past 32 bits instead of truncating them.

use bytemuck::{Pod, Zeroable};

/// `shaders/gemm*.wgsl`: `C (+)= alpha · A · op(B)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct GemmParams {
    /// Rows of A and C.
    pub m: u32,
    /// Columns of C.
    pub n: u32,
    /// Reduction length.
    pub k: u32,
    /// First element of A.
    pub a_offset: u32,
    /// Row stride of A.
    pub lda: u32,
    /// Row stride of B.
    pub ldb: u32,
    /// First element of C.
    pub c_offset: u32,
    /// Row stride of C.
    pub ldc: u32,
    /// Scale of the product.
    pub alpha: f32,
    /// 1: add into C; 0: overwrite.
    pub accumulate: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Parts the reduction is split into (1: no split); workgroup `l`
    /// computes part `l / tiles` of tile `l % tiles`.
    pub k_parts: u32,
    /// Reduction indices per part (`crate::toolkit::split::k_part_len`: a multiple
    /// of 64, at least `k` with one part).
    pub k_part: u32,
    /// Elements between the parts' C blocks.
    pub c_part_stride: u32,
    /// First element of the row statistics in C (0: none are written; see
    /// [`crate::toolkit::RowStats`]).
    pub stats_offset: u32,
    /// Statistics groups per row (pairs; even).
    pub stats_ld: u32,
    /// The group of C's column 0 of this GEMM.
    pub stats_first: u32,
    /// Columns of C that enter the statistics (the real vocabulary).
    pub stats_cols: u32,
    /// The dx GEMM's block filter (`crate::problem::filter`): rows of A whose block
    /// mask is read (0 without the filter; the ceiling report's MODE 2
    /// relies on it being 0). The mask sits in A's buffer after A's `m`
    /// rows, at element `m · lda`.
    pub mask_rows: u32,
    /// Mask words per row of A (`crate::problem::filter::mask_words`).
    pub mask_ld: u32,
}

/// `shaders/gemm_wgmma.cu`'s pack kernels: `rows` rows (M of A, N of B) by
/// `kdim` of K, `ld` elements apart, laid out as the bulk tiles' stages
/// hold them ([`crate::toolkit::wgmma_tile::PackKind`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PackParams {
    /// Rows of the source (M of A, N of B).
    pub rows: u32,
    /// Reduction length of the source.
    pub kdim: u32,
    /// Elements between the source's rows (K-major) or K-rows (N-major).
    pub ld: u32,
    /// Packed tiles along the rows.
    pub tiles: u32,
    /// Packed K steps of 16.
    pub steps: u32,
    /// Workgroups along x of the (folded) launch grid.
    pub grid_x: u32,
    /// Padding to 16-byte blocks.
    pub pad0: u32,
    /// Padding to 16-byte blocks.
    pub pad1: u32,
}

/// `shaders/sum_parts.wgsl`: a split-K GEMM's partial blocks summed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct SumPartsParams {
    /// Elements to write (a multiple of 4).
    pub len: u32,
    /// Parts to add.
    pub parts: u32,
    /// Elements between parts (a multiple of 4).
    pub part_stride: u32,
    /// 1: add into dst; 0: overwrite.
    pub accumulate: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: [u32; 3],
}

/// `shaders/kl_rows.wgsl` and `shaders/topk_rows.wgsl` (which reads the
/// first five fields, the flags and the cap).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct RowParams {
    /// Rows to process.
    pub rows: u32,
    /// Real vocabulary size.
    pub vocab: u32,
    /// Row stride of logits (and grad).
    pub ld: u32,
    /// Teacher or top-k entries per row.
    pub k: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// The KL kernel's terms ([`row_flags`]); 0 is the seed's loss.
    pub flags: u32,
    /// τ (the logits are already divided by it).
    pub temperature: f32,
    /// The softcap on the scaled logits, `c/τ` (read with
    /// [`row_flags::SOFTCAP`]).
    pub cap: f32,
    /// `α_soft`.
    pub soft_weight: f32,
    /// `α_hard`.
    pub hard_weight: f32,
    /// Label smoothing ε.
    pub smoothing: f32,
    /// z-loss λ.
    pub z_loss: f32,
    /// `kl_rows`: first element of the row statistics in the logits
    /// buffer, a multiple of 4 (0: none; the kernel folds the logits
    /// itself). See [`crate::toolkit::RowStats`].
    pub stats_offset: u32,
    /// `kl_rows`: statistics groups per row as stored (even).
    pub stats_ld: u32,
    /// `kl_rows`: statistics groups per row that hold statistics.
    pub stats_groups: u32,
    /// `kl_rows` with [`row_flags::FILTER`]: the block filter's ε on
    /// `|∂L/∂s|` (`crate::problem::filter`).
    pub filter_eps: f32,
    /// `kl_rows` with [`row_flags::FILTER`]: where the block mask starts in
    /// grad, in 4-half words (the mask's element offset / 4).
    pub mask_off4: u32,
    /// `kl_rows` with [`row_flags::FILTER`]: mask words per row.
    pub mask_ld: u32,
    /// `kl_rows`: β of the JSD (read with the divergence's code 2).
    pub beta: f32,
    /// Padding to 16 bytes.
    pub _pad: u32,
}

/// Bits of [`RowParams::flags`]; `shaders/kl_rows.wgsl` and
/// `shaders/topk_rows.wgsl` get them as constants from [`row_flags::wgsl`].
/// With every bit clear the kernels do the seed's work and no more.
pub mod row_flags {
    /// Softcap the logits.
    pub const SOFTCAP: u32 = 1;
    /// Shift of the tail mode's code ([`crate::problem::terms::TailMode::code`], 2 bits).
    pub const TAIL_SHIFT: u32 = 1;
    /// The hard-label term is on.
    pub const HARD: u32 = 8;
    /// The z-loss is on.
    pub const Z_LOSS: u32 = 16;
    /// τ ≠ 1: the softmax at τ = 1 (lse output, hard term, z-loss) needs
    /// its own sums.
    pub const TAU: u32 = 32;
    /// `topk_rows`: write log-probabilities over the full vocabulary
    /// instead of the softmax over the k.
    pub const LOGPROBS: u32 = 64;
    /// `kl_rows`: anything but the seed's loss (a term above, or
    /// `α_soft ≠ 1`), so the flags are 0 exactly on the plain path.
    pub const GENERAL: u32 = 128;
    /// `kl_rows`: shift of τ as a small integer (3 bits: 2, 3 or 4 when τ
    /// is that integer, else 0), so the softmax at τ = 1 comes from the
    /// one at τ by multiplication: `e¹ = (e^τ)^τ`.
    pub const TAU_POW_SHIFT: u32 = 8;
    /// Mask of the τ power's field (after the shift).
    pub const TAU_POW_MASK: u32 = 7;
    /// `kl_rows`: also write the dx GEMM's block mask (`crate::problem::filter`);
    /// a pipeline of its own, so the kernel without it is unchanged.
    pub const FILTER: u32 = 2048;
    /// `kl_rows`: shift of the soft term's divergence
    /// ([`crate::problem::terms::Divergence::code`], 2 bits: 0 forward, 1 reverse, 2 JSD).
    pub const DIVERGENCE_SHIFT: u32 = 12;
    /// `topk_rows`: no selection; write the log-probabilities over the
    /// full vocabulary at the ids the caller put in `ids` (one past the
    /// vocabulary: none, `-inf`), and the row's log-sum-exp in the last
    /// of the k columns.
    pub const GATHER: u32 = 16384;
    /// `kl_rows`: the teacher is dense: `probs` holds the teacher's logits
    /// at τ, `[rows][ld]` like the student's, and the soft term is the
    /// exact divergence over the full vocabulary (`ids` is not read).
    pub const DENSE_TEACHER: u32 = 32768;

    /// The declarations `shaders/kl_rows.wgsl` and `shaders/topk_rows.wgsl`
    /// get in place of [`crate::toolkit::kernels::FLAGS_MARKER`]: these bits, the
    /// divergences' and tail modes' codes they select, and the floors on a
    /// probability ([`crate::problem::terms::PROB_FLOOR`]) and its log, so no shader
    /// spells a host value by hand.
    pub fn wgsl() -> String {
        use crate::problem::terms::{Divergence, TailMode};
        let mut s = String::new();
        for (name, value) in [
            ("F_SOFTCAP", SOFTCAP),
            ("F_TAIL_SHIFT", TAIL_SHIFT),
            ("F_HARD", HARD),
            ("F_Z_LOSS", Z_LOSS),
            ("F_TAU", TAU),
            ("F_LOGPROBS", LOGPROBS),
            ("F_TAU_POW_SHIFT", TAU_POW_SHIFT),
            ("F_TAU_POW_MASK", TAU_POW_MASK),
            ("F_FILTER", FILTER),
            ("F_DIV_SHIFT", DIVERGENCE_SHIFT),
            ("F_GATHER", GATHER),
            ("F_DENSE", DENSE_TEACHER),
            ("DIV_REVERSE", Divergence::Reverse.code()),
            ("DIV_JSD", Divergence::Jsd { beta: 0.5 }.code()),
            ("TAIL_BUCKET", TailMode::Bucket.code()),
            ("TAIL_NONE", TailMode::Unnormalized.code()),
            // The dx block filter's block of vocabulary rows (its mask's bit).
            ("FILTER_BLOCK", crate::problem::filter::BLOCK as u32),
        ] {
            s.push_str(&format!("const {name}: u32 = {value}u;\n"));
        }
        // f32's shortest round-trip digits: the value the host's f32 holds.
        let floor = crate::problem::terms::PROB_FLOOR as f32;
        s.push_str(&format!("const TAIL_FLOOR: f32 = {floor:e};\n"));
        s.push_str(&format!("const LOG_PROB_FLOOR: f32 = {:e};\n", floor.ln()));
        s
    }
}

/// `shaders/transpose.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct TransposeParams {
    /// Real rows in src.
    pub rows: u32,
    /// Columns of dst (its row stride).
    pub rows_padded: u32,
    /// Columns of src moved.
    pub cols: u32,
    /// Row stride of src.
    pub ld_src: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: [u32; 3],
}

/// One field of a parameter block: its name in the shader's struct, its
/// byte offset and its WGSL type (padding fields are left out).
pub type ParamField = (&'static str, usize, &'static str);

/// A parameter block as the shaders declare it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamBlock {
    /// The struct's name in WGSL.
    pub name: &'static str,
    /// Its fields, in order.
    pub fields: &'static [ParamField],
    /// Its size in bytes.
    pub bytes: usize,
}

impl ParamBlock {
    /// The WGSL declaration of the struct (padded to its size with `padN`
    /// fields) and of the uniform `params` at group 0, binding 0: the part
    /// of every shader that `crate::toolkit::kernels::Shader::source` inserts.
    pub fn wgsl(&self) -> String {
        let mut out = format!("struct {} {{\n", self.name);
        let mut end = 0;
        for (name, offset, ty) in self.fields {
            out.push_str(&format!("    {name}: {ty},\n"));
            end = offset + 4;
        }
        for pad in 0..(self.bytes - end) / 4 {
            out.push_str(&format!("    pad{pad}: u32,\n"));
        }
        out.push_str(&format!(
            "}}\n\n@group(0) @binding(0) var<uniform> params: {};\n",
            self.name
        ));
        out
    }
}

macro_rules! param_block {
    ($t:ident: $($f:ident: $w:ident),*) => {
        impl $t {
            /// The block as the shaders declare it.
            pub const BLOCK: ParamBlock = ParamBlock {
                name: stringify!($t),
                fields: &[$((stringify!($f), std::mem::offset_of!($t, $f), stringify!($w))),*],
                bytes: size_of::<$t>(),
            };

            /// The block with the dispatch's folded grid width.
            pub const fn with_grid(mut self, grid_x: u32) -> Self {
                self.grid_x = grid_x;
                self
            }
        }
    };
}

param_block!(GemmParams: m: u32, n: u32, k: u32, a_offset: u32, lda: u32, ldb: u32, c_offset: u32, ldc: u32, alpha: f32, accumulate: u32, grid_x: u32, k_parts: u32, k_part: u32, c_part_stride: u32, stats_offset: u32, stats_ld: u32, stats_first: u32, stats_cols: u32, mask_rows: u32, mask_ld: u32);
param_block!(PackParams: rows: u32, kdim: u32, ld: u32, tiles: u32, steps: u32, grid_x: u32, pad0: u32, pad1: u32);
param_block!(SumPartsParams: len: u32, parts: u32, part_stride: u32, accumulate: u32, grid_x: u32);
param_block!(RowParams: rows: u32, vocab: u32, ld: u32, k: u32, grid_x: u32, flags: u32, temperature: f32, cap: f32, soft_weight: f32, hard_weight: f32, smoothing: f32, z_loss: f32, stats_offset: u32, stats_ld: u32, stats_groups: u32, filter_eps: f32, mask_off4: u32, mask_ld: u32, beta: f32);
param_block!(TransposeParams: rows: u32, rows_padded: u32, cols: u32, ld_src: u32, grid_x: u32);
param_block!(WeightStatsParams: rows: u32, has_weights: u32, grid_x: u32, total: f32, gscale: f32, inv_temperature: f32, grad_bound: f32);
param_block!(TeacherRowsParams: rows: u32, k: u32, vocab: u32, token0: u32, ids_offset: u32, probs_offset: u32, weights_offset: u32, has_weights: u32, logprobs: u32, tail: u32, grid_x: u32);
param_block!(LabelsInParams: rows: u32, vocab: u32, token0: u32, labels_offset: u32, has_labels: u32, grid_x: u32);
param_block!(HiddenInParams: rows: u32, cols: u32, rows_padded: u32, ld: u32, src_offset: u32, dtype: u32, grid_x: u32);
param_block!(LossOutParams: rows: u32, hs: u32, ld: u32, token0: u32, loss_offset: u32, dx_offset: u32, accumulate: u32, write_terms: u32, grid_x: u32);
param_block!(HeadGradOutParams: rows: u32, hs: u32, ld: u32, dst_offset: u32, grid_x: u32);
param_block!(TopkOutParams: rows: u32, k: u32, token0: u32, ids_offset: u32, probs_offset: u32, grid_x: u32);
param_block!(ShardRowsParams: rows: u32, k: u32, v0: u32, v1: u32, token0: u32, stage: u32, lse1_too: u32, grid_x: u32);
param_block!(StatusDetailParams: rows: u32, k: u32, has_weights: u32, logprobs: u32, tail: u32, has_labels: u32, grid_x: u32);
param_block!(GatherRowsParams: rows: u32, k: u32, vocab: u32, token0: u32, ids_offset: u32, out_offset: u32, grid_x: u32);

// The device-resident kernels' blocks (`shaders/resident_*.wgsl`, one per
// kernel; `crate::resident` says what each kernel does). Offsets are in
// elements of the caller's buffers; booleans are 0 or 1; `tail` is
// `crate::problem::terms::TailMode::code`, `dtype` `crate::toolkit::resident_kernels::HiddenDtype::code`.

/// `shaders/resident_stats.wgsl` (one workgroup).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct WeightStatsParams {
    /// Tokens of the call.
    pub rows: u32,
    /// 1: the weights buffer holds `[rows]` weights; 0: all 1.
    pub has_weights: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// The caller's total (0: the weights' sum).
    pub total: f32,
    /// The caller's gradient scale (0: from the weights).
    pub gscale: f32,
    /// `1/τ`.
    pub inv_temperature: f32,
    /// [`crate::problem::terms::LossTerms::grad_bound`] (≥ 1).
    pub grad_bound: f32,
    /// Padding to 16 bytes.
    pub _pad: u32,
}

/// `shaders/resident_teacher.wgsl` (one workgroup per row).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct TeacherRowsParams {
    /// Rows of the chunk.
    pub rows: u32,
    /// Teacher entries per row.
    pub k: u32,
    /// Real vocabulary size.
    pub vocab: u32,
    /// The chunk's first token (for the status buffer).
    pub token0: u32,
    /// The chunk's first id.
    pub ids_offset: u32,
    /// The chunk's first probability.
    pub probs_offset: u32,
    /// The chunk's first weight.
    pub weights_offset: u32,
    /// 1: weights given.
    pub has_weights: u32,
    /// 1: the values are log-probabilities.
    pub logprobs: u32,
    /// The tail mode's code.
    pub tail: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: u32,
}

/// `shaders/resident_labels.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct LabelsInParams {
    /// Rows of the chunk.
    pub rows: u32,
    /// Real vocabulary size.
    pub vocab: u32,
    /// The chunk's first token.
    pub token0: u32,
    /// The chunk's first label.
    pub labels_offset: u32,
    /// 1: labels given.
    pub has_labels: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: [u32; 2],
}

/// `shaders/resident_hidden.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct HiddenInParams {
    /// Real rows.
    pub rows: u32,
    /// Real columns (the hidden size).
    pub cols: u32,
    /// Rows written in the padded operand.
    pub rows_padded: u32,
    /// Row stride of the padded operand.
    pub ld: u32,
    /// The chunk's first element in the source.
    pub src_offset: u32,
    /// The source's element type.
    pub dtype: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: u32,
}

/// `shaders/resident_head_grad_out.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct HeadGradOutParams {
    /// Rows of the piece copied.
    pub rows: u32,
    /// Elements per row of dst.
    pub hs: u32,
    /// Row stride of the piece.
    pub ld: u32,
    /// First element of dst written.
    pub dst_offset: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: [u32; 3],
}

/// `shaders/resident_loss_out.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct LossOutParams {
    /// Rows of the chunk.
    pub rows: u32,
    /// Hidden size.
    pub hs: u32,
    /// Row stride of the chunk's dx (the padded hidden size).
    pub ld: u32,
    /// The chunk's first token.
    pub token0: u32,
    /// The chunk's first loss element in the caller's buffers.
    pub loss_offset: u32,
    /// The chunk's first dx element in the caller's dx.
    pub dx_offset: u32,
    /// 1: add into dx.
    pub accumulate: u32,
    /// 1: write `[lse, soft, hard]` per token.
    pub write_terms: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: [u32; 3],
}

/// `shaders/resident_gather.wgsl`'s two entry points
/// (one invocation per column of a chunk's `[rows][k + 1]` gather rows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct GatherRowsParams {
    /// Rows of the chunk.
    pub rows: u32,
    /// Ids per token (the gather rows hold one more column, the lse).
    pub k: u32,
    /// Vocabulary size.
    pub vocab: u32,
    /// The chunk's first token.
    pub token0: u32,
    /// The chunk's first id in the caller's ids.
    pub ids_offset: u32,
    /// The chunk's first log-probability in the caller's output.
    pub out_offset: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: u32,
}

/// `shaders/resident_topk_out.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct TopkOutParams {
    /// Rows of the chunk.
    pub rows: u32,
    /// Entries per row.
    pub k: u32,
    /// The chunk's first token.
    pub token0: u32,
    /// The chunk's first id in the caller's ids.
    pub ids_offset: u32,
    /// The chunk's first probability in the caller's probabilities.
    pub probs_offset: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: [u32; 2],
}

/// `shaders/resident_shard.wgsl` (one invocation per row): a vocabulary
/// shard's per-row steps of the device-resident two-phase loss
/// ([`crate::toolkit::resident_kernels::ShardRowsDesc`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ShardRowsParams {
    /// Rows of the chunk.
    pub rows: u32,
    /// Teacher entries per row.
    pub k: u32,
    /// The shard's first row of the head.
    pub v0: u32,
    /// One past its last row.
    pub v1: u32,
    /// The chunk's first token (its row in the `[ntok][3]` partials and
    /// statistics).
    pub token0: u32,
    /// The step's code ([`crate::toolkit::resident_kernels::ShardStage::code`]).
    pub stage: u32,
    /// 1: the partials step also writes the lse at τ = 1 (τ is 1).
    pub lse1_too: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
}

/// `shaders/resident_status.wgsl` (one invocation).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct StatusDetailParams {
    /// Tokens of the call.
    pub rows: u32,
    /// Teacher entries per row.
    pub k: u32,
    /// 1: weights given.
    pub has_weights: u32,
    /// 1: the teacher's values are log-probabilities.
    pub logprobs: u32,
    /// The tail mode's code.
    pub tail: u32,
    /// 1: labels given.
    pub has_labels: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wgsl_declaration_pads_to_the_block_size() {
        let text = RowParams::BLOCK.wgsl();
        assert!(text.starts_with("struct RowParams {\n    rows: u32,\n"), "{text}");
        assert!(
            text.contains("    grid_x: u32,\n    flags: u32,\n    temperature: f32,\n"),
            "{text}"
        );
        assert!(
            text.contains("    mask_ld: u32,\n    beta: f32,\n    pad0: u32,\n}"),
            "{text}"
        );
        assert_eq!(RowParams::BLOCK.bytes, 80);
        assert!(SumPartsParams::BLOCK
            .wgsl()
            .contains("    grid_x: u32,\n    pad0: u32,\n    pad1: u32,\n    pad2: u32,\n}"));
        assert!(text.ends_with("var<uniform> params: RowParams;\n"), "{text}");
        assert!(GemmParams::BLOCK.wgsl().contains("    alpha: f32,\n"));
        assert_eq!(GemmParams::BLOCK.bytes, 80);
        assert!(GemmParams::BLOCK
            .wgsl()
            .contains("    stats_cols: u32,\n    mask_rows: u32,\n    mask_ld: u32,\n}"));
    }
}
