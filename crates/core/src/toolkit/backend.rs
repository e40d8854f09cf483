//! The backend boundary: buffers, transfers, and one dispatch for the
//! kernels the driver sequences ([`Backend::dispatch`] of a
//! [`crate::toolkit::Launch`]).
//!
//! A backend is a device plus an associated buffer type. Every method may
//! queue work; [`Backend::download`] waits for everything queued before it,
//! and [`Backend::upload`] is ordered after everything queued before it, so
//! the driver can reuse one scratch set across chunks without its own fences.
//!
//! Layouts are row-major. "f16" buffers hold IEEE binary16 values, "f32"
//! buffers binary32, "u32" buffers unsigned ids. Every dimension a kernel
//! receives has been validated by the driver and every operand buffer is
//! large enough for the extents named in its descriptor: a kernel never has
//! to check an index against a buffer length.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::problem::terms::{LossTerms, TailMode};
use crate::toolkit::launch::Launch;

/// A device buffer as every backend's checks see it.
pub trait DeviceBuffer {
    /// Its length in bytes, as allocated.
    fn len(&self) -> u64;

    /// Whether it was allocated with 0 bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a device offers, as [`Backend::info`] reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceInfo {
    /// Backend name: `reference`, `wgpu` or `vulkan`.
    pub backend: &'static str,
    /// Device (adapter) name as the driver reports it.
    pub device_name: String,
    /// Driver name and version, where known.
    pub driver: String,
    /// Device type in words (`discrete`, `integrated`, `cpu`, `virtual`).
    pub device_type: String,
    /// Whether the GEMM runs on matrix units (cooperative matrices).
    pub matrix_units: bool,
    /// Which GEMM kernels run and where that choice came from, in words
    /// (for logs and bench reports), once a device is open.
    pub gemm: Option<String>,
    /// The queue the backend submits to, in words (`family 2 (compute)`),
    /// once a device is open.
    pub queue: Option<String>,
    /// Matrix-unit shapes usable for f16×f16→f32, as `(m, n, k)`.
    pub matrix_shapes: Vec<(u32, u32, u32)>,
    /// Whether shaders have f16 arithmetic and 16-bit storage.
    pub shader_f16: bool,
    /// Subgroup size, where known.
    pub subgroup_size: Option<u32>,
    /// Largest byte range one storage binding may span.
    pub max_binding_bytes: u64,
    /// Largest single buffer in bytes.
    pub max_buffer_bytes: u64,
    /// Device-local memory in bytes, where known.
    pub memory_bytes: Option<u64>,
    /// Why this device cannot run headkl (a missing feature), or `None`
    /// when it can.
    pub unusable: Option<String>,
}

/// How the GEMM's B operand (always a head slice) is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadLayout {
    /// B is stored `[n][k]` (the head as stored, `[V][hs]`): `C = A · Bᵀ`,
    /// the logits `x · W_sliceᵀ` ([`crate::toolkit::KernelId::GemmLogits`]).
    Logits,
    /// B is stored `[k][n]` (the same head plane, read the other way):
    /// `C = A · B`, the input gradient `g_slice · W_slice`
    /// ([`crate::toolkit::KernelId::GemmDx`]).
    Dx,
}

