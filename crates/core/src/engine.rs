//! The host path, written once over [`Backend`]: the [`Engine`] owns the
//! backend and the uploaded head (`HeadPlanes`, whose per-chunk kernel
//! sequences every path shares), cuts the tokens into chunks, and runs
//! `head_kl` and `topk` with host inputs and outputs.

use crate::align::{round_up, ALIGN};
use crate::engine::head::HeadWeights;
use crate::engine::head_planes::{DevicePlane, DxFilter, HeadGrad, HeadPlanes, Scaling, UploadTimes};
use crate::engine::in_flight::{Copying, InFlight};
use crate::engine::scratch::{Input, Job, LossScratch, RowBytes, RowScratch, ScratchCache};
use crate::error::{Error, Result};
use crate::problem::grad_type::{GradType, GradValues};
use crate::problem::slicing::SliceOptions;
use crate::problem::slicing::VocabSlice;
use crate::problem::terms::{LossTerms, NO_LABEL};
use crate::problem::vocab_order::VocabOrder;
use crate::problem::{Hidden, HiddenData, LossOptions, ResolvedLoss, Teacher, TopkOptions};
use crate::toolkit::backend::{Backend, KlDesc, RowStats, TopkDesc};
use crate::toolkit::chunking::{ChunkPlan, ChunkTransfers, Rows};
use crate::toolkit::launch::Kernels;
use crate::toolkit::split::DxSplit;

mod gather;
pub mod head;
pub(crate) mod head_planes;
pub(crate) mod in_flight;
pub(crate) mod scratch;

pub use gather::{check_gather_ids, Gathered};

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
    /// With [`crate::problem::LossConfig::filter_eps`]: what the dx GEMM's block filter
    /// skipped, and a bound on what that dropped from dx.
    pub filter: Option<crate::problem::filter::FilterStats>,
    /// With [`crate::problem::LossConfig::head_grad`]: `∂mean/∂W`
    /// `[vocab][hs]` in f32, rows in the head's natural id order; else
    /// empty.
    pub head_grad: Vec<f32>,
}

impl LossOutput {
    /// Takes [`Self::head_grad`] out (leaving it empty) in `to`: f32 as
    /// computed (no copy), or the head's own type as a trainer's `.grad`
    /// is, each value rounded once ([`GradValues::convert`]; a value f16
    /// cannot hold is an error naming its row and column, and the f32
    /// values stay).
    pub fn take_head_grad(&mut self, to: GradType) -> Result<GradValues> {
        // `[vocab][hs]`, hs read off dx `[ntok][hs]`.
        let hs = match self.loss.len() {
            0 => self.head_grad.len(),
            ntok => self.dx.len() / ntok,
        };
        if to == GradType::F32 {
            return Ok(GradValues::F32(std::mem::take(&mut self.head_grad)));
        }
        let converted = GradValues::convert(&self.head_grad, hs, to, "head_grad")?;
        self.head_grad = Vec::new();
        Ok(converted)
    }
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
    /// The uploaded head and the kernel sequences every path shares.
    pub(crate) head: HeadPlanes<B>,
    /// The host path's scratch (the vocabulary shards' too).
    scratch: ScratchCache<B>,
    /// Scratch and status of the device-resident entry points
    /// (`crate::resident`).
    pub(crate) resident: crate::engine::scratch::ResidentState<B>,
    /// Log each `head_kl` call's host phases ([`Engine::set_trace`]).
    trace: bool,
    /// Told the tokens of each chunk as its outputs are read
    /// ([`Engine::set_progress`]).
    progress: Option<ProgressCallback>,
    /// `head_kl`'s logits GEMMs write row statistics for the KL rows
    /// ([`Engine::set_row_stats`]).
    row_stats: bool,
    /// The teacher's head for the exact full-vocabulary divergence
    /// ([`Engine::set_teacher_head`]).
    teacher_head: Option<HeadPlanes<B>>,
    /// The teacher's hidden rows' upload and logits scratch.
    teacher_scratch: ScratchCache<B>,
    /// The head's gradient's device memory, kept from one call that asks
    /// for it to the next ([`Engine::release_scratch`] frees it).
    head_grad: Option<HeadGrad<B>>,
}

/// A progress callback: called with the number of tokens a finished chunk
/// of a host call (`head_kl`, `topk`) adds.
pub type ProgressCallback = Box<dyn Fn(usize) + Send + Sync>;

impl<B: Backend> Engine<B> {
    /// Uploads `head` to `backend` as f16 planes, one per vocabulary slice.
    /// Fails on a head value that is not finite or is past f16's range,
    /// naming its row and column, before any of it is on the device.
    pub fn new(backend: B, head: &HeadWeights<'_>, slicing: SliceOptions) -> Result<Self> {
        Self::with_vocab_order(backend, head, slicing, None)
    }

