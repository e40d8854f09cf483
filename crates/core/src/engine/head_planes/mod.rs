//! [`HeadPlanes`]: the head as it lives on the device (its shape, its
//! vocabulary slices and their f16 planes) and the per-chunk kernel
//! sequences every entry point shares: the hidden rows into the padded f16
//! operand, the logits GEMMs, the dx GEMMs with their split-K parts and
//! `sum_parts`, and the chunk plan with its scratch sizes.
//!
//! The host path ([`crate::engine`]), the device-resident path
//! ([`crate::resident`]) and the vocabulary shards ([`crate::shard`]) call
//! these methods rather than each other's internals; the backend stays with
//! the [`crate::engine::Engine`] that owns both and is passed in.

use half::f16;

use crate::align::{round_up, ALIGN};
use crate::engine::head::HeadWeights;
use crate::engine::scratch::{Input, Job, RowBytes};
use crate::error::{Error, Result};
use crate::problem::slicing::SliceOptions;
use crate::problem::slicing::{slice_vocab, VocabSlice};
use crate::problem::vocab_order::VocabOrder;
use crate::problem::Hidden;
use crate::toolkit::backend::{Backend, GemmDesc, GemmRowStats, HeadLayout, RowStats, SumPartsDesc, STATS_GROUP_COLS};
use crate::toolkit::chunking::{plan_chunks, ChunkPlan};
use crate::toolkit::launch::{Kernels, Launch};
use crate::toolkit::resident_kernels::{HiddenInDesc, ResidentBackend};
use crate::toolkit::split::DxSplit;
use crate::toolkit::status::S_DX_MUL;

mod deferred_grad;
mod grad;
mod packing;
pub(crate) use grad::HeadGrad;

/// How the scale of z = S·x·Wᵀ reaches the head's two GEMMs: the logits
/// GEMM writes z/τ, and dx's carries S, with 1/(gscale·τ) as well on the
/// host paths (the resident paths leave that to `loss_out`, where gscale
/// may come from the device). Every entry path builds one of these rather
/// than its own alphas.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scaling {
    /// Temperature τ.
    pub temperature: f32,
    /// Logit scale S ([`crate::problem::terms::LossTerms::logit_scale`],
    /// [`crate::problem::TopkOptions::logit_scale`]).
    pub logit_scale: f32,
    /// The host paths' gradient scale, folded into dx's alpha.
    pub host_gscale: Option<f32>,
}

impl Scaling {
    /// Top-k's: z/τ with z = S·x·Wᵀ, no gradient.
    pub(crate) fn top_k(opts: &crate::problem::TopkOptions) -> Self {
        Self {
            temperature: opts.temperature,
            logit_scale: opts.logit_scale,
            host_gscale: None,
        }
    }

    /// The teacher's logits of the full-vocabulary divergence: z_T/τ, no
    /// logit scale, no gradient.
    pub(crate) fn teacher(temperature: f32) -> Self {
        Self {
            temperature,
            logit_scale: 1.0,
            host_gscale: None,
        }
    }

    /// A host-path loss call's (the driver and the shard engine).
    pub(crate) fn host_loss(resolved: &crate::problem::ResolvedLoss) -> Self {
        Self {
            temperature: resolved.temperature,
            logit_scale: resolved.terms.logit_scale,
            host_gscale: Some(resolved.gscale),
        }
    }

    /// A device-resident loss call's: dx's alpha is S alone.
    pub(crate) fn resident_loss(temperature: f32, logit_scale: f32) -> Self {
        Self {
            temperature,
            logit_scale,
            host_gscale: None,
        }
    }

    /// The logits GEMM's alpha, S/τ.
    fn logits_alpha(self) -> f32 {
        1.0 / (self.temperature / self.logit_scale)
    }

    /// The dx GEMM's alpha: S/(gscale·τ) (in f64, then rounded once) on the
    /// host paths, S on the resident ones.
    pub(crate) fn dx_alpha(self) -> f32 {
        match self.host_gscale {
            Some(gscale) => (f64::from(self.logit_scale) / (f64::from(gscale) * f64::from(self.temperature))) as f32,
            None => self.logit_scale,
        }
    }
}

