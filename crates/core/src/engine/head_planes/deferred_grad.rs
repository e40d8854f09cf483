//! The head's gradient of a resident call in one GEMM per part of the
//! vocabulary over all the call's tokens, where the backend can
//! ([`ResidentBackend::defers_head_grad`]), instead of one GEMM per chunk of
//! rows. Per chunk, the f32 gradient `[V][hs]` is read and written whole
//! (about 10 GB at shape A, four times over); here it is written once, and
//! the GEMMs reduce over all the tokens at once.
//!
//! Until the last chunk the caller's output holds nothing, so it holds the
//! GEMMs' inputs: each chunk's f16 logits gradient is copied into it,
//! column block by column block (a part's block `[tokens][width]`, the
//! parts' blocks one after another), behind them the f16 hidden rows
//! `[tokens][hs]`, all at the buffer's end. The parts then run in order;
//! each writes rows whose bytes end before the first byte of its own block,
//! so no part overwrites what it or a later part still reads. The last
//! part's block and the hidden rows are first copied into the chunk
//! scratch (free once the chunks are done), so it may overwrite the rest.
//! The GEMMs' alpha is read from the status buffer
//! ([`ResidentBackend::gemm_scaled_by_word`]), so nothing is scaled after.

use crate::align::{round_up, ALIGN};
use crate::error::{Error, Result};
use crate::toolkit::backend::{GemmDesc, HeadLayout};
use crate::toolkit::resident_kernels::{ResidentBackend, RowCopyDesc};
use crate::toolkit::status::S_DX_MUL;

/// Most parts a deferred gradient is built in: past that, each part's GEMM
/// is too narrow to gain over one GEMM per chunk.
const MAX_PARTS: usize = 8;

/// Byte alignment of what is copied into the scratch (cuBLASLt's widest).
const SCRATCH_ALIGN: usize = 256;

/// Where everything lies in the caller's `[vocab][hs]` f32 output, as
/// bytes: the parts' vocabulary rows, their parked blocks and the hidden
/// rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeferredLayout {
    tokens: usize,
    vocab: usize,
    hs: usize,
    /// Part `i` is vocabulary rows `[bounds[i], bounds[i + 1])`.
    bounds: Vec<usize>,
}

impl DeferredLayout {
    /// The layout for `tokens` rows of a `[vocab][hs]` head (both multiples
    /// of [`ALIGN`]), whose last part and hidden rows fit in
    /// `scratch_bytes` and whose windows each fit in `max_window` bytes;
    /// `None` where the inputs do not fit beside the rows the first part
    /// writes, or the parts would be too many.
    pub(crate) fn plan(
        tokens: usize,
        (vocab, hs): (usize, usize),
        scratch_bytes: u64,
        max_window: u64,
    ) -> Option<Self> {
        let out = (vocab as u64).checked_mul(hs as u64)?.checked_mul(4)?;
        let (parked, hidden) = (2 * (tokens * vocab) as u64, 2 * (tokens * hs) as u64);
        if tokens == 0 || vocab == 0 || parked + hidden > out || hidden > max_window {
            return None;
        }
        // Rows a window may hold: of the output (4·hs bytes a row) and of
        // a parked block (2·tokens bytes a column).
        let most_rows = (max_window / (4 * hs as u64).max(2 * tokens as u64)) as usize / ALIGN * ALIGN;
        let park_base = out - parked - hidden;
        let mut layout = Self {
            tokens,
            vocab,
            hs,
            bounds: vec![0],
        };
        let mut first = 0;
        loop {
            let tail = vocab - first;
            if tail <= most_rows && layout.scratch_bytes(tail) <= scratch_bytes {
                layout.bounds.push(vocab);
                return Some(layout);
            }
            if layout.bounds.len() >= MAX_PARTS {
                return None;
            }
            // Up to the first byte of this part's own block.
            let writable = ((park_base + 2 * (tokens * first) as u64) / (4 * hs as u64)) as usize;
            let next = (writable / ALIGN * ALIGN).min(first + most_rows).min(vocab);
            if next <= first {
                return None;
            }
            layout.bounds.push(next);
            first = next;
        }
    }

