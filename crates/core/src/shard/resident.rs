//! The device-resident two-phase loss of a shard
//! ([`ShardEngine::loss_partials_device`],
//! [`ShardEngine::loss_finish_device`]) and the merge of partials held in
//! device buffers ([`merge_loss_device`]).
//!
//! **Buffers.** Partials and merged statistics are f32 `[ntok][3]`
//! ([`STATS_PER_TOKEN`]), per token `[lse, lse1, soft_part]` as in
//! [`super::LossPartials`] / [`super::LossStats`]: the shard's log-sum-exp
//! at τ, at τ = 1, and the teacher's in-shard terms. A trainer's
//! all-reduce merges column 0 and 1 by MAX then SUM of `exp(lse − max)`
//! (then `max + ln(sum)`) and column 2 by SUM.
//!
//! **Kernels.** The resident path's own, in the host path's order: per
//! chunk `hidden_in` → `gemm` (logits kept per chunk where the budget
//! allows, as on the host path) → `teacher_rows` (checked against the
//! whole head's `V`, renormalized over the k) → `shard_rows` (ids to the
//! shard's columns) → `kl_rows` → `shard_rows` (the partials); phase two
//! `teacher_rows` → `shard_rows` (the `α` scaling of the host path) →
//! `kl_rows` → `HeadPlanes::dx` → `shard_rows` (the loss from the merged
//! statistics) → `loss_out`. Phase two reads the shard's own lse from a
//! copy the engine keeps, so the caller may all-reduce its partials buffer
//! in place and pass it back as the statistics.
//!
//! **Bad rows.** `teacher_rows` flags a bad teacher row or weight (every
//! row when `total` is not positive) as on the unsharded path, with the
//! coefficient word [`crate::resident::status::FLAGGED_ROW`], and the rule
//! of [`crate::engine::Engine::head_kl_device`] holds for phase two's outputs: a
//! flagged row's loss (and terms) is NaN on every shard and its part of dx
//! exactly 0; the other rows are as without it. Phase one's partials of a
//! flagged row stay finite (its teacher has no mass, so its in-shard term
//! is 0 and its lse the shard's own): the collective merges them as any
//! other, and phase two turns the row into NaN.

use super::engine::check_terms;
use super::{merge_loss, HeadShard, LossPartials, ShardEngine};
use crate::align::{round_up, ALIGN};
use crate::engine::head_planes::{HeadPlanes, Scaling};
use crate::engine::scratch::{Job, LossScratch};
use crate::error::{Error, Result};
use crate::problem::check_k;
use crate::resident::{
    elements, DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, ResidentBackend, ResidentCall,
    ShardRowsDesc, ShardStage,
};
use crate::toolkit::backend::{Backend, DeviceBuffer, KlDesc};
use crate::toolkit::chunking::{ChunkPlan, ChunkTransfers, Rows};
use crate::toolkit::launch::{Kernels, Launch};

/// f32 values per token in a partials or merged-statistics buffer:
/// `[lse, lse1, soft_part]`.
pub const STATS_PER_TOKEN: usize = 3;

/// What the device-resident phase one leaves for phase two.
pub(super) struct DevicePhaseOne<B: Backend> {
    ntok: usize,
    k: usize,
    temperature: f32,
    plan: ChunkPlan,
    /// The engine's copy of its partials `[ntok][3]` (phase two reads the
    /// shard's own lse from it).
    own: B::Buffer,
    /// The chunks' logits, where kept.
    kept: Option<Vec<B::Buffer>>,
}

/// The buffers one `shard_rows` step binds besides its descriptor.
struct ShardSlots<'a, Buf> {
    loss_chunk: &'a Buf,
    stats: &'a Buf,
    partials: &'a Buf,
    ids: &'a Buf,
    probs: &'a Buf,
    row_in: &'a Buf,
    status: &'a Buf,
}

