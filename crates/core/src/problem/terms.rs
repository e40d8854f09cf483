//! The loss's terms beyond the soft KL against a renormalized top-k: how
//! the teacher's k entries are read (probabilities or log-probabilities
//! over the full vocabulary; the tail renormalized, bucketed or left out),
//! a hard-label cross-entropy with label smoothing, a z-loss and a logit
//! softcap. The README's "Loss terms" section has the formulas; the
//! defaults are the seed's loss exactly.
//!
//! One validation ([`LossTerms::check`]) serves the host path
//! ([`crate::problem::LossOptions`]) and the device-resident one
//! ([`crate::resident::DeviceLossOptions`]).

use crate::error::{Error, Result};

/// A token with no label (the kernels' value; a negative label on the
/// host).
pub const NO_LABEL: u32 = u32::MAX;

/// Rounding allowed above 1 in a teacher row's mass where the tail mode
/// reads the k entries as a share of the full vocabulary (bucket, none):
/// f32 probabilities (or `exp` of f32 log-probabilities) of up to 2048
/// entries sum to at most about `1 + 2048 · 2^-24 ≈ 1 + 1.2e-4`.
pub const MASS_TOLERANCE: f64 = 1e-3;

/// How the teacher's k values are given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TeacherForm {
    /// Probabilities `p_T,k ≥ 0`.
    #[default]
    Probs,
    /// Log-probabilities `log p_T,k ≤ 0`, normalized over the full
    /// vocabulary (as an inference server returns them).
    Logprobs,
}

impl TeacherForm {
    /// Its command-line name.
    pub const fn name(self) -> &'static str {
        match self {
            TeacherForm::Probs => "probs",
            TeacherForm::Logprobs => "logprobs",
        }
    }

    /// The form named `name` (`probs` or `logprobs`).
    pub fn from_name(name: &str) -> Option<Self> {
        [TeacherForm::Probs, TeacherForm::Logprobs]
            .into_iter()
            .find(|f| f.name() == name)
    }

    /// Its code in the device-resident kernels' flags.
    pub const fn code(self) -> u32 {
        match self {
            TeacherForm::Probs => 0,
            TeacherForm::Logprobs => 1,
        }
    }
}

/// What the soft term does with the teacher's mass outside its k entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TailMode {
    /// `q = p_T / Σ_k p_T`: KL against the teacher renormalized over its k
    /// (the seed's loss).
    #[default]
    Renormalize,
    /// The k entries plus one bucket holding the rest, `r_T = 1 − Σ_k p_T`
    /// against the student's `r_S = 1 − Σ_k p_S,id_k`.
    Bucket,
    /// `Σ_k p_T (log p_T − log p_S)` over the k alone, the mass outside
    /// ignored (not a divergence: it may be negative).
    Unnormalized,
}

impl TailMode {
    /// Its command-line name.
    pub const fn name(self) -> &'static str {
        match self {
            TailMode::Renormalize => "renormalize",
            TailMode::Bucket => "bucket",
            TailMode::Unnormalized => "none",
        }
    }

    /// The mode named `name` (`renormalize`, `bucket` or `none`).
    pub fn from_name(name: &str) -> Option<Self> {
        [TailMode::Renormalize, TailMode::Bucket, TailMode::Unnormalized]
            .into_iter()
            .find(|m| m.name() == name)
    }

    /// Its code in the kernels' flags (bits 1–2 of `RowParams::flags`).
    pub const fn code(self) -> u32 {
        match self {
            TailMode::Renormalize => 0,
            TailMode::Bucket => 1,
            TailMode::Unnormalized => 2,
        }
    }
}