    /// Bytes of the scratch the last part uses, `width` rows wide: its
    /// block, then the hidden rows.
    fn scratch_bytes(&self, width: usize) -> u64 {
        self.scratch_hidden_offset(width) + 2 * (self.tokens * self.hs) as u64
    }

    fn scratch_hidden_offset(&self, width: usize) -> u64 {
        round_up(2 * self.tokens * width, SCRATCH_ALIGN) as u64
    }

    fn out_bytes(&self) -> u64 {
        4 * (self.vocab * self.hs) as u64
    }

    /// Byte offset of the hidden rows in the output.
    fn hidden_offset(&self) -> u64 {
        self.out_bytes() - 2 * (self.tokens * self.hs) as u64
    }

    /// Byte offset of the parked block of the part starting at row `first`.
    fn block_offset(&self, first: usize) -> u64 {
        self.hidden_offset() - 2 * (self.tokens * (self.vocab - first)) as u64
    }

    /// Each part's rows, `(first, width)`.
    fn parts(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.bounds.windows(2).map(|w| (w[0], w[1] - w[0]))
    }

    /// Copies a chunk's share into the output: columns of `grad` (its f16
    /// logits gradient, `rows` rows `ld` apart) into each part's block,
    /// and its f16 hidden rows `x16` (`hs` apart), for the tokens from
    /// `start`.
    pub(crate) fn park<B: ResidentBackend>(
        &self,
        backend: &B,
        (grad, ld, x16): (&B::Buffer, usize, &B::Buffer),
        dst: &B::Buffer,
        (start, rows): (usize, usize),
    ) -> Result<()> {
        for (first, width) in self.parts() {
            let desc = RowCopyDesc {
                rows,
                row_bytes: 2 * width,
                src_offset: 2 * first as u64,
                src_pitch: 2 * ld,
                dst_offset: self.block_offset(first) + 2 * (start * width) as u64,
                dst_pitch: 2 * width,
            };
            backend.copy_rows(grad, dst, &desc)?;
        }
        let hidden_bytes = 2 * self.hs * rows;
        let at = self.hidden_offset() + 2 * (start * self.hs) as u64;
        backend.copy_rows(x16, dst, &RowCopyDesc::run(hidden_bytes, 0, at))
    }

