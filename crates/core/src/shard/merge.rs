//! The merge of the shards' partials, on host arrays: what a trainer's
//! collective does between the two phases, for a single process that
//! drives several engines itself.

use super::{check_cover, GatherPartials, LossPartials, TopkPartials};
use crate::engine::{Gathered, LossOutput, TopK};
use crate::error::{Error, Result};
use crate::problem::{check_k, TopkOptions};

/// The merged statistics phase two takes, per token `[ntok]`: the global
/// log-sum-exps and the summed teacher terms (a trainer with its own
/// collective fills these from its all-reduce).
#[derive(Clone, Debug, PartialEq)]
pub struct LossStats {
    /// `logsumexp_j(s_j)` over the whole vocabulary, `s = z/τ`.
    pub lse: Vec<f32>,
    /// The same at τ = 1.
    pub lse1: Vec<f32>,
    /// `Σ_k q_k (log q_k − s_id_k)` over all the teacher's entries.
    pub soft_part: Vec<f32>,
}

impl LossStats {
    /// Tokens.
    pub fn ntok(&self) -> usize {
        self.lse.len()
    }
}

/// Two candidates' logits closer than this, relative (`|a − b| ≤
/// TIE_WINDOW · (|a| + |b| + 1)`), are a tie across shards, broken by the
/// lower id: each shard's logit comes back as `log p + lse` in f32, so a
/// tie of the device's logits can come back a few ulps apart.
pub const TIE_WINDOW: f64 = 1.0 / (1u64 << 20) as f64;

/// `log Σ_i exp(v_i)` in f64.
fn log_sum_exp(v: impl Iterator<Item = f64> + Clone) -> f64 {
    let m = v.clone().fold(f64::NEG_INFINITY, f64::max);
    if !m.is_finite() {
        return m;
    }
    m + v.map(|x| (x - m).exp()).sum::<f64>().ln()
}

fn same_tokens(expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::ShardMismatch {
            what: "tokens",
            expected,
            got,
        });
    }
    Ok(())
}

/// Merges the shards' loss partials: log-sum-exps by log-sum-exp, the
/// teacher terms by sum (in f64). Fails on partials of another token count
/// ([`Error::ShardMismatch`]) and on shards that overlap or leave rows
/// uncovered ([`Error::ShardOverlap`], [`Error::ShardGap`]).
pub fn merge_loss(parts: &[LossPartials]) -> Result<LossStats> {
    check_cover(&parts.iter().map(|p| p.shard).collect::<Vec<_>>())?;
    let ntok = parts[0].ntok();
    for p in parts {
        same_tokens(ntok, p.lse.len())?;
        same_tokens(ntok, p.lse1.len())?;
        same_tokens(ntok, p.soft_part.len())?;
    }
    let lse_of = |t: usize, pick: fn(&LossPartials) -> &[f32]| {
        log_sum_exp(parts.iter().map(move |p| f64::from(pick(p)[t]))) as f32
    };
    Ok(LossStats {
        lse: (0..ntok).map(|t| lse_of(t, |p| &p.lse)).collect(),
        lse1: (0..ntok).map(|t| lse_of(t, |p| &p.lse1)).collect(),
        soft_part: (0..ntok)
            .map(|t| parts.iter().map(|p| f64::from(p.soft_part[t])).sum::<f64>() as f32)
            .collect(),
    })
}

/// The shards' phase-two outputs as one: the per-token outputs and the mean
/// of the first (every shard computes them from the same merged
/// statistics), `dx` summed over the shards in f64 — what the trainer's
/// all-reduce of `dx` does.
pub fn merge_loss_outputs(parts: &[LossOutput]) -> Result<LossOutput> {
    let mut merged = LossOutput::default();
    merge_loss_outputs_into(parts, &mut merged)?;
    Ok(merged)
}