/// One GEMM: `C[m][n] (+)= alpha · A[m][k] · op(B)`, f16 operands, f32
/// accumulation, f32 output.
///
/// Offsets and leading dimensions are in elements. `m`, `n` and `k` are
/// multiples of [`crate::align::ALIGN`], `a_offset`, `lda` and `ldb` multiples of
/// 8, and every operand region they name is
/// inside its buffer, so a kernel working in 16×16 tiles may read and write
/// whole tiles. Padding along `k` (in A and B) and along `n` (in B) holds
/// zeros. Rows of A past the caller's real rows may hold anything, NaN
/// included: row `i` of C depends only on row `i` of A, and the driver
/// discards those rows of C.
///
/// Split-K: with `k_parts > 1` the reduction is cut into `k_parts` parts
/// of [`crate::toolkit::split::k_part_len`] indices (the last ones may be shorter,
/// or empty) that run in one dispatch; part `p` computes
/// `alpha · A[:, part] · op(B)[part, :]` and writes (or, with
/// `accumulate`, adds) it into its own C block at
/// `c_offset + p·c_part_stride`. The blocks must not overlap; an empty
/// part writes `alpha · 0`. [`crate::toolkit::Kernels::sum_parts`] adds them up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmDesc {
    /// Rows of A and C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    /// First element of A (f16) and its row stride.
    pub a_offset: usize,
    /// Row stride of A in elements.
    pub lda: usize,
    /// A is stored as its transpose, `[k][m]`: A's column `kk` is the
    /// buffer's row `kk`, from element `a_offset + kk·lda` (the logits
    /// gradient, `[tokens][vocab]`, is A this way in the head's gradient).
    /// Only where [`Backend::gemm_a_columns`] says so, with one part and no
    /// block filter; `k` then need not be a multiple of
    /// [`crate::align::ALIGN`], as no tile reads past it.
    pub a_columns: bool,
    /// How B is laid out; its row stride is `ldb`.
    pub b_layout: HeadLayout,
    /// Row stride of B in elements (B starts at element 0 of its buffer).
    pub ldb: usize,
    /// First element of C (f32).
    pub c_offset: usize,
    /// Row stride of C in elements.
    pub ldc: usize,
    /// Scale applied to the product.
    pub alpha: f32,
    /// Add into C instead of overwriting it.
    pub accumulate: bool,
    /// Parts the reduction is split into (1: no split).
    pub k_parts: usize,
    /// Elements from one part's C block to the next's (unused with one
    /// part).
    pub c_part_stride: usize,
    /// The block filter (`crate::problem::filter`): 0 computes every block; `r > 0`
    /// reads the block mask of A's first `r` rows, stored in A's buffer at
    /// element `m · lda` ([`crate::problem::filter::mask_words`]`(lda)` words a
    /// row), and skips each K step of a row tile whose block is clear in
    /// all of the tile's rows below `r` (the [`HeadLayout::Dx`] GEMM
    /// only). Needs `a_offset < lda` (A starts in row 0, so a K index's
    /// vocabulary column is `a_offset + kk`).
    pub mask_rows: usize,
    /// Also write C's row statistics ([`RowStats`]); only with one part and
    /// no accumulation.
    pub row_stats: Option<GemmRowStats>,
}

/// Columns of C per row-statistics group: every GEMM tile's width, and
/// every matrix-unit subgroup's share of it (32 or 64 columns), is a
/// multiple of it, so each writes whole groups from its own accumulators.
pub const STATS_GROUP_COLS: usize = 32;

/// Where a logits GEMM's epilogue writes the row statistics that let
/// `kl_rows` read the logits once instead of twice (its first pass, the
/// row's maximum and sum of exponentials, comes from them).
///
/// Each group of [`STATS_GROUP_COLS`] columns of a row gets the pair
/// `(m, Σ exp(x − m))` over its real columns (`m` their maximum; a group
/// with none: `(−3e38, 0)`; a group holding a non-finite value: a NaN sum),
/// as f32 at `offset + row·2·ld + 2·group` of the same buffer as C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowStats {
    /// First element (f32) of the statistics, a multiple of 4.
    pub offset: usize,
    /// Groups per row as stored (even, so each row's pairs start on 16
    /// bytes).
    pub ld: usize,
    /// Groups per row that hold statistics (at most `ld`).
    pub groups: usize,
}

/// One GEMM's part of a [`RowStats`] region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmRowStats {
    /// The region.
    pub at: RowStats,
    /// The group of this GEMM's column 0 (its C columns start on a group).
    pub first_group: usize,
    /// Columns of C that enter the statistics (the rest are padding).
    pub cols: usize,
}

impl GemmDesc {
    /// `C[m][n] = A[m][k] · op(B)` on dense operands: every offset 0, each
    /// row stride the row's length (B's `k` or `n`, by `b_layout`), alpha 1,
    /// no accumulation, one part. Change fields with struct update syntax.
    pub fn dense(m: usize, n: usize, k: usize, b_layout: HeadLayout) -> Self {
        let ldb = match b_layout {
            HeadLayout::Logits => k,
            HeadLayout::Dx => n,
        };
        Self {
            m,
            n,
            k,
            a_offset: 0,
            lda: k,
            a_columns: false,
            b_layout,
            ldb,
            c_offset: 0,
            ldc: n,
            alpha: 1.0,
            accumulate: false,
            k_parts: 1,
            c_part_stride: 0,
            row_stats: None,
            mask_rows: 0,
        }
    }
}

