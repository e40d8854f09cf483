//! The same loss written the way a burn user writes it without headkl:
//! the logits `hidden · Wᵀ / τ` materialized `[ntok][V]`, `log_softmax`
//! over the vocabulary, `gather` at the teacher's ids, burn's autodiff for
//! the gradient. The peer headkl is measured and checked against.

use burn::prelude::{Int, Tensor};
use burn::tensor::activation::log_softmax;
use burn::tensor::FloatDType;

/// The teacher side of [`loss`]: ids `[ntok][k]` (burn's int dtype) and
/// probabilities `[ntok][k]` (renormalized over the k here, as headkl
/// does).
#[derive(Clone, Debug)]
pub struct UnfusedTeacher {
    /// Ids `[ntok][k]`.
    pub ids: Tensor<2, Int>,
    /// Probabilities `[ntok][k]`.
    pub probs: Tensor<2>,
}

impl From<&crate::Teacher> for UnfusedTeacher {
    /// The same tensors as headkl's teacher.
    fn from(teacher: &crate::Teacher) -> Self {
        Self {
            ids: teacher.ids.clone(),
            probs: teacher.probs.clone(),
        }
    }
}

/// Mean loss `[1]` and per-token loss `[ntok]` of `hidden` `[ntok][hs]`
/// against the teacher through the head `head` `[V][hs]`, token `weights`
/// `[ntok]` (none: all 1) and `total` (none: `Σ w_t`), at temperature τ:
/// `L_t = Σ_k p_k (log p_k − log_softmax(x_t·Wᵀ/τ)[id_k])`.
pub fn loss(
    hidden: Tensor<2>,
    head: &Tensor<2>,
    teacher: &UnfusedTeacher,
    weights: Option<Tensor<1>>,
    total: Option<f32>,
    temperature: f32,
) -> (Tensor<1>, Tensor<1>) {
    let [ntok, _] = hidden.dims();
    // The softmax and the loss in f32 whatever the operands' dtype (f16
    // rows and head give f16 logits, too coarse for a 10⁵-wide softmax).
    let logits = hidden
        .matmul(head.clone().transpose())
        .cast(FloatDType::F32)
        .div_scalar(temperature);
    let log_p_student = log_softmax(logits, 1).gather(1, teacher.ids.clone());
    let p = teacher.probs.clone().cast(FloatDType::F32);
    let p = p.clone() / p.sum_dim(1);
    // 0 · log 0 = 0: the clamp only keeps the log finite.
    let log_p_teacher = p.clone().clamp_min(1e-30).log();
    let per_token = (p * (log_p_teacher - log_p_student)).sum_dim(1).reshape([ntok]);
    let mean = match weights {
        Some(w) => {
            let sum = (per_token.clone() * w.clone()).sum();
            match total {
                Some(t) => sum.div_scalar(t),
                None => sum / w.sum(),
            }
        }
        None => per_token.clone().sum().div_scalar(total.unwrap_or(ntok as f32)),
    };
    (mean, per_token)
}