/// An uploaded head: its facts, one f16 plane per vocabulary slice, and how
/// the dx GEMM's reduction is split.
pub(crate) struct HeadPlanes<B: Backend> {
    vocab: usize,
    hs: usize,
    hs_padded: usize,
    vocab_padded: usize,
    slices: Vec<VocabSlice>,
    planes: Vec<B::Buffer>,
    dx_split: DxSplit,
    /// `Σ ‖W_j‖` (f16 rows) over each block of [`crate::problem::filter::BLOCK`]
    /// vocabulary rows: the block filter's bound on what it dropped.
    block_norms: Vec<f32>,
    /// The order the rows are stored in (`None`: natural).
    order: Option<VocabOrder>,
    /// Where a host upload's time went (`None` for a head read on the
    /// device).
    upload_times: Option<UploadTimes>,
}

/// Where a head's upload from the host spent its time
/// ([`crate::Engine::head_upload_times`]), in the order it runs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UploadTimes {
    /// Scanning every value on the host before anything is allocated.
    pub check: std::time::Duration,
    /// Allocating the planes.
    pub alloc: std::time::Duration,
    /// Waiting for the packing thread's next piece (f16, padded, norms).
    pub packing_wait: std::time::Duration,
    /// Handing the pieces to the backend's uploads.
    pub copies: std::time::Duration,
    /// Waiting for the last copies to land.
    pub finish: std::time::Duration,
}

/// What writes a device head's planes ([`HeadPlanes::from_device`]).
pub(crate) type PlaneFill<'a, B> = dyn FnMut(&B, DevicePlane<'_, <B as Backend>::Buffer>) -> Result<()> + 'a;

/// One vocabulary slice's plane of a head already on the device
/// ([`crate::engine::Engine::from_device_head`]): `padded_rows` rows of `hs_padded`
/// f16 values from byte 0 of `buffer`, row `r < rows` holding head row
/// `first_row + r` (columns past hs zero), the rows past `rows` zero.
pub struct DevicePlane<'a, Buf> {
    /// The plane (fresh, of `padded_rows · hs_padded · 2` bytes).
    pub buffer: &'a Buf,
    /// The head row the plane starts at.
    pub first_row: usize,
    /// Head rows in the plane.
    pub rows: usize,
    /// Rows the plane holds (`rows` rounded up; the rest zero).
    pub padded_rows: usize,
    /// f16 values per row (hs rounded up; the rest zero).
    pub hs_padded: usize,
}

/// The dx GEMM's block filter for one chunk ([`HeadPlanes::dx`]): the
/// chunk's real rows, whose block mask `kl_rows` left after grad's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DxFilter {
    pub mask_rows: usize,
}

impl<B: Backend> HeadPlanes<B> {
    /// Uploads `head` to `backend` as f16 planes, one per vocabulary slice.
    /// Fails on a head value that is not finite or is past f16's range,
    /// naming its row and column, before any of it is on the device.
    /// With `order`, position `p` of the planes holds head row
    /// `order.id(p)`.
    pub(crate) fn upload(
        backend: &B,
        head: &HeadWeights<'_>,
        slicing: SliceOptions,
        order: Option<VocabOrder>,
    ) -> Result<Self> {
        let (vocab, hs) = (head.vocab(), head.hs());
        if let Some(o) = &order {
            if o.len() != vocab {
                return Err(Error::VocabOrderLength {
                    expected: vocab,
                    got: o.len(),
                });
            }
        }
        // The natural order needs no mapping anywhere.
        let order = order.filter(|o| !o.is_natural());
        let hs_padded = round_up(hs, ALIGN);
        let info = backend.info();
        let max_binding = info.max_binding_bytes.min(info.max_buffer_bytes);
        let slices = slice_vocab(vocab, hs_padded, max_binding, slicing.max_rows_per_slice)?;
        let mut times = UploadTimes::default();
        let mut clock = std::time::Instant::now();
        let mut lap = |into: &mut std::time::Duration| {
            let now = std::time::Instant::now();
            *into += now - clock;
            clock = now;
        };
        // Scan on the host before the first allocation: a bad value should
        // cost no device memory and no upload.
        head.check_values()?;
        lap(&mut times.check);
        let planes = slices
            .iter()
            .map(|s| backend.alloc((s.padded_width() * hs_padded * 2) as u64, "head slice"))
            .collect::<Result<Vec<_>>>()?;
        lap(&mut times.alloc);
        let mut block_norms = vec![0f32; vocab.div_ceil(crate::problem::filter::BLOCK)];
        packing::for_each_piece(head, order.as_ref(), &slices, hs_padded, |piece| {
            lap(&mut times.packing_wait);
            let first = slices[piece.slice].offset + piece.row;
            add_block_norms(&mut block_norms, first, &piece.norms);
            let at = (piece.row * hs_padded * 2) as u64;
            let copied = backend.upload(&planes[piece.slice], at, bytemuck::cast_slice(&piece.data));
            lap(&mut times.copies);
            copied
        })?;
        backend.finish()?;
        lap(&mut times.finish);
        let mut planes = Self::assemble(vocab, hs, slices, planes, block_norms, order);
        planes.upload_times = Some(times);
        Ok(planes)
    }