/// The sum of a split-K GEMM's partial blocks:
/// `dst[i] (+)= Σ_p parts[p·part_stride + i]` for `i < len`, added in
/// increasing `p` (then into `dst` when accumulating), in f32: the same
/// result on every run, with no atomics.
///
/// `len` and `part_stride` are multiples of 4 (the kernel moves 16 bytes
/// at a time), and `part_stride ≥ len` when there are several parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SumPartsDesc {
    /// Elements of `dst` written (and of each part read).
    pub len: usize,
    /// Parts to add (at least 1).
    pub parts: usize,
    /// Elements from one part to the next in `parts`.
    pub part_stride: usize,
    /// Add the sum into `dst` instead of overwriting it.
    pub accumulate: bool,
}

/// The KL row kernel: one row per token.
///
/// Reads the logits `[rows][ld]` (f32, `s = z/τ`: already divided by τ;
/// columns `[vocab, ld)` are padding and must be ignored), the teacher's ids
/// and probabilities `[rows][k]` (u32 and f32, ids distinct and `< vocab`;
/// renormalized in [`TailMode::Renormalize`], a share of the full
/// vocabulary otherwise), and per-row inputs `[rows][2]` of u32 words: the
/// coefficient `c_t = gscale·w_t/total` (f32 bits) and the label
/// ([`crate::problem::terms::NO_LABEL`]: none; else `< vocab`). With a softcap `c` the
/// kernel caps `s` at `c/τ` (`(c/τ)·tanh(sτ/c) = c·tanh(z/c)/τ`), so the
/// GEMM's scaling stays as it is. Writes
/// - `loss[t] = [L_t, lse(z̃), L_soft, L_hard]` (f32 `[rows][4]`,
///   unweighted; `L_t = α_soft·L_soft + α_hard·L_hard + λ·lse²`, the README's
///   "Loss terms"), or a NaN `L_t` when the row's raw logits are not finite
///   (the driver turns that into an error naming the token);
/// - `grad[t][j] = c_t·∂L_t/∂s_j` as f16 for `j < vocab` (with the default
///   terms `c_t·(p_S,j − p_T,j)`), and zero for `j` in `[vocab, ld)`.
///
/// A coefficient word of [`crate::toolkit::status::FLAGGED_ROW`] (a row
/// the device-resident kernels flagged; never the host path's) makes the
/// row's gradient (and filter mask) all zero whatever its logits, and its
/// `L_t` word that marker's bits (a NaN); its lse, soft and hard words are
/// computed as for `c_t = 0`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KlDesc {
    /// Rows (tokens) to process.
    pub rows: usize,
    /// Real vocabulary size.
    pub vocab: usize,
    /// Row stride of `logits` and `grad` (a multiple of [`crate::align::ALIGN`]).
    pub ld: usize,
    /// Teacher entries per row.
    pub k: usize,
    /// The τ the logits were divided by.
    pub temperature: f32,
    /// How the teacher's probabilities are read.
    pub tail: TailMode,
    /// The terms' weights and knobs.
    pub terms: LossTerms,
    /// Statistics the logits GEMM wrote into the logits buffer: the kernel
    /// takes the row's maximum and sum from them instead of a first read
    /// of the row. Used only when that first read computes nothing else
    /// (no softcap, τ = 1, no hard label: [`KlDesc::stats_suffice`]).
    pub row_stats: Option<RowStats>,
    /// The block filter: also write the dx GEMM's block mask into grad
    /// (`crate::problem::filter`; `None`: grad alone).
    pub filter: Option<KlFilter>,
    /// The teacher is dense (the exact full-vocabulary divergence,
    /// DESIGN §1): `probs` holds the teacher's logits at τ, `[rows][ld]`
    /// f32 laid out as the student's, `ids` is not read and `k` is 1, the
    /// tail mode plays no part. Only the soft term, its weight, τ, the
    /// divergence and the logit scale apply (no softcap, hard label,
    /// z-loss, filter or row statistics).
    pub dense_teacher: bool,
}

