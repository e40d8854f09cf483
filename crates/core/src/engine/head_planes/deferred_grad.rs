//! The head's gradient of a resident call in one GEMM per part of the
//! vocabulary over all the call's tokens, where the backend can
//! ([`ResidentBackend::defers_head_grad`]), instead of one GEMM per chunk of
//! rows. Per chunk, the f32 gradient `[V][hs]` is read and written whole
//! (about 10 GB at shape A, four times over); here it is written once, and
//! the GEMMs reduce over all the tokens at once.
//!
//! Until the last chunk the caller's output holds nothing, so it holds the
//! GEMMs' inputs, at its end: the f16 logits gradient of every token, then
//! the f16 hidden rows `[tokens][hs]`. The gradient is parked one of two
//! ways ([`Parking`]):
//! - **rows**: `kl_rows` writes each chunk's rows straight into one
//!   `[tokens][vocab]` block, so nothing is copied, and dx too waits for
//!   the last chunk, one GEMM over every token (a chunk of 1024 rows
//!   fills 1.2 waves of the dx GEMM's tiles at shape A; 4096 rows, 4.8).
//!   The gradient of later columns lies across the whole block, so only
//!   the parts that end before the block can be written in place; the
//!   rest is one last part, its columns copied into the chunk scratch.
//! - **blocks**: after each chunk's dx, its gradient is copied column
//!   block by column block (a part's block `[tokens][width]`, the parts'
//!   blocks one after another). A part then only needs its own and later
//!   blocks, so each may write rows up to its own block: more parts fit
//!   where the rows' block would leave too much for the scratch.
//!
//! The parts run in order; each writes rows whose bytes end before the
//! first byte it or a later part still reads. The last part's gradient
//! and the hidden rows are first copied into the chunk scratch (free once
//! the chunks are done), so it may overwrite the rest. The GEMMs' alpha is
//! read from the status buffer ([`ResidentBackend::gemm_scaled_by_word`]),
//! so nothing is scaled after.

use crate::align::{round_up, ALIGN};
use crate::error::{Error, Result};
use crate::toolkit::backend::{GemmDesc, HeadLayout};
use crate::toolkit::resident_kernels::{ResidentBackend, RowCopyDesc};
use crate::toolkit::status::S_DX_MUL;

/// Most parts a deferred gradient is built in: past that, each part's GEMM
/// is too narrow to gain over one GEMM per chunk.
const MAX_PARTS: usize = 8;

/// Byte alignment of what the GEMMs read (cuBLASLt's widest).
const SCRATCH_ALIGN: usize = 256;

/// How the chunks' logits gradient reaches the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parking {
    /// Written there by `kl_rows`, `[grad_rows][vocab]` from byte
    /// `grad_offset`; dx deferred too.
    Rows { grad_offset: u64, grad_rows: usize },
    /// Copied there after each chunk's dx, a block per part.
    Blocks,
}

/// Where everything lies in the caller's `[vocab][hs]` f32 output, as
/// bytes: the parts' vocabulary rows, the parked gradient and the hidden
/// rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeferredLayout {
    tokens: usize,
    vocab: usize,
    hs: usize,
    parking: Parking,
    /// Part `i` is vocabulary rows `[bounds[i], bounds[i + 1])`.
    bounds: Vec<usize>,
}

impl DeferredLayout {
    /// The layout for `tokens` rows of a `[vocab][hs]` head (both multiples
    /// of [`ALIGN`]), whose last part and hidden rows fit in
    /// `scratch_bytes` and whose windows each fit in `max_window` bytes:
    /// the rows' parking where `rows_allowed` (the call writes no block
    /// mask after the gradient's rows) and it fits, else the blocks';
    /// `None` where neither fits or the parts would be too many.
    pub(crate) fn plan(
        tokens: usize,
        (vocab, hs): (usize, usize),
        (scratch_bytes, max_window): (u64, u64),
        rows_allowed: bool,
    ) -> Option<Self> {
        let plan = |rows| Self::plan_parked(tokens, (vocab, hs), (scratch_bytes, max_window), rows);
        rows_allowed.then(|| plan(true)).flatten().or_else(|| plan(false))
    }

