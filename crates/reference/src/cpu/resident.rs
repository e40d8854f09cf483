//! The device-resident kernels (`shaders/resident_*.wgsl`) on the CPU, so
//! the resident entry points run, and are held to the host path, without a
//! GPU. Same semantics as the shaders, sums in f64.

use half::{bf16, f16};
use headkl_core::resident::status::{
    FLAGGED_ROW, KIND_DUPLICATE, KIND_ID_RANGE, KIND_PROB_NEGATIVE, KIND_PROB_NON_FINITE, KIND_ROW_SUM,
    KIND_WEIGHT_NEGATIVE, KIND_WEIGHT_NON_FINITE, NONE, S_COEF_MUL, S_DX_MUL, S_D_VALUE, S_ID_RANGE, S_KIND, S_LABEL,
    S_LOGITS, S_ROW, S_TOTAL_BAD, S_TOTAL_BITS, S_WEIGHT,
};
use headkl_core::resident::status::{KIND_LABEL, KIND_LOGPROB, KIND_MASS};
use headkl_core::toolkit::params::{
    GatherRowsParams, HeadGradOutParams, HiddenInParams, LabelsInParams, LossOutParams, ShardRowsParams,
    StatusDetailParams, TeacherRowsParams, TopkOutParams, WeightStatsParams,
};
use headkl_core::toolkit::{Checked, GemmDesc, KernelId, Launch, RowCopyDesc, ShardStage};
use headkl_core::{HiddenDtype, ResidentBackend, Result, TailMode, MASS_TOLERANCE, NO_LABEL};

use super::{backend_error, f16s_mut, f32s, f32s_mut, CpuBackend, CpuBuffer};

/// A kernel's parameter block from the bytes the GPU backends bind.
fn block<P: bytemuck::Pod>(id: KernelId, bytes: &[u8]) -> Result<P> {
    bytemuck::try_pod_read_unaligned(bytes).map_err(|e| backend_error(format!("{id}: parameter block: {e}")))
}

/// The floor on a shard's softmax share α, 2^-40 (the shader's).
const ALPHA_FLOOR: f32 = 1.0 / (1u64 << 40) as f32;

fn bad_value(x: f32) -> bool {
    !x.is_finite() || (x < 0.0)
}

/// One teacher row's global ids to a shard's local ids, in place, the
/// probabilities times `inv_alpha` (`resident_shard.wgsl`'s `map_row`): an
/// entry outside `[v0, v1)` copies the row's first in-shard entry
/// (`duplicate`) or gets probability 0; with none it is column 0.
fn map_shard_row(ids: &mut [u32], probs: &mut [f32], (v0, v1): (u32, u32), inv_alpha: f32, duplicate: bool) {
    let inside = |id: u32| id >= v0 && id < v1;
    let first = (0..ids.len()).find(|&q| inside(ids[q]));
    let (first_id, first_p) = first.map_or((0, 0.0), |q| (ids[q] - v0, probs[q] * inv_alpha));
    let first_p = if duplicate { first_p } else { 0.0 };
    for (id, p) in ids.iter_mut().zip(probs.iter_mut()) {
        if inside(*id) {
            *id -= v0;
            *p *= inv_alpha;
        } else {
            (*id, *p) = (first_id, first_p);
        }
    }
}

fn lower(status: &mut [u32], word: usize, value: u32) {
    status[word] = status[word].min(value);
}