    /// A head already on the device: allocates one plane per vocabulary
    /// slice (as [`HeadPlanes::upload`]) and has `fill` write each one
    /// ([`DevicePlane`]). `row_norms` are the f16 rows' Euclidean norms
    /// (`[vocab]`, for the block filter); the caller checked the values.
    pub(crate) fn from_device(
        backend: &B,
        (vocab, hs): (usize, usize),
        slicing: SliceOptions,
        row_norms: &[f32],
        fill: &mut PlaneFill<'_, B>,
    ) -> Result<Self> {
        if vocab == 0 {
            return Err(Error::VocabZero);
        }
        if hs == 0 {
            return Err(Error::HiddenSizeZero);
        }
        crate::error::Field::Head.check_len(vocab, row_norms.len())?;
        let hs_padded = round_up(hs, ALIGN);
        let info = backend.info();
        let max_binding = info.max_binding_bytes.min(info.max_buffer_bytes);
        let slices = slice_vocab(vocab, hs_padded, max_binding, slicing.max_rows_per_slice)?;
        let mut planes = Vec::with_capacity(slices.len());
        for s in &slices {
            let padded = s.padded_width();
            let plane = backend.alloc((padded * hs_padded * 2) as u64, "head slice")?;
            fill(
                backend,
                DevicePlane {
                    buffer: &plane,
                    first_row: s.offset,
                    rows: s.width,
                    padded_rows: padded,
                    hs_padded,
                },
            )?;
            planes.push(plane);
        }
        backend.finish()?;
        let mut block_norms = vec![0f32; vocab.div_ceil(crate::problem::filter::BLOCK)];
        add_block_norms(&mut block_norms, 0, row_norms);
        Ok(Self::assemble(vocab, hs, slices, planes, block_norms, None))
    }

    /// Rewrites every plane in place with `fill` (as [`Self::from_device`]
    /// wrote them; same slices, no allocation) and takes the new rows'
    /// norms: a trainer's head that changed since, read again by a device
    /// copy, after which it waits for the device. Without norms (`None`, a
    /// backend with no dx block filter, their only reader) each block's is
    /// taken as infinite, so a bound made from them could only be loose,
    /// and nothing waits: the fill is queued in order with the engine's
    /// work ([`crate::Engine::refill_device_head_queued`]). Refused for a
    /// head stored in a vocabulary order (the fill writes rows in id order).
    pub(crate) fn refill(&mut self, backend: &B, row_norms: Option<&[f32]>, fill: &mut PlaneFill<'_, B>) -> Result<()> {
        if self.order.is_some() {
            return Err(Error::VocabOrderUnsupported {
                reason: "a head refilled from the device is stored in the natural order",
            });
        }
        if let Some(norms) = row_norms {
            crate::error::Field::Head.check_len(self.vocab, norms.len())?;
        }
        for (s, plane) in self.slices.iter().zip(&self.planes) {
            fill(
                backend,
                DevicePlane {
                    buffer: plane,
                    first_row: s.offset,
                    rows: s.width,
                    padded_rows: s.padded_width(),
                    hs_padded: self.hs_padded,
                },
            )?;
        }
        let Some(norms) = row_norms else {
            self.block_norms.fill(f32::INFINITY);
            return Ok(());
        };
        backend.finish()?;
        self.block_norms.fill(0.0);
        add_block_norms(&mut self.block_norms, 0, norms);
        Ok(())
    }