    /// [`Self::plan`] for one parking.
    fn plan_parked(
        tokens: usize,
        (vocab, hs): (usize, usize),
        (scratch_bytes, max_window): (u64, u64),
        rows: bool,
    ) -> Option<Self> {
        let out = (vocab as u64).checked_mul(hs as u64)?.checked_mul(4)?;
        let hidden = 2 * (tokens * hs) as u64;
        if tokens == 0 || vocab == 0 || hidden > max_window || hidden > out {
            return None;
        }
        let hidden_offset = out - hidden;
        let parking = match rows {
            // The last chunk's pad rows (up to ALIGN − 1) land past the
            // tokens' rows; both GEMMs read the tokens' rows only.
            true => {
                let grad_rows = tokens + ALIGN;
                let grad_bytes = 2 * (grad_rows * vocab) as u64;
                if grad_bytes > hidden_offset || 2 * (tokens * vocab) as u64 > max_window {
                    return None;
                }
                let grad_offset = (hidden_offset - grad_bytes) / SCRATCH_ALIGN as u64 * SCRATCH_ALIGN as u64;
                Parking::Rows { grad_offset, grad_rows }
            }
            false => {
                if 2 * (tokens * vocab) as u64 > hidden_offset {
                    return None;
                }
                Parking::Blocks
            }
        };
        // Rows a window may hold: of the output (4·hs bytes a row) and of
        // a parked block (2·tokens bytes a column).
        let most_rows = (max_window / (4 * hs as u64).max(2 * tokens as u64)) as usize / ALIGN * ALIGN;
        let mut layout = Self {
            tokens,
            vocab,
            hs,
            parking,
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
            // Up to the first byte this part or a later one reads.
            let writable = (layout.first_read(first) / (4 * hs as u64)) as usize;
            let next = (writable / ALIGN * ALIGN).min(first + most_rows).min(vocab);
            if next <= first {
                return None;
            }
            layout.bounds.push(next);
            first = next;
        }
    }

    /// Bytes of the scratch the last part uses, `width` rows wide: its
    /// gradient's columns, then the hidden rows.
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

    /// The first byte of the output that the part starting at row `first`
    /// or a later one reads.
    fn first_read(&self, first: usize) -> u64 {
        match self.parking {
            Parking::Rows { grad_offset, .. } => grad_offset,
            Parking::Blocks => self.block_offset(first),
        }
    }

    /// Byte offset of the parked block of the part starting at row `first`
    /// (blocks' parking).
    fn block_offset(&self, first: usize) -> u64 {
        self.hidden_offset() - 2 * (self.tokens * (self.vocab - first)) as u64
    }

    /// The part from row `first`, `width` wide: where its gradient's first
    /// column starts, its row stride (elements) and its bytes from there.
    fn part_grad(&self, (first, width): (usize, usize)) -> (u64, usize, u64) {
        let ld = match self.parking {
            Parking::Rows { .. } => self.vocab,
            Parking::Blocks => width,
        };
        let offset = match self.parking {
            Parking::Rows { grad_offset, .. } => grad_offset + 2 * first as u64,
            Parking::Blocks => self.block_offset(first),
        };
        (offset, ld, 2 * ((self.tokens - 1) * ld + width) as u64)
    }

    /// Each part's rows, `(first, width)`.
    fn parts(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.bounds.windows(2).map(|w| (w[0], w[1] - w[0]))
    }

    /// Where `kl_rows` writes the chunk of `rows_padded` rows from token
    /// `start` (rows' parking: a window of `dst`, rows `vocab` apart);
    /// `None` with the blocks' parking.
    pub(crate) fn chunk_grad<B: ResidentBackend>(
        &self,
        backend: &B,
        dst: &B::Buffer,
        (start, rows_padded): (usize, usize),
    ) -> Result<Option<B::Buffer>> {
        let Parking::Rows { grad_offset, grad_rows } = self.parking else {
            return Ok(None);
        };
        if start + rows_padded > grad_rows {
            return Err(Error::BadDescriptor {
                kernel: "kl_rows",
                field: "grad rows",
                value: (start + rows_padded) as u128,
                reason: format!("a chunk's rows from {start} past the {grad_rows} parked"),
            });
        }
        let row_bytes = 2 * self.vocab as u64;
        let at = grad_offset + start as u64 * row_bytes;
        window(backend, dst, at, rows_padded as u64 * row_bytes).map(Some)
    }

    /// Every token's parked gradient rows, `vocab` apart, for the deferred
    /// dx GEMM (rows' parking; `None` with the blocks').
    pub(crate) fn all_grad<B: ResidentBackend>(&self, backend: &B, dst: &B::Buffer) -> Result<Option<B::Buffer>> {
        let Parking::Rows { grad_offset, .. } = self.parking else {
            return Ok(None);
        };
        window(backend, dst, grad_offset, 2 * (self.tokens * self.vocab) as u64).map(Some)
    }

    /// Parks a chunk's share in the output: its f16 hidden rows `x16`
    /// (`hs` apart) for the tokens from `start` and, with the blocks'
    /// parking, the columns of `grad` (its f16 logits gradient, `rows`
    /// rows `ld` apart) into each part's block.
    pub(crate) fn park<B: ResidentBackend>(
        &self,
        backend: &B,
        (grad, ld, x16): (&B::Buffer, usize, &B::Buffer),
        dst: &B::Buffer,
        (start, rows): (usize, usize),
    ) -> Result<()> {
        if self.parking == Parking::Blocks {
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
        }
        let hidden_bytes = 2 * self.hs * rows;
        let at = self.hidden_offset() + 2 * (start * self.hs) as u64;
        backend.copy_rows(x16, dst, &RowCopyDesc::run(hidden_bytes, 0, at))
    }