impl<B: ResidentBackend> ShardEngine<B> {
    /// Phase one on device buffers: the shard's logits from `ntok` hidden
    /// rows and its partials, f32 `[ntok][3]` per token `[lse, lse1,
    /// soft_part]` ([`STATS_PER_TOKEN`]), written into `partials` (the
    /// caller's; its collective merges them, or [`merge_loss_device`]).
    /// The teacher's ids are global and checked against the whole head.
    /// Records and submits without waiting, as
    /// [`crate::engine::Engine::head_kl_device`]; [`Self::wait_device`] reports bad data.
    ///
    /// Takes the sharded loss's terms ([`super::check_loss_terms`]'s list,
    /// else [`Error::ShardUnsupported`]) and `k` up to the shard's width
    /// (the host path takes any k). `opts.accumulate_dx` and
    /// `opts.terms_out` are phase two's.
    pub fn loss_partials_device(
        &mut self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        teacher: &DeviceTeacher<'_, B::Buffer>,
        partials: &B::Buffer,
        opts: &DeviceLossOptions<'_, B::Buffer>,
    ) -> Result<()> {
        self.pending_device = None;
        self.check_device_call(ntok, hidden, teacher, opts)?;
        let e = &self.engine;
        e.check_view("partials", partials, elements("partials", ntok, STATS_PER_TOKEN)?, 4)?;
        let k = teacher.k;
        let sizes = e.resident_row_bytes(Job::Loss, k);
        let plan = HeadPlanes::plan_for(
            e.backend(),
            &sizes,
            Job::Loss,
            ntok,
            false,
            (opts.config.budget_bytes, opts.config.max_rows_per_chunk),
        )?;
        let kept_bytes = plan.chunks as u64 * plan.rows_per_chunk as u64 * sizes.logits;
        let keep = self.keep_logits && plan.scratch_bytes.saturating_add(kept_bytes) <= opts.config.budget_bytes;
        let own = e
            .backend()
            .alloc((ntok * STATS_PER_TOKEN * 4) as u64, "shard partials (engine's copy)")?;
        let call: ResidentCall<B, LossScratch<B>> =
            self.engine.begin_resident_call((Job::Loss, plan.rows_per_chunk, k))?;
        let mut kept = keep.then(Vec::new);
        let recorded = self.record_partials(
            (ntok, hidden, teacher, opts),
            (partials, &own),
            &plan,
            &call,
            kept.as_mut().map(|k| (k, sizes.logits)),
        );
        self.engine.end_resident_call(call, recorded)?;
        self.kept_last = keep;
        self.pending_device = Some(DevicePhaseOne {
            ntok,
            k,
            temperature: opts.config.temperature,
            plan,
            own,
            kept,
        });
        if self.engine.resident.checked() {
            self.wait_device()?;
        }
        Ok(())
    }

    /// Phase two on device buffers: takes the merged statistics `stats`
    /// (f32 `[ntok][3]`, as the partials) and writes the per-token loss
    /// (the whole loss, the same on every shard) into `out.loss` and **the
    /// shard's part of `dx`** into `out.dx` (overwritten, or added with
    /// `opts.accumulate_dx`), and with `opts.terms_out` per token `[lse1,
    /// loss, 0]` as the host path's `lse`, `soft`, `hard`. `hidden` and
    /// `teacher` must be phase one's (the teacher is mapped again, the
    /// hidden rows read again where phase one could not keep its logits);
    /// the weights, `total` and `gscale` too. τ is phase one's.
    ///
    /// A row the device flags (module docs, "Bad rows") has a NaN loss and
    /// terms and a zero dx part here, before any wait;
    /// [`Self::wait_device`] names it.
    pub fn loss_finish_device(
        &mut self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        teacher: &DeviceTeacher<'_, B::Buffer>,
        stats: &B::Buffer,
        out: &DeviceLossOutput<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
    ) -> Result<()> {
        let Some(p) = self.pending_device.take() else {
            return Err(Error::ShardPhaseOrder {
                call: "loss_finish_device",
            });
        };
        let checked = self.check_finish(ntok, hidden, teacher, stats, out, opts, &p);
        if let Err(e) = checked {
            // Phase one stays pending: the caller may pass the right buffers.
            self.pending_device = Some(p);
            return Err(e);
        }
        let call: ResidentCall<B, LossScratch<B>> =
            self.engine
                .begin_resident_call((Job::Loss, p.plan.rows_per_chunk, p.k))?;
        let recorded = self.record_finish((hidden, teacher, stats, out, opts), &p, &call);
        self.engine.end_resident_call(call, recorded)?;
        if self.engine.resident.checked() {
            self.wait_device()?;
        }
        Ok(())
    }