    /// The head from its uploaded planes (`upload` and `from_device`'s
    /// last step): the padded extents derived, the dx split automatic.
    fn assemble(
        vocab: usize,
        hs: usize,
        slices: Vec<VocabSlice>,
        planes: Vec<B::Buffer>,
        block_norms: Vec<f32>,
        order: Option<VocabOrder>,
    ) -> Self {
        Self {
            vocab,
            hs,
            hs_padded: round_up(hs, ALIGN),
            vocab_padded: round_up(vocab, ALIGN),
            slices,
            planes,
            dx_split: DxSplit::Auto,
            block_norms,
            order,
            upload_times: None,
        }
    }

    /// Where the host upload's time went (`None` for a head read on the
    /// device).
    pub(crate) fn upload_times(&self) -> Option<UploadTimes> {
        self.upload_times
    }

    /// The order the head's rows are stored in (`None`: natural).
    pub(crate) fn order(&self) -> Option<&VocabOrder> {
        self.order.as_ref()
    }

    /// Vocabulary size.
    pub(crate) fn vocab(&self) -> usize {
        self.vocab
    }

    /// Vocabulary size rounded up to [`ALIGN`]: the logits' row stride.
    pub(crate) fn vocab_padded(&self) -> usize {
        self.vocab_padded
    }

    /// Hidden size.
    pub(crate) fn hs(&self) -> usize {
        self.hs
    }

    /// Hidden size rounded up to [`ALIGN`]: the f16 operand's and dx's row
    /// stride.
    pub(crate) fn hs_padded(&self) -> usize {
        self.hs_padded
    }

    /// The vocabulary slices the head was cut into.
    pub(crate) fn slices(&self) -> &[VocabSlice] {
        &self.slices
    }

    /// The dx GEMM's split setting.
    pub(crate) fn dx_split(&self) -> DxSplit {
        self.dx_split
    }

    /// Sets the dx GEMM's split (the owner frees scratch sized for the old
    /// one).
    pub(crate) fn set_dx_split(&mut self, split: DxSplit) {
        self.dx_split = split;
    }

    /// Fails unless `hidden`'s rows are this head's width.
    pub(crate) fn check_hidden(&self, hidden: &Hidden<'_>) -> Result<()> {
        if hidden.hs() != self.hs {
            return Err(Error::HiddenSizeMismatch {
                expected: self.hs,
                got: hidden.hs(),
            });
        }
        Ok(())
    }

    /// The chunk plan of `job`, budgeting every scratch buffer it allocates.
    pub(crate) fn chunk_plan(
        &self,
        backend: &B,
        job: Job,
        ntok: usize,
        k: usize,
        f32_input: bool,
        budget: (u64, Option<usize>),
    ) -> Result<ChunkPlan> {
        Self::plan_for(backend, &self.row_bytes(backend, job, k), job, ntok, f32_input, budget)
    }

    /// [`Self::chunk_plan`] for the row sizes `sizes` (the resident path's
    /// have no odd-chunk copies).
    pub(crate) fn plan_for(
        backend: &B,
        sizes: &RowBytes,
        job: Job,
        ntok: usize,
        f32_input: bool,
        (budget_bytes, max_rows): (u64, Option<usize>),
    ) -> Result<ChunkPlan> {
        let costs = sizes.costs(job, f32_input);
        let info = backend.info();
        let max_binding = info.max_binding_bytes.min(info.max_buffer_bytes);
        plan_chunks(ntok, &costs, budget_bytes, max_binding, max_rows)
    }

