//! Device-resident entry points (DESIGN §8): `head_kl` and `topk` on
//! buffers a trainer already holds on its device, recorded and submitted
//! without any host transfer or wait.
//!
//! Inputs on the device cannot be checked on the host, so the kernels
//! check them: ids are clamped (no kernel reads or writes out of bounds
//! whatever the bytes), and every bad row is flagged in a small status
//! buffer ([`status`]) that [`Engine::wait_device`] turns into the error
//! the host path gives for the same data, naming the token. A flagged row
//! also shows in the outputs at once: its dx row is 0 and its per-token
//! loss NaN ([`status::FLAGGED_ROW`] carries the flag from the teacher
//! kernel to the loss kernel and out), so a step on bad data is not finite
//! even before anyone waits.
//!
//! Per call: the stats kernel resolves `total` and `gscale` from the weights
//! on the device; per token chunk (the host path's plan and budget): the
//! caller's hidden rows into the padded f16 operand, the logits GEMMs, the
//! teacher rows checked and renormalized into scratch, the KL row kernel,
//! the dx GEMMs, and the chunk's loss and dx into the caller's buffers; at
//! the end the status kernel describes the first bad row.

mod gather;

// The resident kernels' descriptors and the status buffer's words are the
// toolkit's (a backend implements them); the entry points here use them.
pub use crate::toolkit::resident_kernels::{
    GatherRowsDesc, HiddenDtype, HiddenInDesc, LabelsInDesc, LossOutDesc, ResidentBackend, ShardRowsDesc, ShardStage,
    StatusDetailDesc, TeacherRowsDesc, TopkOutDesc, WeightStatsDesc, VIEW_ALIGN,
};
pub use crate::toolkit::status;

use crate::align::{round_up, ALIGN};
use crate::engine::head_planes::{DxFilter, HeadGrad, HeadPlanes, Scaling};
use crate::engine::scratch::{Job, LossScratch, ResidentScratch, RowBytes, RowScratch};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::problem::terms::{TailMode, TeacherForm};
use crate::problem::{check_gscale, check_k, LossConfig, TopkOptions};
use crate::toolkit::backend::{Backend, KlDesc, RowStats, TopkDesc};
use crate::toolkit::chunking::{ChunkTransfers, Rows};
use crate::toolkit::launch::{Kernels, Launch};

/// Hidden rows `[ntok][hs]` in a device buffer.
#[derive(Debug)]
pub struct DeviceHidden<'a, Buf> {
    /// The rows.
    pub buffer: &'a Buf,
    /// Their element type.
    pub dtype: HiddenDtype,
}

/// The teacher's top-k in device buffers: ids u32 and probabilities f32,
/// `[ntok][k]` each. Probabilities need not sum to 1 (they are renormalized
/// on the device).
#[derive(Debug)]
pub struct DeviceTeacher<'a, Buf> {
    /// Ids `[ntok][k]`.
    pub ids: &'a Buf,
    /// Probabilities `[ntok][k]` (or log-probabilities: `form`).
    pub probs: &'a Buf,
    /// Entries per row.
    pub k: usize,
    /// How `probs` holds its values: probabilities or log-probabilities
    /// over the full vocabulary (as [`crate::problem::Teacher::with_form`]'s).
    pub form: TeacherForm,
    /// The tail mode (as the host [`crate::problem::Teacher`]'s).
    pub tail: TailMode,
}

impl<'a, Buf> DeviceTeacher<'a, Buf> {
    /// Probabilities renormalized over the k (the default form and tail).
    pub fn new(ids: &'a Buf, probs: &'a Buf, k: usize) -> Self {
        Self {
            ids,
            probs,
            k,
            form: TeacherForm::Probs,
            tail: TailMode::Renormalize,
        }
    }
}

/// Where [`Engine::head_kl_device`] writes: the per-token loss f32 `[ntok]`
/// (unweighted `L_t`; NaN for a row the device flags) and `dx` f32
/// `[ntok][hs]` (`∂L/∂x` of the weighted mean; 0 for a flagged row).
#[derive(Debug)]
pub struct DeviceLossOutput<'a, Buf> {
    /// Per-token loss `[ntok]`.
    pub loss: &'a Buf,
    /// Gradient `[ntok][hs]`.
    pub dx: &'a Buf,
}

