//! [`ShardEngine`]: an [`Engine`] on a shard's rows with the two-phase
//! calls of the module docs (`crate::shard`), written over the existing
//! kernels (`gemm`, `kl_rows`, `topk_rows`) on the host path.

use super::{GatherPartials, HeadShard, LossPartials, LossStats, TopkPartials};
use crate::align::{round_up, ALIGN};
use crate::engine::head::HeadWeights;
use crate::engine::head_planes::{HeadPlanes, Scaling};
use crate::engine::in_flight::{Copying, InFlight};
use crate::engine::scratch::{Job, RowBytes};
use crate::engine::{Engine, HostCall, LossOutput, Trace};
use crate::error::{Error, Field, Result};
use crate::problem::slicing::SliceOptions;
use crate::problem::terms::{LossTerms, TailMode, NO_LABEL};
use crate::problem::{Hidden, HiddenData, LossOptions, ResolvedLoss, Teacher, TopkOptions};
use crate::toolkit::backend::{Backend, KlDesc, TopkDesc};
use crate::toolkit::chunking::{ChunkPlan, ChunkTransfers, Rows};
use crate::toolkit::launch::Kernels;

/// An engine on rows `[v0, v1)` of a head of `V` rows: the two-phase loss
/// and the top-k candidates of the module docs (`crate::shard`). Teacher
/// ids are global.
///
/// ```
/// use headkl_core::shard::{merge_loss, merge_loss_outputs, HeadShard, ShardEngine};
/// use headkl_core::{HeadData, HeadWeights, Hidden, LossOptions, LossOutput, SliceOptions, Teacher};
/// use headkl_reference::CpuBackend;
///
/// let (vocab, hs, ntok, k) = (300, 24, 5, 4);
/// let w: Vec<f32> = (0..vocab * hs).map(|i| ((i * 7 % 13) as f32 - 6.0) / 16.0).collect();
/// let x: Vec<f32> = (0..ntok * hs).map(|i| ((i * 5 % 11) as f32 - 5.0) / 8.0).collect();
/// let head = HeadWeights::new(HeadData::F32(&w), vocab, hs)?;
/// let ids: Vec<u32> = (0..ntok * k).map(|i| (i * 31 % vocab) as u32).collect();
/// let teacher = Teacher::new(&ids, &vec![0.25f32; ntok * k], ntok, k, vocab)?;
/// let hidden = Hidden::f32(&x, ntok, hs)?;
/// let opts = LossOptions::default();
///
/// // One engine per shard (in a trainer: one per rank).
/// let mut shards = HeadShard::even(vocab, 2)?
///     .into_iter()
///     .map(|s| ShardEngine::new(CpuBackend::new(), &head.rows(s.v0(), s.v1())?, s, SliceOptions::default()))
///     .collect::<Result<Vec<_>, _>>()?;
/// // Phase one on every shard, then the trainer's all-reduce (here: merge_loss).
/// let partials = shards.iter_mut().map(|e| e.loss_partials(&hidden, &teacher, &opts)).collect::<Result<Vec<_>, _>>()?;
/// let stats = merge_loss(&partials)?;
/// // Phase two: each shard's part of dx; the trainer sums them (all-reduce).
/// let mut outs = vec![LossOutput::default(); shards.len()];
/// for (e, out) in shards.iter_mut().zip(&mut outs) {
///     e.loss_finish(&hidden, &stats, out)?;
/// }
/// let out = merge_loss_outputs(&outs)?;
/// assert_eq!((out.loss.len(), out.dx.len()), (ntok, ntok * hs));
/// assert!(out.mean >= 0.0);
/// # Ok::<(), headkl_core::Error>(())
/// ```
pub struct ShardEngine<B: Backend> {
    pub(super) engine: Engine<B>,
    pub(super) shard: HeadShard,
    pub(super) keep_logits: bool,
    /// Whether the last phase one kept its logits.
    pub(super) kept_last: bool,
    pending: Option<PhaseOne<B>>,
    /// What the device-resident phase one leaves for its phase two.
    pub(super) pending_device: Option<super::resident::DevicePhaseOne<B>>,
}