    /// Bytes per token row of every scratch buffer of `job`, with `k`
    /// teacher entries.
    pub(crate) fn row_bytes(&self, backend: &B, job: Job, k: usize) -> RowBytes {
        let (dx_blocks, stats_words) = match job {
            Job::Loss | Job::LossFiltered if self.row_stats_fit(backend) => {
                (self.dx_blocks_most(backend), 2 * self.row_stats(0).ld)
            }
            Job::Loss | Job::LossFiltered => (self.dx_blocks_most(backend), 0),
            Job::Topk => (0, 0),
        };
        let mask = job == Job::LossFiltered;
        let mut sizes = RowBytes::new(self.vocab_padded, self.hs, self.hs_padded, k, dx_blocks, mask);
        // The row statistics follow the chunk's logits in the same buffer.
        sizes.logits = sizes.logits.max((self.vocab_padded + stats_words) as u64 * 4);
        RowBytes {
            doubled: backend.transfers_overlap(),
            ..sizes
        }
    }

    /// Whether [`Self::row_bytes`] makes room for the row statistics: only
    /// where the smallest chunk's logits with them still fit one binding
    /// (else the KL rows fold the logits themselves).
    pub(crate) fn row_stats_fit(&self, backend: &B) -> bool {
        if !backend.gemm_row_stats() {
            return false;
        }
        let info = backend.info();
        let max_binding = info.max_binding_bytes.min(info.max_buffer_bytes);
        let words = self.vocab_padded + 2 * self.row_stats(0).ld;
        (words * 4 * ALIGN) as u64 <= max_binding
    }

    /// Where the logits GEMMs of a `head_kl` chunk of `rows_padded` rows
    /// write their row statistics: right after the chunk's logits in the
    /// logits buffer, whose loss scratch [`Self::row_bytes`] sizes for them.
    /// Each slice's columns start a new group.
    pub(crate) fn row_stats(&self, rows_padded: usize) -> RowStats {
        let groups = self
            .slices
            .iter()
            .map(|s| s.padded_width().div_ceil(STATS_GROUP_COLS))
            .sum();
        RowStats {
            offset: rows_padded * self.vocab_padded,
            ld: round_up(groups, 2),
            groups,
        }
    }

    /// The most split-K partial blocks of dx a chunk can need (every
    /// slice's most parts), or 0 where the dx GEMM always writes dx itself.
    fn dx_blocks_most(&self, backend: &B) -> usize {
        let tile = backend.gemm_tile(HeadLayout::Dx);
        let blocks: usize = self
            .slices
            .iter()
            .map(|s| self.dx_split.most(s.padded_width(), tile))
            .sum();
        if blocks > 1 {
            blocks
        } else {
            0
        }
    }