    /// The parts' GEMMs, once every chunk is parked (and, with the rows'
    /// parking, dx has read the gradient): each part's rows of `dst`
    /// become `alpha · status[S_DX_MUL] · Σ_t g[t][row] · x16[t]`. The last
    /// part reads its columns and the hidden rows from `scratch`.
    pub(crate) fn finish<B: ResidentBackend>(
        &self,
        backend: &B,
        (dst, scratch, status): (&B::Buffer, &B::Buffer, &B::Buffer),
        alpha: f32,
    ) -> Result<()> {
        let hidden_bytes = 2 * (self.tokens * self.hs) as u64;
        let last = self.bounds.len() - 2;
        for (part, (first, width)) in self.parts().enumerate() {
            let (grad_at, ld, grad_bytes) = self.part_grad((first, width));
            let (grad, lda, hidden) = match part == last {
                false => (
                    window(backend, dst, grad_at, grad_bytes)?,
                    ld,
                    window(backend, dst, self.hidden_offset(), hidden_bytes)?,
                ),
                true => {
                    let hidden_at = self.scratch_hidden_offset(width);
                    let columns = RowCopyDesc {
                        rows: self.tokens,
                        row_bytes: 2 * width,
                        src_offset: grad_at,
                        src_pitch: 2 * ld,
                        dst_offset: 0,
                        dst_pitch: 2 * width,
                    };
                    backend.copy_rows(dst, scratch, &columns)?;
                    let run = RowCopyDesc::run(hidden_bytes as usize, self.hidden_offset(), hidden_at);
                    backend.copy_rows(dst, scratch, &run)?;
                    (
                        window(backend, scratch, 0, 2 * (self.tokens * width) as u64)?,
                        width,
                        window(backend, scratch, hidden_at, hidden_bytes)?,
                    )
                }
            };
            let row_bytes = 4 * self.hs as u64;
            let out = window(backend, dst, first as u64 * row_bytes, width as u64 * row_bytes)?;
            let desc = GemmDesc {
                alpha,
                k: self.tokens,
                lda,
                a_columns: true,
                ..GemmDesc::dense(width, self.hs, self.tokens, HeadLayout::Dx)
            };
            backend.gemm_scaled_by_word((&grad, &hidden, &out), &desc, (status, S_DX_MUL))?;
        }
        Ok(())
    }
}

