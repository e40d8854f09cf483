//! The driver, written once over [`Backend`]: it uploads the head in
//! vocabulary slices, cuts the tokens into chunks, and sequences the kernels
//! for `head_kl` and `topk`.

use half::f16;

use crate::backend::{Backend, ConvertDesc, GemmDesc, HeadLayout, KlDesc, PendingDownload, SumPartsDesc, TopkDesc};
use crate::chunking::{plan_chunks, ChunkPlan};
use crate::error::{Error, Result};
use crate::head::HeadWeights;
use crate::launch::Kernels;
use crate::problem::{Hidden, HiddenData, LossOptions, ResolvedLoss, Teacher, TopkOptions};
use crate::scratch::{Input, Job, LossScratch, RowBytes, RowScratch, ScratchCache};
use crate::slicing::{slice_vocab, VocabSlice};
use crate::split::DxSplit;
use crate::terms::NO_LABEL;
use crate::{round_up, ALIGN};

/// Bytes of host data uploaded per transfer while packing the head, so a
/// multi-GB head never needs a second multi-GB copy on the host.
const HEAD_UPLOAD_BYTES: usize = 64 << 20;

/// How the head is cut into vocabulary slices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SliceOptions {
    /// Test knob: at most this many vocabulary rows per slice (rounded down
    /// to a multiple of 128, at least 128), to reach the multi-slice path
    /// with a small head.
    pub max_rows_per_slice: Option<usize>,
}

/// Result of `head_kl`. A caller that keeps one and passes it to
/// [`Engine::head_kl_into`] call after call reuses its memory.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossOutput {
    /// Per-token loss `L_t = α_soft·L_soft + α_hard·L_hard + λ·lse²`
    /// (unweighted: `w_t` enters `mean` and `dx` only) `[ntok]`.
    pub loss: Vec<f32>,
    /// Per-token `lse(z̃)`, the log-sum-exp of the (capped) logits at τ = 1
    /// `[ntok]`.
    pub lse: Vec<f32>,
    /// Per-token soft term `L_soft` (unweighted, before `α_soft`) `[ntok]`.
    pub soft: Vec<f32>,
    /// Per-token hard term `L_hard` (before `α_hard`; 0 for a token
    /// without a label or with the hard term off) `[ntok]`.
    pub hard: Vec<f32>,
    /// `Σ w_t L_t / total`.
    pub mean: f64,
    /// `∂L/∂x` `[ntok][hs]`.
    pub dx: Vec<f32>,
}

/// Result of `topk`: `[ntok][k]` ids (descending logit, ties lowest id
/// first) and their probabilities (softmax over the k at τ).
#[derive(Clone, Debug, PartialEq)]
pub struct TopK {
    /// Ids `[ntok][k]`.
    pub ids: Vec<u32>,
    /// Probabilities `[ntok][k]`.
    pub probs: Vec<f32>,
    /// With [`TopkOptions::logprobs`]: the log-probabilities over the full
    /// vocabulary at τ `[ntok][k]`; else empty.
    pub logprobs: Vec<f32>,
    /// Tokens.
    pub ntok: usize,
    /// Entries per row.
    pub k: usize,
}

