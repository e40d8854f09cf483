//! Which input a core error is about: [`Sources`] holds the tensors a job
//! read (and whether `--total` was given) and maps a core error to the
//! file and tensor, or the command-line option, that caused it.

use headkl_core::{Error as CoreError, Field};

use crate::error::FilesError;
use crate::tensors::TensorRef;

/// Where each input came from, so a core error can name its file and
/// tensor (or option).
pub struct Sources<'a> {
    /// The head `[V][hs]`.
    pub head: &'a TensorRef<'a>,
    /// The hidden rows `[ntok][hs]`.
    pub hidden: &'a TensorRef<'a>,
    /// The teacher's ids, where the job has a teacher file (`gather`: its
    /// `--ids`).
    pub ids: Option<&'a TensorRef<'a>>,
    /// The teacher's `probs` or `logprobs`.
    pub probs: Option<&'a TensorRef<'a>>,
    /// The per-token weights, where given.
    pub weights: Option<&'a TensorRef<'a>>,
    /// The hard labels, where given.
    pub labels: Option<&'a TensorRef<'a>>,
    /// Whether `--total` was given (an all-zero weights tensor is then
    /// not the weights' fault).
    pub total_given: bool,
}

impl<'a> Sources<'a> {
    /// The sources of a job on the head and hidden rows alone.
    pub fn new(head: &'a TensorRef<'a>, hidden: &'a TensorRef<'a>) -> Self {
        Self {
            head,
            hidden,
            ids: None,
            probs: None,
            weights: None,
            labels: None,
            total_given: false,
        }
    }

    /// With a teacher file's ids and probabilities, and the weights and
    /// labels it may hold beside them.
    pub fn with_teacher(
        self,
        ids: &'a TensorRef<'a>,
        probs: &'a TensorRef<'a>,
        weights: Option<&'a TensorRef<'a>>,
        labels: Option<&'a TensorRef<'a>>,
    ) -> Self {
        Self {
            ids: Some(ids),
            probs: Some(probs),
            weights,
            labels,
            ..self
        }
    }

    /// Maps a core error to the input that caused it: a validation error
    /// names its file and tensor (or option) and is bad input
    /// ([`FilesError::is_input`]); a device error is a
    /// [`FilesError::Device`] with `context`.
    pub fn map(&self, e: CoreError, context: &str) -> FilesError {
        use CoreError as E;
        let teacher_ids = self.ids.unwrap_or(self.hidden);
        let teacher_probs = self.probs.unwrap_or(self.hidden);
        match &e {
            E::NonFiniteHead { .. } | E::HeadOutOfF16Range { .. } | E::VocabZero => self.head.core_error(e),
            E::HiddenSizeMismatch { .. } | E::NonFiniteHidden { .. } | E::NoTokens | E::HiddenSizeZero => {
                self.hidden.core_error(e)
            }
            E::IdOutOfRange { .. } | E::DuplicateId { .. } => teacher_ids.core_error(e),
            E::NegativeProbability { .. }
            | E::NonFiniteProbability { .. }
            | E::ProbabilityRowSum { .. }
            | E::InvalidLogProbability { .. }
            | E::TeacherMassAboveOne { .. } => teacher_probs.core_error(e),
            E::LabelOutOfRange { .. } => match self.labels {
                Some(l) => l.core_error(e),
                None => FilesError::in_option(e, "--labels"),
            },
            E::InvalidLossOption { field, .. } => {
                let option = option_of(field);
                FilesError::in_option(e, option)
            }
            E::HardWeightWithoutLabels { .. } => FilesError::in_option(e, "--hard-weight"),
            E::IgnoreMaskWithoutLabels => FilesError::in_option(e, "--ignore-mask"),
            E::ShardUnsupported { option, .. } => FilesError::in_option(e.clone(), shard_option_flag(option)),
            E::FullVocabUnsupported { option, .. } => FilesError::in_option(e.clone(), option),
            E::KZero | E::KTooLarge { .. } => match self.ids {
                Some(ids) => ids.core_error(e),
                None => FilesError::in_option(e, "-k"),
            },
            E::NegativeWeight { .. } | E::NonFiniteWeight { .. } => match self.weights {
                Some(w) => w.core_error(e),
                None => FilesError::in_option(e, "--weights"),
            },
            E::TotalWithReduction { .. } => FilesError::in_option(e, "--reduction"),
            E::TotalNotPositive { .. } => match (self.total_given, self.weights) {
                (false, Some(w)) => w.error(format!("{e} (every weight is 0; pass --total)")),
                _ => FilesError::in_option(e, "--total"),
            },
            E::InvalidTemperature { .. } => FilesError::in_option(e, "--temperature"),
            E::InvalidGradScale { .. } => FilesError::in_option(e, "--gscale"),
            E::BudgetZero | E::BudgetTooSmall { .. } => FilesError::in_option(e, "--budget"),
            E::LengthMismatch { field, .. } => match *field {
                Field::Head => self.head.core_error(e),
                Field::Ids | Field::TeacherRows => teacher_ids.core_error(e),
                Field::Probs | Field::Logprobs => teacher_probs.core_error(e),
                Field::Labels => match self.labels {
                    Some(l) => l.core_error(e),
                    None => FilesError::in_option(e, "--labels"),
                },
                Field::Weights => match self.weights {
                    Some(w) => w.core_error(e),
                    None => FilesError::in_option(e, "--weights"),
                },
                Field::Hidden => self.hidden.core_error(e),
                _ => FilesError::device(context, e),
            },
            _ => FilesError::device(context, e),
        }
    }
}

/// The command-line option of a loss option's field, as
/// [`CoreError::InvalidLossOption`] names it (`hard_weight` →
/// `--hard-weight`); a field the command has no option for is the labels'.
pub fn option_of(field: &str) -> &'static str {
    match field {
        "hard_weight" => "--hard-weight",
        "soft_weight" => "--soft-weight",
        "label_smoothing" => "--label-smoothing",
        "z_loss" => "--z-loss",
        "softcap" => "--softcap",
        "logit_scale" => "--logit-scale",
        "beta" => "--beta",
        "teacher_temperature" => "--teacher-temperature",
        "temperature" => "--temperature",
        _ => "--labels",
    }
}

/// The command-line flag of an option the sharded calls refuse
/// ([`CoreError::ShardUnsupported`]).
fn shard_option_flag(option: &str) -> &'static str {
    match option {
        "tail" => "--tail",
        "hard-weight" => "--hard-weight",
        "z-loss" => "--z-loss",
        "softcap" => "--softcap",
        "soft-weight" => "--soft-weight",
        "divergence" => "--divergence",
        _ => "--shards",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_core_field_has_its_option() {
        for field in [
            "hard_weight",
            "soft_weight",
            "label_smoothing",
            "z_loss",
            "softcap",
            "logit_scale",
            "beta",
            "teacher_temperature",
            "temperature",
        ] {
            assert_eq!(option_of(field), format!("--{}", field.replace('_', "-")));
        }
        for option in ["tail", "hard-weight", "z-loss", "softcap", "soft-weight", "divergence"] {
            assert_eq!(shard_option_flag(option), format!("--{option}"));
        }
        assert_eq!(shard_option_flag("anything else"), "--shards");
    }
}