/// Where and how `kl_rows` writes the dx GEMM's block mask: bit `b` of row
/// `t` is set when some `c_t·∂L_t/∂s_j` with `j` in block `b` is above
/// `eps·|c_t|` in magnitude (or not a number), i.e. `|∂L_t/∂s_j| > eps`;
/// a row with `c_t = 0` has every bit clear (its gradient is zero).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KlFilter {
    /// ε (finite, ≥ 0).
    pub eps: f32,
    /// First half of the mask in grad (a multiple of 4; at least
    /// `rows · ld`): the dx GEMM reads it at `m · lda`.
    pub mask_at: usize,
}

impl KlDesc {
    /// The seed's loss (τ = 1, the teacher renormalized, the soft term
    /// alone) on a `rows × vocab` block.
    pub fn plain(rows: usize, vocab: usize, ld: usize, k: usize) -> Self {
        Self {
            rows,
            vocab,
            ld,
            k,
            temperature: 1.0,
            tail: TailMode::Renormalize,
            terms: LossTerms::default(),
            row_stats: None,
            filter: None,
            dense_teacher: false,
        }
    }

    /// Whether the row statistics stand in for the kernel's whole first
    /// pass: with a softcap, τ ≠ 1 or a hard label that pass also folds
    /// the capped logits, the τ = 1 softmax or Σ of the logits.
    pub fn stats_suffice(terms: &LossTerms, temperature: f32) -> bool {
        terms.softcap.is_none() && temperature == 1.0 && !terms.hard_on()
    }
}

/// The exact top-k row kernel: one row per token.
///
/// Reads logits `[rows][ld]` (f32, already divided by τ; columns past
/// `vocab` ignored). Writes `ids[t][q]` (u32), the k largest logits' column
/// indices in descending order of logit (ties: lowest id first), and
/// `probs[t][q]` (f32), the softmax restricted to those k — or, with
/// `logprobs`, their log-probabilities over the full vocabulary. With a
/// `cap` the values are `cap·tanh(s/cap)` (the selection stays on the raw
/// logits: the cap is monotonic, so only ties it creates by saturating
/// could order differently). Exact for every input and every
/// `k ≤ min(vocab, 2048)`. A row whose max or sum is not finite gets
/// `probs[t][0] = NaN`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopkDesc {
    /// Rows (tokens) to process.
    pub rows: usize,
    /// Real vocabulary size.
    pub vocab: usize,
    /// Row stride of `logits`.
    pub ld: usize,
    /// Entries to select per row.
    pub k: usize,
    /// The softcap on the scaled logits, `c/τ` (`None`: no cap).
    pub cap: Option<f32>,
    /// Write log-probabilities over the full vocabulary.
    pub logprobs: bool,
    /// Gather instead of select ([`crate::toolkit::params::row_flags::GATHER`]):
    /// `ids` holds the caller's ids in the first `k − 1` columns, and the
    /// kernel writes their log-probabilities and the row's lse (last
    /// column) into `probs`.
    pub gather: bool,
}

impl TopkDesc {
    /// The seed's top-k: no cap, probabilities over the k.
    pub fn plain(rows: usize, vocab: usize, ld: usize, k: usize) -> Self {
        Self {
            rows,
            vocab,
            ld,
            k,
            cap: None,
            logprobs: false,
            gather: false,
        }
    }
}

/// f16 rows turned into columns: `dst[c·rows_padded + r] =
/// src[r·ld_src + c]` for `r < rows`, and 0 for `rows ≤ r < rows_padded`,
/// for every `c < cols`. The head's gradient GEMM
/// ([`crate::problem::LossConfig::head_grad`]) reads a chunk's logits
/// gradient `[rows][ld_src]` this way, as `[cols][rows_padded]` with the
/// tokens as its reduction; the zeros are the reduction's padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransposeDesc {
    /// Real rows of `src`.
    pub rows: usize,
    /// Columns of `dst` (≥ rows): its row stride.
    pub rows_padded: usize,
    /// Columns of `src` moved (rows of `dst`).
    pub cols: usize,
    /// Row stride of `src` (≥ cols).
    pub ld_src: usize,
}