/// A window of `buffer`, or the error saying the backend made none.
fn window<B: ResidentBackend>(backend: &B, buffer: &B::Buffer, offset: u64, len: u64) -> Result<B::Buffer> {
    backend.window(buffer, offset, len).ok_or_else(|| {
        Error::MissingFeature(format!(
            "{}: a window of {len} bytes at {offset} (the head's gradient)",
            backend.info().backend
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A_SCRATCH: u64 = 1024 * 248_320 * 4;

    /// Shape A: 4096 tokens of a 248320 × 5120 head, 1 GB of scratch.
    fn shape_a(rows_allowed: bool) -> DeferredLayout {
        DeferredLayout::plan(4096, (248_320, 5120), (A_SCRATCH, 1 << 32), rows_allowed).expect("fits")
    }

    /// Every part writes rows that end before the first byte it or a later
    /// part reads; what each part reads lies inside the parked gradient;
    /// the last one's inputs fit in the scratch; the parts cover the
    /// vocabulary in order; every chunk's rows of the rows' parking fit
    /// the rows parked, whatever the rows a chunk.
    fn check(layout: &DeferredLayout, scratch: u64, max_window: u64) {
        let parts: Vec<_> = layout.parts().collect();
        assert!(!parts.is_empty() && parts.len() <= MAX_PARTS);
        assert_eq!(parts[0].0, 0);
        assert_eq!(parts.iter().map(|p| p.1).sum::<usize>(), layout.vocab);
        let row_bytes = 4 * layout.hs as u64;
        let (tokens, vocab) = (layout.tokens, layout.vocab);
        let grad_span = match layout.parking {
            Parking::Rows { grad_offset, grad_rows } => {
                assert_eq!(grad_offset % SCRATCH_ALIGN as u64, 0);
                assert!(grad_offset + 2 * (grad_rows * vocab) as u64 <= layout.hidden_offset());
                assert!(2 * (tokens * vocab) as u64 <= max_window);
                for rows_per_chunk in [1, 15, 16, 17, 100, 1024] {
                    let mut start = 0;
                    while start < tokens {
                        let rows = rows_per_chunk.min(tokens - start);
                        assert!(start + round_up(rows, ALIGN) <= grad_rows);
                        start += rows;
                    }
                }
                grad_offset..grad_offset + 2 * (tokens * vocab) as u64
            }
            Parking::Blocks => layout.block_offset(0)..layout.hidden_offset(),
        };
        for (i, &(first, width)) in parts.iter().enumerate() {
            assert!(width > 0 && first % ALIGN == 0);
            assert!(width as u64 * row_bytes <= max_window);
            assert!(2 * (tokens * width) as u64 <= max_window);
            let (at, ld, bytes) = layout.part_grad((first, width));
            assert!(grad_span.start <= at && at + bytes <= grad_span.end);
            assert!(ld >= width);
            if i + 1 < parts.len() {
                assert!(
                    (first + width) as u64 * row_bytes <= layout.first_read(first),
                    "part {i} overwrites what it reads"
                );
                assert!(layout.first_read(first) <= at);
            } else {
                assert!(layout.scratch_bytes(width) <= scratch);
            }
            if layout.parking == Parking::Blocks {
                // The blocks tile the region before the hidden rows.
                let end = layout.block_offset(first) + 2 * (tokens * width) as u64;
                let next = parts
                    .get(i + 1)
                    .map_or(layout.hidden_offset(), |p| layout.block_offset(p.0));
                assert_eq!(end, next);
            }
        }
        assert_eq!(
            layout.hidden_offset() + 2 * (tokens * layout.hs) as u64,
            layout.out_bytes()
        );
    }

    #[test]
    fn shape_a_parks_rows_in_two_parts() {
        let layout = shape_a(true);
        check(&layout, A_SCRATCH, 1 << 32);
        assert!(matches!(layout.parking, Parking::Rows { grad_rows: 4112, .. }));
        assert_eq!(layout.bounds, vec![0, 146_544, 248_320]);
    }

    #[test]
    fn shape_a_with_a_block_mask_parks_blocks_in_two_parts() {
        let layout = shape_a(false);
        check(&layout, A_SCRATCH, 1 << 32);
        assert_eq!(layout.parking, Parking::Blocks);
        assert_eq!(layout.bounds, vec![0, 146_944, 248_320]);
    }

    #[test]
    fn layouts_keep_every_part_clear_of_what_it_still_reads() {
        let (mut rows, mut blocks, mut most_parts) = (0, 0, 0);
        for tokens in [1, 17, 40, 1000, 4096, 8192] {
            for (vocab, hs) in [
                (304, 32),
                (304, 64),
                (1024, 256),
                (151_936, 896),
                (248_320, 5120),
                (32_000, 4096),
            ] {
                for scratch in [4096u64, 1 << 20, 1 << 30] {
                    for max_window in [1u64 << 20, 1 << 32] {
                        for rows_allowed in [true, false] {
                            let Some(layout) =
                                DeferredLayout::plan(tokens, (vocab, hs), (scratch, max_window), rows_allowed)
                            else {
                                continue;
                            };
                            check(&layout, scratch, max_window);
                            match layout.parking {
                                Parking::Rows { .. } => rows += 1,
                                Parking::Blocks => blocks += 1,
                            }
                            assert!(rows_allowed || layout.parking == Parking::Blocks);
                            most_parts = most_parts.max(layout.parts().count());
                        }
                    }
                }
            }
        }
        assert!(rows >= 10 && blocks >= 20, "{rows} rows' layouts, {blocks} blocks'");
        assert!(most_parts >= 3, "at most {most_parts} parts");
    }

    #[test]
    fn refused_where_the_inputs_do_not_fit() {
        for rows_allowed in [true, false] {
            // Shape S: 8192 tokens' f16 gradient (2.5 GB) outweighs a 0.5 GB output.
            let plan = |tokens, shape, budget| DeferredLayout::plan(tokens, shape, budget, rows_allowed);
            assert_eq!(plan(8192, (151_936, 896), (1 << 30, 1 << 32)), None);
            assert_eq!(plan(0, (304, 32), (1 << 30, 1 << 32)), None);
            // A scratch too small for any last part: the parts run out.
            assert_eq!(plan(4096, (248_320, 5120), (1024, 1 << 32)), None);
        }
    }

    /// The conformance suite's cases at V 304 (40 tokens, chunks of 16
    /// rows, so a scratch of 16 logits rows): hs 64 parks rows, hs 32 only
    /// blocks (the rows' tail is past the scratch).
    #[test]
    fn the_suites_cases_take_each_parking() {
        let scratch = 16 * 304 * 4;
        let plan = |hs| DeferredLayout::plan(40, (304, hs), (scratch, 1 << 32), true).map(|l| l.parking);
        assert!(matches!(plan(64), Some(Parking::Rows { .. })));
        assert_eq!(plan(32), Some(Parking::Blocks));
    }
}