/// What phase one leaves for phase two.
struct PhaseOne<B: Backend> {
    ntok: usize,
    hs: usize,
    resolved: ResolvedLoss,
    plan: ChunkPlan,
    /// The teacher's in-shard entries, local ids `[ntok][k_s]` (padding
    /// entries: distinct ids off the row's teacher ids, probability 0).
    ids: Vec<u32>,
    probs: Vec<f32>,
    k_s: usize,
    /// The shard's own `lse` at τ.
    lse: Vec<f32>,
    /// The chunks' logits, where kept.
    kept: Option<Vec<B::Buffer>>,
}

impl<B: Backend> ShardEngine<B> {
    /// Uploads the shard's rows (`rows`: `[v1 − v0][hs]`, e.g.
    /// `head.rows(v0, v1)` of the whole head) to `backend`.
    pub fn new(backend: B, rows: &HeadWeights<'_>, shard: HeadShard, slicing: SliceOptions) -> Result<Self> {
        // In values, as the head's own check counts them (hs > 0 there).
        Field::Head.check_len(shard.width() * rows.hs(), rows.vocab() * rows.hs())?;
        Ok(Self {
            engine: Engine::new(backend, rows, slicing)?,
            shard,
            keep_logits: true,
            kept_last: false,
            pending: None,
            pending_device: None,
        })
    }

    /// The shard.
    pub fn shard(&self) -> HeadShard {
        self.shard
    }

    /// The engine on the shard's rows (its vocabulary is the shard's width).
    pub fn engine(&self) -> &Engine<B> {
        &self.engine
    }

    /// The engine on the shard's rows, mutably (its settings).
    pub fn engine_mut(&mut self) -> &mut Engine<B> {
        &mut self.engine
    }

    /// Keep the shard's logits from phase one to phase two where the budget
    /// allows (`true`, the default), or always recompute them in phase two
    /// (a third GEMM, no memory held between the phases).
    pub fn set_keep_logits(&mut self, keep: bool) {
        self.keep_logits = keep;
    }

    /// Whether the last phase one kept its logits.
    pub fn kept_logits(&self) -> bool {
        self.kept_last
    }

    /// Phase one of the loss: the shard's logits and its per-token partials
    /// ([`LossPartials`]). Checks every input as [`Engine::head_kl`] does
    /// (ids against the whole head's `V`), refuses the terms the sharded
    /// loss does not take ([`Error::ShardUnsupported`]), and keeps what
    /// phase two needs (the logits where the budget allows).
    pub fn loss_partials(
        &mut self,
        hidden: &Hidden<'_>,
        teacher: &Teacher,
        opts: &LossOptions,
    ) -> Result<LossPartials> {
        self.pending = None;
        let mut trace = Trace::new("shard phase one", self.engine.trace_on());
        self.engine.head_planes().check_hidden(hidden)?;
        let ntok = hidden.ntok();
        Field::TeacherRows.check_len(ntok, teacher.ntok())?;
        teacher.check_vocab(self.shard.vocab())?;
        check_loss_terms(teacher.tail(), opts)?;
        let resolved = opts.resolve(ntok)?;
        trace.mark("checks");
        let (ids, probs, k_s) = self.pack_teacher(teacher);
        trace.mark("teacher pack");
        let (plan, sizes) =
            self.loss_job_plan(hidden, k_s, (opts.config.budget_bytes, opts.config.max_rows_per_chunk))?;
        // A kept chunk's logits take its rows rounded to whole tiles.
        let kept_rows: usize = plan
            .chunk_rows(ntok, ChunkTransfers::Host)
            .iter()
            .map(|c| round_up(c.rows, ALIGN))
            .sum();
        let kept_bytes = kept_rows as u64 * sizes.logits;
        let keep = self.keep_logits && plan.scratch_bytes.saturating_add(kept_bytes) <= opts.config.budget_bytes;
        let call = self
            .engine
            .begin_loss_call((Job::Loss, &sizes), (plan.rows_per_chunk, k_s), hidden.data())?;
        self.kept_last = keep;
        let mut kept = keep.then(Vec::new);
        trace.mark("scratch");
        let result = self.partial_chunks(
            &plan,
            &call,
            (&ids, &probs, k_s),
            Scaling::host_loss(&resolved),
            kept.as_mut(),
            sizes.logits,
        );
        let (lse, lse1, soft) = self.engine.end_host_call(call, result)?;
        trace.mark("chunks (record, wait, read)");
        // soft = Σ q (log q − s_id + lse_s) over the in-shard entries.
        let soft_part = (0..ntok)
            .map(|t| {
                let mass: f64 = probs[t * k_s..(t + 1) * k_s].iter().map(|&q| f64::from(q)).sum();
                (f64::from(soft[t]) - mass * f64::from(lse[t])) as f32
            })
            .collect();
        let partials = LossPartials {
            shard: self.shard,
            lse: lse.clone(),
            lse1,
            soft_part,
        };
        self.pending = Some(PhaseOne {
            ntok,
            hs: hidden.hs(),
            resolved,
            plan,
            ids,
            probs,
            k_s,
            lse,
            kept,
        });
        trace.mark("partials");
        trace.report();
        Ok(partials)
    }