/// A backend with a head uploaded to it: the entry point for `head_kl` and
/// `topk`.
///
/// ```
/// use headkl_core::{Engine, HeadData, HeadWeights, Hidden, LossOptions, SliceOptions, Teacher};
/// use headkl_reference::CpuBackend;
///
/// let (vocab, hs, ntok, k) = (300, 24, 5, 4);
/// let w: Vec<f32> = (0..vocab * hs).map(|i| ((i * 7 % 13) as f32 - 6.0) / 16.0).collect();
/// let x: Vec<f32> = (0..ntok * hs).map(|i| ((i * 5 % 11) as f32 - 5.0) / 8.0).collect();
/// let head = HeadWeights::new(HeadData::F32(&w), vocab, hs)?;
/// let mut engine = Engine::new(CpuBackend::new(), &head, SliceOptions::default())?;
/// let ids: Vec<u32> = (0..ntok * k).map(|i| (i * 31 % vocab) as u32).collect();
/// let probs = vec![0.25f32; ntok * k];
/// let teacher = Teacher::new(&ids, &probs, ntok, k, vocab)?;
/// let out = engine.head_kl(&Hidden::f32(&x, ntok, hs)?, &teacher, &LossOptions::default())?;
/// assert_eq!(out.loss.len(), ntok);
/// assert_eq!(out.dx.len(), ntok * hs);
/// assert!(out.mean >= 0.0);
/// # Ok::<(), headkl_core::Error>(())
/// ```
pub struct Engine<B: Backend> {
    pub(crate) backend: B,
    pub(crate) vocab: usize,
    pub(crate) hs: usize,
    pub(crate) hs_padded: usize,
    pub(crate) vocab_padded: usize,
    pub(crate) slices: Vec<VocabSlice>,
    pub(crate) planes: Vec<B::Buffer>,
    pub(crate) scratch: ScratchCache<B>,
    /// Scratch and status of the device-resident entry points
    /// (`crate::resident`).
    pub(crate) resident: crate::resident::ResidentState<B>,
    /// Log each `head_kl` call's host phases ([`Engine::set_trace`]).
    trace: bool,
    /// How the dx GEMM's reduction is split ([`Engine::set_dx_split`]).
    dx_split: DxSplit,
    /// Told the tokens of each chunk as its outputs are read
    /// ([`Engine::set_progress`]).
    progress: Option<ProgressCallback>,
}

/// A progress callback: called with the number of tokens a finished chunk
/// of a host call (`head_kl`, `topk`) adds.
pub type ProgressCallback = Box<dyn Fn(usize) + Send + Sync>;

impl<B: Backend> Engine<B> {
    /// Uploads `head` to `backend` as f16 planes, one per vocabulary slice.
    /// Fails on a head value that is not finite or is past f16's range,
    /// naming its row and column, before any of it is on the device.
    pub fn new(backend: B, head: &HeadWeights<'_>, slicing: SliceOptions) -> Result<Self> {
        let (vocab, hs) = (head.vocab(), head.hs());
        let hs_padded = round_up(hs, ALIGN);
        let info = backend.info();
        let max_binding = info.max_binding_bytes.min(info.max_buffer_bytes);
        let slices = slice_vocab(vocab, hs_padded, max_binding, slicing.max_rows_per_slice)?;
        // Scan on the host before the first allocation: a bad value should
        // cost no device memory and no upload.
        head.check_values()?;
        let mut staging = Vec::new();
        let rows_per_upload = (HEAD_UPLOAD_BYTES / (hs_padded * 2)).max(1);
        let mut planes = Vec::with_capacity(slices.len());
        for s in &slices {
            let padded = s.padded_width();
            let plane = backend.alloc((padded * hs_padded * 2) as u64, "head slice")?;
            let mut row = 0;
            while row < padded {
                let rows = rows_per_upload.min(padded - row);
                let real = rows.min(s.width.saturating_sub(row));
                staging.clear();
                head.pack_rows_f16(s.offset + row, real, hs_padded, &mut staging)?;
                staging.resize(rows * hs_padded, f16::ZERO);
                backend.upload(&plane, (row * hs_padded * 2) as u64, bytemuck::cast_slice(&staging))?;
                row += rows;
            }
            planes.push(plane);
        }
        backend.finish()?;
        Ok(Self {
            backend,
            vocab,
            hs,
            hs_padded,
            vocab_padded: round_up(vocab, ALIGN),
            slices,
            planes,
            scratch: ScratchCache::default(),
            resident: crate::resident::ResidentState::new(),
            trace: false,
            dx_split: DxSplit::Auto,
            progress: None,
        })
    }

    /// How the dx GEMM's reduction (the vocabulary) is split into parts
    /// that run in one dispatch (`HEADKL_DX_SPLIT`, through
    /// the command line; [`DxSplit::choose`] has the automatic rule).
    /// Frees the cached scratch, which is sized for the parts.
    pub fn set_dx_split(&mut self, split: DxSplit) {
        if split != self.dx_split {
            self.release_scratch();
        }
        self.dx_split = split;
    }

    /// The dx GEMM's split setting.
    pub fn dx_split(&self) -> DxSplit {
        self.dx_split
    }