    /// An engine whose head `[vocab][hs]` is already on `backend`'s device
    /// (a trainer's own tensor): no host copy of it. `fill` writes each
    /// vocabulary slice's f16 plane ([`DevicePlane`]: the rows rounded to
    /// f16, zero-padded), typically a device copy; `row_norms` are those
    /// f16 rows' Euclidean norms (`[vocab]`). The caller checks the values
    /// (finite, within f16's range) first: nothing here reads them.
    pub fn from_device_head(
        backend: B,
        (vocab, hs): (usize, usize),
        slicing: SliceOptions,
        row_norms: &[f32],
        mut fill: impl FnMut(&B, DevicePlane<'_, B::Buffer>) -> Result<()>,
    ) -> Result<Self> {
        let head = HeadPlanes::from_device(&backend, (vocab, hs), slicing, row_norms, &mut fill)?;
        Ok(Self::with_planes(backend, head))
    }

    /// Reads the head again from the device (a trainable head after an
    /// optimizer step): `fill` rewrites each vocabulary slice's plane in
    /// place, as for [`Engine::from_device_head`] (same vocab and hs, the
    /// same [`DevicePlane`]s, no allocation), and `row_norms` are the new
    /// f16 rows' norms. Costs the device copies `fill` makes; the caller
    /// checks the values first. Waits for work in flight that reads the
    /// planes before the first write.
    pub fn refill_device_head(
        &mut self,
        row_norms: &[f32],
        mut fill: impl FnMut(&B, DevicePlane<'_, B::Buffer>) -> Result<()>,
    ) -> Result<()> {
        self.backend.finish()?;
        self.head.refill(&self.backend, Some(row_norms), &mut fill)
    }

    /// [`Engine::refill_device_head`] without the rows' norms and without
    /// waiting, where this backend's dx GEMM has no block filter (the
    /// norms' only reader; CUDA's has none) and `fill` queues its writes
    /// in order with the engine's work, on the queue it runs on (a CUDA
    /// stream shared with the trainer): the writes then follow the calls
    /// before and precede the calls after, so a trainer refreshing its
    /// head every step neither waits for the device nor reads anything
    /// back for it. Elsewhere [`Error::MissingFeature`] says to pass the
    /// norms.
    pub fn refill_device_head_queued(
        &mut self,
        mut fill: impl FnMut(&B, DevicePlane<'_, B::Buffer>) -> Result<()>,
    ) -> Result<()> {
        if self.backend.gemm_block_filter() {
            return Err(Error::MissingFeature(format!(
                "{}: a head read again without its rows' norms (the dx block filter's bound needs them; \
                 Engine::refill_device_head takes them)",
                self.backend.info().backend
            )));
        }
        self.head.refill(&self.backend, None, &mut fill)
    }

    /// [`Engine::new`] with the head's rows stored in `order`
    /// ([`VocabOrder`]; `None`: natural), fixed for the engine's life: the
    /// dx GEMM's block filter then finds the likely tokens in fewer blocks.
    /// Ids in and out stay token ids (the host path maps them); top-k ties
    /// come out lowest position first. The device-resident entry points
    /// refuse an engine with an order ([`Error::VocabOrderUnsupported`]).
    pub fn with_vocab_order(
        backend: B,
        head: &HeadWeights<'_>,
        slicing: SliceOptions,
        order: Option<VocabOrder>,
    ) -> Result<Self> {
        let head = HeadPlanes::upload(&backend, head, slicing, order)?;
        Ok(Self::with_planes(backend, head))
    }

    /// An engine around a head already on `backend`'s device.
    fn with_planes(backend: B, head: HeadPlanes<B>) -> Self {
        Self {
            backend,
            head,
            scratch: ScratchCache::default(),
            resident: crate::engine::scratch::ResidentState::new(),
            trace: false,
            progress: None,
            row_stats: true,
            teacher_head: None,
            teacher_scratch: ScratchCache::default(),
            head_grad: None,
        }
    }

    /// Whether `head_kl`'s logits GEMMs also write each row's statistics
    /// (maximum and sum of exponentials per 32 columns, [`crate::toolkit::RowStats`])
    /// so the KL rows read the logits once instead of twice (on by
    /// default; `HEADKL_ROW_STATS=off` through the command line). Used only
    /// where those statistics are the KL rows' whole first pass: no
    /// softcap, τ = 1, no hard label. The results agree within rounding
    /// (the row's sum is added in another order), not bit for bit.
    pub fn set_row_stats(&mut self, on: bool) {
        self.row_stats = on;
    }

    /// The row statistics where `head_kl` with these terms uses them.
    pub(crate) fn row_stats_for(&self, terms: &LossTerms, temperature: f32, rows_padded: usize) -> Option<RowStats> {
        (self.row_stats && KlDesc::stats_suffice(terms, temperature) && self.head.row_stats_fit(&self.backend))
            .then(|| self.head.row_stats(rows_padded))
    }

    /// How the dx GEMM's reduction (the vocabulary) is split into parts
    /// that run in one dispatch (`HEADKL_DX_SPLIT`, through
    /// the command line; [`DxSplit::choose`] has the automatic rule).
    /// Frees the cached scratch, which is sized for the parts.
    pub fn set_dx_split(&mut self, split: DxSplit) {
        if split != self.head.dx_split() {
            self.release_scratch();
        }
        self.head.set_dx_split(split);
    }

    /// The dx GEMM's split setting.
    pub fn dx_split(&self) -> DxSplit {
        self.head.dx_split()
    }

    /// Logs each `head_kl` call's host phases (upload, wait, download) as
    /// one `log::info!` line when `on` (`HEADKL_TRACE`, read by the command
    /// line): to see where wall time beyond the kernels goes.
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on;
    }

    /// Whether [`Self::set_trace`] turned the trace on.
    pub(crate) fn trace_on(&self) -> bool {
        self.trace
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
        self.head.vocab()
    }

    /// Hidden size.
    pub fn hs(&self) -> usize {
        self.head.hs()
    }

    /// The vocabulary slices the head was cut into.
    pub fn slices(&self) -> &[VocabSlice] {
        self.head.slices()
    }

    /// The order the head's rows are stored in (`None`: natural).
    pub fn vocab_order(&self) -> Option<&VocabOrder> {
        self.head.order()
    }

    /// Where the head's upload from the host spent its time (`None` for a
    /// head read on the device).
    pub fn head_upload_times(&self) -> Option<UploadTimes> {
        self.head.upload_times()
    }

    /// Frees the cached scratch buffers (they are re-made on the next call).
    pub fn release_scratch(&mut self) {
        self.scratch = ScratchCache::default();
        self.teacher_scratch = ScratchCache::default();
        self.head_grad = None;
        self.resident.release_scratch();
    }

    /// The block filter's ε as this backend runs it: `None` where its dx
    /// GEMM cannot skip blocks ([`Backend::gemm_block_filter`]; dx is then
    /// exact, as with ε = 0, and no mask is written or read).
    pub(crate) fn filter_eps(&self, eps: Option<f32>) -> Option<f32> {
        eps.filter(|_| self.backend.gemm_block_filter())
    }

    /// The chunk plan `head_kl` would use for `ntok` tokens.
    pub fn loss_plan(&self, ntok: usize, k: usize, f32_input: bool, opts: &LossOptions) -> Result<ChunkPlan> {
        let budget = (opts.config.budget_bytes, opts.config.max_rows_per_chunk);
        let job = Job::loss(self.filter_eps(opts.config.filter_eps));
        self.head.chunk_plan(&self.backend, job, ntok, k, f32_input, budget)
    }

    /// The parts each slice's dx GEMM is split into for a chunk of
    /// `rows_padded` rows: [`DxSplit::choose`] with this backend's GEMM
    /// tile.
    pub fn dx_parts(&self, rows_padded: usize) -> Vec<usize> {
        self.head.dx_parts(&self.backend, rows_padded)
    }

    /// The uploaded head, whose kernel sequences the vocabulary shards
    /// share.
    pub(crate) fn head_planes(&self) -> &HeadPlanes<B> {
        &self.head
    }

    /// Starts a host loss call (this engine's or a vocabulary shard's) over
    /// chunks of `rows` rows of `k` entries: frees the device-resident
    /// scratch, so the call can use its memory, and takes the host path's
    /// row and loss scratch. [`Self::end_host_call`] gives them back.
    pub(crate) fn begin_loss_call<'a>(
        &mut self,
        (job, sizes): (Job, &RowBytes),
        (rows, k): (usize, usize),
        hidden: HiddenData<'a>,
    ) -> Result<HostCall<'a, B>> {
        self.resident.release_scratch();
        let (input, rows_s) = self.scratch.begin(&self.backend, job, sizes, (rows, k), hidden)?;
        match self.scratch.take_loss(&self.backend, sizes, rows) {
            Ok(loss) => Ok(HostCall {
                input,
                rows: rows_s,
                loss,
            }),
            Err(e) => {
                self.scratch.put_back(rows_s, None, input);
                Err(e)
            }
        }
    }