impl CpuBackend {
    /// Runs a checked resident kernel on its buffers (in binding order),
    /// reading the parameter block the GPU backends bind.
    pub(super) fn run_resident(&self, checked: &Checked, b: &[&CpuBuffer]) -> Result<()> {
        let bytes = checked.bytes(1);
        let id = checked.id();
        match id {
            KernelId::WeightStats => self.weight_stats(b, &block(id, &bytes)?),
            KernelId::TeacherRows => self.teacher_rows(b, &block(id, &bytes)?),
            KernelId::LabelsIn => self.labels_in(b, &block(id, &bytes)?),
            KernelId::HiddenIn => self.hidden_in(b, &block(id, &bytes)?),
            KernelId::LossOut => self.loss_out(b, &block(id, &bytes)?),
            KernelId::HeadGradOut => self.head_grad_out(b, &block(id, &bytes)?),
            KernelId::TopkOut => self.topk_out(b, &block(id, &bytes)?),
            KernelId::StatusDetail => self.status_detail(b, &block(id, &bytes)?),
            KernelId::ShardRows => self.shard_rows(b, &block(id, &bytes)?),
            KernelId::GatherIn => self.gather_in(b, &block(id, &bytes)?),
            KernelId::GatherOut => self.gather_out(b, &block(id, &bytes)?),
            _ => Err(backend_error(format!("{id} is not a resident kernel"))),
        }
    }

    fn weight_stats(&self, b: &[&CpuBuffer], p: &WeightStatsParams) -> Result<()> {
        let weights = b[0].read("weight_stats")?;
        let mut status = b[1].write("weight_stats")?;
        let w = f32s(&weights);
        let (mut sum, mut max, mut bad) = (0f64, 0f32, NONE);
        for t in 0..p.rows {
            let mut v = if p.has_weights != 0 { w[t as usize] } else { 1.0 };
            if bad_value(v) {
                bad = bad.min(t);
                v = 0.0;
            }
            sum += f64::from(v);
            max = max.max(v);
        }
        if bad != NONE {
            lower(&mut status, S_WEIGHT, bad);
        }
        let total = if p.total > 0.0 { p.total } else { sum as f32 };
        let gscale = if p.gscale > 0.0 {
            p.gscale
        } else if max > 0.0 {
            (16384.0 * f64::from(total) / f64::from(max) / f64::from(p.grad_bound.max(1.0))) as f32
        } else {
            1.0
        };
        // total not positive: every row of the call is flagged
        // (teacher_rows reads the marker here).
        let (coef_mul, dx_mul) = if total > 0.0 && total.is_finite() && gscale > 0.0 && gscale.is_finite() {
            ((gscale / total).to_bits(), p.inv_temperature / gscale)
        } else {
            status[S_TOTAL_BAD] = 1;
            status[S_TOTAL_BITS] = total.to_bits();
            (FLAGGED_ROW, 0.0)
        };
        status[S_COEF_MUL] = coef_mul;
        status[S_DX_MUL] = dx_mul.to_bits();
        Ok(())
    }