    /// Logs each `head_kl` call's host phases (upload, wait, download) as
    /// one `log::info!` line when `on` (`HEADKL_TRACE`, read by the command
    /// line): to see where wall time beyond the kernels goes.
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on;
    }

    /// Calls `progress` (or stops calling it, with `None`) with the tokens
    /// each chunk of `head_kl` and `topk` adds once its outputs are read,
    /// so one call over a long job can drive a progress bar; the results do
    /// not depend on it.
    pub fn set_progress(&mut self, progress: Option<ProgressCallback>) {
        self.progress = progress;
    }

    /// Reports `rows` more tokens done.
    fn report(&self, rows: usize) {
        if let Some(p) = &self.progress {
            p(rows);
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Hidden size.
    pub fn hs(&self) -> usize {
        self.hs
    }

    /// The vocabulary slices the head was cut into.
    pub fn slices(&self) -> &[VocabSlice] {
        &self.slices
    }

    /// Frees the cached scratch buffers (they are re-made on the next call).
    pub fn release_scratch(&mut self) {
        self.scratch = ScratchCache::default();
        self.resident.release_scratch();
    }

    /// The chunk plan `head_kl` would use for `ntok` tokens.
    pub fn loss_plan(&self, ntok: usize, k: usize, f32_input: bool, opts: &LossOptions) -> Result<ChunkPlan> {
        let budget = (opts.budget_bytes, opts.max_rows_per_chunk);
        self.chunk_plan(Job::Loss, ntok, k, f32_input, budget)
    }

    /// The chunk plan of `job`, budgeting every scratch buffer it allocates.
    pub(crate) fn chunk_plan(
        &self,
        job: Job,
        ntok: usize,
        k: usize,
        f32_input: bool,
        (budget_bytes, max_rows): (u64, Option<usize>),
    ) -> Result<ChunkPlan> {
        let costs = self.row_bytes(job, k).costs(job, f32_input);
        let info = self.backend.info();
        let max_binding = info.max_binding_bytes.min(info.max_buffer_bytes);
        plan_chunks(ntok, &costs, budget_bytes, max_binding, max_rows)
    }

    /// Bytes per token row of every scratch buffer of `job`, with `k`
    /// teacher entries.
    pub(crate) fn row_bytes(&self, job: Job, k: usize) -> RowBytes {
        let dx_blocks = match job {
            Job::Loss => self.dx_blocks_most(),
            Job::Topk => 0,
        };
        RowBytes {
            doubled: self.backend.transfers_overlap(),
            ..RowBytes::new(self.vocab_padded, self.hs, self.hs_padded, k, dx_blocks)
        }
    }

    /// The most split-K partial blocks of dx a chunk can need (every
    /// slice's most parts), or 0 where the dx GEMM always writes dx itself.
    fn dx_blocks_most(&self) -> usize {
        let tile = self.backend.gemm_tile(HeadLayout::Dx);
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
        input: &Input<'_, B>,
        x16: &B::Buffer,
        chunk: usize,
        start: usize,
        rows: usize,
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
                self.backend.upload(x32, 0, bytemuck::cast_slice(src))?;
                let desc = ConvertDesc {
                    rows,
                    cols: hs,
                    rows_padded,
                    ld: self.hs_padded,
                };
                self.backend.convert_f16(x32, x16, &desc)?;
            }
            Input::F16(d) if self.hs_padded == hs => {
                // Rows are already the padded width: straight from the
                // caller's slice. Rows past `rows` keep what they held
                // (GemmDesc: rows of A past the real ones may hold anything).
                let src = &d[start * hs..(start + rows) * hs];
                self.backend.upload(x16, 0, bytemuck::cast_slice(src))?;
            }
            Input::F16(d) => {
                let mut packed = vec![f16::ZERO; rows_padded * self.hs_padded];
                for r in 0..rows {
                    let src = &d[(start + r) * hs..(start + r + 1) * hs];
                    packed[r * self.hs_padded..r * self.hs_padded + hs].copy_from_slice(src);
                }
                self.backend.upload(x16, 0, bytemuck::cast_slice(&packed))?;
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
                self.backend.upload(x16, 0, bytemuck::cast_slice(&packed))?;
            }
        }
        Ok(())
    }

    /// The logits GEMMs of one chunk: `logits[:, slice] = x16 · W_sliceᵀ / τ`
    /// (the host path's scratch and the resident path's alike).
    pub(crate) fn logits(
        &self,
        x16: &B::Buffer,
        logits: &B::Buffer,
        rows_padded: usize,
        temperature: f32,
    ) -> Result<()> {
        for (slice, plane) in self.slices.iter().zip(&self.planes) {
            let desc = GemmDesc {
                m: rows_padded,
                n: slice.padded_width(),
                k: self.hs_padded,
                a_offset: 0,
                lda: self.hs_padded,
                b_layout: HeadLayout::Logits,
                ldb: self.hs_padded,
                c_offset: slice.offset,
                ldc: self.vocab_padded,
                alpha: 1.0 / temperature,
                accumulate: false,
                k_parts: 1,
                c_part_stride: 0,
            };
            self.backend.gemm(x16, plane, logits, &desc)?;
        }
        Ok(())
    }

    /// The dx GEMMs of one chunk, summed over the slices in f32:
    /// `dx = alpha · Σ_slice grad[:, slice] · W_slice`.
    ///
    /// Each slice's GEMM runs split into [`Engine::dx_parts`] parts, into
    /// partial blocks of `rows_padded × hs_padded` in `partials` (slice s's
    /// after those of the slices before it), which one `sum_parts` adds
    /// into dx in a fixed order. One slice in one part writes dx directly.
    /// `partials` is the chunk's logits buffer, free once `kl_rows` has
    /// read it, and sized for the most blocks ([`RowBytes::new`]).
    pub(crate) fn dx(
        &self,
        grad: &B::Buffer,
        dx: &B::Buffer,
        partials: &B::Buffer,
        rows_padded: usize,
        alpha: f32,
    ) -> Result<()> {
        let parts = self.dx_parts(rows_padded);
        let total: usize = parts.iter().sum();
        let block = rows_padded * self.hs_padded;
        let mut first = 0;
        for ((slice, plane), &k_parts) in self.slices.iter().zip(&self.planes).zip(&parts) {
            let desc = self.dx_desc(slice, rows_padded, alpha);
            if total == 1 {
                return self.backend.gemm(grad, plane, dx, &desc);
            }
            let desc = GemmDesc {
                k_parts,
                c_part_stride: block,
                c_offset: first * block,
                ..desc
            };
            self.backend.gemm(grad, plane, partials, &desc)?;
            first += k_parts;
        }
        let sum = SumPartsDesc {
            len: block,
            parts: total,
            part_stride: block,
            accumulate: false,
        };
        self.backend.sum_parts(partials, dx, &sum)
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
            b_layout: HeadLayout::Dx,
            ldb: self.hs_padded,
            c_offset: 0,
            ldc: self.hs_padded,
            alpha,
            accumulate: false,
            k_parts: 1,
            c_part_stride: 0,
        }
    }

    /// The parts each slice's dx GEMM is split into for a chunk of
    /// `rows_padded` rows: [`DxSplit::choose`] with this backend's GEMM
    /// tile.
    pub fn dx_parts(&self, rows_padded: usize) -> Vec<usize> {
        let tile = self.backend.gemm_tile(HeadLayout::Dx);
        self.slices
            .iter()
            .map(|s| {
                let desc = self.dx_desc(s, rows_padded, 1.0);
                let tiles = tile.map_or(0, |t| desc.tiles(t));
                self.dx_split.choose(tiles, s.padded_width(), tile)
            })
            .collect()
    }

    pub(crate) fn check_hidden(&self, hidden: &Hidden<'_>) -> Result<()> {
        if hidden.hs() != self.hs {
            return Err(Error::HiddenSizeMismatch {
                expected: self.hs,
                got: hidden.hs(),
            });
        }
        Ok(())
    }

    /// The distillation loss and its input gradient (DESIGN §1): per-token
    /// KL of the student (`x · Wᵀ / τ`, softmax over the full vocabulary)
    /// against the teacher's renormalized top-k, the weighted mean, and
    /// `dx = ∂mean/∂x`.
    ///
    /// Every input is validated before any device work; a hidden row whose
    /// logits are not finite returns [`Error::NonFiniteHidden`] naming the
    /// first such token.
    pub fn head_kl(&mut self, hidden: &Hidden<'_>, teacher: &Teacher, opts: &LossOptions) -> Result<LossOutput> {
        let mut out = LossOutput::default();
        self.head_kl_into(hidden, teacher, opts, &mut out)?;
        Ok(out)
    }

    /// [`Engine::head_kl`] into `out`, whose vectors are resized to
    /// `[ntok]` and `[ntok][hs]` and overwritten: a training loop that keeps
    /// `out` spares the allocation and the page faults of a fresh `dx` on
    /// every call. On an error `out`'s contents are unspecified.
    pub fn head_kl_into(
        &mut self,
        hidden: &Hidden<'_>,
        teacher: &Teacher,
        opts: &LossOptions,
        out: &mut LossOutput,
    ) -> Result<()> {
        self.check_hidden(hidden)?;
        // The device-resident scratch goes, so this call can use its memory.
        self.resident.release_scratch();
        let ntok = hidden.ntok();
        if teacher.ntok() != ntok {
            return Err(Error::LengthMismatch {
                field: crate::error::Field::TeacherRows,
                expected: ntok,
                got: teacher.ntok(),
            });
        }
        teacher.check_vocab(self.vocab)?;
        let resolved = opts.resolve(ntok)?;
        resolved.check_labels(self.vocab)?;
        let k = teacher.k();
        let f32_input = matches!(hidden.data(), HiddenData::F32(_));
        let plan = self.loss_plan(ntok, k, f32_input, opts)?;
        let sizes = self.row_bytes(Job::Loss, k);
        let rows_per_chunk = plan.rows_per_chunk;
        let (input, rows_s) =
            self.scratch
                .begin(&self.backend, Job::Loss, &sizes, (rows_per_chunk, k), hidden.data())?;
        let loss_s = self.scratch.take_loss(&self.backend, &sizes, rows_per_chunk)?;
        let result = self.loss_chunks(&plan, &input, &rows_s, &loss_s, teacher, &resolved, out);
        self.scratch.put_back(rows_s, Some(loss_s), input);
        result
    }

    /// `head_kl`'s chunks, with its scratch.
    #[allow(
        clippy::too_many_arguments,
        reason = "the call's inputs and the scratch groups it took"
    )]
    fn loss_chunks(
        &self,
        plan: &ChunkPlan,
        input: &Input<'_, B>,
        s: &RowScratch<B>,
        ls: &LossScratch<B>,
        teacher: &Teacher,
        resolved: &ResolvedLoss,
        out: &mut LossOutput,
    ) -> Result<()> {
        let (ntok, k) = (teacher.ntok(), teacher.k());

        let mut trace = Trace::new("head_kl", self.trace);
        let hs = self.hs;
        let LossOutput {
            loss,
            lse,
            soft,
            hard,
            mean,
            dx,
        } = out;
        for v in [&mut *loss, &mut *lse, &mut *soft, &mut *hard] {
            v.resize(ntok, 0.0);
        }
        let mut row_out = Vec::new();
        // The kernel's per-row inputs: coefficient bits and label.
        let row_in: Vec<u32> = resolved
            .coef
            .iter()
            .zip(&resolved.labels)
            .flat_map(|(c, &l)| [c.to_bits(), if resolved.terms.hard_on() { l } else { NO_LABEL }])
            .collect();
        dx.resize(ntok * hs, 0.0);
        let mut dx_padded = Vec::new();
        trace.mark("output alloc");
        let dx_scale = 1.0 / (f64::from(resolved.gscale) * f64::from(resolved.temperature));
        let b = &self.backend;
        // Two chunks in flight: chunk i is recorded and its outputs' copies
        // started before chunk i−1's are waited for and read, so the device
        // always has queued work while the host reads. Whatever is still
        // pending when this returns (an error) is drained by `pipe`'s drop.
        let mut pipe = InFlight::new(b);
        for (chunk, (start, rows)) in plan.ranges(ntok).enumerate() {
            let rows_padded = round_up(rows, ALIGN);
            let x16 = s.x16_for(chunk);
            self.load_hidden(input, x16, chunk, start, rows)?;
            trace.mark("hidden upload");
            let (row_in_buf, loss_buf, grad, dx_buf) = (&ls.row_in, &ls.loss, &ls.grad, ls.dx_for(chunk));
            b.upload(
                &s.ids,
                0,
                bytemuck::cast_slice(&teacher.ids()[start * k..(start + rows) * k]),
            )?;
            b.upload(
                &s.probs,
                0,
                bytemuck::cast_slice(&teacher.probs()[start * k..(start + rows) * k]),
            )?;
            b.upload(
                row_in_buf,
                0,
                bytemuck::cast_slice(&row_in[start * 2..(start + rows) * 2]),
            )?;
            self.logits(x16, &s.logits, rows_padded, resolved.temperature)?;
            let kl = KlDesc {
                rows,
                vocab: self.vocab,
                ld: self.vocab_padded,
                k,
                temperature: resolved.temperature,
                tail: teacher.tail(),
                terms: resolved.terms,
            };
            b.kl_rows(&s.logits, &s.ids, &s.probs, row_in_buf, loss_buf, grad, &kl)?;
            self.dx(grad, dx_buf, &s.logits, rows_padded, dx_scale as f32)?;
            let f32_bytes = std::mem::size_of::<f32>();
            let pending = begin_pair(
                b,
                [
                    (loss_buf, rows * 4 * f32_bytes),
                    (dx_buf, rows * self.hs_padded * f32_bytes),
                ],
            )?;
            trace.mark("teacher upload + record");
            if let Some(done) = pipe.push(start, rows, pending) {
                let outs = [&mut **loss, &mut **lse, &mut **soft, &mut **hard];
                let rows = done.rows;
                self.read_loss_chunk(b, done, outs, &mut row_out, dx, &mut dx_padded, &mut trace)?;
                self.report(rows);
            }
        }
        if let Some(done) = pipe.pop() {
            let outs = [&mut **loss, &mut **lse, &mut **soft, &mut **hard];
            let rows = done.rows;
            self.read_loss_chunk(b, done, outs, &mut row_out, dx, &mut dx_padded, &mut trace)?;
            self.report(rows);
        }
        trace.report();
        let weighted: f64 = loss
            .iter()
            .zip(&resolved.weights)
            .map(|(&l, &w)| f64::from(l) * f64::from(w))
            .sum();
        *mean = weighted / f64::from(resolved.total);
        Ok(())
    }

    /// Waits for one `head_kl` chunk's per-row outputs (loss, lse, soft,
    /// hard: `row_out` holds them interleaved) and dx, and puts them in the
    /// output, failing on the chunk's first non-finite row.
    #[allow(clippy::too_many_arguments, reason = "the outputs and their staging")]
    fn read_loss_chunk(
        &self,
        b: &B,
        chunk: Chunk,
        [loss, lse, soft, hard]: [&mut [f32]; 4],
        row_out: &mut Vec<f32>,
        dx: &mut [f32],
        dx_padded: &mut Vec<f32>,
        trace: &mut Trace,
    ) -> Result<()> {
        let (hs, Chunk { start, rows, pending }) = (self.hs, chunk);
        let [loss_p, dx_p] = pending;
        row_out.resize(rows * 4, 0.0);
        if let Err(e) = b.download_end(loss_p, bytemuck::cast_slice_mut(row_out.as_mut_slice())) {
            discard(b, dx_p);
            return Err(e);
        }
        for (t, r) in row_out.chunks_exact(4).enumerate() {
            (loss[start + t], lse[start + t], soft[start + t], hard[start + t]) = (r[0], r[1], r[2], r[3]);
        }
        trace.mark("wait for kernels");
        if let Some(t) = loss[start..start + rows].iter().position(|l| !l.is_finite()) {
            discard(b, dx_p);
            return Err(Error::NonFiniteHidden { token: start + t });
        }
        let dx_rows = &mut dx[start * hs..(start + rows) * hs];
        if self.hs_padded == hs {
            // Rows are already dense: straight into the output.
            b.download_end(dx_p, bytemuck::cast_slice_mut(dx_rows))?;
            trace.mark("dx download");
        } else {
            dx_padded.resize(rows * self.hs_padded, 0f32);
            b.download_end(dx_p, bytemuck::cast_slice_mut(dx_padded.as_mut_slice()))?;
            trace.mark("dx download");
            for (row, padded) in dx_rows.chunks_exact_mut(hs).zip(dx_padded.chunks_exact(self.hs_padded)) {
                row.copy_from_slice(&padded[..hs]);
            }
            trace.mark("dx unpad");
        }
        Ok(())
    }

    /// The teacher's exact top-k of `x · Wᵀ` per row: ids by descending
    /// logit (ties: lowest id first) and probabilities, the softmax over
    /// those k at τ.
    ///
    /// ```
    /// use headkl_core::{Engine, HeadData, HeadWeights, Hidden, SliceOptions, TopkOptions};
    /// use headkl_reference::CpuBackend;
    ///
    /// // Row j of the head is e_j scaled by j, so token x = (1, …, 1) has logit j at id j.
    /// let (vocab, hs) = (200, 4);
    /// let w: Vec<f32> = (0..vocab * hs).map(|i| if i % hs == 0 { (i / hs) as f32 / 64.0 } else { 0.0 }).collect();
    /// let head = HeadWeights::new(HeadData::F32(&w), vocab, hs)?;
    /// let mut engine = Engine::new(CpuBackend::new(), &head, SliceOptions::default())?;
    /// let x = vec![1.0f32; hs];
    /// let top = engine.topk(&Hidden::f32(&x, 1, hs)?, &TopkOptions::new(3))?;
    /// assert_eq!(top.ids, vec![199, 198, 197]);
    /// assert!(top.probs[0] > top.probs[1] && top.probs[1] > top.probs[2]);
    /// # Ok::<(), headkl_core::Error>(())
    /// ```
    pub fn topk(&mut self, hidden: &Hidden<'_>, opts: &TopkOptions) -> Result<TopK> {
        self.check_hidden(hidden)?;
        self.resident.release_scratch();
        opts.check(self.vocab)?;
        let (ntok, k) = (hidden.ntok(), opts.k);
        let f32_input = matches!(hidden.data(), HiddenData::F32(_));
        let sizes = self.row_bytes(Job::Topk, k);
        let budget = (opts.budget_bytes, opts.max_rows_per_chunk);
        let plan = self.chunk_plan(Job::Topk, ntok, k, f32_input, budget)?;
        let (input, rows_s) = self.scratch.begin(
            &self.backend,
            Job::Topk,
            &sizes,
            (plan.rows_per_chunk, k),
            hidden.data(),
        )?;
        let result = self.topk_chunks(&plan, &input, &rows_s, ntok, opts);
        self.scratch.put_back(rows_s, None, input);
        result
    }

    /// `topk`'s chunks, with its scratch.
    fn topk_chunks(
        &self,
        plan: &ChunkPlan,
        input: &Input<'_, B>,
        s: &RowScratch<B>,
        ntok: usize,
        opts: &TopkOptions,
    ) -> Result<TopK> {
        let k = opts.k;
        let mut ids = vec![0u32; ntok * k];
        // The kernel's values: probabilities over the k, or log-probabilities.
        let mut probs = vec![0f32; ntok * k];
        let b = &self.backend;
        // Two chunks in flight, as in `loss_chunks`.
        let mut pipe = InFlight::new(b);
        let read = |done: Chunk, ids: &mut [u32], probs: &mut [f32]| -> Result<()> {
            let Chunk { start, rows, pending } = done;
            let [ids_p, probs_p] = pending;
            let range = start * k..(start + rows) * k;
            if let Err(e) = b.download_end(ids_p, bytemuck::cast_slice_mut(&mut ids[range.clone()])) {
                discard(b, probs_p);
                return Err(e);
            }
            b.download_end(probs_p, bytemuck::cast_slice_mut(&mut probs[range]))?;
            match (0..rows).find(|&t| !probs[(start + t) * k].is_finite()) {
                Some(t) => Err(Error::NonFiniteHidden { token: start + t }),
                None => Ok(()),
            }
        };
        for (chunk, (start, rows)) in plan.ranges(ntok).enumerate() {
            let x16 = s.x16_for(chunk);
            self.load_hidden(input, x16, chunk, start, rows)?;
            self.logits(x16, &s.logits, round_up(rows, ALIGN), opts.temperature)?;
            let desc = TopkDesc {
                cap: opts.softcap.map(|c| c / opts.temperature),
                logprobs: opts.logprobs,
                ..TopkDesc::plain(rows, self.vocab, self.vocab_padded, k)
            };
            b.topk_rows(&s.logits, &s.ids, &s.probs, &desc)?;
            let bytes = rows * k * std::mem::size_of::<u32>();
            let pending = begin_pair(b, [(&s.ids, bytes), (&s.probs, bytes)])?;
            if let Some(done) = pipe.push(start, rows, pending) {
                let rows = done.rows;
                read(done, &mut ids, &mut probs)?;
                self.report(rows);
            }
        }
        if let Some(done) = pipe.pop() {
            let rows = done.rows;
            read(done, &mut ids, &mut probs)?;
            self.report(rows);
        }
        if !opts.logprobs {
            return Ok(TopK {
                ids,
                probs,
                logprobs: Vec::new(),
                ntok,
                k,
            });
        }
        // The softmax over the k from the log-probabilities, in f64.
        let mut over_k = vec![0f32; ntok * k];
        for (lp, p) in probs.chunks_exact(k).zip(over_k.chunks_exact_mut(k)) {
            let m = lp.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
            let z: f64 = lp.iter().map(|&v| (f64::from(v) - m).exp()).sum();
            for (o, &v) in p.iter_mut().zip(lp) {
                *o = ((f64::from(v) - m).exp() / z) as f32;
            }
        }
        Ok(TopK {
            ids,
            probs: over_k,
            logprobs: probs,
            ntok,
            k,
        })
    }
}