    /// Keeps a host call's scratch for the next call, whether or not the
    /// call succeeded (`result`, passed on).
    pub(crate) fn end_host_call<T>(&mut self, call: HostCall<'_, B>, result: Result<T>) -> Result<T> {
        self.scratch.put_back(call.rows, Some(call.loss), call.input);
        result
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
        self.head.check_hidden(hidden)?;
        // The device-resident scratch goes, so this call can use its memory.
        self.resident.release_scratch();
        let ntok = hidden.ntok();
        crate::error::Field::TeacherRows.check_len(ntok, teacher.ntok())?;
        teacher.check_vocab(self.head.vocab())?;
        let mut resolved = opts.resolve(ntok)?;
        resolved.filter_eps = self.filter_eps(resolved.filter_eps);
        resolved.check_labels(self.head.vocab())?;
        let k = teacher.k();
        let f32_input = matches!(hidden.data(), HiddenData::F32(_));
        let plan = self.loss_plan(ntok, k, f32_input, opts)?;
        let job = Job::loss(resolved.filter_eps);
        let sizes = self.head.row_bytes(&self.backend, job, k);
        let call = self.begin_loss_call((job, &sizes), (plan.rows_per_chunk, k), hidden.data())?;
        let teacher = LossTeacher::TopK(teacher);
        let head_grad = match self.take_head_grad(opts.config.head_grad) {
            Ok(head_grad) => head_grad,
            Err(e) => return self.end_host_call(call, Err(e)),
        };
        let result = self.loss_chunks(&plan, &call, (ntok, &teacher), (&resolved, head_grad.as_ref()), out);
        self.head_grad = head_grad.or(self.head_grad.take());
        self.end_host_call(call, result)
    }