/// Which divergence the soft term measures between the teacher's top-k
/// distribution and the student's (`docs/DESIGN.md` §1 defines each over
/// the k ids plus the tail bin of every [`TailMode`]; at k = V each is its
/// full-vocabulary definition).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Divergence {
    /// `KL(p_T ‖ p_S)`, the seed's loss.
    #[default]
    Forward,
    /// `KL(p_S ‖ p_T)` over the teacher file's ids (on-policy
    /// distillation: the ids are the student's own top-k).
    Reverse,
    /// The generalized Jensen–Shannon divergence of TRL's GKD:
    /// `β·KL(p_T ‖ m) + (1−β)·KL(p_S ‖ m)`, `m = β·p_T + (1−β)·p_S`, with
    /// TRL's endpoints: β = 0 is the forward KL, β = 1 the reverse.
    Jsd {
        /// `β ∈ [0, 1]`.
        beta: f32,
    },
}

impl Divergence {
    /// Its command-line name.
    pub const fn name(self) -> &'static str {
        match self {
            Divergence::Forward => "forward",
            Divergence::Reverse => "reverse",
            Divergence::Jsd { .. } => "jsd",
        }
    }

    /// The divergence named `name` (`forward`, `reverse` or `jsd`, the
    /// last with `beta`).
    pub fn from_name(name: &str, beta: f32) -> Option<Self> {
        match name {
            "forward" => Some(Divergence::Forward),
            "reverse" => Some(Divergence::Reverse),
            "jsd" => Some(Divergence::Jsd { beta }),
            _ => None,
        }
    }

    /// What the kernels compute: a JSD at β = 0 or 1 is TRL's endpoint,
    /// the forward or the reverse KL.
    pub fn effective(self) -> Self {
        match self {
            Divergence::Jsd { beta: 0.0 } => Divergence::Forward,
            Divergence::Jsd { beta: 1.0 } => Divergence::Reverse,
            d => d,
        }
    }

    /// Its code in the kernels' flags (`row_flags::DIVERGENCE_SHIFT`), of
    /// [`Divergence::effective`].
    pub const fn code(self) -> u32 {
        match self {
            Divergence::Forward => 0,
            Divergence::Reverse => 1,
            Divergence::Jsd { .. } => 2,
        }
    }

    /// β of a JSD (0 otherwise).
    pub const fn beta(self) -> f32 {
        match self {
            Divergence::Jsd { beta } => beta,
            _ => 0.0,
        }
    }
}

/// Floor of a bin's probability inside a logarithm where 0 would make the
/// loss infinite (2⁻²⁴, about what f32 resolves below 1): the student's
/// tail `r_S` in bucket mode, the teacher's bins in the reverse KL.
pub const PROB_FLOOR: f64 = 1.0 / 16_777_216.0;

/// The weights and knobs of the loss's terms, per token
/// `L_t = α_soft·L_soft + α_hard·L_hard + λ·lse(z̃)²` on the capped
/// logits `z̃ = c·tanh(z/c)`, where `z = S·x·Wᵀ` with the logit scale `S`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossTerms {
    /// `α_soft ≥ 0`, the soft (distillation) term's weight (default 1).
    pub soft_weight: f32,
    /// `α_hard ≥ 0`, the hard-label cross-entropy's weight (default 0:
    /// no hard term). Above 0 it needs labels.
    pub hard_weight: f32,
    /// Label smoothing `ε ∈ [0, 1)` of the hard term (default 0).
    pub label_smoothing: f32,
    /// `λ ≥ 0`, the z-loss weight (default 0).
    pub z_loss: f32,
    /// The logit softcap `c > 0` (default none).
    pub softcap: Option<f32>,
    /// The logit scale `S > 0`: `z = S·x·Wᵀ` before the softcap and τ
    /// (default 1), as models that scale their logits (Cohere's
    /// `logit_scale`) define them.
    pub logit_scale: f32,
    /// The soft term's divergence (default: the forward KL).
    pub divergence: Divergence,
}

impl Default for LossTerms {
    fn default() -> Self {
        Self {
            soft_weight: 1.0,
            hard_weight: 0.0,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            logit_scale: 1.0,
            divergence: Divergence::Forward,
        }
    }
}