/// [`merge_loss_outputs`] into `merged`, whose buffers are reused from
/// call to call (as a training loop keeps its gradient buffer).
pub fn merge_loss_outputs_into(parts: &[LossOutput], merged: &mut LossOutput) -> Result<()> {
    let Some(first) = parts.first() else {
        return Err(Error::ShardMismatch {
            what: "shards",
            expected: 1,
            got: 0,
        });
    };
    let len = first.dx.len();
    for p in parts {
        same_tokens(first.loss.len(), p.loss.len())?;
        if p.dx.len() != len {
            return Err(Error::ShardMismatch {
                what: "dx length",
                expected: len,
                got: p.dx.len(),
            });
        }
    }
    let dx = &mut merged.dx;
    // Every element is written below: a kept dx of this length is not
    // zeroed first.
    if dx.len() != len {
        dx.clear();
        dx.resize(len, 0.0);
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    sum_dx_on(parts, dx, threads);
    merged.loss.clone_from(&first.loss);
    merged.lse.clone_from(&first.lse);
    merged.soft.clone_from(&first.soft);
    merged.hard.clone_from(&first.hard);
    merged.mean = first.mean;
    Ok(())
}

/// Sums the shards' dx into `dx` on up to `threads` threads, in element
/// ranges of at least 2^20 (each element's sum runs over the shards in
/// order, so the result does not depend on the split): one thread's pass
/// over the shards' dx (tens of MB each) was a large part of the sharded
/// call's host time.
fn sum_dx_on(parts: &[LossOutput], dx: &mut [f32], threads: usize) {
    const PIECE: usize = 1 << 20;
    let per_thread = dx.len().div_ceil(threads.max(1)).max(PIECE);
    if dx.len() <= per_thread {
        return sum_dx(parts, 0, dx);
    }
    std::thread::scope(|scope| {
        for (i, out) in dx.chunks_mut(per_thread).enumerate() {
            scope.spawn(move || sum_dx(parts, i * per_thread, out));
        }
    });
}

/// `out[i] = Σ_parts dx[start + i]`, in blocks through an f64 accumulator
/// that stays in cache (a whole f64 copy of dx, 168 MB at shape A, cost
/// more than the shards' kernels).
fn sum_dx(parts: &[LossOutput], start: usize, out: &mut [f32]) {
    const BLOCK: usize = 4096;
    let mut acc = [0f64; BLOCK];
    for (b, out) in out.chunks_mut(BLOCK).enumerate() {
        let at = start + b * BLOCK;
        let acc = &mut acc[..out.len()];
        acc.fill(0.0);
        for p in parts {
            for (a, &v) in acc.iter_mut().zip(&p.dx[at..at + out.len()]) {
                *a += f64::from(v);
            }
        }
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = a as f32;
        }
    }
}

/// Merges the shards' top-k candidates into the global top-k of
/// `opts.k` per token: by descending logit, ties (within [`TIE_WINDOW`]
/// across shards, exact within one) to the lowest id; probabilities the
/// softmax over the k, and with `opts.logprobs` the log-probabilities at
/// the global log-sum-exp. Fails on partials of another token count, too
/// few candidates for k, and shards that overlap or leave rows uncovered.
pub fn merge_topk(parts: &[TopkPartials], opts: &TopkOptions) -> Result<TopK> {
    let sorted = check_cover(&parts.iter().map(|p| p.shard).collect::<Vec<_>>())?;
    let vocab = sorted[0].vocab();
    let k = opts.k;
    check_k(k, vocab)?;
    let ntok = parts[0].ntok;
    for p in parts {
        same_tokens(ntok, p.ntok)?;
        same_tokens(ntok, p.lse.len())?;
        // Each shard must bring min(k, width) candidates, or the global
        // top-k may be missing from the union.
        let want = k.min(p.shard.width());
        if p.k < want {
            return Err(Error::ShardMismatch {
                what: "k",
                expected: want,
                got: p.k,
            });
        }
        for (what, len) in [("ids length", p.ids.len()), ("logits length", p.logits.len())] {
            if len != ntok * p.k {
                return Err(Error::ShardMismatch {
                    what,
                    expected: ntok * p.k,
                    got: len,
                });
            }
        }
    }
    let mut ids = Vec::with_capacity(ntok * k);
    let mut probs = Vec::with_capacity(ntok * k);
    let mut logprobs = Vec::new();
    let mut cand: Vec<(f64, u32)> = Vec::new();
    for t in 0..ntok {
        cand.clear();
        for p in parts {
            let row = t * p.k..(t + 1) * p.k;
            cand.extend(
                p.logits[row.clone()]
                    .iter()
                    .map(|&v| f64::from(v))
                    .zip(p.ids[row].iter().copied()),
            );
        }
        // -0.0 ties 0.0, as the kernels order them.
        cand.sort_by(|a, b| (b.0 + 0.0).total_cmp(&(a.0 + 0.0)).then(a.1.cmp(&b.1)));
        // Near-ties across shards to the lower id: an insertion pass (it
        // ends: each swap removes an inversion of ids).
        for i in 1..cand.len() {
            let mut j = i;
            while j > 0 && near(cand[j - 1].0, cand[j].0) && cand[j - 1].1 > cand[j].1 {
                cand.swap(j - 1, j);
                j -= 1;
            }
        }
        let top = &cand[..k];
        let m = top[0].0;
        let z: f64 = top.iter().map(|(v, _)| (v - m).exp()).sum();
        ids.extend(top.iter().map(|&(_, id)| id));
        probs.extend(top.iter().map(|(v, _)| ((v - m).exp() / z) as f32));
        if opts.logprobs {
            let lse = log_sum_exp(parts.iter().map(|p| f64::from(p.lse[t])));
            logprobs.extend(top.iter().map(|(v, _)| (v - lse) as f32));
        }
    }
    Ok(TopK {
        ids,
        probs,
        logprobs,
        ntok,
        k,
    })
}

