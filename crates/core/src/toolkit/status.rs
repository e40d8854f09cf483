//! The status buffer the device-resident kernels flag bad rows in, and its
//! translation into the host path's typed errors.
//!
//! Words (u32), generated into every resident shader under the same names
//! ([`wgsl`]): first out-of-range id (flat
//! index `token·k + entry`), first row with a repeated id, a bad
//! probability or a zero sum, first bad weight, first row with non-finite
//! logits (all `NONE` until set, lowered with atomic min), whether `total`
//! was not positive and its bits, first bad label, then the detail the status kernel
//! records for the first bad teacher row or weight, then the coefficients
//! the stats kernel resolved.
//!
//! A row the kernels flag also carries the flag through the chunk's
//! scratch: its KL coefficient word is [`FLAGGED_ROW`] (see there), so its
//! dx row is 0 and its per-token loss NaN without any host wait.

use crate::error::{Error, Result};
use crate::problem::terms::{TailMode, MASS_TOLERANCE};

/// Words in the status buffer.
pub const WORDS: usize = 32;
/// "Nothing flagged".
pub const NONE: u32 = u32::MAX;

/// The KL coefficient word (word 0 of the loss kernel's per-row inputs
/// `[rows][2]`) of a row the device flagged: a quiet NaN with a payload of
/// its own (not the canonical `0x7fc00000` an arithmetic NaN usually is),
/// which no host path writes (its coefficients are finite).
///
/// `teacher_rows` writes it for a bad teacher row or a bad weight, and for
/// every row when `total` is not positive (the stats kernel leaves it in
/// [`S_COEF_MUL`] then); `labels_in` for a bad label. Every reader compares
/// the word's bits with it (never a float NaN test, which a compiler may
/// fold): `kl_rows` writes a zero gradient row (and an all-clear filter
/// mask) whatever the row's logits, and this word's bits as the row's loss
/// word, keeping its lse, soft and hard words; `shard_rows` leaves the
/// word as it is where it scales a coefficient and the loss row as the
/// kernel wrote it; `loss_out` writes NaN into the caller's loss and terms
/// for the row and flags [`S_LOGITS`] only if the row's lse word is not
/// finite (its logits were bad too), so the status words stay truthful. A
/// flagged row's dx is then exactly 0 (nothing added when accumulating) and
/// any mean over the call's losses is NaN; [`to_result`] still reports the
/// first bad row's detail.
pub const FLAGGED_ROW: u32 = 0x7fc0_0bad;

// Word indices and detail kinds: the shaders get them from [`wgsl`]; public
// for the CPU reference's kernels.
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

/// Every word index, by the name the shaders use.
pub const WORD_NAMES: [(&str, usize); 14] = [
    ("S_ID_RANGE", S_ID_RANGE),
    ("S_ROW", S_ROW),
    ("S_WEIGHT", S_WEIGHT),
    ("S_LOGITS", S_LOGITS),
    ("S_TOTAL_BAD", S_TOTAL_BAD),
    ("S_TOTAL_BITS", S_TOTAL_BITS),
    ("S_LABEL", S_LABEL),
    ("S_KIND", S_KIND),
    ("S_D_ROW", S_D_ROW),
    ("S_D_A", S_D_A),
    ("S_D_B", S_D_B),
    ("S_D_VALUE", S_D_VALUE),
    ("S_COEF_MUL", S_COEF_MUL),
    ("S_DX_MUL", S_DX_MUL),
];

/// Every detail kind, by the name the shaders use.
pub const KIND_NAMES: [(&str, u32); 10] = [
    ("KIND_ID_RANGE", KIND_ID_RANGE),
    ("KIND_DUPLICATE", KIND_DUPLICATE),
    ("KIND_PROB_NON_FINITE", KIND_PROB_NON_FINITE),
    ("KIND_PROB_NEGATIVE", KIND_PROB_NEGATIVE),
    ("KIND_ROW_SUM", KIND_ROW_SUM),
    ("KIND_WEIGHT_NON_FINITE", KIND_WEIGHT_NON_FINITE),
    ("KIND_WEIGHT_NEGATIVE", KIND_WEIGHT_NEGATIVE),
    ("KIND_LOGPROB", KIND_LOGPROB),
    ("KIND_MASS", KIND_MASS),
    ("KIND_LABEL", KIND_LABEL),
];