    /// Uploads chunk rows `[start, start + rows)` (chunk number `chunk`)
    /// into the padded f16 GEMM operand.
    pub(crate) fn load_hidden(
        &self,
        backend: &B,
        input: &Input<'_, B>,
        x16: &B::Buffer,
        (chunk, start, rows): (usize, usize, usize),
    ) -> Result<()> {
        let hs = self.hs;
        let rows_padded = round_up(rows, ALIGN);
        match input {
            Input::F32 { data, x32, x32_odd } => {
                let x32 = if chunk % 2 == 1 {
                    x32_odd.as_ref().unwrap_or(x32)
                } else {
                    x32
                };
                let src = &data[start * hs..(start + rows) * hs];
                backend.upload(x32, 0, bytemuck::cast_slice(src))?;
                backend.dispatch(Launch::HiddenIn {
                    src: x32,
                    dst: x16,
                    desc: HiddenInDesc::f32(rows, hs, self.hs_padded, rows_padded),
                })?;
            }
            Input::F16(d) if self.hs_padded == hs => {
                // Rows are already the padded width: straight from the
                // caller's slice. The rows past `rows` are zeroed, as the
                // other inputs' are: the head's gradient reduces over them.
                let src = &d[start * hs..(start + rows) * hs];
                backend.upload(x16, 0, bytemuck::cast_slice(src))?;
                if rows_padded > rows {
                    let zeros = vec![f16::ZERO; (rows_padded - rows) * hs];
                    backend.upload(x16, (rows * hs * 2) as u64, bytemuck::cast_slice(&zeros))?;
                }
            }
            Input::F16(d) => {
                let mut packed = vec![f16::ZERO; rows_padded * self.hs_padded];
                for r in 0..rows {
                    let src = &d[(start + r) * hs..(start + r + 1) * hs];
                    packed[r * self.hs_padded..r * self.hs_padded + hs].copy_from_slice(src);
                }
                backend.upload(x16, 0, bytemuck::cast_slice(&packed))?;
            }
            Input::Bf16(d) => {
                // Rounded to f16 here, as the f16 operand is packed: the
                // same cost as packing unpadded f16 rows.
                let mut packed = vec![f16::ZERO; rows_padded * self.hs_padded];
                for r in 0..rows {
                    let src = &d[(start + r) * hs..(start + r + 1) * hs];
                    let dst = &mut packed[r * self.hs_padded..r * self.hs_padded + hs];
                    for (o, v) in dst.iter_mut().zip(src) {
                        *o = f16::from_f32(v.to_f32());
                    }
                }
                backend.upload(x16, 0, bytemuck::cast_slice(&packed))?;
            }
        }
        Ok(())
    }

    /// Chunk `chunk`'s rows `[start, start + rows)` up into `x16`
    /// ([`Self::load_hidden`]) and their logits into `logits`
    /// ([`Self::logits`], without row statistics).
    pub(crate) fn chunk_logits(
        &self,
        backend: &B,
        input: &Input<'_, B>,
        x16: &B::Buffer,
        (chunk, start, rows): (usize, usize, usize),
        logits: &B::Buffer,
        scaling: Scaling,
    ) -> Result<()> {
        self.load_hidden(backend, input, x16, (chunk, start, rows))?;
        self.logits(backend, x16, logits, round_up(rows, ALIGN), scaling, None)
    }

    /// The logits GEMMs of one chunk: `logits[:, slice] = S · x16 · W_sliceᵀ / τ`
    /// (the host path's scratch and the resident path's alike), with the
    /// row statistics at `stats` when given ([`Self::row_stats`]).
    pub(crate) fn logits(
        &self,
        backend: &B,
        x16: &B::Buffer,
        logits: &B::Buffer,
        rows_padded: usize,
        scaling: Scaling,
        stats: Option<RowStats>,
    ) -> Result<()> {
        let mut first_group = 0;
        for (slice, plane) in self.slices.iter().zip(&self.planes) {
            let row_stats = stats.map(|at| GemmRowStats {
                at,
                first_group,
                cols: slice.width,
            });
            first_group += slice.padded_width().div_ceil(STATS_GROUP_COLS);
            let desc = GemmDesc {
                m: rows_padded,
                n: slice.padded_width(),
                k: self.hs_padded,
                a_offset: 0,
                lda: self.hs_padded,
                a_columns: false,
                b_layout: HeadLayout::Logits,
                ldb: self.hs_padded,
                c_offset: slice.offset,
                ldc: self.vocab_padded,
                alpha: scaling.logits_alpha(),
                accumulate: false,
                k_parts: 1,
                c_part_stride: 0,
                row_stats,
                mask_rows: 0,
            };
            backend.gemm(x16, plane, logits, &desc)?;
        }
        Ok(())
    }