fn near(a: f64, b: f64) -> bool {
    (a - b).abs() <= TIE_WINDOW * (a.abs() + b.abs() + 1.0)
}

/// Merges the shards' gather partials into [`Engine::logprobs_at`]'s
/// result: each token's lse by log-sum-exp over the shards, and at each id
/// the one shard holding it moves its log-probability to the global lse
/// (`-inf` for none). Fails on partials of other token or id counts and
/// on shards that overlap or leave rows uncovered.
///
/// [`Engine::logprobs_at`]: crate::engine::Engine::logprobs_at
pub fn merge_gather(parts: &[GatherPartials]) -> Result<Gathered> {
    check_cover(&parts.iter().map(|p| p.shard).collect::<Vec<_>>())?;
    let (ntok, k) = (parts[0].ntok, parts[0].k);
    for p in parts {
        same_tokens(ntok, p.ntok)?;
        same_tokens(ntok, p.lse.len())?;
        for (what, expected, got) in [("k", k, p.k), ("logprobs length", ntok * k, p.logprobs.len())] {
            if expected != got {
                return Err(Error::ShardMismatch { what, expected, got });
            }
        }
    }
    let mut out = Gathered {
        logprobs: vec![f32::NEG_INFINITY; ntok * k],
        lse: vec![0f32; ntok],
        ntok,
        k,
    };
    for t in 0..ntok {
        let lse = log_sum_exp(parts.iter().map(|p| f64::from(p.lse[t])));
        out.lse[t] = lse as f32;
        for p in parts {
            let shard_lse = f64::from(p.lse[t]);
            for (o, &v) in out.logprobs[t * k..(t + 1) * k]
                .iter_mut()
                .zip(&p.logprobs[t * k..(t + 1) * k])
            {
                if v > f32::NEG_INFINITY {
                    *o = (f64::from(v) + shard_lse - lse) as f32;
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::HeadShard;

    fn part(v0: usize, v1: usize, ids: Vec<u32>, logits: Vec<f32>, k: usize) -> TopkPartials {
        let ntok = ids.len() / k;
        TopkPartials {
            shard: HeadShard::new(v0, v1, 8).expect("shard"),
            ntok,
            k,
            ids,
            logits,
            lse: vec![0.0; ntok],
        }
    }

    #[test]
    fn a_near_tie_across_shards_goes_to_the_lower_id() {
        // id 6's logit came back one ulp above id 2's.
        let a = part(0, 4, vec![2, 1], vec![1.5, 0.5], 2);
        let b = part(4, 8, vec![6, 5], vec![f32::from_bits(1.5f32.to_bits() + 1), 0.0], 2);
        let top = merge_topk(&[b, a], &TopkOptions::new(2)).expect("merge");
        assert_eq!(top.ids, vec![2, 6]);
        let sum: f32 = top.probs.iter().sum();
        assert!((sum - 1.0).abs() < 1e-6);
    }

    #[test]
    fn partials_of_another_token_count_are_refused() {
        let a = part(0, 4, vec![2, 1], vec![1.5, 0.5], 2);
        let b = part(4, 8, vec![6, 5, 7, 4], vec![1.0, 0.0, 1.0, 0.0], 2);
        assert!(matches!(
            merge_topk(&[a, b], &TopkOptions::new(2)),
            Err(Error::ShardMismatch {
                what: "tokens",
                expected: 1,
                got: 2
            })
        ));
    }

    #[test]
    fn dx_sums_in_f64_across_blocks_and_reuses_the_output() {
        // Three shards, a length that is not a multiple of the block, and
        // values whose f32 sum in shard order would round differently.
        let len = 2 * 4096 + 37;
        let out = |dx: Vec<f32>| LossOutput {
            head_grad: Vec::new(),
            loss: vec![1.0; 2],
            lse: vec![2.0; 2],
            soft: vec![1.0; 2],
            hard: vec![0.0; 2],
            mean: 0.5,
            dx,
            filter: None,
        };
        let parts: Vec<LossOutput> = [1.0f32, 1e-8, -1.0]
            .iter()
            .enumerate()
            .map(|(s, &scale)| out((0..len).map(|i| scale * (1.0 + (i + s) as f32 * 1e-3)).collect()))
            .collect();
        let mut merged = out(vec![f32::NAN; 5]);
        merge_loss_outputs_into(&parts, &mut merged).expect("merge");
        assert_eq!(merged.dx.len(), len);
        for (i, &v) in merged.dx.iter().enumerate() {
            let want: f64 = parts.iter().map(|p| f64::from(p.dx[i])).sum();
            assert_eq!(v, want as f32, "element {i}");
        }
        assert_eq!((merged.loss.clone(), merged.mean), (vec![1.0; 2], 0.5));
        assert_eq!(merge_loss_outputs(&parts).expect("merge").dx, merged.dx);
    }

    #[test]
    fn dx_summed_on_threads_equals_one_thread() {
        // Past three ranges of 2^20, so three threads each take one and a
        // fourth the rest.
        let len = 3 * (1 << 20) + 4096 + 11;
        let parts: Vec<LossOutput> = [1.0f32, 1e-8, -1.0]
            .iter()
            .map(|&scale| LossOutput {
                dx: (0..len).map(|i| scale * (1.0 + (i % 977) as f32 * 1e-3)).collect(),
                ..LossOutput::default()
            })
            .collect();
        let (mut one, mut three) = (vec![0f32; len], vec![f32::NAN; len]);
        sum_dx_on(&parts, &mut one, 1);
        sum_dx_on(&parts, &mut three, 3);
        assert!(one == three, "the threaded sum differs");
        let i = len - 1;
        assert_eq!(one[i], parts.iter().map(|p| f64::from(p.dx[i])).sum::<f64>() as f32);
    }

    #[test]
    fn loss_partials_merge_by_log_sum_exp_and_sum() {
        let p = |v0, v1, lse: f32, soft: f32| LossPartials {
            shard: HeadShard::new(v0, v1, 8).expect("shard"),
            lse: vec![lse],
            lse1: vec![lse],
            soft_part: vec![soft],
        };
        let m = merge_loss(&[p(0, 3, 1.0, 0.25), p(3, 8, 1.0, 0.5)]).expect("merge");
        assert!((m.lse[0] - (1.0 + 2f32.ln())).abs() < 1e-6);
        assert!((m.soft_part[0] - 0.75).abs() < 1e-7);
        assert!(matches!(
            merge_loss(&[p(0, 3, 1.0, 0.0), p(2, 8, 1.0, 0.0)]),
            Err(Error::ShardOverlap { .. })
        ));
    }
}