    /// Uploads the teacher's head `[V][hs_T]` for
    /// [`Engine::head_kl_full_vocab`], in place of any before it. It shares
    /// the student's vocabulary, not its hidden size; values are checked as
    /// [`Engine::new`] checks the student's.
    pub fn set_teacher_head(&mut self, head: &HeadWeights<'_>, slicing: SliceOptions) -> Result<()> {
        if head.vocab() != self.head.vocab() {
            return Err(Error::TeacherHeadMismatch {
                what: "vocab",
                expected: self.head.vocab(),
                got: head.vocab(),
            });
        }
        if self.head.order().is_some() {
            return Err(Error::VocabOrderUnsupported {
                reason: "the teacher's head is stored in the natural order; use an engine without a vocabulary order",
            });
        }
        // The old head and its scratch go first, so the new one can use
        // their memory.
        self.teacher_head = None;
        self.teacher_scratch = ScratchCache::default();
        self.teacher_head = Some(HeadPlanes::upload(&self.backend, head, slicing, None)?);
        Ok(())
    }

    /// Frees the teacher's head and its scratch.
    pub fn remove_teacher_head(&mut self) {
        self.teacher_head = None;
        self.teacher_scratch = ScratchCache::default();
    }

    /// The teacher head's hidden size, once [`Engine::set_teacher_head`]
    /// has uploaded one.
    pub fn teacher_hs(&self) -> Option<usize> {
        self.teacher_head.as_ref().map(|h| h.hs())
    }

    /// The exact full-vocabulary divergence (DESIGN §1 "The teacher's
    /// hidden rows"): the teacher is `softmax(x_T · W_Tᵀ / τ)` over all V,
    /// from its hidden rows `teacher_hidden` `[ntok][hs_T]` and the head of
    /// [`Engine::set_teacher_head`]. Its logits are made chunk by chunk
    /// beside the student's and never stored, so memory stays within the
    /// budget. Every divergence, τ, the soft weight, per-token weights,
    /// the reductions, `ignore_mask` and the logit scale (on the student)
    /// apply; the softcap, the hard term, the z-loss and the block filter
    /// are refused ([`Error::FullVocabUnsupported`]).
    pub fn head_kl_full_vocab(
        &mut self,
        hidden: &Hidden<'_>,
        teacher_hidden: &Hidden<'_>,
        opts: &LossOptions,
    ) -> Result<LossOutput> {
        let mut out = LossOutput::default();
        self.head_kl_full_vocab_into(hidden, teacher_hidden, opts, &mut out)?;
        Ok(out)
    }

    /// [`Engine::head_kl_full_vocab`] into `out` (as [`Engine::head_kl_into`]).
    pub fn head_kl_full_vocab_into(
        &mut self,
        hidden: &Hidden<'_>,
        teacher_hidden: &Hidden<'_>,
        opts: &LossOptions,
        out: &mut LossOutput,
    ) -> Result<()> {
        let Some(teacher_head) = self.teacher_head.as_ref() else {
            return Err(Error::NoTeacherHead);
        };
        self.head.check_hidden(hidden)?;
        teacher_head.check_hidden(teacher_hidden)?;
        let ntok = hidden.ntok();
        if teacher_hidden.ntok() != ntok {
            return Err(Error::TeacherHeadMismatch {
                what: "hidden rows' tokens",
                expected: ntok,
                got: teacher_hidden.ntok(),
            });
        }
        let mut resolved = opts.resolve(ntok)?;
        resolved.filter_eps = self.filter_eps(resolved.filter_eps);
        resolved.check_labels(self.head.vocab())?;
        check_full_vocab_terms(&resolved)?;
        self.resident.release_scratch();
        let t_f32 = matches!(teacher_hidden.data(), HiddenData::F32(_));
        let f32_input = matches!(hidden.data(), HiddenData::F32(_));
        let sizes = self.head.row_bytes(&self.backend, Job::Loss, 1);
        let t_sizes = teacher_head.row_bytes(&self.backend, Job::Topk, 1);
        let mut costs = sizes.costs(Job::Loss, f32_input);
        costs.extend(
            t_sizes
                .costs(Job::Topk, t_f32)
                .into_iter()
                .map(|c| crate::toolkit::chunking::RowCost {
                    what: teacher_cost_name(c.what),
                    ..c
                }),
        );
        let info = self.backend.info();
        let max_binding = info.max_binding_bytes.min(info.max_buffer_bytes);
        let plan = crate::toolkit::chunking::plan_chunks(
            ntok,
            &costs,
            opts.config.budget_bytes,
            max_binding,
            opts.config.max_rows_per_chunk,
        )?;
        let rows = plan.rows_per_chunk;
        let (t_input, t_rows) =
            self.teacher_scratch
                .begin(&self.backend, Job::Topk, &t_sizes, (rows, 1), teacher_hidden.data())?;
        let head_grad = match self.take_head_grad(opts.config.head_grad) {
            Ok(head_grad) => head_grad,
            Err(e) => {
                self.teacher_scratch.put_back(t_rows, None, t_input);
                return Err(e);
            }
        };
        let call = match self.begin_loss_call((Job::Loss, &sizes), (rows, 1), hidden.data()) {
            Ok(call) => call,
            Err(e) => {
                self.teacher_scratch.put_back(t_rows, None, t_input);
                return Err(e);
            }
        };
        let result = match self.teacher_head.as_ref() {
            Some(head) => {
                let teacher = LossTeacher::Hidden {
                    head,
                    input: &t_input,
                    scratch: &t_rows,
                };
                self.loss_chunks(&plan, &call, (ntok, &teacher), (&resolved, head_grad.as_ref()), out)
            }
            None => Err(Error::NoTeacherHead),
        };
        self.head_grad = head_grad.or(self.head_grad.take());
        let result = self.end_host_call(call, result);
        self.teacher_scratch.put_back(t_rows, None, t_input);
        result
    }

