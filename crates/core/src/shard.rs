//! Vocabulary-parallel: a head sharded across engines (or ranks), each
//! holding rows `[v0, v1)` of a head of `V` rows, the loss and the top-k
//! computed in two phases with the trainer's own collective (or
//! [`merge_loss`] / [`merge_topk`]) between them.
//!
//! **The loss, per call.** Phase one ([`ShardEngine::loss_partials`])
//! computes the shard's logits `s = x·W_sᵀ/τ` and returns per token
//! ([`LossPartials`]): the shard's log-sum-exp at τ (`lse`), at τ = 1
//! (`lse1`, the `lse` output), and the teacher's in-shard terms
//! `Σ_{id_k ∈ shard} q_k (log q_k − s_id_k)` (`soft_part`). The trainer
//! all-reduces them: the log-sum-exps by MAX, then SUM of
//! `exp(lse_s − max)` (two floats per token each), `soft_part` by SUM
//! ([`LossStats`]). Phase two ([`ShardEngine::loss_finish`]) takes the
//! merged statistics and writes the per-token loss `soft_part + lse` (the
//! whole loss: the same on every shard, from the merged statistics) and
//! **the shard's part of `dx`, overwritten**: `dx_s = G_s·W_s` with
//! `G_s = c·(p_S − q)` on the shard's columns, `p_S = exp(s − lse)` at the
//! global `lse`; the trainer sums `dx` over the shards (all-reduce SUM, as
//! it does for any tensor-parallel input gradient; the head is frozen, so
//! there is no `dW`).
//!
//! Why per call and not per chunk: the trainer's collective then runs once
//! per step on `ntok` floats, not once per chunk inside the library, and
//! the library needs no callback into the trainer. The cost is that the
//! shard's logits must live from phase one to phase two: they are kept in
//! device memory (one buffer per chunk) when the chunk scratch plus all
//! kept logits fit [`crate::problem::LossConfig::budget_bytes`]; otherwise phase two
//! recomputes them (a third GEMM: the hidden rows are passed again).
//! [`ShardEngine::set_keep_logits`] turns keeping off.
//!
//! Phase two reuses the loss kernel unchanged: with the per-row
//! coefficient `c·α` and the teacher's in-shard probabilities `q/α`, where
//! `α = exp(lse_s − lse)` is the shard's share of the softmax, the kernel's
//! `c·α·(softmax_s − q/α)` is exactly `c·(p_S − q)` (α is floored at
//! `2^-40`, an error below the f16 gradient's resolution).
//!
//! **Terms.** The default loss (renormalized tail, teacher probabilities or
//! log-probabilities), token weights, `total`, `gscale` and the
//! temperature work sharded. The other terms (tail `bucket`/`none`, the
//! hard term and its labels, z-loss, softcap, a soft weight other than 1)
//! are refused with [`Error::ShardUnsupported`] naming the option.
//!
//! **On device buffers.** [`ShardEngine::loss_partials_device`] and
//! [`ShardEngine::loss_finish_device`] run the same two phases on a
//! trainer's buffers (partials and merged statistics f32 `[ntok][3]`,
//! [`STATS_PER_TOKEN`]), and [`merge_loss_device`] merges partials held in
//! device buffers for engines in one process (`resident` module docs).
//!
//! **Top-k.** [`ShardEngine::topk_partials`] returns the shard's top-k
//! candidates (global ids, their logits at τ) and its log-sum-exp at τ
//! ([`TopkPartials`]); the trainer all-gathers them and [`merge_topk`]
//! picks the global top-k (ties: lowest id first, as unsharded) with
//! probabilities from the global log-sum-exp.

mod engine;
mod merge;
mod ranks;
mod resident;

pub use engine::{check_loss_terms, ShardEngine};
pub use merge::{
    merge_gather, merge_loss, merge_loss_outputs, merge_loss_outputs_into, merge_topk, LossStats, TIE_WINDOW,
};
pub use ranks::two_phases_on_threads;
pub use resident::{merge_loss_device, STATS_PER_TOKEN};