/// Per-kernel GPU time from timestamp queries.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// Which kernel: its [`crate::toolkit::KernelId::name`].
    pub kernel: &'static str,
    /// Its duration in milliseconds.
    pub ms: f64,
}

/// Bytes of device memory a backend holds for buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes allocated now.
    pub current: u64,
    /// Most bytes allocated at once since the last reset.
    pub peak: u64,
}

/// A download recorded by [`Backend::download_begin`] and not yet read:
/// hand it to [`Backend::download_end`] (which waits for it) exactly once.
/// It holds either the bytes themselves (a backend that downloads
/// synchronously) or the backend's ticket for a copy still in flight.
#[derive(Debug)]
#[must_use = "a pending download is read (and its staging freed) by Backend::download_end"]
pub struct PendingDownload {
    ticket: u64,
    len: usize,
    bytes: Option<Vec<u8>>,
}

impl PendingDownload {
    /// A download that already finished, holding its bytes.
    pub fn ready(bytes: Vec<u8>) -> Self {
        Self {
            ticket: 0,
            len: bytes.len(),
            bytes: Some(bytes),
        }
    }

    /// A download of `len` bytes still in flight, named by the backend's
    /// `ticket`.
    pub fn in_flight(ticket: u64, len: usize) -> Self {
        Self {
            ticket,
            len,
            bytes: None,
        }
    }

    /// Bytes it carries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it carries no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backend's ticket, or the finished bytes.
    pub fn into_parts(self) -> (u64, Option<Vec<u8>>) {
        (self.ticket, self.bytes)
    }
}

/// A backend's downloads begun and not yet ended, each a record `R` (its
/// staging buffer, the submission that fills it) under the ticket its
/// [`PendingDownload`] carries: the bookkeeping every backend with
/// asynchronous downloads needs, kept in one place.
#[derive(Debug)]
pub struct DownloadsInFlight<R> {
    next_ticket: u64,
    records: HashMap<u64, R>,
}

impl<R> Default for DownloadsInFlight<R> {
    fn default() -> Self {
        Self {
            next_ticket: 1,
            records: HashMap::new(),
        }
    }
}

impl<R> DownloadsInFlight<R> {
    /// Files `record` for a download of `len` bytes.
    pub fn begin(&mut self, record: R, len: usize) -> PendingDownload {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.records.insert(ticket, record);
        PendingDownload::in_flight(ticket, len)
    }

    /// Takes `pending`'s record back once `out` is checked to be its
    /// length. A download that finished when it began is copied into `out`
    /// here and gives `None`; a ticket this set never issued (or already
    /// ended) is an error naming `backend`.
    pub fn end(&mut self, pending: PendingDownload, out: &mut [u8], backend: &'static str) -> Result<Option<R>> {
        let len = pending.len();
        crate::error::Field::DownloadOutput.check_len(len, out.len())?;
        match pending.into_parts() {
            (_, Some(bytes)) => {
                out.copy_from_slice(&bytes);
                Ok(None)
            }
            (ticket, None) => match self.records.remove(&ticket) {
                Some(record) => Ok(Some(record)),
                None => Err(Error::Backend {
                    backend,
                    message: format!("download_end: no download in flight as ticket {ticket}"),
                }),
            },
        }
    }

    /// Every record still filed, removed (at teardown).
    pub fn drain(&mut self) -> impl Iterator<Item = R> + '_ {
        self.records.drain().map(|(_, record)| record)
    }
}

/// A device that can run the driver: buffers, transfers and kernels.
///
/// Errors are for what the caller cannot anticipate: out-of-memory, device
/// loss, a failed pipeline build. Shapes were validated before a call.
pub trait Backend {
    /// A device buffer. Dropping it frees the memory.
    type Buffer: DeviceBuffer;

    /// What the device offers.
    fn info(&self) -> &DeviceInfo;

