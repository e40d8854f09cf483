//! A problem's extents (tokens, vocabulary, hidden size, teacher entries)
//! and the named shapes of DESIGN §7 that the benchmarks time: one type
//! for the CLI's bench, the burn bench and the loss file's record.

use std::fmt;
use std::str::FromStr;

use crate::problem::check_k;

/// A problem's extents: `ntok` rows of hidden size `hs` through a
/// `[vocab][hs]` head, `k` teacher entries a row (top-k's k).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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

    /// Every extent at least 1 and `k` within [`check_k`]'s bounds; the
    /// message names the shape.
    pub fn validate(&self) -> Result<(), String> {
        if self.ntok == 0 || self.vocab == 0 || self.hs == 0 {
            return Err(format!("{self}: ntok, V and hs must be at least 1"));
        }
        check_k(self.k, self.vocab).map_err(|e| format!("{self}: {e}"))
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}:{}", self.ntok, self.vocab, self.hs, self.k)
    }
}

impl FromStr for Shape {
    type Err = String;

    /// `A`, `B`, `S`, `M` (either case) or `NTOK:V:HS:K`, validated.
    fn from_str(s: &str) -> Result<Self, String> {
        let shape = match s.trim() {
            "A" | "a" => Shape::A,
            "B" | "b" => Shape::B,
            "S" | "s" => Shape::S,
            "M" | "m" => Shape::M,
            other => {
                let nums: Result<Vec<usize>, _> = other.split(':').map(|p| p.trim().parse::<usize>()).collect();
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
    }
}