    fn teacher_rows(&self, b: &[&CpuBuffer], p: &TeacherRowsParams) -> Result<()> {
        let k = p.k as usize;
        let (ids_in, probs_in, weights) = (
            b[0].read("teacher_rows")?,
            b[1].read("teacher_rows")?,
            b[2].read("teacher_rows")?,
        );
        let mut status = b[3].write("teacher_rows")?;
        let mut ids_out = b[4].write("teacher_rows")?;
        let mut probs_out = b[5].write("teacher_rows")?;
        let mut coef = b[6].write("teacher_rows")?;
        let (probs_in, weights) = (f32s(&probs_in), f32s(&weights));
        // The KL kernel's per-row inputs [rows][2]: coefficient bits, label
        // (none: the resident path has no hard term).
        let (probs_out, row_in): (_, &mut [u32]) = (f32s_mut(&mut probs_out), &mut coef);
        // Compared as bits: FLAGGED_ROW is a NaN.
        let coef_mul = status[S_COEF_MUL];
        let logprobs = p.logprobs != 0;
        let renormalize = p.tail == TailMode::Renormalize.code();
        // (bad, probability) of a value in the teacher's form.
        let value = |v: f32| -> (bool, f64) {
            if logprobs {
                if v.is_nan() || v > 0.0 {
                    (true, 0.0)
                } else {
                    (false, f64::from(v).exp())
                }
            } else if bad_value(v) {
                (true, 0.0)
            } else {
                (false, f64::from(v))
            }
        };
        for row in 0..p.rows as usize {
            let ids = &ids_in[p.ids_offset as usize + row * k..][..k];
            let probs = &probs_in[p.probs_offset as usize + row * k..][..k];
            let first_range = ids.iter().position(|&id| id >= p.vocab);
            let repeated = (1..k).any(|q| ids[..q].contains(&ids[q]));
            let bad_prob = probs.iter().any(|&v| value(v).0);
            let sum: f64 = probs.iter().map(|&v| value(v).1).sum();
            let mass_bad = !renormalize && sum > 1.0 + MASS_TOLERANCE;
            let row_bad = repeated || bad_prob || !(sum > 0.0 && sum.is_finite()) || mass_bad;
            let any_bad = row_bad || first_range.is_some();
            let scale = if renormalize { 1.0 / sum } else { 1.0 };
            for q in 0..k {
                ids_out[row * k + q] = ids[q].min(p.vocab - 1);
                probs_out[row * k + q] = if any_bad {
                    0.0
                } else {
                    (value(probs[q]).1 * scale) as f32
                };
            }
            let token = p.token0 + row as u32;
            if let Some(q) = first_range {
                lower(&mut status, S_ID_RANGE, token * p.k + q as u32);
            }
            if row_bad {
                lower(&mut status, S_ROW, token);
            }
            let w = if p.has_weights != 0 {
                weights[p.weights_offset as usize + row]
            } else {
                1.0
            };
            // A bad teacher row or weight, or total not positive: flagged.
            row_in[row * 2] = if any_bad || bad_value(w) || coef_mul == FLAGGED_ROW {
                FLAGGED_ROW
            } else {
                (w * f32::from_bits(coef_mul)).to_bits()
            };
        }
        Ok(())
    }

    fn labels_in(&self, b: &[&CpuBuffer], p: &LabelsInParams) -> Result<()> {
        let labels = b[0].read("labels_in")?;
        let mut status = b[1].write("labels_in")?;
        let mut row_in = b[2].write("labels_in")?;
        for row in 0..p.rows as usize {
            let mut label = NO_LABEL;
            if p.has_labels != 0 {
                label = labels[p.labels_offset as usize + row];
                if label != NO_LABEL && label >= p.vocab {
                    lower(&mut status, S_LABEL, p.token0 + row as u32);
                    label = NO_LABEL;
                    row_in[row * 2] = FLAGGED_ROW;
                }
            }
            row_in[row * 2 + 1] = label;
        }
        Ok(())
    }

    fn hidden_in(&self, b: &[&CpuBuffer], p: &HiddenInParams) -> Result<()> {
        let src = b[0].read("hidden_in")?;
        let mut dst = b[1].write("hidden_in")?;
        let dst = f16s_mut(&mut dst);
        let halves: &[u16] = bytemuck::cast_slice(&src);
        let (rows, cols, ld) = (p.rows as usize, p.cols as usize, p.ld as usize);
        for r in 0..p.rows_padded as usize {
            for c in 0..ld {
                dst[r * ld + c] = if r < rows && c < cols {
                    let e = p.src_offset as usize + r * cols + c;
                    if p.dtype == HiddenDtype::F32.code() {
                        f16::from_f32(f32::from_bits(src[e]))
                    } else if p.dtype == HiddenDtype::F16.code() {
                        f16::from_bits(halves[e])
                    } else {
                        f16::from_f32(bf16::from_bits(halves[e]).to_f32())
                    }
                } else {
                    f16::ZERO
                };
            }
        }
        Ok(())
    }

    fn head_grad_out(&self, b: &[&CpuBuffer], p: &HeadGradOutParams) -> Result<()> {
        const K: &str = "head_grad_out";
        let piece = b[0].read(K)?;
        let status = b[1].read(K)?;
        let mut dst = b[2].write(K)?;
        let (piece, dst) = (f32s(&piece), f32s_mut(&mut dst));
        let mul = f32::from_bits(status[S_DX_MUL]);
        let (hs, ld, first) = (p.hs as usize, p.ld as usize, p.dst_offset as usize);
        for (r, row) in dst[first..first + p.rows as usize * hs]
            .chunks_exact_mut(hs)
            .enumerate()
        {
            for (o, &v) in row.iter_mut().zip(&piece[r * ld..r * ld + hs]) {
                *o = mul * v;
            }
        }
        Ok(())
    }

