//! The status buffer the device-resident kernels flag bad rows in, and its
//! translation into the host path's typed errors.
//!
//! Words (u32), as `shaders/resident_common.wgsl` and
//! `shaders/resident_status.wgsl` name them: first out-of-range id (flat
//! index `token·k + entry`), first row with a repeated id, a bad
//! probability or a zero sum, first bad weight, first row with non-finite
//! logits (all `NONE` until set, lowered with atomic min), whether `total`
//! was not positive and its bits, first bad label, then the detail the status kernel
//! records for the first bad teacher row or weight, then the coefficients
//! the stats kernel resolved.

use crate::error::{Error, Result};
use crate::terms::{TailMode, MASS_TOLERANCE};

/// Words in the status buffer.
pub const WORDS: usize = 32;
/// "Nothing flagged".
pub const NONE: u32 = u32::MAX;

// Word indices and detail kinds, as `resident_common.wgsl` and
// `resident_status.wgsl` name them; public for the CPU reference's kernels.
/// First out-of-range teacher id (flat index `token·k + entry`).
pub const S_ID_RANGE: usize = 0;
/// First teacher row with a repeated id, a bad probability or a zero sum.
pub const S_ROW: usize = 1;
/// First bad weight.
pub const S_WEIGHT: usize = 2;
/// First token with non-finite logits.
pub const S_LOGITS: usize = 3;
/// Non-zero when `total` was not positive.
pub const S_TOTAL_BAD: usize = 4;
/// `total`'s bits.
pub const S_TOTAL_BITS: usize = 5;
/// First token whose label is neither below V nor `NONE`.
pub const S_LABEL: usize = 6;
/// The detail's kind (0 until the status kernel records one), followed by
/// its row, two operands and value (`S_D_*`).
pub const S_KIND: usize = 8;
/// The detail's row.
pub const S_D_ROW: usize = 9;
/// The detail's first operand (a column or first index).
pub const S_D_A: usize = 10;
/// The detail's second operand (an id or second index).
pub const S_D_B: usize = 11;
/// The detail's value (bits of an f32, or a repeated id).
pub const S_D_VALUE: usize = 12;
/// The KL coefficient's multiplier the stats kernel resolved (f32 bits).
pub const S_COEF_MUL: usize = 16;
/// The dx multiplier the stats kernel resolved (f32 bits).
pub const S_DX_MUL: usize = 17;

/// Detail kind: a teacher id out of range.
pub const KIND_ID_RANGE: u32 = 1;
/// Detail kind: a repeated teacher id.
pub const KIND_DUPLICATE: u32 = 2;
/// Detail kind: a non-finite probability.
pub const KIND_PROB_NON_FINITE: u32 = 3;
/// Detail kind: a negative probability.
pub const KIND_PROB_NEGATIVE: u32 = 4;
/// Detail kind: a teacher row's probabilities sum to zero.
pub const KIND_ROW_SUM: u32 = 5;
/// Detail kind: a non-finite weight.
pub const KIND_WEIGHT_NON_FINITE: u32 = 6;
/// Detail kind: a negative weight.
pub const KIND_WEIGHT_NEGATIVE: u32 = 7;
/// Detail kind: a teacher log-probability above 0 or NaN.
pub const KIND_LOGPROB: u32 = 8;
/// Detail kind: a teacher row's mass above 1 in the bucket or none tail
/// mode (operand b: the tail mode's code).
pub const KIND_MASS: u32 = 9;
/// Detail kind: a label out of range (value: the label).
pub const KIND_LABEL: u32 = 10;

/// The status words of a buffer with nothing flagged.
pub fn cleared() -> [u32; WORDS] {
    let mut w = [0u32; WORDS];
    for i in [S_ID_RANGE, S_ROW, S_WEIGHT, S_LOGITS, S_LABEL] {
        w[i] = NONE;
    }
    w
}