    /// The chunk plan and row sizes of a call that runs the loss job's
    /// scratch with `k_s` entries a row (phase one, and the top-k, whose
    /// lse comes from the loss kernel), the sizes computed once for both.
    fn loss_job_plan(
        &self,
        hidden: &Hidden<'_>,
        k_s: usize,
        budget: (u64, Option<usize>),
    ) -> Result<(ChunkPlan, RowBytes)> {
        let backend = self.engine.backend();
        let sizes = self.engine.head_planes().row_bytes(backend, Job::Loss, k_s);
        let f32_input = matches!(hidden.data(), HiddenData::F32(_));
        let plan = HeadPlanes::plan_for(backend, &sizes, Job::Loss, hidden.ntok(), f32_input, budget)?;
        Ok((plan, sizes))
    }

    /// The teacher's entries in this shard, per row: local ids and
    /// probabilities `[ntok][k_s]`, `k_s` the most any row has (at least
    /// 1), the rest padded with distinct local ids off the row's entries at
    /// probability 0 (the loss kernel writes each entry's gradient column
    /// whole, so a padding entry must not share a column with a real one).
    fn pack_teacher(&self, teacher: &Teacher) -> (Vec<u32>, Vec<f32>, usize) {
        let (ntok, k, v0) = (teacher.ntok(), teacher.k(), self.shard.v0());
        let rows = |t: usize| {
            teacher.ids()[t * k..(t + 1) * k]
                .iter()
                .zip(&teacher.probs()[t * k..(t + 1) * k])
                .filter(|(&id, _)| self.shard.contains(id as usize))
        };
        let k_s = (0..ntok).map(|t| rows(t).count()).max().unwrap_or(0).max(1);
        let mut ids = Vec::with_capacity(ntok * k_s);
        let mut probs = Vec::with_capacity(ntok * k_s);
        let mut used = Vec::new();
        for t in 0..ntok {
            used.clear();
            for (&id, &p) in rows(t) {
                ids.push(id - v0 as u32);
                probs.push(p);
                used.push(id - v0 as u32);
            }
            used.sort_unstable();
            // k_s ≤ min(k, width): the width has room for the padding.
            let mut next = 0u32;
            for _ in used.len()..k_s {
                while used.binary_search(&next).is_ok() {
                    next += 1;
                }
                ids.push(next);
                probs.push(0.0);
                next += 1;
            }
        }
        (ids, probs, k_s)
    }