    /// The device memory the head's gradient builds up in, when a call
    /// asks for it: the last call's, else fresh.
    pub(crate) fn take_head_grad(&mut self, asked: bool) -> Result<Option<HeadGrad<B>>> {
        if !asked {
            return Ok(None);
        }
        match self.head_grad.take() {
            Some(kept) => Ok(Some(kept)),
            None => HeadGrad::alloc(&self.backend, &self.head).map(Some),
        }
    }

    /// Frees the head's gradient's kept device memory (a call that builds
    /// it in the caller's buffer needs none).
    pub(crate) fn drop_head_grad(&mut self) {
        self.head_grad = None;
    }

    /// Keeps the head's gradient's device memory for the next call.
    pub(crate) fn keep_head_grad(&mut self, pieces: HeadGrad<B>) {
        self.head_grad = Some(pieces);
    }

    /// `head_kl`'s chunks, with the scratch its call took, adding each
    /// chunk's share of the head's gradient into `head_grad` when given.
    fn loss_chunks(
        &self,
        plan: &ChunkPlan,
        call: &HostCall<'_, B>,
        (ntok, teacher): (usize, &LossTeacher<'_, '_, B>),
        (resolved, head_grad): (&ResolvedLoss, Option<&HeadGrad<B>>),
        out: &mut LossOutput,
    ) -> Result<()> {
        let (input, s, ls) = (&call.input, &call.rows, &call.loss);
        let mut trace = Trace::new("head_kl", self.trace);
        let hs = self.head.hs();
        let LossOutput {
            loss,
            lse,
            soft,
            hard,
            mean,
            dx,
            filter,
            head_grad: head_grad_out,
        } = out;
        *filter = resolved.filter_eps.map(|eps| crate::problem::filter::FilterStats {
            eps,
            ..Default::default()
        });
        for v in [&mut *loss, &mut *lse, &mut *soft, &mut *hard] {
            v.resize(ntok, 0.0);
        }
        let mut row_out = Vec::new();
        // The kernel's per-row inputs: coefficient bits and label.
        // Ids and labels as positions in the head's order.
        let order = self.head.order();
        let at = |id: u32| order.map_or(id, |o| o.position(id));
        let row_in: Vec<u32> = resolved
            .coef
            .iter()
            .zip(&resolved.labels)
            .flat_map(|(c, &l)| {
                let label = if resolved.terms.hard_on() && l != NO_LABEL {
                    at(l)
                } else {
                    NO_LABEL
                };
                [c.to_bits(), label]
            })
            .collect();
        // A chunk's ids in the head's order, mapped as the chunk is
        // uploaded (so all but the first chunk's mapping overlaps kernels).
        let mut mapped_ids = Vec::new();
        dx.resize(ntok * hs, 0.0);
        let mut dx_padded = Vec::new();
        trace.mark("output alloc");
        let scaling = Scaling::host_loss(resolved);
        let b = &self.backend;
        // Two chunks in flight: chunk i is recorded and its outputs' copies
        // started before chunk i−1's are waited for and read, so the device
        // always has queued work while the host reads. Whatever is still
        // pending when this returns (an error) is drained by `pipe`'s drop.
        let mut pipe = InFlight::new();
        for (chunk, Rows { start, rows }) in plan.chunk_rows(ntok, ChunkTransfers::Host).into_iter().enumerate() {
            let rows_padded = round_up(rows, ALIGN);
            let x16 = s.x16_for(chunk);
            self.head.load_hidden(b, input, x16, (chunk, start, rows))?;
            trace.mark("hidden upload");
            let (row_in_buf, loss_buf, grad, dx_buf) = (&ls.row_in, &ls.loss, &ls.grad, ls.dx_for(chunk));
            b.upload(
                row_in_buf,
                0,
                bytemuck::cast_slice(&row_in[start * 2..(start + rows) * 2]),
            )?;
            // The teacher's values: the chunk's top-k rows, or its logits
            // at τ made here from its hidden rows (never stored beyond the
            // chunk).
            let (k, tail, probs, dense) = match teacher {
                LossTeacher::TopK(teacher) => {
                    let k = teacher.k();
                    let chunk_ids = &teacher.ids()[start * k..(start + rows) * k];
                    let chunk_ids = match order {
                        Some(_) => {
                            mapped_ids.clear();
                            mapped_ids.extend(chunk_ids.iter().map(|&id| at(id)));
                            mapped_ids.as_slice()
                        }
                        None => chunk_ids,
                    };
                    b.upload(&s.ids, 0, bytemuck::cast_slice(chunk_ids))?;
                    b.upload(
                        &s.probs,
                        0,
                        bytemuck::cast_slice(&teacher.probs()[start * k..(start + rows) * k]),
                    )?;
                    (k, teacher.tail(), &s.probs, false)
                }
                LossTeacher::Hidden { head, input, scratch } => {
                    let t_x16 = scratch.x16_for(chunk);
                    head.chunk_logits(
                        b,
                        input,
                        t_x16,
                        (chunk, start, rows),
                        &scratch.logits,
                        Scaling::teacher(resolved.temperature),
                    )?;
                    (1, crate::problem::terms::TailMode::Renormalize, &scratch.logits, true)
                }
            };
            let row_stats = match dense {
                true => None,
                false => self.row_stats_for(&resolved.terms, resolved.temperature, rows_padded),
            };
            self.head.logits(b, x16, &s.logits, rows_padded, scaling, row_stats)?;
            let kl = KlDesc {
                rows,
                vocab: self.head.vocab(),
                ld: self.head.vocab_padded(),
                k,
                temperature: resolved.temperature,
                tail,
                terms: resolved.terms,
                row_stats,
                filter: self.head.kl_filter(resolved.filter_eps, rows_padded),
                dense_teacher: dense,
            };
            b.kl_rows(&s.logits, &s.ids, probs, row_in_buf, loss_buf, grad, &kl)?;
            let dx_filter = kl.filter.map(|_| DxFilter { mask_rows: rows });
            self.head
                .dx(b, (grad, dx_buf, &s.logits), rows_padded, scaling, dx_filter)?;
            if let Some(head_grad) = head_grad {
                // The logits buffer is free again once dx's parts are summed.
                let buffers = (grad, x16, &s.logits);
                head_grad.add_chunk(b, &self.head, buffers, (rows, rows_padded), scaling, chunk > 0)?;
            }
            // The per-row outputs, dx and (with the filter, for the call's
            // statistics) the block mask.
            let f32_bytes = std::mem::size_of::<f32>();
            let loss_out = (loss_buf, 0, rows * 4 * f32_bytes);
            let dx_out = (dx_buf, 0, rows * self.head.hs_padded() * f32_bytes);
            let copying = match kl.filter {
                Some(_) => {
                    let (at, halves) = self.head.mask_span(rows, rows_padded);
                    Copying::begin(
                        b,
                        (start, rows),
                        &[loss_out, dx_out, (grad, (at * 2) as u64, halves * 2)],
                    )?
                }
                None => Copying::begin(b, (start, rows), &[loss_out, dx_out])?,
            };
            trace.mark("teacher upload + record");
            if let Some(mut done) = pipe.push(copying) {
                let outs = [&mut **loss, &mut **lse, &mut **soft, &mut **hard];
                self.read_loss_chunk(&mut done, outs, &mut row_out, dx, &mut dx_padded, &mut trace)?;
                self.read_mask(&mut done, resolved, filter)?;
                self.report(done.rows);
            }
        }
        if let Some(mut done) = pipe.pop() {
            let outs = [&mut **loss, &mut **lse, &mut **soft, &mut **hard];
            self.read_loss_chunk(&mut done, outs, &mut row_out, dx, &mut dx_padded, &mut trace)?;
            self.read_mask(&mut done, resolved, filter)?;
            self.report(done.rows);
        }
        match head_grad {
            Some(head_grad) => {
                head_grad.read(b, &self.head, head_grad_out)?;
                trace.mark("head_grad download");
            }
            None => head_grad_out.clear(),
        }
        trace.report();
        *mean = resolved.mean_of(loss);
        Ok(())
    }