use crate::align::ALIGN;
use crate::error::{Error, Result};

/// Rows `[v0, v1)` of a head of `vocab` rows: one engine's (or rank's)
/// share of the vocabulary. Teacher ids stay global.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadShard {
    v0: usize,
    v1: usize,
    vocab: usize,
}

impl HeadShard {
    /// Rows `[v0, v1)` of a head of `vocab` rows; an empty range or one past
    /// the head is [`Error::ShardRange`].
    pub fn new(v0: usize, v1: usize, vocab: usize) -> Result<Self> {
        if !(v0 < v1 && v1 <= vocab) {
            return Err(Error::ShardRange { v0, v1, vocab });
        }
        Ok(Self { v0, v1, vocab })
    }

    /// `n` shards covering `vocab` rows, split evenly to [`ALIGN`] (16)
    /// rows: each shard but the last has `round_up(ceil(V / n), 16)` rows,
    /// the last the rest. Fails where that leaves a shard empty (`V` too
    /// small for `n`).
    pub fn even(vocab: usize, n: usize) -> Result<Vec<Self>> {
        if n == 0 {
            return Err(Error::ShardRange { v0: 0, v1: 0, vocab });
        }
        let per = crate::align::round_up(vocab.div_ceil(n), ALIGN);
        (0..n)
            .map(|i| Self::new((i * per).min(vocab), ((i + 1) * per).min(vocab), vocab))
            .collect()
    }

    /// Shards split at `cuts` (strictly increasing rows inside `(0, V)`):
    /// `[0, cuts[0]), [cuts[0], cuts[1]), …, [cuts[last], V)`.
    pub fn split_at(vocab: usize, cuts: &[usize]) -> Result<Vec<Self>> {
        let mut bounds = Vec::with_capacity(cuts.len() + 2);
        bounds.push(0);
        bounds.extend_from_slice(cuts);
        bounds.push(vocab);
        bounds.windows(2).map(|w| Self::new(w[0], w[1], vocab)).collect()
    }

    /// First row.
    pub fn v0(&self) -> usize {
        self.v0
    }

    /// One past the last row.
    pub fn v1(&self) -> usize {
        self.v1
    }

    /// The whole head's rows `V`.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Rows in this shard.
    pub fn width(&self) -> usize {
        self.v1 - self.v0
    }

    /// Whether global row `id` is in this shard.
    pub fn contains(&self, id: usize) -> bool {
        (self.v0..self.v1).contains(&id)
    }
}

/// Checks that `shards` (in any order) cover their head exactly once:
/// one `V`, no overlap, no gap. Returns them sorted by `v0`.
pub fn check_cover(shards: &[HeadShard]) -> Result<Vec<HeadShard>> {
    let Some(first) = shards.first() else {
        return Err(Error::ShardMismatch {
            what: "shards",
            expected: 1,
            got: 0,
        });
    };
    let vocab = first.vocab;
    if let Some(s) = shards.iter().find(|s| s.vocab != vocab) {
        return Err(Error::ShardMismatch {
            what: "vocab",
            expected: vocab,
            got: s.vocab,
        });
    }
    let mut sorted = shards.to_vec();
    sorted.sort_by_key(|s| (s.v0, s.v1));
    let mut covered = 0;
    for (i, s) in sorted.iter().enumerate() {
        if s.v0 < covered {
            let prev = sorted[i - 1];
            return Err(Error::ShardOverlap {
                first_v0: prev.v0,
                first_v1: prev.v1,
                second_v0: s.v0,
                second_v1: s.v1,
            });
        }
        if s.v0 > covered {
            return Err(Error::ShardGap {
                from: covered,
                to: s.v0,
                vocab,
            });
        }
        covered = s.v1;
    }
    if covered < vocab {
        return Err(Error::ShardGap {
            from: covered,
            to: vocab,
            vocab,
        });
    }
    Ok(sorted)
}