/// One chunk whose outputs are being copied out: its token range and its
/// two downloads (loss and dx, or ids and probabilities).
struct Chunk {
    start: usize,
    rows: usize,
    pending: [PendingDownload; 2],
}

/// The chunks in flight on a backend: at most one waits to be read while
/// the next is recorded. Dropping it (an error path) waits for and discards
/// whatever is still pending, so no copy outlives the call.
struct InFlight<'a, B: Backend> {
    backend: &'a B,
    waiting: Option<Chunk>,
}

impl<'a, B: Backend> InFlight<'a, B> {
    fn new(backend: &'a B) -> Self {
        Self { backend, waiting: None }
    }

    /// Adds the chunk just recorded and hands back the one before it, now
    /// due to be read.
    fn push(&mut self, start: usize, rows: usize, pending: [PendingDownload; 2]) -> Option<Chunk> {
        self.waiting.replace(Chunk { start, rows, pending })
    }

    /// The last chunk, after the loop.
    fn pop(&mut self) -> Option<Chunk> {
        self.waiting.take()
    }
}

impl<B: Backend> Drop for InFlight<'_, B> {
    fn drop(&mut self) {
        if let Some(chunk) = self.waiting.take() {
            for p in chunk.pending {
                discard(self.backend, p);
            }
        }
    }
}

