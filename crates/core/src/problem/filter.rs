//! The dx GEMM's block filter (Cut Cross-Entropy's gradient filtering,
//! arXiv 2411.09009): `kl_rows` records, per token row and per block of
//! [`BLOCK`] vocabulary entries, whether any `|∂L/∂s_j|` of the block
//! (before the row's coefficient) exceeds ε; each dx GEMM tile ORs the
//! bits of its rows and skips the K steps of blocks left clear. The loss
//! is exact; only dx drops the skipped products.
//!
//! The mask lives in the grad buffer after the chunk's `rows_padded` rows
//! of `ld` halves (the dx GEMM's A: element `m · lda`), so no kernel gains
//! a binding. Row `r` has [`mask_words`]`(ld)` words of four halves each;
//! each half holds 8 block bits as the integer value 0..=255 (exact in
//! f16, so no shader reinterprets bits): block `b` is bit `b % 8` of half
//! `b / 8`, i.e. bit `b % 32` of word `b / 32` (halves little-endian). A
//! word covers [`WORD_VOCAB`] vocabulary entries.

use half::f16;

/// Vocabulary entries per mask bit: one K step of the 64-deep GEMM tiles
/// (the 16- and 32-deep ones read the bit of the block their step is in).
pub const BLOCK: usize = 64;

/// Vocabulary entries per mask word (32 blocks).
pub const WORD_VOCAB: usize = 32 * BLOCK;

/// ε of `--filter-eps auto`: f16's machine epsilon / 32 (2⁻¹⁵), as Cut
/// Cross-Entropy uses for f16.
pub const AUTO_EPS: f32 = 1.0 / 32768.0;

/// Mask words per row for a grad row stride of `ld` halves.
pub const fn mask_words(ld: usize) -> usize {
    ld.div_ceil(WORD_VOCAB)
}

/// Halves of mask after `rows` grad rows of stride `ld`.
pub const fn mask_halves(rows: usize, ld: usize) -> usize {
    rows * mask_words(ld) * 4
}

/// Word `w` of a row's mask from its four halves.
pub fn word_of(halves: &[f16]) -> u32 {
    let bytes = byte_table();
    halves.iter().take(4).enumerate().fold(0, |acc, (i, h)| {
        acc | u32::from(bytes[usize::from(h.to_bits())]) << (8 * i)
    })
}

/// ORs into `or` (one word each) the mask words of `rows`, each row
/// `or.len()` words of four halves from `halves`: bit `b` of word `w` ends
/// set when some row keeps block `32·w + b`. A row past `halves` adds
/// nothing.
pub fn or_rows(halves: &[f16], rows: std::ops::Range<usize>, or: &mut [u32]) {
    let words = or.len();
    for r in rows {
        let row = halves.get(r * words * 4..(r + 1) * words * 4).unwrap_or_default();
        for (o, word) in or.iter_mut().zip(row.chunks_exact(4)) {
            *o |= word_of(word);
        }
    }
}

/// [`byte_of`] of every f16 bit pattern. The host reads a mask of rows ×
/// vocabulary / 256 halves per chunk (A: half a million); a lookup is a
/// quarter of the time of decoding each (1 ms a chunk at A, on the host
/// path between chunks).
fn byte_table() -> &'static [u8] {
    static TABLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(|bits| byte_of(f16::from_bits(bits)) as u8).collect())
}

/// `(h as u32) & 0xff` (truncated toward zero, negatives and NaN 0),
/// from the bits.
fn byte_of(h: f16) -> u32 {
    let bits = u32::from(h.to_bits());
    let (exponent, mantissa) = ((bits >> 10) & 0x1f, bits & 0x3ff);
    if bits & 0x8000 != 0 || exponent < 15 || (exponent == 31 && mantissa != 0) {
        return 0;
    }
    if exponent == 31 {
        // +∞ saturates.
        return 0xff;
    }
    // The value is (1024 + mantissa) · 2^(exponent − 25); past 2^32 it
    // saturates as a float conversion does.
    let significand = u64::from(0x400 | mantissa);
    let value = if exponent >= 25 {
        (significand << (exponent - 25)).min(u64::from(u32::MAX))
    } else {
        significand >> (25 - exponent)
    };
    (value as u32) & 0xff
}

/// The four halves of a mask word.
pub fn halves_of(word: u32) -> [f16; 4] {
    std::array::from_fn(|i| f16::from_f32(((word >> (8 * i)) & 0xff) as f32))
}

/// What the filter did in one `head_kl` call (host path).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FilterStats {
    /// The dx GEMM's (row tile × block) pairs over the call's chunks and
    /// the whole padded vocabulary.
    pub blocks: u64,
    /// Of those, the ones skipped (every entry of the tile's real rows
    /// within ε).
    pub skipped: u64,
    /// A bound on `‖dx_filtered − dx_exact‖₂` over the whole tensor, from
    /// `|dx_t,dropped| ≤ |w_t|/(τ·total) · ε · Σ_{j skipped for t} ‖W_j‖`
    /// (f16 head rows' norms; the f16 rounding of `g` is not counted).
    pub dropped_bound: f64,
    /// ε used.
    pub eps: f32,
}

impl FilterStats {
    /// The skipped fraction (0 when nothing ran).
    pub fn skipped_fraction(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            self.skipped as f64 / self.blocks as f64
        }
    }

    /// Adds another chunk's counts.
    pub fn merge(&mut self, other: &FilterStats) {
        self.blocks += other.blocks;
        self.skipped += other.skipped;
        self.dropped_bound = self.dropped_bound.hypot(other.dropped_bound);
        self.eps = other.eps;
    }
}

/// Checks ε: finite and not negative.
pub fn check_eps(eps: f32) -> crate::error::Result<()> {
    if eps >= 0.0 && eps.is_finite() {
        Ok(())
    } else {
        Err(crate::error::Error::InvalidFilterEps { value: eps })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_from_bits_match_the_float_conversion() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let want = (h.to_f32() as u32) & 0xff;
            assert_eq!(byte_of(h), want, "{bits:#06x} ({h})");
            assert_eq!(
                word_of(&[f16::ZERO, h, f16::ZERO, f16::ZERO]),
                want << 8,
                "{bits:#06x} ({h})"
            );
        }
    }

    #[test]
    fn words_round_trip_through_halves() {
        for w in [0u32, 1, 0x8000_0000, 0xdead_beef, u32::MAX, 0x00ff_0100] {
            assert_eq!(word_of(&halves_of(w)), w, "{w:#x}");
        }
        assert_eq!(mask_words(2048), 1);
        assert_eq!(mask_words(2049), 2);
        assert_eq!(mask_halves(3, 4096), 24);
        assert!(check_eps(-1.0).is_err() && check_eps(f32::NAN).is_err() && check_eps(0.0).is_ok());
    }
}