    /// The dx GEMMs of one chunk, summed over the slices in f32:
    /// `dx = alpha · Σ_slice grad[:, slice] · W_slice`, alpha as
    /// [`Scaling`] says.
    ///
    /// Each slice's GEMM runs split into [`Self::dx_parts`] parts, into
    /// partial blocks of `rows_padded × hs_padded` in `partials` (slice s's
    /// after those of the slices before it), which one `sum_parts` adds
    /// into dx in a fixed order. One slice in one part writes dx directly.
    /// `partials` is the chunk's logits buffer, free once `kl_rows` has
    /// read it, and sized for the most blocks ([`RowBytes::new`]).
    ///
    /// With `filter` every GEMM is the filtered one ([`GemmDesc::mask_rows`]),
    /// reading the block mask `kl_rows` left after grad's `rows_padded`
    /// rows ([`Self::kl_filter`]).
    pub(crate) fn dx(
        &self,
        backend: &B,
        (grad, dx, partials): (&B::Buffer, &B::Buffer, &B::Buffer),
        rows_padded: usize,
        scaling: Scaling,
        filter: Option<DxFilter>,
    ) -> Result<()> {
        let alpha = scaling.dx_alpha();
        let parts = self.dx_parts(backend, rows_padded);
        let total: usize = parts.iter().sum();
        let block = rows_padded * self.hs_padded;
        let mut first = 0;
        for ((slice, plane), &k_parts) in self.slices.iter().zip(&self.planes).zip(&parts) {
            let desc = GemmDesc {
                mask_rows: filter.map_or(0, |f| f.mask_rows),
                ..self.dx_desc(slice, rows_padded, alpha)
            };
            if total == 1 {
                return backend.gemm(grad, plane, dx, &desc);
            }
            let desc = GemmDesc {
                k_parts,
                c_part_stride: block,
                c_offset: first * block,
                ..desc
            };
            backend.gemm(grad, plane, partials, &desc)?;
            first += k_parts;
        }
        let sum = SumPartsDesc {
            len: block,
            parts: total,
            part_stride: block,
            accumulate: false,
        };
        backend.sum_parts(partials, dx, &sum)
    }

    /// One slice's dx GEMM, unsplit: `dx = alpha · grad[:, slice] · W_slice`
    /// (slices never accumulate into dx: several go through `sum_parts`).
    fn dx_desc(&self, slice: &VocabSlice, rows_padded: usize, alpha: f32) -> GemmDesc {
        GemmDesc {
            m: rows_padded,
            n: self.hs_padded,
            k: slice.padded_width(),
            a_offset: slice.offset,
            lda: self.vocab_padded,
            a_columns: false,
            b_layout: HeadLayout::Dx,
            ldb: self.hs_padded,
            c_offset: 0,
            ldc: self.hs_padded,
            alpha,
            accumulate: false,
            k_parts: 1,
            c_part_stride: 0,
            row_stats: None,
            mask_rows: 0,
        }
    }

    /// Where `kl_rows` writes a chunk's block mask for ε (after grad's
    /// `rows_padded` rows, where the dx GEMM reads it), or `None` without
    /// the filter.
    pub(crate) fn kl_filter(&self, eps: Option<f32>, rows_padded: usize) -> Option<crate::toolkit::backend::KlFilter> {
        eps.map(|eps| crate::toolkit::backend::KlFilter {
            eps,
            mask_at: rows_padded * self.vocab_padded,
        })
    }

    /// The halves of a chunk's block mask of `rows` rows, and where they
    /// start in grad (the download [`Self::filter_stats`] reads).
    pub(crate) fn mask_span(&self, rows: usize, rows_padded: usize) -> (usize, usize) {
        (
            rows_padded * self.vocab_padded,
            crate::problem::filter::mask_halves(rows, self.vocab_padded),
        )
    }