    fn loss_out(&self, b: &[&CpuBuffer], p: &LossOutParams) -> Result<()> {
        let (loss, dx) = (b[0].read("loss_out")?, b[1].read("loss_out")?);
        let mut status = b[2].write("loss_out")?;
        let (mut loss_dst, mut dx_dst) = (b[3].write("loss_out")?, b[4].write("loss_out")?);
        let (loss, dx) = (f32s(&loss), f32s(&dx));
        let (loss_dst, dx_dst) = (f32s_mut(&mut loss_dst), f32s_mut(&mut dx_dst));
        let mut terms_guard = if p.write_terms != 0 {
            Some(b[5].write("loss_out")?)
        } else {
            None
        };
        let mut terms_dst = terms_guard.as_deref_mut().map(f32s_mut);
        let dx_mul = f32::from_bits(status[S_DX_MUL]);
        let (cols, ld) = (p.hs as usize, p.ld as usize);
        for r in 0..p.rows as usize {
            // [rows][4]: loss, lse, soft, hard; the loss is word 0, the
            // marker's bits for a flagged row (NaN loss and terms; its
            // logits judged by its lse word).
            let l = loss[r * 4];
            let flagged = l.to_bits() == FLAGGED_ROW;
            loss_dst[p.loss_offset as usize + r] = l;
            if let Some(t) = terms_dst.as_deref_mut() {
                let o = (p.loss_offset as usize + r) * 3;
                if flagged {
                    t[o..o + 3].fill(l);
                } else {
                    t[o..o + 3].copy_from_slice(&loss[r * 4 + 1..r * 4 + 4]);
                }
            }
            let logits_word = if flagged { loss[r * 4 + 1] } else { l };
            if !logits_word.is_finite() {
                lower(&mut status, S_LOGITS, p.token0 + r as u32);
            }
            for c in 0..cols {
                let v = dx_mul * dx[r * ld + c];
                let o = &mut dx_dst[p.dx_offset as usize + r * cols + c];
                *o = if p.accumulate != 0 { *o + v } else { v };
            }
        }
        Ok(())
    }

