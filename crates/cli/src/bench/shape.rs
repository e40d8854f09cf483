//! Benchmark shapes (`A`, `B`, `S`, `M`, `NTOK:V:HS:K`, and each backend's
//! default)
//! and the jobs timed on them.

use std::fmt;
use std::str::FromStr;

use headkl_core::{check_k, DeviceInfo};
use serde::Serialize;

use crate::select::BackendKind;

/// A benchmark shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shape {
    /// Tokens.
    pub ntok: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub hs: usize,
    /// Teacher entries per token (and top-k's k).
    pub k: usize,
}

impl Shape {
    /// Shape A of DESIGN §7.
    pub const A: Shape = Shape::new(4096, 248_320, 5120, 64);
    /// Shape B of DESIGN §7.
    pub const B: Shape = Shape::new(8192, 151_936, 4096, 64);
    /// Shape S: a 0.5B-parameter student's head (hs 896), the vocabulary of
    /// shape B, 8192 tokens.
    pub const S: Shape = Shape::new(8192, 151_936, 896, 64);
    /// Shape M: a 1B-parameter student's head (hs 2048, a 128 256-token
    /// vocabulary), 8192 tokens.
    pub const M: Shape = Shape::new(8192, 128_256, 2048, 64);

    /// The shape `NTOK:V:HS:K`.
    pub const fn new(ntok: usize, vocab: usize, hs: usize, k: usize) -> Shape {
        Shape { ntok, vocab, hs, k }
    }

    /// A size the backend finishes in seconds: the CPU reference and
    /// software Vulkan (a `cpu` device such as lavapipe) get a small one.
    pub fn default_for(info: &DeviceInfo, kind: BackendKind) -> Shape {
        let software = crate::select::is_software(info);
        let (ntok, vocab, hs, k) = match kind {
            BackendKind::Reference => (64, 4096, 256, 16),
            _ if info.matrix_units => (1024, 65_536, 4096, 64),
            _ if software => (64, 8192, 256, 64),
            _ => (256, 32_768, 1024, 64),
        };
        Shape::new(ntok, vocab, hs, k)
    }

    /// `4·ntok·V·hs` for head_kl (two GEMMs), half that for topk and the
    /// gather (one), and the teacher's logits GEMM `2·ntok·V·hs_T` on top
    /// of head_kl's for the full-vocabulary loss.
    pub fn flops(&self, job: JobKind) -> f64 {
        let gemm = |hs: usize| 2.0 * self.ntok as f64 * self.vocab as f64 * hs as f64;
        match job {
            JobKind::HeadKl => 2.0 * gemm(self.hs),
            JobKind::HeadGrad => 3.0 * gemm(self.hs),
            JobKind::Topk | JobKind::Gather => gemm(self.hs),
            JobKind::FullVocab { teacher_hs } => 2.0 * gemm(self.hs) + gemm(teacher_hs),
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}:{}", self.ntok, self.vocab, self.hs, self.k)
    }
}

impl FromStr for Shape {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let shape = match s.trim() {
            "A" | "a" => Shape::A,
            "B" | "b" => Shape::B,
            "S" | "s" => Shape::S,
            "M" | "m" => Shape::M,
            other => {
                let parts: Vec<&str> = other.split(':').collect();
                let nums: Result<Vec<usize>, _> = parts.iter().map(|p| p.trim().parse::<usize>()).collect();
                match nums.as_deref() {
                    Ok(&[ntok, vocab, hs, k]) => Shape::new(ntok, vocab, hs, k),
                    _ => {
                        return Err(format!(
                            "`{s}`: expected A, B, S, M or NTOK:V:HS:K (e.g. 256:32768:1024:64)"
                        ))
                    }
                }
            }
        };
        shape.validate()?;
        Ok(shape)
    }
}

impl Shape {
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.ntok == 0 || self.vocab == 0 || self.hs == 0 {
            return Err(format!("{self}: ntok, V and hs must be at least 1"));
        }
        check_k(self.k, self.vocab).map_err(|e| format!("{self}: {e}"))
    }
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
    fn shapes_parse() {
        assert_eq!("A".parse::<Shape>(), Ok(Shape::A));
        assert_eq!("b".parse::<Shape>(), Ok(Shape::B));
        assert_eq!(
            "S".parse::<Shape>().map(|s| s.to_string()),
            Ok("8192:151936:896:64".to_string())
        );
        assert_eq!(
            "m".parse::<Shape>().map(|s| s.to_string()),
            Ok("8192:128256:2048:64".to_string())
        );
        assert_eq!("64:4096:256:16".parse::<Shape>(), Ok(Shape::new(64, 4096, 256, 16)));
        assert!("64:4096:256".parse::<Shape>().is_err());
        assert!("64:100:256:200".parse::<Shape>().is_err(), "k > V");
        assert!("0:100:256:2".parse::<Shape>().is_err());
        assert_eq!(Shape::A.flops(JobKind::HeadKl), 4.0 * 4096.0 * 248_320.0 * 5120.0);
        assert_eq!(Shape::A.flops(JobKind::Topk) * 2.0, Shape::A.flops(JobKind::HeadKl));
    }
}
