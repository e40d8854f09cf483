//! Benchmark shapes (core's [`Shape`]: `A`, `B`, `S`, `M`,
//! `NTOK:V:HS:K`), each backend's default, and the jobs timed on them.

use headkl_core::DeviceInfo;
pub use headkl_core::Shape;
use serde::Serialize;

use crate::select::BackendKind;

/// What the bench asks of a [`Shape`] beyond its extents: each backend's
/// default size and the work a job does on it.
pub trait ShapeCost {
    /// A size the backend finishes in seconds: the CPU reference and
    /// software Vulkan (a `cpu` device such as lavapipe) get a small one.
    fn default_for(info: &DeviceInfo, kind: BackendKind) -> Shape;

    /// `4·ntok·V·hs` for head_kl (two GEMMs), half that for topk and the
    /// gather (one), and the teacher's logits GEMM `2·ntok·V·hs_T` on top
    /// of head_kl's for the full-vocabulary loss.
    fn flops(&self, job: JobKind) -> f64;
}

impl ShapeCost for Shape {
    fn default_for(info: &DeviceInfo, kind: BackendKind) -> Shape {
        let software = crate::select::is_software(info);
        let (ntok, vocab, hs, k) = match kind {
            BackendKind::Reference => (64, 4096, 256, 16),
            _ if info.matrix_units => (1024, 65_536, 4096, 64),
            _ if software => (64, 8192, 256, 64),
            _ => (256, 32_768, 1024, 64),
        };
        Shape::new(ntok, vocab, hs, k)
    }

    fn flops(&self, job: JobKind) -> f64 {
        let gemm = |hs: usize| 2.0 * self.ntok as f64 * self.vocab as f64 * hs as f64;
        match job {
            JobKind::HeadKl => 2.0 * gemm(self.hs),
            JobKind::HeadGrad => 3.0 * gemm(self.hs),
            JobKind::Topk | JobKind::Gather => gemm(self.hs),
            JobKind::FullVocab { teacher_hs } => 2.0 * gemm(self.hs) + gemm(teacher_hs),
        }
    }
}

/// The shape in the bench's JSON: `{"ntok", "vocab", "hs", "k"}`.
pub(crate) fn shape_json<S: serde::Serializer>(shape: &Shape, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeStruct;
    let mut fields = s.serialize_struct("Shape", 4)?;
    fields.serialize_field("ntok", &shape.ntok)?;
    fields.serialize_field("vocab", &shape.vocab)?;
    fields.serialize_field("hs", &shape.hs)?;
    fields.serialize_field("k", &shape.k)?;
    fields.end()
}

/// Which job is timed; in the JSON, its [`JobKind::name`] (the report
/// records the teacher's hidden size as `teacher_hs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    /// The loss and its gradient.
    HeadKl,
    /// The loss, its gradient and the head's (`LossConfig::head_grad`).
    HeadGrad,
    /// The teacher's top-k.
    Topk,
    /// The log-probabilities at given ids (`Engine::logprobs_at`).
    Gather,
    /// The exact full-vocabulary loss from teacher hidden rows of this
    /// hidden size (`Engine::head_kl_full_vocab`).
    FullVocab {
        /// The teacher's hidden size.
        teacher_hs: usize,
    },
}

impl Serialize for JobKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl JobKind {
    /// The job's name.
    pub fn name(self) -> &'static str {
        match self {
            JobKind::HeadKl => "head_kl",
            JobKind::HeadGrad => "head_kl_head_grad",
            JobKind::Topk => "topk",
            JobKind::Gather => "gather",
            JobKind::FullVocab { .. } => "head_kl_full_vocab",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_count_the_gemms() {
        assert_eq!(Shape::A.flops(JobKind::HeadKl), 4.0 * 4096.0 * 248_320.0 * 5120.0);
        assert_eq!(Shape::A.flops(JobKind::Topk) * 2.0, Shape::A.flops(JobKind::HeadKl));
        assert_eq!(Shape::A.flops(JobKind::HeadGrad), 1.5 * Shape::A.flops(JobKind::HeadKl));
    }
}