    /// One chunk's block mask (`halves`, `rows` rows) counted as the dx
    /// GEMM skips it: per row tile of `backend`'s dx GEMM (64 rows for the
    /// fallback) and block, skipped when the block is clear in every row of
    /// the tile. `weight(r)` is row r's `|w_t|/(τ·total)`: the bound adds
    /// `weight(r) · ε · Σ_{skipped blocks} Σ_j ‖W_j‖` per row, in
    /// quadrature over the rows.
    pub(crate) fn filter_stats(
        &self,
        backend: &B,
        halves: &[f16],
        rows: usize,
        eps: f32,
        weight: impl Fn(usize) -> f64,
    ) -> crate::problem::filter::FilterStats {
        let words = crate::problem::filter::mask_words(self.vocab_padded);
        let tile = backend.gemm_tile(HeadLayout::Dx).map_or(64, |t| t.0 as usize);
        let blocks = self.vocab_padded.div_ceil(crate::problem::filter::BLOCK);
        let (mut bound_sq, mut skipped) = (0.0f64, 0u64);
        let tiles = round_up(rows, ALIGN).div_ceil(tile);
        // The OR of a tile's rows' words, row by row (the mask is row-major).
        let mut tile_or = vec![0u32; words];
        for t0 in (0..rows).step_by(tile) {
            let tile_rows = t0..(t0 + tile).min(rows);
            tile_or.fill(0);
            crate::problem::filter::or_rows(halves, tile_rows.clone(), &mut tile_or);
            let mut dropped_norm = 0.0f64;
            for (w, &or) in tile_or.iter().enumerate() {
                // The clear blocks: the zero bits, lowest first.
                let mut clear = !or;
                while clear != 0 {
                    let block = w * 32 + clear.trailing_zeros() as usize;
                    clear &= clear - 1;
                    if block < blocks {
                        skipped += 1;
                        dropped_norm += f64::from(self.block_norms.get(block).copied().unwrap_or(0.0));
                    }
                }
            }
            for r in tile_rows {
                bound_sq += (weight(r) * f64::from(eps) * dropped_norm).powi(2);
            }
        }
        crate::problem::filter::FilterStats {
            blocks: (tiles * blocks) as u64,
            skipped,
            dropped_bound: bound_sq.sqrt(),
            eps,
        }
    }

    /// The parts each slice's dx GEMM is split into for a chunk of
    /// `rows_padded` rows: [`DxSplit::choose`] with `backend`'s GEMM tile.
    pub(crate) fn dx_parts(&self, backend: &B, rows_padded: usize) -> Vec<usize> {
        let tile = backend.gemm_tile(HeadLayout::Dx);
        self.slices
            .iter()
            .map(|s| {
                let desc = self.dx_desc(s, rows_padded, 1.0);
                let tiles = tile.map_or(0, |t| desc.tiles(t));
                self.dx_split.choose(tiles, s.padded_width(), tile)
            })
            .collect()
    }
}

/// Adds the norms of rows `first..` (positions in the head's order) into
/// their blocks of [`crate::problem::filter::BLOCK`] rows: each block's
/// norm is the sum of its rows', the filter bound's input.
fn add_block_norms(block_norms: &mut [f32], first: usize, row_norms: &[f32]) {
    for (r, norm) in row_norms.iter().enumerate() {
        block_norms[(first + r) / crate::problem::filter::BLOCK] += norm;
    }
}

impl<B: ResidentBackend> HeadPlanes<B> {
    /// dx of `rows` tokens at once from their logits gradient `grad`
    /// (`[rows][vocab_padded]`), straight into the caller's `dx`
    /// (`[rows][hs]`, hs unpadded): `alpha · status[S_DX_MUL] · grad · W`,
    /// added into `dx` where `accumulate`. One GEMM a vocabulary slice,
    /// unsplit: the rows are every token of the call, so the GEMM's tiles
    /// fill the device without a split of the reduction.
    pub(crate) fn dx_scaled_by_word(
        &self,
        backend: &B,
        (grad, dx, status): (&B::Buffer, &B::Buffer, &B::Buffer),
        rows: usize,
        scaling: Scaling,
        accumulate: bool,
    ) -> Result<()> {
        if self.hs != self.hs_padded {
            return Err(Error::BadDescriptor {
                kernel: "gemm",
                field: "hs",
                value: self.hs as u128,
                reason: format!(
                    "dx written straight out needs unpadded rows ({} padded)",
                    self.hs_padded
                ),
            });
        }
        for (i, (slice, plane)) in self.slices.iter().zip(&self.planes).enumerate() {
            let desc = GemmDesc {
                accumulate: accumulate || i > 0,
                ..self.dx_desc(slice, rows, scaling.dx_alpha())
            };
            backend.gemm_scaled_by_word((grad, plane, dx), &desc, (status, S_DX_MUL))?;
        }
        Ok(())
    }
}