fn non_negative(field: &'static str, value: f32) -> Result<()> {
    if value >= 0.0 && value.is_finite() {
        Ok(())
    } else {
        Err(Error::InvalidLossOption {
            field,
            value,
            reason: "must be finite and at least 0",
        })
    }
}

/// Checks a logit softcap `c·tanh(z/c)`: `c` positive and finite.
pub(crate) fn check_softcap(c: f32) -> Result<()> {
    if c > 0.0 && c.is_finite() {
        Ok(())
    } else {
        Err(Error::InvalidLossOption {
            field: "softcap",
            value: c,
            reason: "must be positive and finite",
        })
    }
}

impl LossTerms {
    /// Checks every value's range.
    pub fn check(&self) -> Result<()> {
        non_negative("soft_weight", self.soft_weight)?;
        non_negative("hard_weight", self.hard_weight)?;
        non_negative("z_loss", self.z_loss)?;
        let eps = self.label_smoothing;
        if !(0.0..1.0).contains(&eps) {
            return Err(Error::InvalidLossOption {
                field: "label_smoothing",
                value: eps,
                reason: "must be in [0, 1)",
            });
        }
        if !(self.logit_scale > 0.0 && self.logit_scale.is_finite()) {
            return Err(Error::InvalidLossOption {
                field: "logit_scale",
                value: self.logit_scale,
                reason: "must be positive and finite",
            });
        }
        if let Divergence::Jsd { beta } = self.divergence {
            if !(0.0..=1.0).contains(&beta) {
                return Err(Error::InvalidLossOption {
                    field: "beta",
                    value: beta,
                    reason: "must be in [0, 1]",
                });
            }
        }
        if let Some(c) = self.softcap {
            check_softcap(c)?;
        }
        Ok(())
    }

    /// Whether the hard-label term is on.
    pub fn hard_on(&self) -> bool {
        self.hard_weight > 0.0
    }

    /// A bound on `|τ·∂L_t/∂z_j|` apart from the z-loss, whose share
    /// `2λτ·|lse|·p_j` is not known before the logits are: the default
    /// gradient scale divides by it so the f16 gradient stays in range.
    pub fn grad_bound(&self, temperature: f32) -> f64 {
        let hard = f64::from(temperature) * f64::from(self.hard_weight);
        // The soft term's |∂/∂s_j| = q_j·|f'_j − E| (DESIGN §1): at most
        // 1 forward, 2 for the JSD (|q·(1−β)·log(q/m)| < 1), and for the
        // reverse KL up to the floored teacher's log, ln 2²⁴ + 1, twice.
        let soft = f64::from(self.soft_weight)
            * match self.divergence.effective() {
                Divergence::Forward => 1.0,
                Divergence::Jsd { .. } => 2.0,
                Divergence::Reverse => 2.0 * (1.0 - PROB_FLOOR.ln()),
            };
        (soft + hard).max(1.0)
    }
}

