//! Split-K for the dx GEMM: how a GEMM's reduction is cut into parts that
//! run in one dispatch into f32 partial blocks (summed afterwards, in a
//! fixed order, by [`crate::toolkit::KernelId::SumParts`]), and how many parts the
//! driver asks for (`HEADKL_DX_SPLIT`, [`DxSplit`]).
//!
//! The dx GEMM's output is small (`rows × hs`), so its 128 × 128 tiles make
//! few workgroups: at shape A on the H200 a chunk's 440 workgroups fill
//! 1.67 waves of 264. Splitting its reduction (the vocabulary) into parts
//! multiplies the workgroups without atomics.

use std::fmt;

use crate::error::{Error, Result};

/// Reduction indices a part's length is a multiple of (whole `BK` steps
/// of every GEMM kernel, and 16-byte aligned operand offsets).
pub const K_PART_ALIGN: usize = 64;

/// Most parts `HEADKL_DX_SPLIT` (and [`DxSplit::Parts`]) may ask for.
pub const MAX_DX_SPLIT: usize = 16;

/// Workgroups per dx GEMM dispatch the automatic choice aims for: 5 waves
/// of the H200's 132 SMs × 2 workgroups is 1320.
pub const AUTO_TARGET_WORKGROUPS: u64 = 1300;

/// The shortest part the automatic choice makes, in reduction indices:
/// shorter parts spend more on the partial blocks' traffic than they gain.
pub const AUTO_MIN_PART_K: usize = 4096;

/// The length of each part of a reduction of `k` indices cut into
/// `k_parts` parts: `ceil(k / k_parts)` rounded up to [`K_PART_ALIGN`].
/// Part `p` covers `[p·len, min(k, (p + 1)·len))`, which may be empty for
/// the last parts. One definition for the checks, the shaders' parameters
/// and the CPU backend.
pub const fn k_part_len(k: usize, k_parts: usize) -> usize {
    let parts = if k_parts == 0 { 1 } else { k_parts };
    k.div_ceil(parts).div_ceil(K_PART_ALIGN) * K_PART_ALIGN
}

/// The reduction range `[start, end)` of part `p`.
pub fn k_part_range(k: usize, k_parts: usize, p: usize) -> std::ops::Range<usize> {
    let len = k_part_len(k, k_parts);
    let start = (p * len).min(k);
    start..((p + 1) * len).min(k)
}

/// How many parts the dx GEMM's reduction is cut into.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DxSplit {
    /// [`DxSplit::choose`]'s rule.
    #[default]
    Auto,
    /// This many parts (1 ..= [`MAX_DX_SPLIT`]; 1 never splits), fewer
    /// only where a slice has fewer than `parts` runs of
    /// [`K_PART_ALIGN`] indices.
    Parts(usize),
}

impl DxSplit {
    /// Parses `auto` or an integer in `1..=16`; `name` is the setting's
    /// name for the error.
    pub fn parse(name: &'static str, value: &str) -> Result<Self> {
        let text = value.trim();
        if text.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        match text.parse::<usize>() {
            Ok(p) if (1..=MAX_DX_SPLIT).contains(&p) => Ok(Self::Parts(p)),
            _ => Err(Error::InvalidSetting {
                name,
                value: value.to_string(),
                reason: format!("expected `auto` or an integer in 1..={MAX_DX_SPLIT}"),
            }),
        }
    }

    /// The parts of each slice's dx GEMM, whose reduction is `k` indices
    /// long and whose output makes `tiles` workgroups, where the backend's
    /// matrix-unit GEMM has tile `tile` (`None`: the fallback GEMM or the
    /// CPU, where splitting only adds traffic).
    ///
    /// `Auto`: the fewest parts whose workgroups (`tiles × parts`) reach
    /// [`AUTO_TARGET_WORKGROUPS`], but no part shorter than
    /// [`AUTO_MIN_PART_K`] indices, at most [`MAX_DX_SPLIT`], and 1
    /// without a matrix-unit GEMM.
    pub fn choose(self, tiles: u64, k: usize, tile: Option<(u32, u32)>) -> usize {
        let nonempty = k.div_ceil(K_PART_ALIGN).max(1);
        match self {
            Self::Parts(p) => p.clamp(1, MAX_DX_SPLIT).min(nonempty),
            Self::Auto if tile.is_none() || tiles == 0 => 1,
            Self::Auto => {
                let most = (k / AUTO_MIN_PART_K).clamp(1, MAX_DX_SPLIT);
                let want = AUTO_TARGET_WORKGROUPS.div_ceil(tiles) as usize;
                want.clamp(1, most)
            }
        }
    }

