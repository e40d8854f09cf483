//! Device-resident entry points (DESIGN §8): `head_kl` and `topk` on
//! buffers a trainer already holds on its device, recorded and submitted
//! without any host transfer or wait.
//!
//! Inputs on the device cannot be checked on the host, so the kernels
//! check them: ids are clamped (no kernel reads or writes out of bounds
//! whatever the bytes), and every bad row is flagged in a small status
//! buffer ([`status`]) that [`Engine::wait_device`] turns into the error
//! the host path gives for the same data, naming the token.
//!
//! Per call: the stats kernel resolves `total` and `gscale` from the weights
//! on the device; per token chunk (the host path's plan and budget): the
//! caller's hidden rows into the padded f16 operand, the logits GEMMs, the
//! teacher rows checked and renormalized into scratch, the KL row kernel,
//! the dx GEMMs, and the chunk's loss and dx into the caller's buffers; at
//! the end the status kernel describes the first bad row.

mod kernels;
pub mod status;

pub use kernels::{ResidentBackend, ResidentKernel};

use crate::backend::{Backend, KlDesc, TopkDesc};
use crate::driver::Engine;
use crate::error::{Error, Result};
use crate::launch::Kernels;
use crate::params::ResidentParams;
use crate::problem::{check_k, TopkOptions, DEFAULT_BUDGET_BYTES};
use crate::scratch::Job;
use crate::terms::{LossTerms, TailMode, TeacherForm};
use crate::{round_up, ALIGN};

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

    fn code(self) -> u32 {
        match self {
            HiddenDtype::F32 => 0,
            HiddenDtype::F16 => 1,
            HiddenDtype::Bf16 => 2,
        }
    }
}

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
    /// Probabilities `[ntok][k]`.
    pub probs: &'a Buf,
    /// Entries per row.
    pub k: usize,
}

/// Where [`Engine::head_kl_device`] writes: the per-token loss f32 `[ntok]`
/// (unweighted `L_t`) and `dx` f32 `[ntok][hs]` (`∂L/∂x` of the weighted
/// mean).
#[derive(Debug)]
pub struct DeviceLossOutput<'a, Buf> {
    /// Per-token loss `[ntok]`.
    pub loss: &'a Buf,
    /// Gradient `[ntok][hs]`.
    pub dx: &'a Buf,
}

/// Options of [`Engine::head_kl_device`].
#[derive(Debug)]
pub struct DeviceLossOptions<'a, Buf> {
    /// Temperature τ (default 1).
    pub temperature: f32,
    /// Per-token weights f32 `[ntok]` on the device; `None`: all 1.
    pub weights: Option<&'a Buf>,
    /// The weight the step averages over; `None`: `Σ w_t`, summed on the
    /// device.
    pub total: Option<f32>,
    /// Scale of the f16 gradient; `None`: `2^14 · total / max_t w_t`, on
    /// the device.
    pub gscale: Option<f32>,
    /// Add the gradient into `dx` instead of overwriting it.
    pub accumulate_dx: bool,
    /// Device-memory budget for scratch buffers, in bytes.
    pub budget_bytes: u64,
    /// Test knob: at most this many tokens per chunk.
    pub max_rows_per_chunk: Option<usize>,
    /// How the teacher's `probs` buffer holds its values: probabilities
    /// (default) or log-probabilities over the full vocabulary.
    pub teacher_form: TeacherForm,
    /// The teacher's tail mode (default: renormalized over the k).
    pub tail: TailMode,
    /// The loss terms (the same [`LossTerms`] and checks as the host path).
    pub terms: LossTerms,
    /// Labels u32 `[ntok]` on the device ([`crate::NO_LABEL`]: none),
    /// needed when `terms.hard_weight > 0`. A label at or past V is flagged
    /// like bad teacher data.
    pub labels: Option<&'a Buf>,
    /// Optional output: per token `[lse, soft, hard]`, f32 `[ntok][3]`
    /// (the host path's `LossOutput::{lse, soft, hard}`).
    pub terms_out: Option<&'a Buf>,
}

impl<Buf> Default for DeviceLossOptions<'_, Buf> {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            weights: None,
            total: None,
            gscale: None,
            accumulate_dx: false,
            budget_bytes: DEFAULT_BUDGET_BYTES,
            max_rows_per_chunk: None,
            teacher_form: TeacherForm::Probs,
            tail: TailMode::Renormalize,
            terms: LossTerms::default(),
            labels: None,
            terms_out: None,
        }
    }
}

/// Scratch of the resident entry points for one chunk, kept across calls.
pub(crate) struct ResidentScratch<B: Backend> {
    job: Job,
    rows: usize,
    k: usize,
    x16: B::Buffer,
    logits: B::Buffer,
    ids: B::Buffer,
    probs: B::Buffer,
    // head_kl only
    loss_buffers: Option<LossScratch<B>>,
}