/// Options of [`Engine::head_kl_device`]: the call's [`LossConfig`], and
/// its weights, labels and extra outputs in device buffers.
#[derive(Debug)]
pub struct DeviceLossOptions<'a, Buf> {
    /// τ, the reduction, the terms, the budget: what every path takes (a
    /// `total` left `None` is summed on the device, and so is the default
    /// `gscale`; no filter statistics come back to the host here).
    pub config: LossConfig,
    /// Per-token weights f32 `[ntok]` on the device; `None`: all 1.
    pub weights: Option<&'a Buf>,
    /// Labels u32 `[ntok]` on the device ([`crate::problem::terms::NO_LABEL`]: none),
    /// needed when `config.terms.hard_weight > 0`. A label at or past V is
    /// flagged like bad teacher data.
    pub labels: Option<&'a Buf>,
    /// Add the gradient into `dx` instead of overwriting it.
    pub accumulate_dx: bool,
    /// Optional output: per token `[lse, soft, hard]`, f32 `[ntok][3]`
    /// (the host path's `LossOutput::{lse, soft, hard}`).
    pub terms_out: Option<&'a Buf>,
    /// The head's gradient `∂mean/∂W`, f32 `[V][hs]` on the device,
    /// overwritten (rows in id order): given, it is computed (with
    /// `config.head_grad` it must be given). It must fit in one binding
    /// (the device's `max_binding_bytes`).
    pub head_grad_out: Option<&'a Buf>,
}

impl<Buf> Default for DeviceLossOptions<'_, Buf> {
    fn default() -> Self {
        Self {
            config: LossConfig::default(),
            weights: None,
            labels: None,
            accumulate_dx: false,
            terms_out: None,
            head_grad_out: None,
        }
    }
}

impl<Buf> From<LossConfig> for DeviceLossOptions<'_, Buf> {
    /// The options of a call without weights, labels or extra outputs.
    fn from(config: LossConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }
}

/// A resident call's buffers, taken out of the engine by
/// [`Engine::begin_resident_call`] and given back by
/// [`Engine::end_resident_call`]: the status buffer, the row scratch and,
/// where `L` is [`LossScratch`], the loss group.
pub(crate) struct ResidentCall<B: Backend, L> {
    /// The status buffer the call's kernels flag rows in.
    pub(crate) status: B::Buffer,
    scratch: ResidentScratch<B>,
    /// The loss group (`()` for a call without one).
    pub(crate) loss: L,
}

impl<B: Backend, L> ResidentCall<B, L> {
    /// The row scratch.
    pub(crate) fn rows(&self) -> &RowScratch<B> {
        &self.scratch.rows
    }

    /// The call's first launch: the weights' statistics (their sum, or
    /// `total`, and the gradient's scale) into the status buffer.
    pub(crate) fn weight_stats(
        &self,
        b: &B,
        (ntok, temperature): (usize, f32),
        teacher: &DeviceTeacher<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
    ) -> Result<()> {
        // The total the reduction sets (`None`: `Σ w`, summed on the device).
        let total = opts.config.total_for(ntok)?;
        b.dispatch(Launch::WeightStats {
            // Without weights, the probabilities fill the (unread) slot.
            weights: opts.weights.unwrap_or(teacher.probs),
            status: &self.status,
            desc: WeightStatsDesc {
                rows: ntok,
                has_weights: opts.weights.is_some(),
                total,
                gscale: opts.config.gscale,
                temperature,
                grad_bound: opts.config.terms.grad_bound(temperature),
            },
        })
    }

    /// The call's last launch: the first bad row's detail into the status
    /// buffer, for [`Engine::wait_device`]. `labels`, where given, are
    /// checked too.
    pub(crate) fn status_detail(
        &self,
        b: &B,
        ntok: usize,
        teacher: &DeviceTeacher<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
        labels: Option<&B::Buffer>,
    ) -> Result<()> {
        b.dispatch(Launch::StatusDetail {
            ids: teacher.ids,
            probs: teacher.probs,
            weights: opts.weights.unwrap_or(teacher.probs),
            status: &self.status,
            // Unread without labels: a buffer already at hand.
            labels: labels.unwrap_or(teacher.ids),
            desc: StatusDetailDesc {
                rows: ntok,
                k: teacher.k,
                has_weights: opts.weights.is_some(),
                form: teacher.form,
                tail: teacher.tail,
                has_labels: labels.is_some(),
            },
        })
    }
}

impl<B: Backend> ResidentCall<B, LossScratch<B>> {
    /// Chunk `[start, start + rows)`'s loss and dx (rows of `hs`, `ld`
    /// apart in the chunk) into the caller's outputs, and with
    /// `opts.terms_out` its terms.
    pub(crate) fn loss_out(
        &self,
        b: &B,
        (start, rows): (usize, usize),
        (hs, ld): (usize, usize),
        out: &DeviceLossOutput<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
    ) -> Result<()> {
        b.dispatch(Launch::LossOut {
            loss_chunk: &self.loss.loss,
            dx_chunk: &self.loss.dx,
            status: &self.status,
            loss: out.loss,
            dx: out.dx,
            // Unread without terms: a buffer already at hand.
            terms: opts.terms_out.unwrap_or(&self.rows().probs),
            desc: LossOutDesc {
                rows,
                hs,
                ld,
                token0: start,
                loss_offset: start,
                dx_offset: elements("dx", start, hs)?,
                accumulate: opts.accumulate_dx,
                write_terms: opts.terms_out.is_some(),
            },
        })
    }