    /// A buffer of `bytes` bytes (contents undefined). `label` names it in
    /// errors and debuggers.
    fn alloc(&self, bytes: u64, label: &'static str) -> Result<Self::Buffer>;

    /// Copies `data` into `dst` at `offset` bytes, after all queued work.
    fn upload(&self, dst: &Self::Buffer, offset: u64, data: &[u8]) -> Result<()>;

    /// Copies `out.len()` bytes from `src` at `offset` bytes into `out`,
    /// after all queued work has finished.
    fn download(&self, src: &Self::Buffer, offset: u64, out: &mut [u8]) -> Result<()>;

    /// Starts copying `len` bytes of `src` at `offset` out, ordered after
    /// all queued work, and returns without waiting for it: work queued
    /// afterwards (the next chunk) may overwrite `src` while the copy is in
    /// flight. [`Backend::download_end`] waits for it and hands the bytes
    /// over. The default downloads at once (a synchronous backend).
    fn download_begin(&self, src: &Self::Buffer, offset: u64, len: usize) -> Result<PendingDownload> {
        let mut bytes = vec![0u8; len];
        self.download(src, offset, &mut bytes)?;
        Ok(PendingDownload::ready(bytes))
    }

    /// Waits for a download [`Backend::download_begin`] started (and only
    /// for the work queued before it) and copies its bytes into `out`
    /// (`out.len()` is the length it was started with).
    fn download_end(&self, pending: PendingDownload, out: &mut [u8]) -> Result<()> {
        let len = pending.len();
        match pending.into_parts() {
            (_, Some(bytes)) if bytes.len() == out.len() => {
                out.copy_from_slice(&bytes);
                Ok(())
            }
            _ => Err(crate::error::Error::LengthMismatch {
                field: crate::error::Field::DownloadOutput,
                expected: len,
                got: out.len(),
            }),
        }
    }

    /// Runs one kernel ([`Launch`]): checks its descriptor against its
    /// buffers ([`Launch::check`], the only source of the parameter block)
    /// and queues it. The driver's per-kernel calls are [`crate::toolkit::Kernels`]'s.
    fn dispatch(&self, launch: Launch<'_, Self::Buffer>) -> Result<()>;

    /// The output tile `(rows, columns)` of the matrix-unit GEMM this
    /// backend runs for `layout`, or `None` where it runs none (the
    /// fallback GEMM, or no GPU): what [`crate::toolkit::DxSplit::choose`] counts
    /// workgroups with.
    fn gemm_tile(&self, _layout: HeadLayout) -> Option<(u32, u32)> {
        None
    }

    /// Whether this backend's logits GEMM writes row statistics
    /// ([`GemmDesc::row_stats`]). A backend whose GEMM comes from a library
    /// with no such epilogue (cuBLASLt) says no, and the KL rows then fold
    /// the logits themselves.
    fn gemm_row_stats(&self) -> bool {
        true
    }

    /// Whether this backend's dx GEMM skips the block filter's clear
    /// blocks ([`GemmDesc::mask_rows`], [`crate::toolkit::KernelId::GemmDxFiltered`]).
    /// One that cannot (cuBLASLt's GEMMs) refuses the filtered GEMM, and
    /// the engine then runs the loss without the filter: dx exact.
    fn gemm_block_filter(&self) -> bool {
        true
    }

    /// Whether this backend's GEMM reads A stored as its transpose
    /// ([`GemmDesc::a_columns`]): a library GEMM (cuBLASLt) transposes an
    /// operand for free, so the head's gradient needs no `transpose` of
    /// the logits gradient first. The kernel GEMMs read A as rows.
    fn gemm_a_columns(&self) -> bool {
        false
    }

    /// Whether large uploads and downloads run beside the kernels (on a
    /// copy queue of their own) rather than in line with them. The host
    /// path then gives the buffers they touch (the hidden rows' upload
    /// buffer and dx) a second copy, used by odd chunks, so that chunk
    /// `i + 1`'s upload and chunk `i`'s copy out need not wait for the
    /// kernels of the chunk beside them.
    fn transfers_overlap(&self) -> bool {
        false
    }

    /// Waits for all queued work.
    fn finish(&self) -> Result<()>;

    /// Buffer memory held now and at peak.
    fn memory(&self) -> MemoryStats;

    /// Restarts the peak count from the current allocation.
    fn reset_peak_memory(&self);

    /// Turns per-kernel GPU timing on or off. Returns whether the backend
    /// can time kernels.
    fn set_profiling(&self, _on: bool) -> bool {
        false
    }

    /// Takes the kernel times recorded since the last call (after
    /// [`Backend::finish`]).
    fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        Ok(Vec::new())
    }

    /// Takes the validation-layer errors (or other driver diagnostics that
    /// mean a kernel misbehaved) reported since the last call. The
    /// conformance suite fails a case that leaves any.
    fn take_diagnostics(&self) -> Vec<String> {
        Vec::new()
    }
}

/// A shared reference to a backend is a backend, so one device can serve
/// several engines (the conformance suite opens a device once for all its
/// cases).
impl<T: Backend + ?Sized> Backend for &T {
    type Buffer = T::Buffer;