    /// Reads one chunk's block mask (its last download, with the filter
    /// on) into the call's statistics ([`HeadPlanes::filter_stats`]).
    fn read_mask(
        &self,
        chunk: &mut Copying<'_, B>,
        resolved: &ResolvedLoss,
        stats: &mut Option<crate::problem::filter::FilterStats>,
    ) -> Result<()> {
        let Some(len) = chunk.next_len() else {
            return Ok(());
        };
        let (b, start, rows) = (&self.backend, chunk.start, chunk.rows);
        let mut halves = vec![half::f16::ZERO; len / 2];
        chunk.read_next(bytemuck::cast_slice_mut(halves.as_mut_slice()))?;
        let Some(st) = stats.as_mut() else {
            return Ok(());
        };
        let scale = 1.0 / (f64::from(resolved.temperature) * f64::from(resolved.total));
        let weight = |r: usize| f64::from(resolved.weights[start + r]).abs() * scale;
        st.merge(&self.head.filter_stats(b, &halves, rows, st.eps, weight));
        Ok(())
    }

    /// Waits for one `head_kl` chunk's per-row outputs (loss, lse, soft,
    /// hard: `row_out` holds them interleaved) and dx, and puts them in the
    /// output, failing on the chunk's first non-finite row.
    #[allow(clippy::too_many_arguments, reason = "the outputs and their staging")]
    fn read_loss_chunk(
        &self,
        chunk: &mut Copying<'_, B>,
        [loss, lse, soft, hard]: [&mut [f32]; 4],
        row_out: &mut Vec<f32>,
        dx: &mut [f32],
        dx_padded: &mut Vec<f32>,
        trace: &mut Trace,
    ) -> Result<()> {
        let (hs, start, rows) = (self.head.hs(), chunk.start, chunk.rows);
        row_out.resize(rows * 4, 0.0);
        chunk.read_next(bytemuck::cast_slice_mut(row_out.as_mut_slice()))?;
        for (t, r) in row_out.chunks_exact(4).enumerate() {
            (loss[start + t], lse[start + t], soft[start + t], hard[start + t]) = (r[0], r[1], r[2], r[3]);
        }
        trace.mark("wait for kernels");
        if let Some(t) = loss[start..start + rows].iter().position(|l| !l.is_finite()) {
            return Err(Error::NonFiniteHidden { token: start + t });
        }
        let dx_rows = &mut dx[start * hs..(start + rows) * hs];
        if self.head.hs_padded() == hs {
            // Rows are already dense: straight into the output.
            chunk.read_next(bytemuck::cast_slice_mut(dx_rows))?;
            trace.mark("dx download");
        } else {
            dx_padded.resize(rows * self.head.hs_padded(), 0f32);
            chunk.read_next(bytemuck::cast_slice_mut(dx_padded.as_mut_slice()))?;
            trace.mark("dx download");
            for (row, padded) in dx_rows
                .chunks_exact_mut(hs)
                .zip(dx_padded.chunks_exact(self.head.hs_padded()))
            {
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
        self.head.check_hidden(hidden)?;
        self.resident.release_scratch();
        opts.check(self.head.vocab())?;
        let ntok = hidden.ntok();
        let (plan, input, rows_s) = self.begin_row_job(hidden, opts.k, opts)?;
        let result = self.topk_chunks(&plan, &input, &rows_s, ntok, opts);
        self.scratch.put_back(rows_s, None, input);
        result
    }

    /// The chunk plan and scratch of a call shaped as `topk`'s (`topk`
    /// itself, the gather): `width` values a row, `opts`' budget.
    fn begin_row_job<'a>(
        &mut self,
        hidden: &Hidden<'a>,
        width: usize,
        opts: &TopkOptions,
    ) -> Result<(ChunkPlan, Input<'a, B>, RowScratch<B>)> {
        let f32_input = matches!(hidden.data(), HiddenData::F32(_));
        let sizes = self.head.row_bytes(&self.backend, Job::Topk, width);
        let budget = (opts.budget_bytes, opts.max_rows_per_chunk);
        let plan = self
            .head
            .chunk_plan(&self.backend, Job::Topk, hidden.ntok(), width, f32_input, budget)?;
        let (input, rows) = self.scratch.begin(
            &self.backend,
            Job::Topk,
            &sizes,
            (plan.rows_per_chunk, width),
            hidden.data(),
        )?;
        Ok((plan, input, rows))
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
        let mut pipe = InFlight::new();
        let read = |mut done: Copying<'_, B>, ids: &mut [u32], probs: &mut [f32]| -> Result<()> {
            let (start, rows) = (done.start, done.rows);
            let range = start * k..(start + rows) * k;
            done.read_next(bytemuck::cast_slice_mut(&mut ids[range.clone()]))?;
            done.read_next(bytemuck::cast_slice_mut(&mut probs[range.clone()]))?;
            if let Some(t) = (0..rows).find(|&t| !probs[(start + t) * k].is_finite()) {
                return Err(Error::NonFiniteHidden { token: start + t });
            }
            // Positions in the head's order back to ids.
            if let Some(o) = self.head.order() {
                for id in &mut ids[range] {
                    *id = o.order().get(*id as usize).copied().unwrap_or(*id);
                }
            }
            Ok(())
        };
        for (chunk, Rows { start, rows }) in plan.chunk_rows(ntok, ChunkTransfers::Host).into_iter().enumerate() {
            let x16 = s.x16_for(chunk);
            self.head
                .chunk_logits(b, input, x16, (chunk, start, rows), &s.logits, Scaling::top_k(opts))?;
            let desc = TopkDesc {
                cap: opts.softcap.map(|c| c / opts.temperature),
                logprobs: opts.logprobs,
                ..TopkDesc::plain(rows, self.head.vocab(), self.head.vocab_padded(), k)
            };
            b.topk_rows(&s.logits, &s.ids, &s.probs, &desc)?;
            let bytes = rows * k * std::mem::size_of::<u32>();
            let copying = Copying::begin(b, (start, rows), &[(&s.ids, 0, bytes), (&s.probs, 0, bytes)])?;
            if let Some(done) = pipe.push(copying) {
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

/// Where a loss call's teacher comes from.
enum LossTeacher<'c, 'h, B: Backend> {
    /// A top-k file's rows, uploaded chunk by chunk.
    TopK(&'c Teacher),
    /// The teacher's hidden rows through its head: each chunk's logits at
    /// τ, the dense teacher of [`KlDesc::dense_teacher`].
    Hidden {
        head: &'c HeadPlanes<B>,
        input: &'c Input<'h, B>,
        scratch: &'c RowScratch<B>,
    },
}

/// Refuses the terms the full-vocabulary divergence
/// ([`Engine::head_kl_full_vocab`]) does not compute, naming the option as
/// the command line does: callers check before uploading anything.
pub fn check_full_vocab_terms(resolved: &ResolvedLoss) -> Result<()> {
    let t = &resolved.terms;
    let refused = [
        (t.softcap.map(|c| c.to_string()), "--softcap"),
        (t.hard_on().then(|| t.hard_weight.to_string()), "--hard-weight"),
        ((t.z_loss > 0.0).then(|| t.z_loss.to_string()), "--z-loss"),
        (resolved.filter_eps.map(|e| e.to_string()), "--filter-eps"),
    ];
    match refused
        .into_iter()
        .find_map(|(value, option)| value.map(|v| (option, v)))
    {
        Some((option, value)) => Err(Error::FullVocabUnsupported {
            option,
            value,
            hint:
                "the full-vocabulary divergence computes the soft term alone; use a top-k teacher for the other terms",
        }),
        None => Ok(()),
    }
}

/// A teacher buffer's name in the chunk plan's errors.
fn teacher_cost_name(what: &'static str) -> &'static str {
    match what {
        "x16" => "teacher x16",
        "x16 (odd chunks)" => "teacher x16 (odd chunks)",
        "x32" => "teacher x32",
        "x32 (odd chunks)" => "teacher x32 (odd chunks)",
        "logits" => "teacher logits",
        _ => "teacher row buffers",
    }
}

/// A host loss call's scratch, taken out of the engine by
/// [`Engine::begin_loss_call`] and given back by [`Engine::end_host_call`]:
/// the hidden rows' input, the row group and the loss group.
pub(crate) struct HostCall<'a, B: Backend> {
    /// The hidden rows, as the chunks read them.
    pub(crate) input: Input<'a, B>,
    /// The row group (the f16 operand, logits, teacher rows).
    pub(crate) rows: RowScratch<B>,
    /// The loss group (per-row inputs and outputs, gradient, dx).
    pub(crate) loss: LossScratch<B>,
}

/// Host-side time per phase of a call, printed to stderr when the engine's
/// trace is on.
pub(crate) struct Trace {
    job: &'static str,
    last: Option<std::time::Instant>,
    phases: Vec<(&'static str, f64)>,
}

impl Trace {
    pub(crate) fn new(job: &'static str, on: bool) -> Self {
        Self {
            job,
            last: on.then(std::time::Instant::now),
            phases: Vec::new(),
        }
    }

    /// Charges the time since the last mark to `phase`.
    pub(crate) fn mark(&mut self, phase: &'static str) {
        let Some(last) = self.last else { return };
        let now = std::time::Instant::now();
        let ms = (now - last).as_secs_f64() * 1e3;
        match self.phases.iter_mut().find(|(p, _)| *p == phase) {
            Some((_, total)) => *total += ms,
            None => self.phases.push((phase, ms)),
        }
        self.last = Some(now);
    }

    pub(crate) fn report(&self) {
        if self.last.is_none() {
            return;
        }
        let total: f64 = self.phases.iter().map(|(_, ms)| ms).sum();
        let parts: Vec<String> = self.phases.iter().map(|(p, ms)| format!("{p} {ms:.1}")).collect();
        log::info!(
            target: crate::toolkit::settings::DIAGNOSTICS_LOG_TARGET,
            "trace {}: {total:.1} ms = {}",
            self.job,
            parts.join(", ")
        );
    }
}