struct LossScratch<B: Backend> {
    /// The KL kernel's per-row inputs `[rows][2]`: coefficient, label.
    row_in: B::Buffer,
    loss: B::Buffer,
    grad: B::Buffer,
    dx: B::Buffer,
}

/// What an [`Engine`] keeps for the resident entry points: scratch, the
/// status buffer, and whether work is in flight since the last wait.
pub(crate) struct ResidentState<B: Backend> {
    scratch: Option<ResidentScratch<B>>,
    status: Option<B::Buffer>,
    pending: bool,
    checked: bool,
}

impl<B: Backend> ResidentState<B> {
    pub(crate) fn new() -> Self {
        Self {
            scratch: None,
            status: None,
            pending: false,
            checked: false,
        }
    }

    pub(crate) fn release_scratch(&mut self) {
        self.scratch = None;
    }
}

fn u32_extent(field: &'static str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::DeviceBuffer {
        field,
        reason: format!("{n} elements: the kernels index with u32"),
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
    /// gives for the same data (naming the token). Clears the status.
    pub fn wait_device(&mut self) -> Result<()> {
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
        status::to_result(&words, self.vocab)
    }

    fn check_view(&self, field: &'static str, buffer: &B::Buffer, bytes: usize) -> Result<()> {
        let len = self.backend.buffer_len(buffer);
        if len < bytes as u64 {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!("{len} bytes, the shape needs {bytes}"),
            });
        }
        if !self.backend.buffer_offset(buffer).is_multiple_of(256) {
            return Err(Error::DeviceBuffer {
                field,
                reason: format!(
                    "starts at byte {} of its buffer; a view must start at a multiple of 256",
                    self.backend.buffer_offset(buffer)
                ),
            });
        }
        Ok(())
    }

    fn ensure_status(&mut self) -> Result<()> {
        if self.resident.status.is_none() {
            let b = self.backend.alloc((status::WORDS * 4) as u64, "status")?;
            self.backend.upload(&b, 0, bytemuck::cast_slice(&status::cleared()))?;
            self.resident.status = Some(b);
        }
        Ok(())
    }

    fn ensure_resident_scratch(&mut self, job: Job, rows: usize, k: usize) -> Result<()> {
        if let Some(s) = &self.resident.scratch {
            if s.job == job && s.rows == rows && s.k == k {
                return Ok(());
            }
        }
        self.release_scratch();
        let b = &self.backend;
        let (v, h, r, k64) = (self.vocab_padded as u64, self.hs_padded as u64, rows as u64, k as u64);
        // The logits hold the dx GEMM's split-K partials too (as the
        // host path's do), so they take the chunk plan's size.
        let logits_row = self.row_bytes(job, k).logits;
        let x16 = b.alloc(r * h * 2, "x16")?;
        let logits = b.alloc(r * logits_row, "logits")?;
        let ids = b.alloc(r * k64 * 4, "ids")?;
        let probs = b.alloc(r * k64 * 4, "probs")?;
        let loss_buffers = if job == Job::Loss {
            Some(LossScratch {
                row_in: b.alloc(r * 8, "row_in")?,
                loss: b.alloc(r * 16, "loss")?,
                grad: b.alloc(r * v * 2, "grad")?,
                dx: b.alloc(r * h * 4, "dx")?,
            })
        } else {
            None
        };
        self.resident.scratch = Some(ResidentScratch {
            job,
            rows,
            k,
            x16,
            logits,
            ids,
            probs,
            loss_buffers,
        });
        Ok(())
    }

    /// Records the caller's rows `[start, start + rows)` into the padded f16
    /// operand and the logits GEMMs.
    fn resident_logits(
        &self,
        s: &ResidentScratch<B>,
        hidden: &DeviceHidden<'_, B::Buffer>,
        start: usize,
        rows: usize,
        temperature: f32,
    ) -> Result<()> {
        let rows_padded = round_up(rows, ALIGN);
        let params = ResidentParams {
            rows: rows as u32,
            cols: self.hs as u32,
            ld: self.hs_padded as u32,
            rows_padded: rows_padded as u32,
            off_a: (start * self.hs) as u32,
            flags: hidden.dtype.code() << 2,
            ..ResidentParams::default()
        };
        let elements = (rows_padded * self.hs_padded) as u64;
        self.backend.resident_dispatch(
            ResidentKernel::HiddenIn,
            &[hidden.buffer, &s.x16],
            &params,
            elements.div_ceil(256),
        )?;
        self.logits(&s.x16, &s.logits, rows_padded, temperature)
    }

    fn check_resident_hidden(&self, ntok: usize, hidden: &DeviceHidden<'_, B::Buffer>) -> Result<()> {
        if ntok == 0 {
            return Err(Error::NoTokens);
        }
        u32_extent("hidden", ntok * self.hs)?;
        self.check_view("hidden", hidden.buffer, ntok * self.hs * hidden.dtype.bytes())
    }

    /// [`Engine::head_kl`] on device buffers (DESIGN §8): reads `ntok`
    /// hidden rows and the teacher's ids and probabilities from `hidden` and
    /// `teacher`, writes the per-token loss and `dx` into `out` (overwritten,
    /// or accumulated into with `opts.accumulate_dx`). Records the work and
    /// submits it; nothing is copied to or from the host and nothing waits.
    /// [`Engine::wait_device`] waits and reports bad data (an id out of range
    /// or repeated, a probability negative or not finite, a row summing to
    /// 0, a bad weight, non-finite logits) as the host path's error naming
    /// the token; until then `out` is unspecified for bad rows.
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
    ///     &DeviceTeacher { ids: &ids, probs: &probs, k },
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
        let k = teacher.k;
        check_k(k, self.vocab)?;
        self.check_resident_hidden(ntok, hidden)?;
        u32_extent("ids", ntok * k)?;
        self.check_view("ids", teacher.ids, ntok * k * 4)?;
        self.check_view("probs", teacher.probs, ntok * k * 4)?;
        self.check_view("loss", out.loss, ntok * 4)?;
        self.check_view("dx", out.dx, ntok * self.hs * 4)?;
        if let Some(w) = opts.weights {
            self.check_view("weights", w, ntok * 4)?;
        }
        opts.terms.check()?;
        if opts.terms.hard_on() && opts.labels.is_none() {
            return Err(Error::HardWeightWithoutLabels {
                value: opts.terms.hard_weight,
            });
        }
        if let Some(l) = opts.labels {
            self.check_view("labels", l, ntok * 4)?;
        }
        if let Some(t) = opts.terms_out {
            self.check_view("terms_out", t, ntok * 3 * 4)?;
        }
        if !(opts.temperature > 0.0 && opts.temperature.is_finite()) {
            return Err(Error::InvalidTemperature {
                value: opts.temperature,
            });
        }
        if let Some(t) = opts.total {
            if !(t > 0.0 && t.is_finite()) {
                return Err(Error::TotalNotPositive { value: t });
            }
        }
        if let Some(g) = opts.gscale {
            if !(g > 0.0 && g.is_finite()) {
                return Err(Error::InvalidGradScale { value: g });
            }
        }
        if opts.budget_bytes == 0 {
            return Err(Error::BudgetZero);
        }
        let plan = self.chunk_plan(Job::Loss, ntok, k, false, (opts.budget_bytes, opts.max_rows_per_chunk))?;
        self.ensure_status()?;
        self.ensure_resident_scratch(Job::Loss, plan.rows_per_chunk, k)?;
        self.resident.pending = true;

        let (Some(s), Some(status)) = (&self.resident.scratch, &self.resident.status) else {
            return Err(scratch_missing());
        };
        let Some(ls) = &s.loss_buffers else {
            return Err(scratch_missing());
        };
        let b = &self.backend;
        let has_w = u32::from(opts.weights.is_some());
        // Without weights, the probabilities fill the (unread) weights slot.
        let weights = opts.weights.unwrap_or(teacher.probs);
        let stats = ResidentParams {
            rows: ntok as u32,
            flags: has_w,
            f0: opts.total.unwrap_or(0.0),
            f1: opts.gscale.unwrap_or(0.0),
            f2: 1.0 / opts.temperature,
            f3: opts.terms.grad_bound(opts.temperature) as f32,
            ..ResidentParams::default()
        };
        b.resident_dispatch(ResidentKernel::WeightStats, &[weights, status], &stats, 1)?;
        let teacher_flags = has_w | (opts.teacher_form.code() << 1) | (opts.tail.code() << 2);
        // Labels are checked whenever given (as the host path does); the KL
        // kernel reads them only with the hard term on.
        let labels = opts.labels;
        // Unread slots get a buffer already at hand.
        let labels_buf = labels.unwrap_or(teacher.ids);
        let terms_out = opts.terms_out.unwrap_or(&s.probs);
        for (start, rows) in plan.ranges(ntok) {
            let rows_padded = round_up(rows, ALIGN);
            self.resident_logits(s, hidden, start, rows, opts.temperature)?;
            let teacher_params = ResidentParams {
                rows: rows as u32,
                cols: k as u32,
                vocab: self.vocab as u32,
                token0: start as u32,
                off_a: (start * k) as u32,
                off_b: (start * k) as u32,
                off_c: start as u32,
                flags: teacher_flags,
                ..ResidentParams::default()
            };
            b.resident_dispatch(
                ResidentKernel::TeacherRows,
                &[
                    teacher.ids,
                    teacher.probs,
                    weights,
                    status,
                    &s.ids,
                    &s.probs,
                    &ls.row_in,
                ],
                &teacher_params,
                rows as u64,
            )?;
            let labels_params = ResidentParams {
                rows: rows as u32,
                vocab: self.vocab as u32,
                token0: start as u32,
                off_a: start as u32,
                flags: u32::from(labels.is_some()),
                ..ResidentParams::default()
            };
            b.resident_dispatch(
                ResidentKernel::LabelsIn,
                &[labels_buf, status, &ls.row_in],
                &labels_params,
                (rows as u64).div_ceil(256),
            )?;
            let kl = KlDesc {
                temperature: opts.temperature,
                tail: opts.tail,
                terms: opts.terms,
                ..KlDesc::plain(rows, self.vocab, self.vocab_padded, k)
            };
            b.kl_rows(&s.logits, &s.ids, &s.probs, &ls.row_in, &ls.loss, &ls.grad, &kl)?;
            // Scaled by 1/(gscale·τ) in loss_out: gscale may come from the
            // device.
            self.dx(&ls.grad, &ls.dx, &s.logits, rows_padded, 1.0)?;
            let out_params = ResidentParams {
                rows: rows as u32,
                cols: self.hs as u32,
                ld: self.hs_padded as u32,
                token0: start as u32,
                off_a: start as u32,
                off_b: (start * self.hs) as u32,
                flags: (u32::from(opts.accumulate_dx) << 1) | (u32::from(opts.terms_out.is_some()) << 2),
                ..ResidentParams::default()
            };
            b.resident_dispatch(
                ResidentKernel::LossOut,
                &[&ls.loss, &ls.dx, status, out.loss, out.dx, terms_out],
                &out_params,
                ((rows * self.hs) as u64).div_ceil(256),
            )?;
        }
        let detail = ResidentParams {
            rows: ntok as u32,
            cols: k as u32,
            flags: teacher_flags | (u32::from(labels.is_some()) << 4),
            ..ResidentParams::default()
        };
        b.resident_dispatch(
            ResidentKernel::StatusDetail,
            &[teacher.ids, teacher.probs, weights, status, labels_buf],
            &detail,
            1,
        )?;
        b.submit()?;
        if self.resident.checked {
            self.wait_device()?;
        }
        Ok(())
    }

    /// [`Engine::topk`] on device buffers: reads `ntok` hidden rows from
    /// `hidden`, writes ids u32 and probabilities f32 `[ntok][k]` into
    /// `ids` and `probs`. Records and submits without waiting;
    /// [`Engine::wait_device`] reports a row whose logits were not finite.
    pub fn topk_device(
        &mut self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        ids: &B::Buffer,
        probs: &B::Buffer,
        opts: &TopkOptions,
    ) -> Result<()> {
        opts.check(self.vocab)?;
        let k = opts.k;
        self.check_resident_hidden(ntok, hidden)?;
        u32_extent("ids", ntok * k)?;
        self.check_view("ids", ids, ntok * k * 4)?;
        self.check_view("probs", probs, ntok * k * 4)?;
        let plan = self.chunk_plan(Job::Topk, ntok, k, false, (opts.budget_bytes, opts.max_rows_per_chunk))?;
        self.ensure_status()?;
        self.ensure_resident_scratch(Job::Topk, plan.rows_per_chunk, k)?;
        self.resident.pending = true;
        let (Some(s), Some(status)) = (&self.resident.scratch, &self.resident.status) else {
            return Err(scratch_missing());
        };
        for (start, rows) in plan.ranges(ntok) {
            self.resident_logits(s, hidden, start, rows, opts.temperature)?;
            let desc = TopkDesc::plain(rows, self.vocab, self.vocab_padded, k);
            self.backend.topk_rows(&s.logits, &s.ids, &s.probs, &desc)?;
            let params = ResidentParams {
                rows: rows as u32,
                cols: k as u32,
                token0: start as u32,
                off_a: (start * k) as u32,
                off_b: (start * k) as u32,
                ..ResidentParams::default()
            };
            self.backend.resident_dispatch(
                ResidentKernel::TopkOut,
                &[&s.ids, &s.probs, status, ids, probs],
                &params,
                ((rows * k) as u64).div_ceil(256),
            )?;
        }
        self.backend.submit()?;
        if self.resident.checked {
            self.wait_device()?;
        }
        Ok(())
    }
}

fn scratch_missing() -> Error {
    Error::Backend {
        backend: "driver",
        message: "resident scratch buffers missing after allocation".into(),
    }
}