/// Teacher values `[ntok][k]` made at temperature `from` (a server's
/// log-probabilities come at τ = 1), read as made at `to`: since
/// `log p^to = (from/to)·log p^from + c`, each row's bins (the k ids, and
/// in `bucket` and `none` mode the tail `1 − Σ_k p` as one bin) are raised
/// to `from/to` and renormalized over those bins; the k come back in
/// `form`. Exact for the k renormalized among themselves (the
/// `renormalize` mode, and at k = V); the tail's members are unknown, so
/// `bucket` and `none` rescale it as one bin (README "Loss terms").
/// Values are not checked here: pass the output to [`crate::problem::Teacher::with_form`].
pub fn rescale_teacher(
    values: &[f32],
    k: usize,
    form: TeacherForm,
    tail: TailMode,
    from: f32,
    to: f32,
) -> Result<Vec<f32>> {
    for (field, value) in [("teacher_temperature", from), ("temperature", to)] {
        if !(value > 0.0 && value.is_finite()) {
            return Err(Error::InvalidLossOption {
                field,
                value,
                reason: "must be positive and finite",
            });
        }
    }
    let power = f64::from(from) / f64::from(to);
    let mut out = Vec::with_capacity(values.len());
    for row in values.chunks(k.max(1)) {
        let p: Vec<f64> = row
            .iter()
            .map(|&v| match form {
                TeacherForm::Probs => f64::from(v),
                TeacherForm::Logprobs => f64::from(v).exp(),
            })
            .collect();
        let tail_mass = match tail {
            TailMode::Renormalize => 0.0,
            _ => (1.0 - p.iter().sum::<f64>()).max(0.0),
        };
        let raised: Vec<f64> = p.iter().map(|&v| if v > 0.0 { v.powf(power) } else { 0.0 }).collect();
        let norm = raised.iter().sum::<f64>() + if tail_mass > 0.0 { tail_mass.powf(power) } else { 0.0 };
        if !(norm > 0.0 && norm.is_finite()) {
            // An empty or broken row: left for the teacher's checks to name.
            out.extend_from_slice(row);
            continue;
        }
        out.extend(raised.iter().map(|&v| match form {
            TeacherForm::Probs => (v / norm) as f32,
            TeacherForm::Logprobs => (v / norm).ln() as f32,
        }));
    }
    Ok(out)
}