    /// The parts' GEMMs, once every chunk is parked: each part's rows of
    /// `dst` become `alpha · status[S_DX_MUL] · Σ_t g[t][row] · x16[t]`.
    /// The last part reads its block and the hidden rows from `scratch`.
    pub(crate) fn finish<B: ResidentBackend>(
        &self,
        backend: &B,
        (dst, scratch, status): (&B::Buffer, &B::Buffer, &B::Buffer),
        alpha: f32,
    ) -> Result<()> {
        let window = |buffer: &B::Buffer, offset: u64, len: u64| {
            backend.window(buffer, offset, len).ok_or_else(|| {
                Error::MissingFeature(format!(
                    "{}: a window of {len} bytes at {offset} (the head's gradient)",
                    backend.info().backend
                ))
            })
        };
        let hidden_bytes = 2 * (self.tokens * self.hs) as u64;
        let last = self.bounds.len() - 2;
        for (part, (first, width)) in self.parts().enumerate() {
            let block_bytes = 2 * (self.tokens * width) as u64;
            let (block, hidden) = match part == last {
                false => (
                    window(dst, self.block_offset(first), block_bytes)?,
                    window(dst, self.hidden_offset(), hidden_bytes)?,
                ),
                true => {
                    let hidden_at = self.scratch_hidden_offset(width);
                    backend.copy_rows(
                        dst,
                        scratch,
                        &RowCopyDesc::run(block_bytes as usize, self.block_offset(first), 0),
                    )?;
                    let run = RowCopyDesc::run(hidden_bytes as usize, self.hidden_offset(), hidden_at);
                    backend.copy_rows(dst, scratch, &run)?;
                    (
                        window(scratch, 0, block_bytes)?,
                        window(scratch, hidden_at, hidden_bytes)?,
                    )
                }
            };
            let row_bytes = 4 * self.hs as u64;
            let out = window(dst, first as u64 * row_bytes, width as u64 * row_bytes)?;
            let desc = GemmDesc {
                alpha,
                k: self.tokens,
                lda: width,
                a_columns: true,
                ..GemmDesc::dense(width, self.hs, self.tokens, HeadLayout::Dx)
            };
            backend.gemm_scaled_by_word((&block, &hidden, &out), &desc, (status, S_DX_MUL))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shape A: 4096 tokens of a 248320 × 5120 head, 1 GB of scratch.
    fn shape_a() -> DeferredLayout {
        DeferredLayout::plan(4096, (248_320, 5120), 1024 * 248_320 * 4, 1 << 32).expect("fits")
    }

    /// Every part writes rows that end at or before its own block, and so
    /// before every later part's block and the hidden rows; the last one's
    /// inputs fit in the scratch; the parts cover the vocabulary in order.
    fn check(layout: &DeferredLayout, scratch: u64, max_window: u64) {
        let parts: Vec<_> = layout.parts().collect();
        assert!(!parts.is_empty() && parts.len() <= MAX_PARTS);
        assert_eq!(parts[0].0, 0);
        assert_eq!(parts.iter().map(|p| p.1).sum::<usize>(), layout.vocab);
        let row_bytes = 4 * layout.hs as u64;
        for (i, &(first, width)) in parts.iter().enumerate() {
            assert!(width > 0 && first % ALIGN == 0);
            assert!(width as u64 * row_bytes <= max_window);
            assert!(2 * (layout.tokens * width) as u64 <= max_window);
            if i + 1 < parts.len() {
                assert!(
                    (first + width) as u64 * row_bytes <= layout.block_offset(first),
                    "part {i} overwrites its block"
                );
            } else {
                assert!(layout.scratch_bytes(width) <= scratch);
            }
            // The blocks tile the region before the hidden rows.
            let end = layout.block_offset(first) + 2 * (layout.tokens * width) as u64;
            let next = parts
                .get(i + 1)
                .map_or(layout.hidden_offset(), |p| layout.block_offset(p.0));
            assert_eq!(end, next);
        }
        assert_eq!(
            layout.hidden_offset() + 2 * (layout.tokens * layout.hs) as u64,
            layout.out_bytes()
        );
    }

    #[test]
    fn shape_a_is_two_parts() {
        let layout = shape_a();
        check(&layout, 1024 * 248_320 * 4, 1 << 32);
        assert_eq!(layout.bounds, vec![0, 146_944, 248_320]);
    }

    #[test]
    fn layouts_keep_every_part_clear_of_what_it_still_reads() {
        let (mut planned, mut most_parts) = (0, 0);
        for tokens in [1, 17, 40, 1000, 4096, 8192] {
            for (vocab, hs) in [(304, 32), (1024, 256), (151_936, 896), (248_320, 5120), (32_000, 4096)] {
                for scratch in [4096u64, 1 << 20, 1 << 30] {
                    for max_window in [1u64 << 20, 1 << 32] {
                        if let Some(layout) = DeferredLayout::plan(tokens, (vocab, hs), scratch, max_window) {
                            check(&layout, scratch, max_window);
                            planned += 1;
                            most_parts = most_parts.max(layout.parts().count());
                        }
                    }
                }
            }
        }
        assert!(planned >= 20, "{planned} layouts planned");
        assert!(most_parts >= 3, "at most {most_parts} parts");
    }

    #[test]
    fn refused_where_the_inputs_do_not_fit() {
        // Shape S: 8192 tokens' f16 gradient (2.5 GB) outweighs a 0.5 GB output.
        assert_eq!(DeferredLayout::plan(8192, (151_936, 896), 1 << 30, 1 << 32), None);
        assert_eq!(DeferredLayout::plan(0, (304, 32), 1 << 30, 1 << 32), None);
        // A scratch too small for any last part: the parts run out.
        assert_eq!(DeferredLayout::plan(4096, (248_320, 5120), 1024, 1 << 32), None);
    }
}