    fn info(&self) -> &DeviceInfo {
        (**self).info()
    }
    fn alloc(&self, bytes: u64, label: &'static str) -> Result<Self::Buffer> {
        (**self).alloc(bytes, label)
    }
    fn upload(&self, dst: &Self::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        (**self).upload(dst, offset, data)
    }
    fn download(&self, src: &Self::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        (**self).download(src, offset, out)
    }
    fn download_begin(&self, src: &Self::Buffer, offset: u64, len: usize) -> Result<PendingDownload> {
        (**self).download_begin(src, offset, len)
    }
    fn download_end(&self, pending: PendingDownload, out: &mut [u8]) -> Result<()> {
        (**self).download_end(pending, out)
    }
    fn dispatch(&self, launch: Launch<'_, Self::Buffer>) -> Result<()> {
        (**self).dispatch(launch)
    }
    fn gemm_tile(&self, layout: HeadLayout) -> Option<(u32, u32)> {
        (**self).gemm_tile(layout)
    }
    fn gemm_row_stats(&self) -> bool {
        (**self).gemm_row_stats()
    }
    fn gemm_block_filter(&self) -> bool {
        (**self).gemm_block_filter()
    }
    fn gemm_a_columns(&self) -> bool {
        (**self).gemm_a_columns()
    }
    fn transfers_overlap(&self) -> bool {
        (**self).transfers_overlap()
    }
    fn finish(&self) -> Result<()> {
        (**self).finish()
    }
    fn memory(&self) -> MemoryStats {
        (**self).memory()
    }
    fn reset_peak_memory(&self) {
        (**self).reset_peak_memory()
    }
    fn set_profiling(&self, on: bool) -> bool {
        (**self).set_profiling(on)
    }
    fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        (**self).take_kernel_times()
    }
    fn take_diagnostics(&self) -> Vec<String> {
        (**self).take_diagnostics()
    }
}

/// A buffer that is only a length: what the descriptor checks read.
#[cfg(test)]
pub(crate) struct Len(pub(crate) u64);

#[cfg(test)]
impl DeviceBuffer for Len {
    fn len(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downloads_in_flight_give_back_each_record_once() {
        let mut set = DownloadsInFlight::default();
        let (a, b) = (set.begin("a", 4), set.begin("b", 2));
        let mut out = [0u8; 4];
        assert!(matches!(
            set.end(b, &mut out, "test"),
            Err(Error::LengthMismatch {
                expected: 2,
                got: 4,
                ..
            })
        ));
        assert_eq!(set.end(a, &mut out, "test").ok().flatten(), Some("a"));
        // The ready path copies and files nothing.
        let mut ready_out = [0u8; 3];
        assert_eq!(
            set.end(PendingDownload::ready(vec![7, 8, 9]), &mut ready_out, "test")
                .ok(),
            Some(None)
        );
        assert_eq!(ready_out, [7, 8, 9]);
        // A ticket ended twice (here: one never issued) names the backend.
        match set.end(PendingDownload::in_flight(99, 4), &mut out, "test") {
            Err(Error::Backend { backend, message }) => {
                assert!(backend == "test" && message.contains("99"), "{message}")
            }
            other => panic!("expected a backend error, got {other:?}"),
        }
        assert_eq!(set.drain().count(), 1, "b is still filed");
    }
}