/// Labels `[ntok]` as the kernels take them: a negative label is
/// [`NO_LABEL`]; one at or above `vocab` is an error naming its row.
pub fn labels_to_u32(labels: &[i64], vocab: usize) -> Result<Vec<u32>> {
    labels
        .iter()
        .enumerate()
        .map(|(row, &label)| {
            if label < 0 {
                Ok(NO_LABEL)
            } else if (label as u64) < vocab as u64 && label < i64::from(NO_LABEL) {
                Ok(label as u32)
            } else {
                Err(Error::LabelOutOfRange { row, label, vocab })
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bad_value_names_its_field() {
        let bad = [
            (
                LossTerms {
                    hard_weight: -1.0,
                    ..LossTerms::default()
                },
                "hard_weight",
            ),
            (
                LossTerms {
                    soft_weight: f32::NAN,
                    ..LossTerms::default()
                },
                "soft_weight",
            ),
            (
                LossTerms {
                    z_loss: f32::INFINITY,
                    ..LossTerms::default()
                },
                "z_loss",
            ),
            (
                LossTerms {
                    label_smoothing: 1.0,
                    ..LossTerms::default()
                },
                "label_smoothing",
            ),
            (
                LossTerms {
                    label_smoothing: -0.1,
                    ..LossTerms::default()
                },
                "label_smoothing",
            ),
            (
                LossTerms {
                    softcap: Some(0.0),
                    ..LossTerms::default()
                },
                "softcap",
            ),
            (
                LossTerms {
                    softcap: Some(f32::INFINITY),
                    ..LossTerms::default()
                },
                "softcap",
            ),
            (
                LossTerms {
                    logit_scale: 0.0,
                    ..LossTerms::default()
                },
                "logit_scale",
            ),
            (
                LossTerms {
                    logit_scale: f32::NAN,
                    ..LossTerms::default()
                },
                "logit_scale",
            ),
            (
                LossTerms {
                    divergence: Divergence::Jsd { beta: 1.5 },
                    ..LossTerms::default()
                },
                "beta",
            ),
            (
                LossTerms {
                    divergence: Divergence::Jsd { beta: f32::NAN },
                    ..LossTerms::default()
                },
                "beta",
            ),
        ];
        for (terms, name) in bad {
            match terms.check() {
                Err(Error::InvalidLossOption { field, .. }) => assert_eq!(field, name),
                other => panic!("{terms:?}: {other:?}"),
            }
        }
        assert_eq!(LossTerms::default().check(), Ok(()));
    }

    /// At k = V the rescaled teacher is the softmax at the new temperature,
    /// in every mode and form; at the same temperature nothing changes.
    #[test]
    fn rescaled_teacher_is_the_softmax_at_the_new_temperature() {
        let z = [1.5f64, -0.25, 0.75, 3.0, -2.0];
        let softmax = |tau: f64| {
            let e: Vec<f64> = z.iter().map(|v| (v / tau).exp()).collect();
            let sum: f64 = e.iter().sum();
            e.into_iter().map(|v| v / sum).collect::<Vec<f64>>()
        };
        let at_one = softmax(1.0);
        let want = softmax(2.5);
        for form in [TeacherForm::Probs, TeacherForm::Logprobs] {
            let values: Vec<f32> = at_one
                .iter()
                .map(|&p| match form {
                    TeacherForm::Probs => p as f32,
                    TeacherForm::Logprobs => p.ln() as f32,
                })
                .collect();
            for tail in [TailMode::Renormalize, TailMode::Bucket, TailMode::Unnormalized] {
                let got = rescale_teacher(&values, z.len(), form, tail, 1.0, 2.5).unwrap();
                for (g, w) in got.iter().zip(&want) {
                    let g = match form {
                        TeacherForm::Probs => f64::from(*g),
                        TeacherForm::Logprobs => f64::from(*g).exp(),
                    };
                    assert!((g - w).abs() < 1e-6, "{form:?} {tail:?}: {g} vs {w}");
                }
                let same = rescale_teacher(&values, z.len(), form, tail, 2.0, 2.0).unwrap();
                for (a, b) in same.iter().zip(&values) {
                    assert!((a - b).abs() < 1e-6, "{a} vs {b}");
                }
            }
        }
        // A partial row in bucket mode keeps its tail as one bin: mass
        // 0.5 on the k, 0.5 in the tail, at power 2 → 0.25 + 0.25 + 0.5.
        let got = rescale_teacher(&[0.25, 0.25], 2, TeacherForm::Probs, TailMode::Bucket, 2.0, 1.0).unwrap();
        assert!((got[0] - 0.0625 / 0.375).abs() < 1e-6, "{got:?}");
        assert_eq!(
            rescale_teacher(&[0.5], 1, TeacherForm::Probs, TailMode::Bucket, 0.0, 1.0),
            Err(Error::InvalidLossOption {
                field: "teacher_temperature",
                value: 0.0,
                reason: "must be positive and finite"
            })
        );
    }

    #[test]
    fn labels_map_negative_to_none_and_refuse_past_vocab() {
        assert_eq!(labels_to_u32(&[0, -1, 9, -100], 10), Ok(vec![0, NO_LABEL, 9, NO_LABEL]));
        assert_eq!(
            labels_to_u32(&[0, 10], 10),
            Err(Error::LabelOutOfRange {
                row: 1,
                label: 10,
                vocab: 10
            })
        );
    }

    #[test]
    fn names_round_trip() {
        for m in [TailMode::Renormalize, TailMode::Bucket, TailMode::Unnormalized] {
            assert_eq!(TailMode::from_name(m.name()), Some(m));
        }
        for f in [TeacherForm::Probs, TeacherForm::Logprobs] {
            assert_eq!(TeacherForm::from_name(f.name()), Some(f));
        }
        assert_eq!(TailMode::from_name("ghost"), None);
        for d in [Divergence::Forward, Divergence::Reverse, Divergence::Jsd { beta: 0.25 }] {
            assert_eq!(Divergence::from_name(d.name(), 0.25), Some(d));
        }
        assert_eq!(Divergence::from_name("kl", 0.5), None);
        assert_eq!(Divergence::Jsd { beta: 0.0 }.effective(), Divergence::Forward);
        assert_eq!(Divergence::Jsd { beta: 1.0 }.effective(), Divergence::Reverse);
        assert_eq!(Divergence::Jsd { beta: 0.5 }.effective().code(), 2);
    }
}