    /// `resident_shard.wgsl`: one step of a shard's two-phase loss, each
    /// touching only the buffers it names (so unread slots may alias).
    fn shard_rows(&self, b: &[&CpuBuffer], p: &ShardRowsParams) -> Result<()> {
        const K: &str = "shard_rows";
        let stage = ShardStage::ALL
            .into_iter()
            .find(|s| s.code() == p.stage)
            .ok_or_else(|| backend_error(format!("{K}: no stage {}", p.stage)))?;
        let (rows, k) = (p.rows as usize, p.k as usize);
        let (v0, v1) = (p.v0, p.v1);
        let token = |r: usize| (p.token0 as usize + r) * 3;
        match stage {
            ShardStage::Map => {
                let (mut ids, mut probs) = (b[3].write(K)?, b[4].write(K)?);
                let probs = f32s_mut(&mut probs);
                for r in 0..rows {
                    let range = r * k..(r + 1) * k;
                    map_shard_row(&mut ids[range.clone()], &mut probs[range], (v0, v1), 1.0, false);
                }
            }
            ShardStage::Partials => {
                let (loss, probs) = (b[0].read(K)?, b[4].read(K)?);
                let (mut partials, mut status) = (b[2].write(K)?, b[6].write(K)?);
                let (loss, probs, partials) = (f32s(&loss), f32s(&probs), f32s_mut(&mut partials));
                for r in 0..rows {
                    let lse = loss[r * 4 + 1];
                    let mass: f32 = probs[r * k..(r + 1) * k].iter().sum();
                    let t = token(r);
                    partials[t] = lse;
                    if p.lse1_too != 0 {
                        partials[t + 1] = lse;
                    }
                    partials[t + 2] = loss[r * 4 + 2] - mass * lse;
                    if !lse.is_finite() {
                        lower(&mut status, S_LOGITS, p.token0 + r as u32);
                    }
                }
            }
            ShardStage::Lse1 => {
                let loss = b[0].read(K)?;
                let mut partials = b[2].write(K)?;
                let (loss, partials) = (f32s(&loss), f32s_mut(&mut partials));
                for r in 0..rows {
                    partials[token(r) + 1] = loss[r * 4 + 1];
                }
            }
            ShardStage::MapFinish => {
                let (stats, partials) = (b[1].read(K)?, b[2].read(K)?);
                let (mut ids, mut probs, mut row_in) = (b[3].write(K)?, b[4].write(K)?, b[5].write(K)?);
                let (stats, partials, probs) = (f32s(&stats), f32s(&partials), f32s_mut(&mut probs));
                for r in 0..rows {
                    let t = token(r);
                    let alpha = (partials[t] - stats[t]).exp().max(ALPHA_FLOOR);
                    let range = r * k..(r + 1) * k;
                    map_shard_row(&mut ids[range.clone()], &mut probs[range], (v0, v1), 1.0 / alpha, true);
                    // A flagged row's word stays the marker.
                    if row_in[r * 2] != FLAGGED_ROW {
                        row_in[r * 2] = (f32::from_bits(row_in[r * 2]) * alpha).to_bits();
                    }
                }
            }
            ShardStage::Loss => {
                let stats = b[1].read(K)?;
                let mut loss = b[0].write(K)?;
                let (stats, loss) = (f32s(&stats), f32s_mut(&mut loss));
                for r in 0..rows {
                    // Bad logits, or a flagged row: as the kernel wrote it.
                    if loss[r * 4].is_finite() {
                        let t = token(r);
                        let l = stats[t + 2] + stats[t];
                        loss[r * 4..r * 4 + 4].copy_from_slice(&[l, stats[t + 1], l, 0.0]);
                    }
                }
            }
        }
        Ok(())
    }

    fn topk_out(&self, b: &[&CpuBuffer], p: &TopkOutParams) -> Result<()> {
        let (ids, probs) = (b[0].read("topk_out")?, b[1].read("topk_out")?);
        let mut status = b[2].write("topk_out")?;
        let (mut ids_dst, mut probs_dst) = (b[3].write("topk_out")?, b[4].write("topk_out")?);
        let probs = f32s(&probs);
        let probs_dst = f32s_mut(&mut probs_dst);
        let k = p.k as usize;
        for i in 0..p.rows as usize * k {
            ids_dst[p.ids_offset as usize + i] = ids[i];
            probs_dst[p.probs_offset as usize + i] = probs[i];
            if i % k == 0 && !probs[i].is_finite() {
                lower(&mut status, S_LOGITS, p.token0 + (i / k) as u32);
            }
        }
        Ok(())
    }

    fn gather_in(&self, b: &[&CpuBuffer], p: &GatherRowsParams) -> Result<()> {
        let ids = b[0].read("gather_in")?;
        let mut status = b[1].write("gather_in")?;
        let mut chunk = b[2].write("gather_in")?;
        let (k, cols) = (p.k as usize, p.k as usize + 1);
        for i in 0..p.rows as usize * cols {
            let (row, col) = (i / cols, i % cols);
            let mut id = NONE;
            if col < k {
                id = ids[p.ids_offset as usize + row * k + col];
                if id != NONE && id >= p.vocab {
                    lower(&mut status, S_ID_RANGE, (p.token0 + row as u32) * p.k + col as u32);
                    id = NONE;
                }
            }
            chunk[i] = id;
        }
        Ok(())
    }