    /// The most parts [`DxSplit::choose`] can return for a reduction of
    /// `k` indices, whatever the tile count: what the scratch is sized for.
    pub fn most(self, k: usize, tile: Option<(u32, u32)>) -> usize {
        self.choose(1, k, tile)
    }
}

impl fmt::Display for DxSplit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Parts(p) => write!(f, "{p}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_reduction_in_aligned_runs() {
        assert_eq!(k_part_len(124_160, 3), 41_408);
        assert_eq!(k_part_len(272, 2), 192);
        assert_eq!(k_part_len(272, 3), 128);
        assert_eq!(k_part_len(48, 1), 64);
        for (k, parts) in [(272, 2), (272, 3), (124_160, 3), (128, 3), (16, 4)] {
            let mut next = 0;
            for p in 0..parts {
                let r = k_part_range(k, parts, p);
                assert_eq!(r.start, next, "k {k} parts {parts} part {p}");
                assert!(r.start.is_multiple_of(K_PART_ALIGN) || r.start == k);
                next = r.end;
            }
            assert_eq!(next, k);
        }
        // k 128 in 3: 64 + 64 + an empty last part.
        assert!(k_part_range(128, 3, 2).is_empty());
    }

    #[test]
    fn auto_fills_the_h200_at_shape_a() {
        let tile = Some((128, 128));
        // 1408 × 5120 in 128 × 128 tiles: 11 × 40 = 440 workgroups.
        assert_eq!(DxSplit::Auto.choose(440, 124_160, tile), 3);
        // Few tiles, a long reduction: many parts, capped at 16.
        assert_eq!(DxSplit::Auto.choose(4, 1 << 20, tile), MAX_DX_SPLIT);
        // Few tiles but a short reduction: parts stay ≥ 4096 long.
        assert_eq!(DxSplit::Auto.choose(4, 3 * 4096 + 64, tile), 3);
        assert_eq!(DxSplit::Auto.choose(4, 4000, tile), 1);
        // Enough tiles already, or no matrix units: no split.
        assert_eq!(DxSplit::Auto.choose(2000, 124_160, tile), 1);
        assert_eq!(DxSplit::Auto.choose(4, 1 << 20, None), 1);
        assert_eq!(DxSplit::Auto.most(124_160, tile), MAX_DX_SPLIT);
        assert_eq!(DxSplit::Auto.most(124_160, None), 1);
    }

    #[test]
    fn forced_parts_are_kept_unless_the_slice_is_too_short() {
        assert_eq!(DxSplit::Parts(3).choose(10_000, 304, None), 3);
        assert_eq!(DxSplit::Parts(16).choose(1, 304, Some((128, 128))), 5);
        assert_eq!(DxSplit::Parts(1).choose(1, 1 << 20, Some((128, 128))), 1);
        assert_eq!(DxSplit::Parts(4).most(1 << 20, None), 4);
    }

    #[test]
    fn the_setting_parses_and_names_bad_values() {
        assert_eq!(DxSplit::parse("X", " Auto ").unwrap(), DxSplit::Auto);
        assert_eq!(DxSplit::parse("X", "3").unwrap(), DxSplit::Parts(3));
        for bad in ["0", "17", "two", "-1", ""] {
            match DxSplit::parse("X", bad) {
                Err(Error::InvalidSetting { name, value, .. }) => assert_eq!((name, value.as_str()), ("X", bad)),
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert_eq!(DxSplit::Parts(4).to_string(), "4");
    }
}
