//! Vocabulary slices: cut the head `[V][hs]` into row ranges whose f16
//! planes each fit the device's largest storage binding.

use crate::align::{round_up, ALIGN};
use crate::error::{Error, Result};

/// Granularity of slice widths: every slice but the last is a multiple of
/// this many vocabulary rows, so slice offsets stay aligned to any GEMM tile.
pub const SLICE_ROWS: usize = 128;

/// One vocabulary slice: head rows `[offset, offset + width)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabSlice {
    /// First vocabulary row.
    pub offset: usize,
    /// Rows in the slice.
    pub width: usize,
}

impl VocabSlice {
    /// Rows the slice's device plane holds: `width` rounded up to [`ALIGN`]
    /// (the pad rows are zero).
    pub fn padded_width(&self) -> usize {
        round_up(self.width, ALIGN)
    }
}

/// Cuts `[0, vocab)` into slices whose f16 planes (`padded_width × hs_padded`
/// elements) fit in `max_binding_bytes`.
///
/// Widths are multiples of [`SLICE_ROWS`] except the last, the slices cover
/// `[0, vocab)` exactly and in order, and their widths differ by at most one
/// block of [`SLICE_ROWS`] (plus the last one's partial block).
/// `max_rows_per_slice` forces smaller slices (a test knob); it is rounded
/// down to a multiple of [`SLICE_ROWS`], and at least one block.
pub fn slice_vocab(
    vocab: usize,
    hs_padded: usize,
    max_binding_bytes: u64,
    max_rows_per_slice: Option<usize>,
) -> Result<Vec<VocabSlice>> {
    if vocab == 0 {
        return Err(Error::VocabZero);
    }
    if hs_padded == 0 {
        return Err(Error::HiddenSizeZero);
    }
    let block_bytes = (SLICE_ROWS * hs_padded * 2) as u64;
    let binding_blocks = (max_binding_bytes / block_bytes) as usize;
    if binding_blocks == 0 {
        return Err(Error::BindingTooSmall {
            what: "head slice",
            row_bytes: block_bytes,
            max_binding: max_binding_bytes,
        });
    }
    let knob_blocks = max_rows_per_slice.map_or(usize::MAX, |r| (r / SLICE_ROWS).max(1));
    let cap_blocks = binding_blocks.min(knob_blocks);
    let blocks = vocab.div_ceil(SLICE_ROWS);
    let count = blocks.div_ceil(cap_blocks);
    let (base, extra) = (blocks / count, blocks % count);
    let mut slices = Vec::with_capacity(count);
    let mut offset = 0;
    for i in 0..count {
        let nblocks = base + usize::from(i < extra);
        let width = (nblocks * SLICE_ROWS).min(vocab - offset);
        slices.push(VocabSlice { offset, width });
        offset += width;
    }
    debug_assert_eq!(offset, vocab);
    Ok(slices)
}

/// How the head is cut into vocabulary slices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SliceOptions {
    /// Test knob: at most this many vocabulary rows per slice (rounded down
    /// to a multiple of 128, at least 128), to reach the multi-slice path
    /// with a small head.
    pub max_rows_per_slice: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn forced_small_slices_split_1024_rows_in_three() {
        let s = slice_vocab(1024, 256, u64::MAX, Some(384)).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s.iter().map(|x| x.width).sum::<usize>(), 1024);
    }

    #[test]
    fn h200_shape_a_fits_one_vulkan_slice_and_two_wgpu_slices() {
        let vulkan = slice_vocab(248_320, 5120, (4u64 << 30) - 1, None).unwrap();
        assert_eq!(vulkan.len(), 1);
        let wgpu = slice_vocab(248_320, 5120, (2u64 << 30) - 4, None).unwrap();
        assert_eq!(wgpu.len(), 2);
    }

    #[test]
    fn binding_below_one_block_is_an_error() {
        let e = slice_vocab(1000, 4096, 1000, None).unwrap_err();
        assert!(matches!(e, Error::BindingTooSmall { .. }), "{e}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, rng_seed: proptest::test_runner::RngSeed::Fixed(7), ..ProptestConfig::default() })]
        #[test]
        fn slices_cover_in_order_aligned_and_fit(
            vocab in 1usize..400_000,
            hs in 1usize..6000,
            binding_mib in 1u64..5000,
            knob in proptest::option::of(1usize..50_000),
        ) {
            let hs_padded = round_up(hs, ALIGN);
            let binding = binding_mib << 20;
            match slice_vocab(vocab, hs_padded, binding, knob) {
                Err(Error::BindingTooSmall { .. }) => {
                    prop_assert!(((SLICE_ROWS * hs_padded * 2) as u64) > binding);
                }
                Err(e) => prop_assert!(false, "unexpected error {e}"),
                Ok(s) => {
                    let mut next = 0;
                    for (i, sl) in s.iter().enumerate() {
                        prop_assert_eq!(sl.offset, next);
                        prop_assert!(sl.width > 0);
                        if i + 1 < s.len() {
                            prop_assert_eq!(sl.width % SLICE_ROWS, 0);
                        }
                        prop_assert!((sl.padded_width() * hs_padded * 2) as u64 <= binding);
                        if let Some(k) = knob {
                            prop_assert!(sl.width <= (k / SLICE_ROWS).max(1) * SLICE_ROWS);
                        }
                        next += sl.width;
                    }
                    prop_assert_eq!(next, vocab);
                    let widest = s.iter().map(|x| x.width).max().unwrap();
                    let narrowest_full = s[..s.len() - 1].iter().map(|x| x.width).min().unwrap_or(widest);
                    prop_assert!(widest - narrowest_full <= SLICE_ROWS);
                }
            }
        }
    }
}
