//! The loss-term options of `headkl loss` and `headkl topk` (README "Loss
//! terms"): how the teacher file is read, the hard-label term and its
//! labels file, the z-loss and the softcap.

use std::path::PathBuf;

use clap::Args;
use headkl_core::{Divergence, LossTerms, TailMode, TeacherForm};

use crate::error::CliError;

/// `--teacher-form`'s value.
fn parse_form(s: &str) -> Result<TeacherForm, String> {
    TeacherForm::from_name(s).ok_or_else(|| format!("`{s}`: expected `probs` or `logprobs`"))
}

/// `--tail`'s value.
fn parse_tail(s: &str) -> Result<TailMode, String> {
    TailMode::from_name(s).ok_or_else(|| format!("`{s}`: expected `renormalize`, `bucket` or `none`"))
}

/// `--divergence`'s value (β filled in from `--beta`).
pub(crate) fn parse_divergence(s: &str) -> Result<Divergence, String> {
    Divergence::from_name(s, DEFAULT_BETA).ok_or_else(|| format!("`{s}`: expected `forward`, `reverse` or `jsd`"))
}

/// β of `--divergence jsd` without `--beta`: TRL's `GKDConfig` default.
const DEFAULT_BETA: f32 = 0.5;

/// `--divergence` with `--beta`: β goes to the JSD (0.5 when not given);
/// `--beta` beside another divergence is refused.
pub(crate) fn with_beta(divergence: Divergence, beta: Option<f32>) -> Result<Divergence, CliError> {
    match (divergence, beta) {
        (Divergence::Jsd { .. }, beta) => Ok(Divergence::Jsd {
            beta: beta.unwrap_or(DEFAULT_BETA),
        }),
        (d, Some(beta)) => Err(CliError::option(
            "--beta",
            format!("--beta {beta} applies to --divergence jsd, not {}", d.name()),
        )),
        (d, None) => Ok(d),
    }
}

/// The options of `headkl loss` beyond the seed's loss.
#[derive(Clone, Debug, Args)]
pub struct LossTermArgs {
    /// Labels of the hard term: tensor `labels` (I64 or I32) `[ntok]`; a negative label, or one equal to --ignore-index, is none
    #[arg(long, value_name = "L.safetensors")]
    pub labels: Option<PathBuf>,
    /// The label that means none, as PyTorch's `ignore_index` (any negative label is none too)
    #[arg(long, value_name = "I", default_value_t = headkl_core::DEFAULT_IGNORE_INDEX, allow_negative_numbers = true)]
    pub ignore_index: i64,
    /// Drop the tokens without a label from every term, the soft one too (weight 0, out of the mean's Σ w), as Liger's `shift_labels`; needs --labels, not the hard term
    #[arg(long)]
    pub ignore_mask: bool,
    /// Weight α_hard of the hard-label cross-entropy (≥ 0; above 0 it needs --labels)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub hard_weight: f32,
    /// Weight α_soft of the distillation term (≥ 0)
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub soft_weight: f32,
    /// Label smoothing ε of the hard term, in [0, 1)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub label_smoothing: f32,
    /// z-loss weight λ: adds λ·lse(z̃)² per token (≥ 0)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub z_loss: f32,
    /// Logit softcap c: z̃ = c·tanh(z/c) before τ and every term (> 0) [default: none]
    #[arg(long, allow_negative_numbers = true)]
    pub softcap: Option<f32>,
    /// Logit scale S: z = S·x·Wᵀ before the softcap, τ and every term (> 0), as a model that scales its logits defines them
    #[arg(long, value_name = "S", default_value_t = 1.0, allow_negative_numbers = true)]
    pub logit_scale: f32,
    /// How the teacher file holds its k values: `probs` (tensor `probs`) or `logprobs` (tensor `logprobs`, over the full vocabulary)
    #[arg(long, value_name = "FORM", default_value = "probs", value_parser = parse_form)]
    pub teacher_form: TeacherForm,
    /// The temperature the teacher file's values were made at, when not --temperature (an inference server's log-probabilities come at 1): its k ids (and tail bin) are rescaled to --temperature and renormalized; the file's recorded temperature is checked against this [default: --temperature]
    #[arg(long, value_name = "T", allow_negative_numbers = true)]
    pub teacher_temperature: Option<f32>,
    /// The teacher's mass outside its k: `renormalize` (over the k), `bucket` (one extra bin) or `none` (ignored)
    #[arg(long, value_name = "MODE", default_value = "renormalize", value_parser = parse_tail)]
    pub tail: TailMode,
    /// The soft term's divergence over the teacher file's ids (and the tail bin): `forward` KL(p_T‖p_S), `reverse` KL(p_S‖p_T) (on-policy distillation, with the student's own top-k ids), or `jsd`, TRL's generalized Jensen–Shannon with --beta
    #[arg(long, value_name = "D", default_value = "forward", value_parser = parse_divergence)]
    pub divergence: Divergence,
    /// β of --divergence jsd, in [0, 1]: β·KL(p_T‖m) + (1−β)·KL(p_S‖m) with m = β·p_T + (1−β)·p_S; 0 is the forward KL, 1 the reverse [default: 0.5]
    #[arg(long, value_name = "B", allow_negative_numbers = true)]
    pub beta: Option<f32>,
}

impl LossTermArgs {
    /// The terms as the core takes them (checked there).
    pub fn terms(&self) -> LossTerms {
        LossTerms {
            soft_weight: self.soft_weight,
            hard_weight: self.hard_weight,
            label_smoothing: self.label_smoothing,
            z_loss: self.z_loss,
            softcap: self.softcap,
            logit_scale: self.logit_scale,
            divergence: with_beta(self.divergence, self.beta).unwrap_or(self.divergence),
        }
    }

    /// Refuses `--beta` beside a divergence that has none (the values
    /// themselves are checked by the core).
    pub fn check(&self) -> Result<(), CliError> {
        with_beta(self.divergence, self.beta).map(|_| ())
    }

    /// The teacher file's tensor of values for this form.
    pub fn teacher_tensor(&self) -> &'static str {
        self.teacher_form.name()
    }
}

/// The options of `headkl topk` beyond the seed's.
#[derive(Clone, Debug, Args)]
pub struct TopkTermArgs {
    /// Also write `logprobs`: the top-k log-probabilities at τ over the full vocabulary (a stored teacher)
    #[arg(long)]
    pub logprobs: bool,
    /// Logit softcap c: values from c·tanh(z/c) before τ (> 0) [default: none]
    #[arg(long, allow_negative_numbers = true)]
    pub softcap: Option<f32>,
    /// Logit scale S: z = S·x·Wᵀ before the softcap and τ (> 0), as the teacher model scales its logits
    #[arg(long, value_name = "S", default_value_t = 1.0, allow_negative_numbers = true)]
    pub logit_scale: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

    // The options of the core's fields (`option_of`) are tested with
    // `headkl_files::sources`.
    #[test]
    fn tail_form_and_divergence_names_parse() {
        assert_eq!(parse_tail("bucket"), Ok(TailMode::Bucket));
        assert_eq!(parse_form("logprobs"), Ok(TeacherForm::Logprobs));
        assert!(parse_tail("ghost").unwrap_err().contains("renormalize"));
        assert_eq!(parse_divergence("reverse"), Ok(Divergence::Reverse));
        assert!(parse_divergence("kl").unwrap_err().contains("jsd"));
    }
}