    /// Waits for the device and reports the first bad row either phase
    /// flagged since the last wait, as [`crate::engine::Engine::wait_device`] does (ids
    /// named against the whole head).
    pub fn wait_device(&mut self) -> Result<()> {
        self.engine.wait_device_for(self.shard.vocab())
    }

    /// The checks both phases make, before anything is recorded.
    fn check_device_call(
        &self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        teacher: &DeviceTeacher<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
    ) -> Result<()> {
        let (e, k) = (&self.engine, teacher.k);
        check_k(k, self.shard.vocab())?;
        if k > self.shard.width() {
            return Err(Error::ShardUnsupported {
                option: "k",
                value: format!("{k} (the shard has {} rows)", self.shard.width()),
                hint: "the device-resident two-phase loss takes k up to the shard's rows; the host path takes any k",
            });
        }
        e.check_resident_loss_inputs(ntok, hidden, teacher, opts)?;
        if opts.config.head_grad || opts.head_grad_out.is_some() {
            return Err(Error::ShardUnsupported {
                option: "head-grad",
                value: "true".into(),
                hint: "the head's gradient runs unsharded",
            });
        }
        check_terms(
            teacher.tail,
            &opts.config.terms,
            opts.labels.is_some(),
            opts.config.filter_eps,
        )
    }

    #[allow(clippy::too_many_arguments, reason = "phase two's inputs and phase one's record")]
    fn check_finish(
        &self,
        ntok: usize,
        hidden: &DeviceHidden<'_, B::Buffer>,
        teacher: &DeviceTeacher<'_, B::Buffer>,
        stats: &B::Buffer,
        out: &DeviceLossOutput<'_, B::Buffer>,
        opts: &DeviceLossOptions<'_, B::Buffer>,
        p: &DevicePhaseOne<B>,
    ) -> Result<()> {
        for (what, expected, got) in [("tokens", p.ntok, ntok), ("k", p.k, teacher.k)] {
            if expected != got {
                return Err(Error::ShardMismatch { what, expected, got });
            }
        }
        self.check_device_call(ntok, hidden, teacher, opts)?;
        let e = &self.engine;
        e.check_view("stats", stats, elements("stats", ntok, STATS_PER_TOKEN)?, 4)?;
        e.check_view("loss", out.loss, ntok, 4)?;
        e.check_view("dx", out.dx, elements("dx", ntok, e.head_planes().hs())?, 4)?;
        if let Some(t) = opts.terms_out {
            e.check_view("terms_out", t, elements("terms_out", ntok, 3)?, 4)?;
        }
        Ok(())
    }

    /// One `shard_rows` step on a chunk.
    fn shard_step(
        &self,
        (stage, lse1_too): (ShardStage, bool),
        (start, rows, k): (usize, usize, usize),
        s: ShardSlots<'_, B::Buffer>,
    ) -> Result<()> {
        self.engine.backend().dispatch(Launch::ShardRows {
            loss_chunk: s.loss_chunk,
            stats: s.stats,
            partials: s.partials,
            ids: s.ids,
            probs: s.probs,
            row_in: s.row_in,
            status: s.status,
            desc: ShardRowsDesc {
                stage,
                rows,
                k,
                v0: self.shard.v0(),
                v1: self.shard.v1(),
                token0: start,
                lse1_too,
            },
        })
    }