    fn gather_out(&self, b: &[&CpuBuffer], p: &GatherRowsParams) -> Result<()> {
        let values = b[0].read("gather_out")?;
        let mut status = b[1].write("gather_out")?;
        let (mut logprobs, mut lse) = (b[2].write("gather_out")?, b[3].write("gather_out")?);
        let values = f32s(&values);
        let (logprobs, lse) = (f32s_mut(&mut logprobs), f32s_mut(&mut lse));
        let (k, cols) = (p.k as usize, p.k as usize + 1);
        for (i, &v) in values[..p.rows as usize * cols].iter().enumerate() {
            let (row, col) = (i / cols, i % cols);
            let token = p.token0 + row as u32;
            if col < k {
                logprobs[p.out_offset as usize + row * k + col] = v;
                if col == 0 && v.is_nan() {
                    lower(&mut status, S_LOGITS, token);
                }
            } else {
                lse[token as usize] = v;
                if !v.is_finite() {
                    lower(&mut status, S_LOGITS, token);
                }
            }
        }
        Ok(())
    }

    fn status_detail(&self, b: &[&CpuBuffer], p: &StatusDetailParams) -> Result<()> {
        let (ids, probs, weights, labels) = (
            b[0].read("status_detail")?,
            b[1].read("status_detail")?,
            b[2].read("status_detail")?,
            b[4].read("status_detail")?,
        );
        let mut status = b[3].write("status_detail")?;
        let (probs, weights) = (f32s(&probs), f32s(&weights));
        if status[S_KIND] != 0 {
            return Ok(());
        }
        let k = p.k as usize;
        let (logprobs, tail) = (p.logprobs != 0, p.tail);
        let flat = status[S_ID_RANGE];
        let row = status[S_ROW];
        let wrow = status[S_WEIGHT];
        let lrow = status[S_LABEL];
        let mut record = |kind: u32, row: u32, a: u32, b: u32, value: u32| {
            status[S_KIND..=S_D_VALUE].copy_from_slice(&[kind, row, a, b, value]);
        };
        if flat != NONE {
            let id = ids[flat as usize];
            record(KIND_ID_RANGE, flat / p.k, flat % p.k, id, 0);
        } else if row != NONE && row < p.rows {
            let r = row as usize;
            let ids = &ids[r * k..][..k];
            let probs = &probs[r * k..][..k];
            // The smallest repeated id, at its first two entries.
            let dup = (1..k)
                .filter_map(|q| ids[..q].iter().position(|&i| i == ids[q]).map(|j| (ids[q], j, q)))
                .min();
            let bad_value_at = |q: usize| {
                let v = probs[q];
                if logprobs {
                    (v.is_nan() || v > 0.0).then_some(KIND_LOGPROB)
                } else if !v.is_finite() {
                    Some(KIND_PROB_NON_FINITE)
                } else {
                    (v < 0.0).then_some(KIND_PROB_NEGATIVE)
                }
            };
            if let Some((id, first, second)) = dup {
                record(KIND_DUPLICATE, row, first as u32, second as u32, id);
            } else if let Some((q, kind)) = (0..k).find_map(|q| bad_value_at(q).map(|kind| (q, kind))) {
                record(kind, row, q as u32, 0, probs[q].to_bits());
            } else {
                let sum: f64 = if logprobs {
                    probs.iter().map(|&v| f64::from(v).exp()).sum()
                } else {
                    probs.iter().map(|&v| f64::from(v)).sum()
                };
                if tail != TailMode::Renormalize.code() && sum > 1.0 + MASS_TOLERANCE && sum.is_finite() {
                    record(KIND_MASS, row, 0, tail, (sum as f32).to_bits());
                } else {
                    record(KIND_ROW_SUM, row, 0, 0, (sum as f32).to_bits());
                }
            }
        } else if wrow != NONE && wrow < p.rows && p.has_weights != 0 {
            let w = weights[wrow as usize];
            record(
                if w.is_finite() {
                    KIND_WEIGHT_NEGATIVE
                } else {
                    KIND_WEIGHT_NON_FINITE
                },
                wrow,
                0,
                0,
                w.to_bits(),
            );
        } else if lrow != NONE && lrow < p.rows && p.has_labels != 0 {
            let label = labels[lrow as usize];
            record(KIND_LABEL, lrow, 0, 0, label);
        }
        Ok(())
    }
}