/// The codes the resident kernels compare parameters against, by the names
/// the shaders use: the tail mode that renormalizes and the hidden rows'
/// element types.
pub fn code_names() -> [(&'static str, u32); 4] {
    [
        ("TAIL_RENORMALIZE", TailMode::Renormalize.code()),
        ("DTYPE_F32", super::resident_kernels::HiddenDtype::F32.code()),
        ("DTYPE_F16", super::resident_kernels::HiddenDtype::F16.code()),
        ("DTYPE_BF16", super::resident_kernels::HiddenDtype::Bf16.code()),
    ]
}

/// The WGSL constant `FLAGGED_ROW` ([`FLAGGED_ROW`]): part of [`wgsl`],
/// and what `kl_rows.wgsl` (a driver kernel, which has no status buffer)
/// gets in place of [`crate::toolkit::kernels::ROW_MARKER`].
pub fn row_wgsl() -> String {
    format!("const FLAGGED_ROW: u32 = 0x{FLAGGED_ROW:08x}u;\n")
}

/// The WGSL constants every resident shader gets in place of
/// [`crate::toolkit::kernels::RESIDENT_MARKER`]: `NONE`, `FLAGGED_ROW`, the words,
/// the detail kinds, the codes and `MASS_TOLERANCE`, so the shaders cannot
/// drift from this file.
pub fn wgsl() -> String {
    let mut out = format!("const NONE: u32 = {NONE}u;\n");
    out.push_str(&row_wgsl());
    for (name, word) in WORD_NAMES {
        out.push_str(&format!("const {name}: u32 = {word}u;\n"));
    }
    for (name, value) in KIND_NAMES.into_iter().chain(code_names()) {
        out.push_str(&format!("const {name}: u32 = {value}u;\n"));
    }
    out.push_str(&format!("const MASS_TOLERANCE: f32 = {:?};\n", MASS_TOLERANCE as f32));
    out
}

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

    /// The shaders declare none of the generated names themselves, use no
    /// status word or kind this file does not name, and get all of them
    /// from [`wgsl`] through `resident_common.wgsl`'s marker.
    #[test]
    fn the_shaders_take_their_status_names_from_here() {
        use crate::toolkit::kernels::{KernelId, RESIDENT_MARKER};
        let generated = wgsl();
        let names: Vec<&str> = WORD_NAMES
            .iter()
            .map(|(n, _)| *n)
            .chain(KIND_NAMES.iter().map(|(n, _)| *n))
            .chain(code_names().iter().map(|(n, _)| *n))
            .chain(["NONE", "FLAGGED_ROW", "MASS_TOLERANCE"])
            .collect();
        for name in &names {
            assert_eq!(generated.matches(&format!("const {name}:")).count(), 1, "{name}");
        }
        assert!(generated.contains("const S_DX_MUL: u32 = 17u;\n"), "{generated}");
        assert!(
            generated.contains("const MASS_TOLERANCE: f32 = 0.001;\n"),
            "{generated}"
        );
        assert!(
            generated.contains("const FLAGGED_ROW: u32 = 0x7fc00badu;\n"),
            "{generated}"
        );
        let resident: Vec<KernelId> = KernelId::ALL.into_iter().filter(|k| k.is_resident()).collect();
        assert_eq!(resident.len(), 11);
        for kernel in resident {
            for shader in kernel.shaders() {
                assert_eq!(shader.text.matches(RESIDENT_MARKER).count(), 1, "{}", shader.file);
                let source = shader.source();
                for name in &names {
                    assert_eq!(
                        source.matches(&format!("const {name}:")).count(),
                        1,
                        "{}: {name}",
                        shader.file
                    );
                }
                // Every S_/KIND_/DTYPE_/TAIL_ name the kernel uses is one of these.
                for word in source.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                    if ["S_", "KIND_", "DTYPE_", "TAIL_"].iter().any(|p| word.starts_with(p)) {
                        assert!(names.contains(&word), "{}: {word} is not generated", shader.file);
                    }
                }
            }
        }
    }

    /// The marker is a quiet NaN that neither arithmetic's canonical NaN
    /// nor Rust's `f32::NAN` is, so only a kernel that means it writes it.
    #[test]
    fn the_flagged_row_marker_is_a_quiet_nan_of_its_own() {
        let m = f32::from_bits(FLAGGED_ROW);
        assert!(m.is_nan());
        assert_eq!(FLAGGED_ROW & 0x7fc0_0000, 0x7fc0_0000, "quiet");
        assert_ne!(FLAGGED_ROW, 0x7fc0_0000);
        assert_ne!(FLAGGED_ROW, f32::NAN.to_bits());
        assert_ne!(FLAGGED_ROW, (-f32::NAN).to_bits());
        assert_eq!(row_wgsl(), "const FLAGGED_ROW: u32 = 0x7fc00badu;\n");
    }

    /// `kl_rows.wgsl` reads the coefficient word too: it gets the marker
    /// from [`row_wgsl`] and declares none of its own.
    #[test]
    fn kl_rows_takes_the_marker_from_here() {
        use crate::toolkit::kernels::{KL_ROWS_WGSL, ROW_MARKER};
        assert_eq!(KL_ROWS_WGSL.text.matches(ROW_MARKER).count(), 1);
        assert!(!KL_ROWS_WGSL.text.contains("const FLAGGED_ROW"));
        assert_eq!(KL_ROWS_WGSL.source().matches(&row_wgsl()).count(), 1);
    }

    #[test]
    fn flag_without_detail_is_an_error() {
        let mut w = cleared();
        w[S_ROW] = 0;
        assert!(matches!(to_result(&w, 10), Err(Error::Backend { .. })));
    }
}