    /// Phase one's chunks: per token the shard's `lse` at τ, at τ = 1, and
    /// the loss kernel's soft term over the in-shard entries.
    #[allow(clippy::type_complexity, reason = "three per-token vectors")]
    fn partial_chunks(
        &self,
        plan: &ChunkPlan,
        call: &HostCall<'_, B>,
        (ids, probs, k_s): (&[u32], &[f32], usize),
        scaling: Scaling,
        mut kept: Option<&mut Vec<B::Buffer>>,
        logits_row_bytes: u64,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (b, h) = (self.engine.backend(), self.engine.head_planes());
        let (input, s, ls) = (&call.input, &call.rows, &call.loss);
        let ntok = ids.len() / k_s;
        let (mut lse, mut lse1, mut soft) = (vec![0f32; ntok], vec![0f32; ntok], vec![0f32; ntok]);
        let mut rows_out = Vec::new();
        let tau_on = scaling.temperature != 1.0;
        // One chunk's outputs: [soft, lse, soft, 0] per row, then (τ ≠ 1) the
        // lse at τ = 1 in the second download's column 1.
        let mut read_chunk = |mut done: Copying<'_, B>, lse: &mut [f32], lse1: &mut [f32], soft: &mut [f32]| {
            let (start, rows) = (done.start, done.rows);
            rows_out.resize(rows * 4, 0f32);
            done.read_next(bytemuck::cast_slice_mut(rows_out.as_mut_slice()))?;
            for (t, r) in rows_out.chunks_exact(4).enumerate() {
                if !r[1].is_finite() {
                    return Err(Error::NonFiniteHidden { token: start + t });
                }
                (soft[start + t], lse[start + t]) = (r[2], r[1]);
            }
            if tau_on {
                done.read_next(bytemuck::cast_slice_mut(rows_out.as_mut_slice()))?;
                for (t, r) in rows_out.chunks_exact(4).enumerate() {
                    lse1[start + t] = r[1];
                }
            } else {
                lse1[start..start + rows].copy_from_slice(&lse[start..start + rows]);
            }
            Ok(())
        };
        // Two chunks in flight, as in the driver: chunk i's outputs start
        // their copy out before chunk i−1's are read.
        let mut pipe = InFlight::new();
        for (chunk, Rows { start, rows }) in plan.chunk_rows(ntok, ChunkTransfers::Host).into_iter().enumerate() {
            let logits = match kept.as_deref_mut() {
                Some(kept) => {
                    let buf = b.alloc(round_up(rows, ALIGN) as u64 * logits_row_bytes, "kept shard logits")?;
                    kept.push(buf);
                    &kept[kept.len() - 1]
                }
                None => &s.logits,
            };
            h.chunk_logits(b, input, s.x16_for(chunk), (chunk, start, rows), logits, scaling)?;
            b.upload(&s.ids, 0, bytemuck::cast_slice(&ids[start * k_s..(start + rows) * k_s]))?;
            b.upload(
                &s.probs,
                0,
                bytemuck::cast_slice(&probs[start * k_s..(start + rows) * k_s]),
            )?;
            // Coefficient 0: phase one's gradient is not used.
            let row_in: Vec<u32> = (0..rows).flat_map(|_| [0f32.to_bits(), NO_LABEL]).collect();
            b.upload(&ls.row_in, 0, bytemuck::cast_slice(&row_in))?;
            // τ = 1 on the scaled logits: the kernel's lse is the shard's
            // logsumexp of s = z/τ, its soft term at that lse.
            let desc = KlDesc::plain(rows, h.vocab(), h.vocab_padded(), k_s);
            b.kl_rows(logits, &s.ids, &s.probs, &ls.row_in, &ls.loss, &ls.grad, &desc)?;
            let mut copying = Copying::begin(b, (start, rows), &[(&ls.loss, 0, rows * 16)])?;
            if tau_on {
                // The kernel at τ: its lse output is at τ = 1.
                let desc = KlDesc {
                    temperature: scaling.temperature,
                    ..desc
                };
                b.kl_rows(logits, &s.ids, &s.probs, &ls.row_in, &ls.loss, &ls.grad, &desc)?;
                copying.begin_more(&[(&ls.loss, 0, rows * 16)])?;
            }
            if let Some(done) = pipe.push(copying) {
                read_chunk(done, &mut lse, &mut lse1, &mut soft)?;
            }
        }
        if let Some(done) = pipe.pop() {
            read_chunk(done, &mut lse, &mut lse1, &mut soft)?;
        }
        Ok((lse, lse1, soft))
    }

    /// Phase two of the loss: from the merged statistics `stats` (the
    /// trainer's all-reduce of every shard's [`LossPartials`], or
    /// [`super::merge_loss`]), writes into `out` the per-token loss, lse
    /// (at τ = 1), soft term (the loss) and hard term (0), the mean — all
    /// the whole loss's, the same on every shard — and **the shard's part
    /// of `dx`, overwritten**: the trainer sums `dx` over the shards.
    /// `hidden` must be phase one's rows (they are read again where phase
    /// one could not keep its logits).
    pub fn loss_finish(&mut self, hidden: &Hidden<'_>, stats: &LossStats, out: &mut LossOutput) -> Result<()> {
        let Some(p) = self.pending.take() else {
            return Err(Error::ShardPhaseOrder { call: "loss_finish" });
        };
        let ntok = p.ntok;
        if hidden.ntok() != ntok {
            return Err(Error::ShardMismatch {
                what: "tokens",
                expected: ntok,
                got: hidden.ntok(),
            });
        }
        self.engine.head_planes().check_hidden(hidden)?;
        for len in [stats.lse.len(), stats.lse1.len(), stats.soft_part.len()] {
            if len != ntok {
                // Phase one stays pending: the caller may pass the right stats.
                self.pending = Some(p);
                return Err(Error::ShardMismatch {
                    what: "tokens",
                    expected: ntok,
                    got: len,
                });
            }
        }
        let mut trace = Trace::new("shard phase two", self.engine.trace_on());
        let k_s = p.k_s;
        // Per row: coefficient c·α and the teacher q/α (module docs).
        let mut row_in = Vec::with_capacity(ntok * 2);
        let mut probs = Vec::with_capacity(ntok * k_s);
        for t in 0..ntok {
            let alpha = (f64::from(p.lse[t]) - f64::from(stats.lse[t]))
                .exp()
                .max(crate::toolkit::resident_kernels::ALPHA_FLOOR);
            row_in.extend([((f64::from(p.resolved.coef[t]) * alpha) as f32).to_bits(), NO_LABEL]);
            probs.extend(
                p.probs[t * k_s..(t + 1) * k_s]
                    .iter()
                    .map(|&q| (f64::from(q) / alpha) as f32),
            );
        }
        out.filter = None;
        out.loss.clear();
        out.loss
            .extend(stats.soft_part.iter().zip(&stats.lse).map(|(&s, &l)| s + l));
        out.lse.clone_from(&stats.lse1);
        out.soft.clone_from(&out.loss);
        out.hard.clear();
        out.hard.resize(ntok, 0.0);
        out.mean = p.resolved.mean_of(&out.loss);
        out.dx.resize(ntok * p.hs, 0.0);
        trace.mark("row inputs + per-token outputs");

        let sizes = self
            .engine
            .head_planes()
            .row_bytes(self.engine.backend(), Job::Loss, k_s);
        let call = self
            .engine
            .begin_loss_call((Job::Loss, &sizes), (p.plan.rows_per_chunk, k_s), hidden.data())?;
        trace.mark("scratch");
        let result = self.finish_chunks(&p, &call, (&row_in, &probs), &mut out.dx, &mut trace);
        let result = self.engine.end_host_call(call, result);
        trace.mark("scratch back");
        trace.report();
        result
    }

    /// Phase two's chunks: the gradient at the global lse and its dx GEMM.
    fn finish_chunks(
        &self,
        p: &PhaseOne<B>,
        call: &HostCall<'_, B>,
        (row_in, probs): (&[u32], &[f32]),
        dx: &mut [f32],
        trace: &mut Trace,
    ) -> Result<()> {
        let (b, h) = (self.engine.backend(), self.engine.head_planes());
        let (input, s, ls) = (&call.input, &call.rows, &call.loss);
        let (k_s, hs, hs_padded) = (p.k_s, h.hs(), h.hs_padded());
        let scaling = Scaling::host_loss(&p.resolved);
        let mut padded = Vec::new();
        let mut read_chunk = |mut done: Copying<'_, B>, dx: &mut [f32]| -> Result<()> {
            let (start, rows) = (done.start, done.rows);
            let rows_dx = &mut dx[start * hs..(start + rows) * hs];
            if hs == hs_padded {
                // No padding columns: the chunk's rows land in dx directly,
                // not through a padded copy (84 MB a shard at shape A).
                return done.read_next(bytemuck::cast_slice_mut(rows_dx));
            }
            padded.resize(rows * hs_padded, 0f32);
            done.read_next(bytemuck::cast_slice_mut(padded.as_mut_slice()))?;
            for (row, src) in rows_dx.chunks_exact_mut(hs).zip(padded.chunks_exact(hs_padded)) {
                row.copy_from_slice(&src[..hs]);
            }
            Ok(())
        };
        let mut pipe = InFlight::new();
        for (chunk, Rows { start, rows }) in p.plan.chunk_rows(p.ntok, ChunkTransfers::Host).into_iter().enumerate() {
            let rows_padded = round_up(rows, ALIGN);
            let logits = match &p.kept {
                Some(kept) => &kept[chunk],
                None => {
                    let x16 = s.x16_for(chunk);
                    h.chunk_logits(b, input, x16, (chunk, start, rows), &s.logits, scaling)?;
                    &s.logits
                }
            };
            b.upload(
                &s.ids,
                0,
                bytemuck::cast_slice(&p.ids[start * k_s..(start + rows) * k_s]),
            )?;
            b.upload(
                &s.probs,
                0,
                bytemuck::cast_slice(&probs[start * k_s..(start + rows) * k_s]),
            )?;
            b.upload(
                &ls.row_in,
                0,
                bytemuck::cast_slice(&row_in[start * 2..(start + rows) * 2]),
            )?;
            let desc = KlDesc::plain(rows, h.vocab(), h.vocab_padded(), k_s);
            b.kl_rows(logits, &s.ids, &s.probs, &ls.row_in, &ls.loss, &ls.grad, &desc)?;
            // The logits are spent: the dx GEMM's split-K parts may use them.
            h.dx(b, (&ls.grad, &ls.dx, logits), rows_padded, scaling, None)?;
            let copying = Copying::begin(b, (start, rows), &[(&ls.dx, 0, rows * hs_padded * 4)])?;
            trace.mark("record");
            if let Some(done) = pipe.push(copying) {
                read_chunk(done, dx)?;
                trace.mark("wait + read dx");
            }
        }
        if let Some(done) = pipe.pop() {
            read_chunk(done, dx)?;
            trace.mark("wait + read dx");
        }
        Ok(())
    }

    /// The shard's top-k candidates: per token its `min(k, width)` largest
    /// logits at τ (global ids, descending, ties lowest id first) and its
    /// log-sum-exp at τ ([`TopkPartials`]), for [`super::merge_topk`]. A
    /// softcap is refused ([`Error::ShardUnsupported`]: the cap saturates,
    /// and the merge orders by the values it gets).
    pub fn topk_partials(&mut self, hidden: &Hidden<'_>, opts: &TopkOptions) -> Result<TopkPartials> {
        self.engine.head_planes().check_hidden(hidden)?;
        opts.check(self.shard.vocab())?;
        if let Some(c) = opts.softcap {
            return Err(Error::ShardUnsupported {
                option: "softcap",
                value: c.to_string(),
                hint: "the capped top-k runs unsharded",
            });
        }
        let ntok = hidden.ntok();
        let k_s = opts.k.min(self.shard.width());
        // The loss job's scratch: the top-k's ids and values, and the loss
        // kernel's outputs for the shard's lse.
        let (plan, sizes) = self.loss_job_plan(hidden, k_s, (opts.budget_bytes, opts.max_rows_per_chunk))?;
        let call = self
            .engine
            .begin_loss_call((Job::Loss, &sizes), (plan.rows_per_chunk, k_s), hidden.data())?;
        let result = self.topk_chunks(&plan, &call, ntok, k_s, Scaling::top_k(opts));
        let (ids, logits, lse) = self.engine.end_host_call(call, result)?;
        Ok(TopkPartials {
            shard: self.shard,
            ntok,
            k: k_s,
            ids,
            logits,
            lse,
        })
    }

    #[allow(clippy::type_complexity, reason = "the partials' three vectors")]
    fn topk_chunks(
        &self,
        plan: &ChunkPlan,
        call: &HostCall<'_, B>,
        ntok: usize,
        k_s: usize,
        scaling: Scaling,
    ) -> Result<(Vec<u32>, Vec<f32>, Vec<f32>)> {
        let (b, h) = (self.engine.backend(), self.engine.head_planes());
        let (input, s, ls) = (&call.input, &call.rows, &call.loss);
        let v0 = self.shard.v0() as u32;
        let mut ids = vec![0u32; ntok * k_s];
        let mut logits = vec![0f32; ntok * k_s];
        let mut lse = vec![0f32; ntok];
        let mut logprobs = Vec::new();
        let mut rows_out = Vec::new();
        let mut read_chunk =
            |mut done: Copying<'_, B>, ids: &mut [u32], logits: &mut [f32], lse: &mut [f32]| -> Result<()> {
                let (start, rows) = (done.start, done.rows);
                let range = start * k_s..(start + rows) * k_s;
                done.read_next(bytemuck::cast_slice_mut(&mut ids[range]))?;
                logprobs.resize(rows * k_s, 0f32);
                done.read_next(bytemuck::cast_slice_mut(logprobs.as_mut_slice()))?;
                rows_out.resize(rows * 4, 0f32);
                done.read_next(bytemuck::cast_slice_mut(rows_out.as_mut_slice()))?;
                for t in 0..rows {
                    let l = rows_out[t * 4 + 1];
                    if !l.is_finite() || !logprobs[t * k_s].is_finite() {
                        return Err(Error::NonFiniteHidden { token: start + t });
                    }
                    lse[start + t] = l;
                    for q in 0..k_s {
                        let i = (start + t) * k_s + q;
                        ids[i] += v0;
                        logits[i] = (f64::from(logprobs[t * k_s + q]) + f64::from(l)) as f32;
                    }
                }
                Ok(())
            };
        let mut pipe = InFlight::new();
        for (chunk, Rows { start, rows }) in plan.chunk_rows(ntok, ChunkTransfers::Host).into_iter().enumerate() {
            let x16 = s.x16_for(chunk);
            h.chunk_logits(b, input, x16, (chunk, start, rows), &s.logits, scaling)?;
            // Log-probabilities over the shard: with its lse, the logits.
            let desc = TopkDesc {
                logprobs: true,
                ..TopkDesc::plain(rows, h.vocab(), h.vocab_padded(), k_s)
            };
            b.topk_rows(&s.logits, &s.ids, &s.probs, &desc)?;
            // The loss kernel, coefficient 0, on the top-k as its teacher:
            // only its lse output is read.
            let row_in: Vec<u32> = (0..rows).flat_map(|_| [0f32.to_bits(), NO_LABEL]).collect();
            b.upload(&ls.row_in, 0, bytemuck::cast_slice(&row_in))?;
            let kl = KlDesc::plain(rows, h.vocab(), h.vocab_padded(), k_s);
            b.kl_rows(&s.logits, &s.ids, &s.probs, &ls.row_in, &ls.loss, &ls.grad, &kl)?;
            let bytes = rows * k_s * 4;
            let outputs = [(&s.ids, 0, bytes), (&s.probs, 0, bytes), (&ls.loss, 0, rows * 16)];
            let copying = Copying::begin(b, (start, rows), &outputs)?;
            if let Some(done) = pipe.push(copying) {
                read_chunk(done, &mut ids, &mut logits, &mut lse)?;
            }
        }
        if let Some(done) = pipe.pop() {
            read_chunk(done, &mut ids, &mut logits, &mut lse)?;
        }
        Ok((ids, logits, lse))
    }
}