impl ResidentBackend for CpuBackend {
    fn buffer_len(&self, buffer: &CpuBuffer) -> u64 {
        buffer.bytes
    }

    fn buffer_offset(&self, _buffer: &CpuBuffer) -> u64 {
        0
    }

    fn submit(&self) -> Result<()> {
        Ok(())
    }

    /// A window shares the buffer's words: any whole-word range inside it.
    fn window(&self, buffer: &CpuBuffer, offset: u64, len: u64) -> Option<CpuBuffer> {
        buffer.window(offset, len)
    }

    fn defers_head_grad(&self) -> bool {
        true
    }

    /// The rows are read out, then written: source and destination may be
    /// windows of one storage, but not overlapping ones.
    fn copy_rows(&self, src: &CpuBuffer, dst: &CpuBuffer, d: &RowCopyDesc) -> Result<()> {
        const K: &str = "copy_rows";
        d.check(src.bytes, dst.bytes)?;
        if d.rows == 0 {
            return Ok(());
        }
        let span = |offset: u64, pitch: usize| offset..offset + ((d.rows - 1) * pitch + d.row_bytes) as u64;
        let (from, to) = (span(d.src_offset, d.src_pitch), span(d.dst_offset, d.dst_pitch));
        if src.overlaps(&from, dst, &to) {
            return Err(backend_error(format!(
                "{K}: source bytes {from:?} overlap destination bytes {to:?}"
            )));
        }
        let rows: Vec<u8> = {
            let words = src.read(K)?;
            let bytes: &[u8] = bytemuck::cast_slice(&words[..]);
            (0..d.rows)
                .flat_map(|r| {
                    let at = d.src_offset as usize + r * d.src_pitch;
                    bytes[at..at + d.row_bytes].iter().copied()
                })
                .collect()
        };
        let mut words = dst.write(K)?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words[..]);
        for (r, row) in rows.chunks_exact(d.row_bytes).enumerate() {
            let at = d.dst_offset as usize + r * d.dst_pitch;
            bytes[at..at + d.row_bytes].copy_from_slice(row);
        }
        Ok(())
    }

    /// A and B are copied out first, as they may be windows of C's
    /// storage (the parked inputs of a deferred head gradient), but never
    /// of C's own words: that would be a race on a device.
    fn gemm_scaled_by_word(
        &self,
        (a, b, c): (&CpuBuffer, &CpuBuffer, &CpuBuffer),
        desc: &GemmDesc,
        (scale, word): (&CpuBuffer, usize),
    ) -> Result<()> {
        const K: &str = "gemm_scaled_by_word";
        let launch = Launch::Gemm { a, b, c, desc: *desc };
        launch.check(self.info.max_binding_bytes)?;
        let mul = scale.read(K)?.get(word).copied().ok_or_else(|| {
            backend_error(format!(
                "{K}: word {word} is past the scale buffer's {} bytes",
                scale.bytes
            ))
        })?;
        let whole = |x: &CpuBuffer| 0..x.bytes;
        for (name, x) in [("A", a), ("B", b)] {
            if x.overlaps(&whole(x), c, &whole(c)) {
                return Err(backend_error(format!("{K}: {name} overlaps C")));
            }
        }
        let (a_words, b_words) = (a.read(K)?.to_vec(), b.read(K)?.to_vec());
        let mut out = c.write(K)?;
        let desc = GemmDesc {
            alpha: desc.alpha * f32::from_bits(mul),
            ..*desc
        };
        crate::cpu::kernels::gemm(
            bytemuck::cast_slice(&a_words),
            bytemuck::cast_slice(&b_words),
            f32s_mut(&mut out),
            &desc,
            self.precision,
        );
        Ok(())
    }
}