/// One shard's phase-one statistics of the loss, per token `[ntok]`
/// ([`ShardEngine::loss_partials`]); what the trainer's collective merges.
#[derive(Clone, Debug, PartialEq)]
pub struct LossPartials {
    /// The shard they come from.
    pub shard: HeadShard,
    /// `logsumexp_j∈shard(s_j)`, `s = z/τ` (merge: log-sum-exp; all-reduce
    /// MAX, then SUM of `exp(lse − max)`).
    pub lse: Vec<f32>,
    /// The same at τ = 1, `logsumexp_j∈shard(z_j)` (merged alike; equal to
    /// `lse` at τ = 1).
    pub lse1: Vec<f32>,
    /// The teacher's in-shard terms `Σ_{id_k ∈ shard} q_k (log q_k − s_id_k)`
    /// (merge: SUM).
    pub soft_part: Vec<f32>,
}

impl LossPartials {
    /// Tokens.
    pub fn ntok(&self) -> usize {
        self.lse.len()
    }
}

/// One shard's top-k candidates ([`ShardEngine::topk_partials`]); what the
/// trainer's collective all-gathers.
#[derive(Clone, Debug, PartialEq)]
pub struct TopkPartials {
    /// The shard they come from.
    pub shard: HeadShard,
    /// Tokens.
    pub ntok: usize,
    /// Candidates per token: `min(k, shard width)`.
    pub k: usize,
    /// Global ids `[ntok][k]`, by descending logit (ties lowest id first).
    pub ids: Vec<u32>,
    /// Their logits at τ, `s = z/τ` `[ntok][k]`.
    pub logits: Vec<f32>,
    /// `logsumexp_j∈shard(s_j)` `[ntok]`.
    pub lse: Vec<f32>,
}

/// One shard's part of a gather ([`ShardEngine::gather_partials`]), for
/// [`merge_gather`]: what a trainer's collective all-gathers (or, the
/// log-probabilities being `-inf` off the shard, all-reduces by max after
/// adding the lse).
#[derive(Clone, Debug, PartialEq)]
pub struct GatherPartials {
    /// The shard they come from.
    pub shard: HeadShard,
    /// Tokens.
    pub ntok: usize,
    /// Ids per token.
    pub k: usize,
    /// At each id inside the shard, its log-probability over the shard's
    /// rows alone, `s_id − logsumexp_j∈shard(s_j)`; `-inf` at ids outside
    /// it and at none `[ntok][k]`.
    pub logprobs: Vec<f32>,
    /// `logsumexp_j∈shard(s_j)` `[ntok]`.
    pub lse: Vec<f32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_split_aligns_to_16_rows_and_covers_the_head() {
        let s = HeadShard::even(1000, 3).expect("split");
        let spans: Vec<_> = s.iter().map(|s| (s.v0(), s.v1())).collect();
        assert_eq!(spans, vec![(0, 336), (336, 672), (672, 1000)]);
        assert_eq!(check_cover(&s).expect("cover").len(), 3);
        assert!(matches!(HeadShard::even(20, 3), Err(Error::ShardRange { .. })));
    }

    #[test]
    fn cover_errors_name_the_rows() {
        let a = HeadShard::new(0, 100, 300).expect("a");
        let b = HeadShard::new(90, 300, 300).expect("b");
        let c = HeadShard::new(120, 300, 300).expect("c");
        assert!(matches!(
            check_cover(&[b, a]),
            Err(Error::ShardOverlap {
                first_v0: 0,
                second_v0: 90,
                ..
            })
        ));
        assert!(matches!(
            check_cover(&[a, c]),
            Err(Error::ShardGap { from: 100, to: 120, .. })
        ));
        assert!(matches!(
            check_cover(&[a]),
            Err(Error::ShardGap { from: 100, to: 300, .. })
        ));
        assert!(matches!(
            HeadShard::new(200, 400, 300),
            Err(Error::ShardRange {
                v0: 200,
                v1: 400,
                vocab: 300
            })
        ));
    }
}