impl<B: Backend> ShardEngine<B> {
    /// The shard's part of [`Engine::logprobs_at`] at global `ids`
    /// `[ntok][k]` (negative: none), for [`super::merge_gather`]: the
    /// log-probabilities over the shard alone at the ids inside it, and its
    /// lse. A softcap is taken (it caps each logit alone). Where k exceeds
    /// what one call over the shard takes (its width, at most
    /// [`crate::problem::MAX_K`]), the ids go in column blocks, the
    /// shard's logits made once a block.
    ///
    /// [`Engine::logprobs_at`]: crate::engine::Engine::logprobs_at
    pub fn gather_partials(&mut self, hidden: &Hidden<'_>, ids: &[i64], opts: &TopkOptions) -> Result<GatherPartials> {
        let (ntok, k) = (hidden.ntok(), opts.k);
        if k == 0 {
            return Err(Error::KZero);
        }
        crate::engine::check_gather_ids(ids, ntok, k, self.shard.vocab())?;
        let (v0, v1) = (self.shard.v0() as i64, self.shard.v1() as i64);
        let block = k.min(self.shard.width()).min(crate::problem::MAX_K);
        let mut out = GatherPartials {
            shard: self.shard,
            ntok,
            k,
            logprobs: vec![f32::NEG_INFINITY; ntok * k],
            lse: Vec::new(),
        };
        let mut local = Vec::with_capacity(ntok * block);
        for c0 in (0..k).step_by(block) {
            let c1 = (c0 + block).min(k);
            local.clear();
            for row in ids.chunks_exact(k) {
                local.extend(
                    row[c0..c1]
                        .iter()
                        .map(|&id| if (v0..v1).contains(&id) { id - v0 } else { -1 }),
                );
            }
            let g = self
                .engine
                .logprobs_at(hidden, &local, &TopkOptions { k: c1 - c0, ..*opts })?;
            for (t, row) in g.logprobs.chunks_exact(c1 - c0).enumerate() {
                out.logprobs[t * k + c0..t * k + c1].copy_from_slice(row);
            }
            out.lse = g.lse;
        }
        Ok(out)
    }
}