    /// Chunk `[start, start + rows)`'s teacher rows, checked into the
    /// scratch (ids against a head of `vocab` rows) and their weights into
    /// the loss group's per-row input.
    pub(crate) fn teacher_rows(
        &self,
        b: &B,
        (start, rows, vocab): (usize, usize, usize),
        teacher: &DeviceTeacher<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
    ) -> Result<()> {
        let first_entry = elements("ids", start, teacher.k)?;
        let s = self.rows();
        b.dispatch(Launch::TeacherRows {
            ids: teacher.ids,
            probs: teacher.probs,
            weights: opts.weights.unwrap_or(teacher.probs),
            status: &self.status,
            ids_out: &s.ids,
            probs_out: &s.probs,
            row_in: &self.loss.row_in,
            desc: TeacherRowsDesc {
                rows,
                k: teacher.k,
                vocab,
                token0: start,
                ids_offset: first_entry,
                probs_offset: first_entry,
                weights_offset: start,
                has_weights: opts.weights.is_some(),
                form: teacher.form,
                tail: teacher.tail,
            },
        })
    }
}

/// What a resident call takes beside its rows: nothing, or the loss group.
pub(crate) trait CallLoss<B: ResidentBackend>: Sized {
    /// Takes it out of `scratch` (or makes it from the scratch's sizes).
    fn take(engine: &Engine<B>, scratch: &mut ResidentScratch<B>) -> Result<Self>;
    /// What goes back into the scratch.
    fn kept(self) -> Option<LossScratch<B>>;
}

impl<B: ResidentBackend> CallLoss<B> for () {
    fn take(_: &Engine<B>, _: &mut ResidentScratch<B>) -> Result<Self> {
        Ok(())
    }
    fn kept(self) -> Option<LossScratch<B>> {
        None
    }
}

impl<B: ResidentBackend> CallLoss<B> for LossScratch<B> {
    fn take(engine: &Engine<B>, scratch: &mut ResidentScratch<B>) -> Result<Self> {
        match scratch.loss.take() {
            Some(ls) => Ok(ls),
            None => {
                let (job, rows, k) = scratch.key;
                LossScratch::alloc(&engine.backend, &engine.resident_row_bytes(job, k), rows)
            }
        }
    }
    fn kept(self) -> Option<LossScratch<B>> {
        Some(self)
    }
}

pub(crate) fn u32_extent(field: &'static str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::DeviceBuffer {
        field,
        reason: format!("{n} elements: the kernels index with u32"),
    })
}

/// `a · b`, or the error of a shape too large to index.
pub(crate) fn elements(field: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| Error::DeviceBuffer {
        field,
        reason: format!("{a} × {b} elements overflow"),
    })
}

impl<B: ResidentBackend> Engine<B> {
    /// Checked mode: every resident call waits for the device and returns
    /// its error at once (for debugging; a trainer normally waits once per
    /// step with [`Engine::wait_device`]).
    pub fn set_checked(&mut self, on: bool) {
        self.resident.checked = on;
    }

    /// Waits for the device and reports the first bad row any resident
    /// call flagged since the last wait, as the typed error the host path
    /// gives for the same data (naming the token; the first bad row in the
    /// host's order of checks). Clears the status.
    ///
    /// A trainer need not wait before its optimizer step to notice bad
    /// data: each row this reports (a bad teacher row, weight or label, and
    /// every row when `total` was not positive) already has a NaN
    /// per-token loss and a zero dx row in the call's outputs (see
    /// [`Self::head_kl_device`]), so the step's mean loss is NaN. This
    /// still names the row, with the same error as without those NaNs: a
    /// flagged row's NaN loss is not reported as non-finite logits.
    pub fn wait_device(&mut self) -> Result<()> {
        self.wait_device_for(self.head.vocab())
    }

    /// [`Self::wait_device`], naming `vocab` as the head's rows in its
    /// errors (a vocabulary shard's engine checks ids against the whole
    /// head).
    pub(crate) fn wait_device_for(&mut self, vocab: usize) -> Result<()> {
        self.backend.finish()?;
        let Some(status) = &self.resident.status else {
            return Ok(());
        };
        if !self.resident.pending {
            return Ok(());
        }
        let mut words = [0u32; status::WORDS];
        self.backend.download(status, 0, bytemuck::cast_slice_mut(&mut words))?;
        self.backend
            .upload(status, 0, bytemuck::cast_slice(&status::cleared()))?;
        self.resident.pending = false;
        status::to_result(&words, vocab)
    }