/// Starts copying out one chunk's two outputs (`(buffer, bytes)` from
/// offset 0). If the second cannot start, the first is drained.
fn begin_pair<B: Backend>(backend: &B, outputs: [(&B::Buffer, usize); 2]) -> Result<[PendingDownload; 2]> {
    let [(first, first_len), (second, second_len)] = outputs;
    let first = backend.download_begin(first, 0, first_len)?;
    match backend.download_begin(second, 0, second_len) {
        Ok(second) => Ok([first, second]),
        Err(e) => {
            discard(backend, first);
            Err(e)
        }
    }
}

/// Waits for a download whose bytes are no longer wanted (an error is on
/// its way out already), so its staging is free when the call returns.
fn discard<B: Backend>(backend: &B, pending: PendingDownload) {
    let mut sink = vec![0u8; pending.len()];
    // The caller is already returning an error; this one adds nothing.
    let _ = backend.download_end(pending, &mut sink);
}

/// Host-side time per phase of a call, printed to stderr when the engine's
/// trace is on.
struct Trace {
    job: &'static str,
    last: Option<std::time::Instant>,
    phases: Vec<(&'static str, f64)>,
}

impl Trace {
    fn new(job: &'static str, on: bool) -> Self {
        Self {
            job,
            last: on.then(std::time::Instant::now),
            phases: Vec::new(),
        }
    }

    /// Charges the time since the last mark to `phase`.
    fn mark(&mut self, phase: &'static str) {
        let Some(last) = self.last else { return };
        let now = std::time::Instant::now();
        let ms = (now - last).as_secs_f64() * 1e3;
        match self.phases.iter_mut().find(|(p, _)| *p == phase) {
            Some((_, total)) => *total += ms,
            None => self.phases.push((phase, ms)),
        }
        self.last = Some(now);
    }

    fn report(&self) {
        if self.last.is_none() {
            return;
        }
        let total: f64 = self.phases.iter().map(|(_, ms)| ms).sum();
        let parts: Vec<String> = self.phases.iter().map(|(p, ms)| format!("{p} {ms:.1}")).collect();
        log::info!(
            target: crate::DIAGNOSTICS_LOG_TARGET,
            "trace {}: {total:.1} ms = {}",
            self.job,
            parts.join(", ")
        );
    }
}