/// Refuses what the sharded loss does not compute, naming the option
/// ([`Error::ShardUnsupported`]): a tail other than renormalize, the hard
/// term (or labels), the z-loss, a softcap, a soft weight other than 1,
/// the dx GEMM's block filter, a divergence other than the forward KL, the
/// head's gradient. [`ShardEngine::loss_partials`] calls it; a caller can call it before
/// anything is uploaded.
pub fn check_loss_terms(tail: TailMode, opts: &LossOptions) -> Result<()> {
    if opts.config.head_grad {
        return Err(Error::ShardUnsupported {
            option: "head-grad",
            value: "true".into(),
            hint: "the head's gradient runs unsharded",
        });
    }
    check_terms(tail, &opts.config.terms, opts.labels.is_some(), opts.config.filter_eps)
}

/// [`check_loss_terms`] on the terms themselves (the device-resident calls
/// take them in [`crate::resident::DeviceLossOptions`]).
pub(super) fn check_terms(tail: TailMode, terms: &LossTerms, has_labels: bool, filter_eps: Option<f32>) -> Result<()> {
    let refuse = |option, value: String, hint| Err(Error::ShardUnsupported { option, value, hint });
    let d = LossTerms::default();
    let t = *terms;
    if tail != TailMode::Renormalize {
        return refuse("tail", tail.name().into(), "use the default tail, renormalize");
    }
    if has_labels || t.hard_weight != d.hard_weight {
        return refuse("hard-weight", t.hard_weight.to_string(), "the hard term runs unsharded");
    }
    if t.z_loss != d.z_loss {
        return refuse("z-loss", t.z_loss.to_string(), "the z-loss runs unsharded");
    }
    if let Some(c) = t.softcap {
        return refuse("softcap", c.to_string(), "the softcap runs unsharded");
    }
    if t.soft_weight != d.soft_weight {
        return refuse("soft-weight", t.soft_weight.to_string(), "scale the loss outside");
    }
    if let Some(eps) = filter_eps {
        return refuse("filter-eps", eps.to_string(), "the block filter runs unsharded");
    }
    if t.divergence.effective() != crate::problem::terms::Divergence::Forward {
        return refuse(
            "divergence",
            t.divergence.name().into(),
            "the reverse KL and the JSD run unsharded",
        );
    }
    Ok(())
}