/// The error the host path would give for what the status words flag, in
/// the host's order (the teacher, then the weights and `total`, then the
/// logits), or `Ok` when nothing is flagged. `vocab` and `k` are the
/// engine's vocabulary and the calls' teacher width.
pub fn to_result(words: &[u32; WORDS], vocab: usize) -> Result<()> {
    let row = words[S_D_ROW] as usize;
    let (a, b) = (words[S_D_A] as usize, words[S_D_B]);
    let value = f32::from_bits(words[S_D_VALUE]);
    match words[S_KIND] {
        0 => {}
        KIND_ID_RANGE => {
            return Err(Error::IdOutOfRange {
                row,
                col: a,
                id: i64::from(b),
                vocab,
            })
        }
        KIND_DUPLICATE => {
            return Err(Error::DuplicateId {
                row,
                id: i64::from(words[S_D_VALUE]),
                first: a,
                second: b as usize,
            })
        }
        KIND_PROB_NON_FINITE => return Err(Error::NonFiniteProbability { row, col: a, value }),
        KIND_PROB_NEGATIVE => return Err(Error::NegativeProbability { row, col: a, value }),
        KIND_ROW_SUM => {
            return Err(Error::ProbabilityRowSum {
                row,
                sum: f64::from(value),
            })
        }
        KIND_WEIGHT_NON_FINITE => return Err(Error::NonFiniteWeight { row, value }),
        KIND_WEIGHT_NEGATIVE => return Err(Error::NegativeWeight { row, value }),
        KIND_LOGPROB => return Err(Error::InvalidLogProbability { row, col: a, value }),
        KIND_MASS => {
            let tail = [TailMode::Renormalize, TailMode::Bucket, TailMode::Unnormalized]
                .into_iter()
                .find(|t| t.code() == b)
                .unwrap_or(TailMode::Bucket);
            return Err(Error::TeacherMassAboveOne {
                row,
                sum: f64::from(value),
                tolerance: MASS_TOLERANCE,
                tail: tail.name(),
            });
        }
        KIND_LABEL => {
            return Err(Error::LabelOutOfRange {
                row,
                label: i64::from(words[S_D_VALUE]),
                vocab,
            })
        }
        other => {
            return Err(Error::Backend {
                backend: "driver",
                message: format!("status buffer: unknown detail kind {other}"),
            })
        }
    }
    if [S_ID_RANGE, S_ROW, S_WEIGHT, S_LABEL].iter().any(|&i| words[i] != NONE) {
        // The status kernel runs after every head_kl_device call: a flag
        // without its detail means the buffer was overwritten.
        return Err(Error::Backend {
            backend: "driver",
            message: format!("status buffer: a bad row flagged without its detail ({words:?})"),
        });
    }
    if words[S_TOTAL_BAD] != 0 {
        return Err(Error::TotalNotPositive {
            value: f32::from_bits(words[S_TOTAL_BITS]),
        });
    }
    if words[S_LOGITS] != NONE {
        return Err(Error::NonFiniteHidden {
            token: words[S_LOGITS] as usize,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cleared_is_ok() {
        assert_eq!(to_result(&cleared(), 10), Ok(()));
    }

    #[test]
    fn detail_comes_before_logits_and_total() {
        let mut w = cleared();
        w[S_LOGITS] = 3;
        w[S_TOTAL_BAD] = 1;
        assert_eq!(to_result(&w, 10), Err(Error::TotalNotPositive { value: 0.0 }));
        w[S_TOTAL_BAD] = 0;
        assert_eq!(to_result(&w, 10), Err(Error::NonFiniteHidden { token: 3 }));
        w[S_ID_RANGE] = 9;
        w[S_KIND] = KIND_ID_RANGE;
        w[S_D_ROW] = 2;
        w[S_D_A] = 1;
        w[S_D_B] = 12;
        assert_eq!(
            to_result(&w, 10),
            Err(Error::IdOutOfRange {
                row: 2,
                col: 1,
                id: 12,
                vocab: 10
            })
        );
    }

    #[test]
    fn flag_without_detail_is_an_error() {
        let mut w = cleared();
        w[S_ROW] = 0;
        assert!(matches!(to_result(&w, 10), Err(Error::Backend { .. })));
    }
}