    /// Records phase one (its checks done) and submits it.
    #[allow(clippy::type_complexity, reason = "the call's inputs, outputs and scratch")]
    fn record_partials(
        &self,
        (ntok, hidden, teacher, opts): (
            usize,
            &DeviceHidden<'_, B::Buffer>,
            &DeviceTeacher<'_, B::Buffer>,
            &DeviceLossOptions<'_, B::Buffer>,
        ),
        (partials, own): (&B::Buffer, &B::Buffer),
        plan: &ChunkPlan,
        call: &ResidentCall<B, LossScratch<B>>,
        mut kept: Option<(&mut Vec<B::Buffer>, u64)>,
    ) -> Result<()> {
        let (b, h) = (self.engine.backend(), self.engine.head_planes());
        let (status, s, ls) = (&call.status, call.rows(), &call.loss);
        let (k, tau) = (teacher.k, opts.config.temperature);
        let scaling = Scaling::resident_loss(tau, opts.config.terms.logit_scale);
        call.weight_stats(b, (ntok, tau), teacher, opts)?;
        for Rows { start, rows } in plan.chunk_rows(ntok, ChunkTransfers::Resident) {
            let logits = match kept.as_mut() {
                Some((kept, row_bytes)) => {
                    kept.push(b.alloc(plan.rows_per_chunk as u64 * *row_bytes, "kept shard logits")?);
                    &kept[kept.len() - 1]
                }
                None => &s.logits,
            };
            self.engine
                .resident_logits_into((&s.x16, logits), hidden, (start, rows), scaling, None)?;
            call.teacher_rows(b, (start, rows, self.shard.vocab()), teacher, opts)?;
            // No statistics in phase one: the stats slot (read only) gets
            // a scratch buffer no other slot binds.
            let slots = |partials| ShardSlots {
                loss_chunk: &ls.loss,
                stats: &s.x16,
                partials,
                ids: &s.ids,
                probs: &s.probs,
                row_in: &ls.row_in,
                status,
            };
            self.shard_step((ShardStage::Map, false), (start, rows, k), slots(partials))?;
            // τ = 1 on the scaled logits: the kernel's lse is the shard's
            // log-sum-exp of s = z/τ, its soft term at that lse.
            let kl = KlDesc::plain(rows, h.vocab(), h.vocab_padded(), k);
            b.kl_rows(logits, &s.ids, &s.probs, &ls.row_in, &ls.loss, &ls.grad, &kl)?;
            // The caller's partials, and the engine's copy phase two reads.
            for target in [partials, own] {
                self.shard_step((ShardStage::Partials, tau == 1.0), (start, rows, k), slots(target))?;
            }
            if tau != 1.0 {
                // The kernel at τ: its lse output is at τ = 1.
                let kl = KlDesc { temperature: tau, ..kl };
                b.kl_rows(logits, &s.ids, &s.probs, &ls.row_in, &ls.loss, &ls.grad, &kl)?;
                self.shard_step((ShardStage::Lse1, false), (start, rows, k), slots(partials))?;
            }
        }
        call.status_detail(b, ntok, teacher, opts, None)?;
        b.submit()
    }

