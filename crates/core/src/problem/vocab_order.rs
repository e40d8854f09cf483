//! A vocabulary order fixed at head upload ([`VocabOrder`],
//! [`crate::engine::Engine::with_vocab_order`]): the head's rows are stored in that
//! order, so the dx GEMM's block filter (`crate::problem::filter`) finds the likely
//! tokens in fewer blocks. The teacher's ids and the labels are mapped to
//! positions on the way in and the top-k's positions back to ids on the
//! way out: a caller sees ids only.

use crate::error::{Error, Result};

/// A permutation of the vocabulary: position `p` holds token
/// `order()[p]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VocabOrder {
    /// Position → token id.
    order: Vec<u32>,
    /// Token id → position.
    position: Vec<u32>,
}

impl VocabOrder {
    /// The order `order` (position → id): each id of `0..order.len()`
    /// exactly once, else [`Error::InvalidVocabOrder`] naming the first
    /// position at fault.
    pub fn new(order: Vec<u32>) -> Result<Self> {
        let n = order.len();
        if u32::try_from(n).is_err() {
            return Err(Error::InvalidVocabOrder {
                position: n,
                id: 0,
                reason: "more than 2^32 entries",
            });
        }
        let mut position = vec![u32::MAX; n];
        for (p, &id) in order.iter().enumerate() {
            let Some(slot) = position.get_mut(id as usize) else {
                return Err(Error::InvalidVocabOrder {
                    position: p,
                    id: i64::from(id),
                    reason: "past the vocabulary",
                });
            };
            if *slot != u32::MAX {
                return Err(Error::InvalidVocabOrder {
                    position: p,
                    id: i64::from(id),
                    reason: "given twice",
                });
            }
            // n fits in u32 (checked above).
            *slot = p as u32;
        }
        Ok(Self { order, position })
    }

    /// The tokens by descending `score` (e.g. a unigram log-prior), ties
    /// by id: the likely tokens first, so they share blocks.
    pub fn by_score(score: &[f32]) -> Result<Self> {
        let mut order: Vec<u32> = (0..score.len() as u32).collect();
        order.sort_by(|&a, &b| score[b as usize].total_cmp(&score[a as usize]).then(a.cmp(&b)));
        Self::new(order)
    }

    /// Its vocabulary size.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether it orders no tokens.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Position → id.
    pub fn order(&self) -> &[u32] {
        &self.order
    }

    /// The position of token `id` (`id` below [`Self::len`]).
    pub fn position(&self, id: u32) -> u32 {
        self.position[id as usize]
    }

    /// The token at position `p` (`p` below [`Self::len`]).
    pub fn id(&self, p: u32) -> u32 {
        self.order[p as usize]
    }

    /// Whether it is the natural order (then nothing needs mapping).
    pub fn is_natural(&self) -> bool {
        self.order.iter().enumerate().all(|(p, &id)| p == id as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_are_permutations_and_map_both_ways() {
        let o = VocabOrder::new(vec![2, 0, 1]).unwrap();
        assert_eq!((o.position(2), o.id(0), o.len()), (0, 2, 3));
        assert!(!o.is_natural() && VocabOrder::new(vec![0, 1]).unwrap().is_natural());
        assert!(matches!(
            VocabOrder::new(vec![0, 3, 1]),
            Err(Error::InvalidVocabOrder { position: 1, id: 3, .. })
        ));
        assert!(matches!(
            VocabOrder::new(vec![1, 1, 0]),
            Err(Error::InvalidVocabOrder { position: 1, id: 1, .. })
        ));
        let by = VocabOrder::by_score(&[-3.0, 0.5, 0.5, 2.0]).unwrap();
        assert_eq!(by.order(), &[3, 1, 2, 0]);
    }
}