    /// The device-resident entry points take and give ids in device
    /// buffers, which nothing maps through a vocabulary order.
    fn refuse_vocab_order(&self) -> Result<()> {
        match self.head.order() {
            Some(_) => Err(Error::VocabOrderUnsupported {
                reason: "the device-resident entry points read and write ids in device buffers, which are not \
                         mapped through it; use the host path or an engine in the natural order",
            }),
            None => Ok(()),
        }
    }

    /// Checks a caller's view: `elems` elements of 4 bytes (or
    /// `elem_bytes`) fit, and it starts where a binding may.
    pub(crate) fn check_view(
        &self,
        field: &'static str,
        buffer: &B::Buffer,
        elems: usize,
        elem_bytes: usize,
    ) -> Result<()> {
        let bytes = elements(field, elems, elem_bytes)?;
        let len = self.backend.buffer_len(buffer);
        if u64::try_from(bytes).map_or(true, |b| len < b) {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!("{len} bytes, the shape needs {bytes}"),
            });
        }
        if !self.backend.buffer_offset(buffer).is_multiple_of(VIEW_ALIGN) {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!(
                    "starts at byte {} of its buffer; a view must start at a multiple of {VIEW_ALIGN}",
                    self.backend.buffer_offset(buffer)
                ),
            });
        }
        Ok(())
    }

    /// The status buffer, taken out of the engine for a call (made the
    /// first time).
    fn take_status(&mut self) -> Result<B::Buffer> {
        if let Some(b) = self.resident.status.take() {
            return Ok(b);
        }
        let b = self.backend.alloc((status::WORDS * 4) as u64, "status")?;
        self.backend.upload(&b, 0, bytemuck::cast_slice(&status::cleared()))?;
        Ok(b)
    }

    /// The host path's row sizes without its second (odd-chunk) buffers:
    /// nothing crosses to the host here, so there is no copy to overlap.
    pub(crate) fn resident_row_bytes(&self, job: Job, k: usize) -> RowBytes {
        RowBytes {
            doubled: false,
            ..self.head.row_bytes(&self.backend, job, k)
        }
    }

    /// Begins a resident call: takes the status buffer and the scratch of
    /// `job` for chunks of `rows` rows of `k` entries out of the engine
    /// (the host path's row group from the chunk plan's sizes, freeing
    /// scratch made for another key first; with `L` = [`LossScratch`],
    /// `head_kl_device`'s own group too) and marks work in flight for
    /// [`Engine::wait_device`]. [`Self::end_resident_call`] gives them back.
    pub(crate) fn begin_resident_call<L: CallLoss<B>>(
        &mut self,
        (job, rows, k): (Job, usize, usize),
    ) -> Result<ResidentCall<B, L>> {
        let key = (job, rows, k);
        let status = self.take_status()?;
        let mut scratch = match self.resident.scratch.take() {
            Some(s) if s.key == key => s,
            _ => {
                self.release_scratch();
                match RowScratch::alloc(&self.backend, &self.resident_row_bytes(job, k), rows, false) {
                    Ok(rows) => ResidentScratch { key, rows, loss: None },
                    Err(e) => {
                        self.resident.status = Some(status);
                        return Err(e);
                    }
                }
            }
        };
        let loss = match L::take(self, &mut scratch) {
            Ok(loss) => loss,
            Err(e) => {
                self.resident.status = Some(status);
                self.resident.scratch = Some(scratch);
                return Err(e);
            }
        };
        self.resident.pending = true;
        Ok(ResidentCall { status, scratch, loss })
    }

    /// Ends a resident call: keeps its status buffer and scratch for the
    /// next call, whether or not its recording succeeded (`recorded`,
    /// passed on).
    pub(crate) fn end_resident_call<T, L: CallLoss<B>>(
        &mut self,
        call: ResidentCall<B, L>,
        recorded: Result<T>,
    ) -> Result<T> {
        let ResidentCall {
            status,
            mut scratch,
            loss,
        } = call;
        if let Some(ls) = loss.kept() {
            scratch.loss = Some(ls);
        }
        self.resident.status = Some(status);
        self.resident.scratch = Some(scratch);
        recorded
    }

    /// Records the caller's rows `[start, start + rows)` into the padded f16
    /// operand and the logits GEMMs into the scratch's logits.
    fn resident_logits(
        &self,
        s: &RowScratch<B>,
        hidden: &DeviceHidden<'_, B::Buffer>,
        (start, rows): (usize, usize),
        scaling: Scaling,
        row_stats: Option<RowStats>,
    ) -> Result<()> {
        self.resident_logits_into((&s.x16, &s.logits), hidden, (start, rows), scaling, row_stats)
    }

    /// [`Self::resident_logits`] into `logits` (a shard's kept buffer).
    pub(crate) fn resident_logits_into(
        &self,
        (x16, logits): (&B::Buffer, &B::Buffer),
        hidden: &DeviceHidden<'_, B::Buffer>,
        (start, rows): (usize, usize),
        scaling: Scaling,
        row_stats: Option<RowStats>,
    ) -> Result<()> {
        let rows_padded = round_up(rows, ALIGN);
        self.backend.dispatch(Launch::HiddenIn {
            src: hidden.buffer,
            dst: x16,
            desc: HiddenInDesc {
                rows,
                cols: self.head.hs(),
                ld: self.head.hs_padded(),
                rows_padded,
                src_offset: elements("hidden", start, self.head.hs())?,
                dtype: hidden.dtype,
            },
        })?;
        self.head
            .logits(&self.backend, x16, logits, rows_padded, scaling, row_stats)
    }

    /// The checks a top-k-shaped call (`topk_device`, `logprobs_at_device`)
    /// makes before its outputs': the options, the hidden rows and the
    /// `ids` view of `[ntok][k]` u32; the number of entries.
    pub(crate) fn check_topk_call(
        &self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        ids: &B::Buffer,
        opts: &TopkOptions,
    ) -> Result<usize> {
        self.refuse_vocab_order()?;
        opts.check(self.head.vocab())?;
        self.check_resident_hidden(ntok, hidden)?;
        let entries = elements("ids", ntok, opts.k)?;
        u32_extent("ids", entries)?;
        self.check_view("ids", ids, entries, 4)?;
        Ok(entries)
    }

    pub(crate) fn check_resident_hidden(&self, ntok: usize, hidden: &DeviceHidden<'_, B::Buffer>) -> Result<()> {
        if ntok == 0 {
            return Err(Error::NoTokens);
        }
        let elems = elements("hidden", ntok, self.head.hs())?;
        u32_extent("hidden", elems)?;
        self.check_view("hidden", hidden.buffer, elems, hidden.dtype.bytes())
    }

    /// The checks every device-resident loss call makes before recording
    /// (this engine's and a resident shard's phases): the hidden rows, the
    /// teacher's ids and probabilities, the weights, and the options the
    /// host path checks, in its order. `k` is the caller's to check.
    pub(crate) fn check_resident_loss_inputs(
        &self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        teacher: &DeviceTeacher<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
    ) -> Result<()> {
        self.check_resident_hidden(ntok, hidden)?;
        let entries = elements("ids", ntok, teacher.k)?;
        u32_extent("ids", entries)?;
        self.check_view("ids", teacher.ids, entries, 4)?;
        self.check_view("probs", teacher.probs, entries, 4)?;
        if let Some(w) = opts.weights {
            self.check_view("weights", w, ntok, 4)?;
        }
        opts.config.check(opts.labels.is_some())?;
        opts.config.total_for(ntok)?;
        opts.config.gscale.map(check_gscale).transpose()?;
        Ok(())
    }

    /// [`Engine::head_kl`] on device buffers (DESIGN §8): reads `ntok`
    /// hidden rows and the teacher's ids and probabilities from `hidden` and
    /// `teacher`, writes the per-token loss and `dx` into `out` (overwritten,
    /// or accumulated into with `opts.accumulate_dx`). Records the work and
    /// submits it; nothing is copied to or from the host and nothing waits.
    /// [`Engine::wait_device`] waits and reports bad data (an id out of range
    /// or repeated, a probability negative or not finite, a row summing to
    /// 0, a bad weight, a bad label, `total` not positive, non-finite
    /// logits) as the host path's error naming the token.
    ///
    /// Bad data also shows in `out` without a wait. A row the device flags
    /// (a bad teacher row, a weight negative or not finite, a label past V;
    /// every row when `total` is not positive, e.g. all weights 0):
    /// - contributes nothing to the gradient: its `dx` row is exactly 0
    ///   (with `opts.accumulate_dx`, nothing is added to it), whatever its
    ///   logits;
    /// - has a NaN per-token loss in `out.loss` (and NaN lse, soft and hard
    ///   in `opts.terms_out`), so any mean over the call's losses is NaN:
    ///   the step is visibly not finite before the trainer waits.
    ///
    /// The other rows are unaffected: bit for bit what the same call gives
    /// with each flagged row's teacher row or label replaced by a good one
    /// and a bad weight by 0 (so `total` and `gscale` stay as they are: a
    /// flagged teacher row's weight still counts in the default `total`);
    /// with `opts.config.filter_eps`, their dx may differ from that call's by
    /// products the filter skips (DESIGN §5), the loss does not. A row whose
    /// logits are not finite (and that is not flagged) has a NaN loss and,
    /// as on the host path, unspecified dx.
    ///
    /// Shapes, options and buffer sizes are checked here, before anything is
    /// recorded.
    ///
    /// ```
    /// use headkl_core::*;
    /// use headkl_reference::CpuBackend;
    ///
    /// let (vocab, hs, ntok, k) = (300, 24, 5, 4);
    /// let w: Vec<f32> = (0..vocab * hs).map(|i| ((i * 7 % 13) as f32 - 6.0) / 16.0).collect();
    /// let mut engine = Engine::new(CpuBackend::new(), &HeadWeights::new(HeadData::F32(&w), vocab, hs)?, SliceOptions::default())?;
    /// // Buffers the trainer already holds on its device.
    /// let b = engine.backend();
    /// let buffer = |bytes: &[u8]| -> Result<_> { let x = b.alloc(bytes.len() as u64, "trainer")?; b.upload(&x, 0, bytes)?; Ok(x) };
    /// let x: Vec<f32> = (0..ntok * hs).map(|i| ((i * 5 % 11) as f32 - 5.0) / 8.0).collect();
    /// let ids: Vec<u32> = (0..ntok * k).map(|i| (i * 31 % vocab) as u32).collect();
    /// let x = buffer(bytemuck::cast_slice(&x))?;
    /// let ids = buffer(bytemuck::cast_slice(&ids))?;
    /// let probs = buffer(bytemuck::cast_slice(&vec![3.0f32; ntok * k]))?; // renormalized on the device
    /// let (loss, dx) = (buffer(&vec![0; ntok * 4])?, buffer(&vec![0; ntok * hs * 4])?);
    /// engine.head_kl_device(
    ///     ntok,
    ///     &DeviceHidden { buffer: &x, dtype: HiddenDtype::F32 },
    ///     &DeviceTeacher::new(&ids, &probs, k),
    ///     &DeviceLossOutput { loss: &loss, dx: &dx },
    ///     &DeviceLossOptions::default(),
    /// )?;
    /// engine.wait_device()?; // the trainer waits when it chooses
    /// let mut per_token = vec![0f32; ntok];
    /// engine.backend().download(&loss, 0, bytemuck::cast_slice_mut(&mut per_token))?;
    /// assert!(per_token.iter().all(|l| l.is_finite() && *l >= 0.0));
    /// # Ok::<(), headkl_core::Error>(())
    /// ```
    pub fn head_kl_device(
        &mut self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        teacher: &DeviceTeacher<'_, B::Buffer>,
        out: &DeviceLossOutput<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
    ) -> Result<()> {
        self.refuse_vocab_order()?;
        let k = teacher.k;
        check_k(k, self.head.vocab())?;
        self.check_resident_loss_inputs(ntok, hidden, teacher, opts)?;
        self.check_view("loss", out.loss, ntok, 4)?;
        self.check_view("dx", out.dx, elements("dx", ntok, self.head.hs())?, 4)?;
        if let Some(l) = opts.labels {
            self.check_view("labels", l, ntok, 4)?;
        }
        if let Some(t) = opts.terms_out {
            self.check_view("terms_out", t, elements("terms_out", ntok, 3)?, 4)?;
        }
        let head_grad_out = self.check_head_grad_out(opts)?;
        let job = Job::loss(self.filter_eps(opts.config.filter_eps));
        // Planned as the host call plans (its odd-chunk buffers budgeted,
        // though none is allocated here), so both calls run the same GEMM
        // shapes: at shape A that is 1024 rows a chunk, not 1408, whose dx
        // GEMM cuBLASLt ran 1.3–2.5 ms slower a call, and 1.45 GiB of
        // scratch, not 1.99 (docs/PERFORMANCE.md, row 67).
        let plan = HeadPlanes::plan_for(
            &self.backend,
            &self.head.row_bytes(&self.backend, job, k),
            job,
            ntok,
            false,
            (opts.config.budget_bytes, opts.config.max_rows_per_chunk),
        )?;
        let call: ResidentCall<B, LossScratch<B>> = self.begin_resident_call((job, plan.rows_per_chunk, k))?;
        // The gradient built in the caller's buffer where the backend can
        // (no pieces of our own to keep), else in pieces kept for the next
        // call.
        let head_grad = match head_grad_out {
            // A block mask follows a chunk's gradient rows with the filter:
            // those rows cannot be parked back to back in `dst`.
            Some(dst) => match HeadGrad::in_output(
                &self.backend,
                &self.head,
                dst,
                (ntok, self.backend.buffer_len(&call.rows().logits)),
                self.filter_eps(opts.config.filter_eps).is_none(),
            ) {
                Some(in_output) => {
                    self.drop_head_grad();
                    Some((in_output, dst, false))
                }
                None => match self.take_head_grad(true) {
                    Ok(pieces) => pieces.map(|p| (p, dst, true)),
                    Err(e) => return self.end_resident_call(call, Err(e)),
                },
            },
            None => None,
        };
        let grad = head_grad.as_ref().map(|(pieces, dst, _)| (pieces, *dst));
        let recorded = self.record_head_kl(ntok, (hidden, teacher), out, opts, &plan, &call, grad);
        if let Some((pieces, _, true)) = head_grad {
            self.keep_head_grad(pieces);
        }
        self.end_resident_call(call, recorded)?;
        if self.resident.checked {
            self.wait_device()?;
        }
        Ok(())
    }

    /// `opts.head_grad_out`, checked, when given (it asks for the head's
    /// gradient, as `opts.config.head_grad` does); an error where the
    /// config asks for it without a buffer.
    fn check_head_grad_out<'o>(&self, opts: &DeviceLossOptions<'o, B::Buffer>) -> Result<Option<&'o B::Buffer>> {
        match (opts.config.head_grad, opts.head_grad_out) {
            (false, None) => Ok(None),
            (_, Some(dst)) => {
                let (vocab, hs) = (self.head.vocab(), self.head.hs());
                self.check_view("head_grad_out", dst, elements("head_grad_out", vocab, hs)?, 4)?;
                HeadGrad::fits_out(&self.backend, (vocab * hs * 4) as u64, dst)?;
                Ok(Some(dst))
            }
            (true, None) => Err(Error::HeadGradUnsupported {
                entry: "the device-resident loss without an output buffer",
                hint: "give DeviceLossOptions::head_grad_out, f32 [V][hs]",
            }),
        }
    }

    /// Records [`Engine::head_kl_device`]'s kernels (its checks done) and
    /// submits them; with `head_grad`, the head's gradient built in its
    /// pieces and copied into the caller's buffer.
    #[allow(clippy::too_many_arguments, reason = "the call's inputs and the scratch it took")]
    fn record_head_kl(
        &self,
        ntok: usize,
        (hidden, teacher): (&DeviceHidden<'_, B::Buffer>, &DeviceTeacher<'_, B::Buffer>),
        out: &DeviceLossOutput<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
        plan: &crate::toolkit::chunking::ChunkPlan,
        call: &ResidentCall<B, LossScratch<B>>,
        head_grad: Option<(&HeadGrad<B>, &B::Buffer)>,
    ) -> Result<()> {
        let (k, b) = (teacher.k, &self.backend);
        let (status, s, ls) = (&call.status, call.rows(), &call.loss);
        call.weight_stats(b, (ntok, opts.config.temperature), teacher, opts)?;
        // Labels are checked whenever given (as the host path does); the KL
        // kernel reads them only with the hard term on.
        let labels = opts.labels;
        // Unread slots get a buffer already at hand.
        let labels_buf = labels.unwrap_or(teacher.ids);
        let scaling = Scaling::resident_loss(opts.config.temperature, opts.config.terms.logit_scale);
        let chunks = plan.chunk_rows(ntok, ChunkTransfers::Resident);
        // Where the gradient's rows are parked, dx of the chunks up to the
        // last boundary on a multiple of ALIGN rows waits for one GEMM
        // over them all (a GEMM's rows come in multiples of ALIGN); the
        // chunks after it run their own.
        let deferrable_rows = chunks
            .iter()
            .map(|r| r.start + r.rows)
            .filter(|end| end % ALIGN == 0)
            .max()
            .unwrap_or(0);
        for (chunk, Rows { start, rows }) in chunks.into_iter().enumerate() {
            let rows_padded = round_up(rows, ALIGN);
            let row_stats = self.row_stats_for(&opts.config.terms, opts.config.temperature, rows_padded);
            self.resident_logits(s, hidden, (start, rows), scaling, row_stats)?;
            call.teacher_rows(b, (start, rows, self.head.vocab()), teacher, opts)?;
            b.dispatch(Launch::LabelsIn {
                labels: labels_buf,
                status,
                row_in: &ls.row_in,
                desc: LabelsInDesc {
                    rows,
                    vocab: self.head.vocab(),
                    token0: start,
                    labels_offset: start,
                    has_labels: labels.is_some(),
                },
            })?;
            let kl = KlDesc {
                temperature: opts.config.temperature,
                tail: teacher.tail,
                terms: opts.config.terms,
                row_stats,
                filter: self
                    .head
                    .kl_filter(self.filter_eps(opts.config.filter_eps), rows_padded),
                ..KlDesc::plain(rows, self.head.vocab(), self.head.vocab_padded(), k)
            };
            // The gradient's rows parked in the head's gradient output.
            let parked = match head_grad {
                Some((pieces, dst)) => pieces.chunk_grad(b, dst, (start, rows_padded))?,
                None => None,
            };
            let grad = parked.as_ref().unwrap_or(&ls.grad);
            b.kl_rows(&s.logits, &s.ids, &s.probs, &ls.row_in, &ls.loss, grad, &kl)?;
            let dx_deferred = parked.is_some() && start + rows <= deferrable_rows;
            if !dx_deferred {
                // Scaled by 1/(gscale·τ) in loss_out: gscale may come from
                // the device.
                let dx_filter = kl.filter.map(|_| DxFilter { mask_rows: rows });
                self.head
                    .dx(b, (grad, &ls.dx, &s.logits), rows_padded, scaling, dx_filter)?;
            }
            if let Some((pieces, dst)) = head_grad {
                let buffers = (grad, &s.x16, &s.logits);
                let at = (start, rows, rows_padded);
                pieces.add_resident_chunk(b, &self.head, buffers, at, scaling, chunk > 0, (dst, status))?;
            }
            // No dx to write out (hs 0) where the deferred GEMM writes it.
            let hs = if dx_deferred { 0 } else { self.head.hs() };
            call.loss_out(b, (start, rows), (hs, self.head.hs_padded()), out, opts)?;
        }
        if let Some((pieces, dst)) = head_grad {
            // Every chunk's rows are parked, or none.
            if let Some(parked) = pieces.parked_grad(b, dst)?.filter(|_| deferrable_rows > 0) {
                let dx_out = (&parked, out.dx, status);
                self.head
                    .dx_scaled_by_word(b, dx_out, deferrable_rows, scaling, opts.accumulate_dx)?;
            }
            pieces.write_out(b, &self.head, (&call.status, dst, &s.logits), scaling)?;
        }
        call.status_detail(b, ntok, teacher, opts, labels)?;
        b.submit()
    }

    /// [`Engine::topk`] on device buffers: reads `ntok` hidden rows from
    /// `hidden`, writes ids u32 and probabilities f32 `[ntok][k]` into
    /// `ids` and `probs` (with [`TopkOptions::logprobs`], the
    /// log-probabilities over the full vocabulary at τ instead, as the
    /// host path's `TopK::logprobs`). Records and submits without waiting;
    /// [`Engine::wait_device`] reports a row whose logits were not finite.
    pub fn topk_device(
        &mut self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        ids: &B::Buffer,
        probs: &B::Buffer,
        opts: &TopkOptions,
    ) -> Result<()> {
        let entries = self.check_topk_call(ntok, hidden, ids, opts)?;
        self.check_view("probs", probs, entries, 4)?;
        self.resident_row_call((ntok, opts.k), opts, |e, plan, scratch| {
            e.record_topk(ntok, hidden, (ids, probs), opts, plan, scratch)
        })
    }

    /// A resident call shaped as `topk`'s (`topk_device`, the gather's
    /// `logprobs_at_device`), its checks done: plans `ntok` rows of `width`
    /// columns within `opts`' budget, takes the status and row scratch,
    /// marks the call pending, has `record` record and submit, puts the
    /// scratch back whatever it returned, and in checked mode waits.
    pub(crate) fn resident_row_call(
        &mut self,
        (ntok, width): (usize, usize),
        opts: &TopkOptions,
        record: impl FnOnce(&Self, &crate::toolkit::chunking::ChunkPlan, (&B::Buffer, &RowScratch<B>)) -> Result<()>,
    ) -> Result<()> {
        let plan = HeadPlanes::plan_for(
            &self.backend,
            &self.resident_row_bytes(Job::Topk, width),
            Job::Topk,
            ntok,
            false,
            (opts.budget_bytes, opts.max_rows_per_chunk),
        )?;
        let call: ResidentCall<B, ()> = self.begin_resident_call((Job::Topk, plan.rows_per_chunk, width))?;
        let recorded = record(self, &plan, (&call.status, call.rows()));
        self.end_resident_call(call, recorded)?;
        if self.resident.checked {
            self.wait_device()?;
        }
        Ok(())
    }

    /// Records [`Engine::topk_device`]'s kernels (its checks done) and
    /// submits them.
    fn record_topk(
        &self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        (ids, probs): (&B::Buffer, &B::Buffer),
        opts: &TopkOptions,
        plan: &crate::toolkit::chunking::ChunkPlan,
        (status, s): (&B::Buffer, &RowScratch<B>),
    ) -> Result<()> {
        let k = opts.k;
        for Rows { start, rows } in plan.chunk_rows(ntok, ChunkTransfers::Resident) {
            self.resident_logits(s, hidden, (start, rows), Scaling::top_k(opts), None)?;
            // As the host path's: the softcap at τ, and log-probabilities
            // over the full vocabulary where asked for.
            let desc = TopkDesc {
                cap: opts.softcap.map(|c| c / opts.temperature),
                logprobs: opts.logprobs,
                ..TopkDesc::plain(rows, self.head.vocab(), self.head.vocab_padded(), k)
            };
            self.backend.topk_rows(&s.logits, &s.ids, &s.probs, &desc)?;
            let first_entry = elements("ids", start, k)?;
            self.backend.dispatch(Launch::TopkOut {
                ids_chunk: &s.ids,
                probs_chunk: &s.probs,
                status,
                ids,
                probs,
                desc: TopkOutDesc {
                    rows,
                    k,
                    token0: start,
                    ids_offset: first_entry,
                    probs_offset: first_entry,
                },
            })?;
        }
        self.backend.submit()
    }
}