    /// Records phase two (its checks done) and submits it.
    #[allow(clippy::type_complexity, reason = "the call's inputs, outputs and scratch")]
    fn record_finish(
        &self,
        (hidden, teacher, stats, out, opts): (
            &DeviceHidden<'_, B::Buffer>,
            &DeviceTeacher<'_, B::Buffer>,
            &B::Buffer,
            &DeviceLossOutput<'_, B::Buffer>,
            &DeviceLossOptions<'_, B::Buffer>,
        ),
        p: &DevicePhaseOne<B>,
        call: &ResidentCall<B, LossScratch<B>>,
    ) -> Result<()> {
        let (b, h) = (self.engine.backend(), self.engine.head_planes());
        let (status, s, ls) = (&call.status, call.rows(), &call.loss);
        let (ntok, k, tau) = (p.ntok, p.k, p.temperature);
        let scaling = Scaling::resident_loss(tau, opts.config.terms.logit_scale);
        call.weight_stats(b, (ntok, tau), teacher, opts)?;
        let slots = ShardSlots {
            loss_chunk: &ls.loss,
            stats,
            partials: &p.own,
            ids: &s.ids,
            probs: &s.probs,
            row_in: &ls.row_in,
            status,
        };
        for (chunk, Rows { start, rows }) in p
            .plan
            .chunk_rows(ntok, ChunkTransfers::Resident)
            .into_iter()
            .enumerate()
        {
            let logits = match &p.kept {
                Some(kept) => &kept[chunk],
                None => {
                    self.engine
                        .resident_logits_into((&s.x16, &s.logits), hidden, (start, rows), scaling, None)?;
                    &s.logits
                }
            };
            call.teacher_rows(b, (start, rows, self.shard.vocab()), teacher, opts)?;
            self.shard_step((ShardStage::MapFinish, false), (start, rows, k), slots)?;
            let kl = KlDesc::plain(rows, h.vocab(), h.vocab_padded(), k);
            b.kl_rows(logits, &s.ids, &s.probs, &ls.row_in, &ls.loss, &ls.grad, &kl)?;
            // The logits are spent: the dx GEMM's split-K parts may use
            // them. Scaled by 1/(gscale·τ) in loss_out.
            h.dx(b, (&ls.grad, &ls.dx, logits), round_up(rows, ALIGN), scaling, None)?;
            self.shard_step((ShardStage::Loss, false), (start, rows, k), slots)?;
            call.loss_out(b, (start, rows), (h.hs(), h.hs_padded()), out, opts)?;
        }
        call.status_detail(b, ntok, teacher, opts, None)?;
        b.submit()
    }
}

impl<Buf> Clone for ShardSlots<'_, Buf> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<Buf> Copy for ShardSlots<'_, Buf> {}

/// Merges N shards' partials held in device buffers (f32 `[ntok][3]`
/// each, as [`ShardEngine::loss_partials_device`] writes them) into one
/// merged-statistics buffer `stats` for [`ShardEngine::loss_finish_device`],
/// on `backend`: what a single process with several engines on one device
/// needs. The shards must cover the head once ([`super::check_cover`]'s
/// errors); a buffer holding fewer than `ntok` tokens is
/// [`Error::ShardMismatch`]. It reads the partials back (12 bytes a token
/// a shard; wait for every shard's phase one first, e.g.
/// [`ShardEngine::wait_device`]), merges them as [`merge_loss`] does and
/// uploads the result. A multi-process trainer uses its own all-reduce on
/// the partials instead (module docs of `crate::shard`).
pub fn merge_loss_device<B: Backend>(
    backend: &B,
    ntok: usize,
    partials: &[(HeadShard, &B::Buffer)],
    stats: &B::Buffer,
) -> Result<()> {
    let tokens_in = |buf: &B::Buffer| -> Result<()> {
        let got = buf.len() / (STATS_PER_TOKEN as u64 * 4);
        if got < ntok as u64 {
            return Err(Error::ShardMismatch {
                what: "tokens",
                expected: ntok,
                got: got as usize,
            });
        }
        Ok(())
    };
    tokens_in(stats)?;
    let mut parts = Vec::with_capacity(partials.len());
    let mut words = vec![0f32; ntok * STATS_PER_TOKEN];
    for &(shard, buf) in partials {
        tokens_in(buf)?;
        backend.download(buf, 0, bytemuck::cast_slice_mut(&mut words[..]))?;
        let column = |c: usize| words.chunks_exact(STATS_PER_TOKEN).map(|r| r[c]).collect();
        parts.push(LossPartials {
            shard,
            lse: column(0),
            lse1: column(1),
            soft_part: column(2),
        });
    }
    let merged = merge_loss(&parts)?;
    for (t, row) in words.chunks_exact_mut(STATS_PER_TOKEN).enumerate() {
        row.copy_from_slice(&[merged.lse[t], merged.lse1[t], merged.soft_part[t]]);
    }
    backend.upload(stats, 0, bytemuck::cast_slice(&words))
}
