//! Token chunking: how many rows one pass of the kernels takes, from a byte
//! budget and the device's binding limit; and workgroup grid folding.

use crate::align::{round_up, ALIGN};
use crate::error::{Error, Result};

/// Most workgroups a dispatch may have along one dimension.
pub const MAX_WORKGROUPS_PER_DIM: u32 = 65_535;

/// One scratch buffer's cost per token row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowCost {
    /// Which buffer (for errors).
    pub what: &'static str,
    /// Bytes per token row.
    pub bytes_per_row: u64,
}

/// How the tokens of one call are cut into chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPlan {
    /// Token rows per chunk (a multiple of [`ALIGN`]; the last chunk may
    /// hold fewer real rows).
    pub rows_per_chunk: usize,
    /// Number of chunks.
    pub chunks: usize,
    /// Bytes of scratch the plan allocates.
    pub scratch_bytes: u64,
}

/// One chunk's token rows: `rows` tokens from token `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    /// The chunk's first token.
    pub start: usize,
    /// How many tokens it holds (at most the plan's `rows_per_chunk`).
    pub rows: usize,
}

/// Where a path's token rows come from and its outputs go, which decides
/// how [`ChunkPlan::chunk_rows`] cuts the tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkTransfers {
    /// Host slices: each chunk's rows are uploaded and its outputs
    /// downloaded beside the next chunk's kernels, except the first
    /// chunk's upload and the last chunk's download, which nothing
    /// overlaps; so those two chunks are halved.
    Host,
    /// Rows already on the device: nothing to wait for, equal chunks.
    Resident,
}

impl ChunkPlan {
    /// The chunks every path walks, in order. With [`ChunkTransfers::Host`]
    /// the first and the last chunk are cut to about half, where chunks
    /// are at least [`TAPER_MIN_ROWS`] and there are several: before the
    /// first chunk's kernels the device waits for its hidden rows' upload,
    /// and after the last one's the host waits for its dx download, so
    /// halving those two chunks halves the host time the call adds to the
    /// kernels'. Every chunk stays within `rows_per_chunk`; the chunks
    /// cover `0..ntok` once.
    pub fn chunk_rows(&self, ntok: usize, transfers: ChunkTransfers) -> Vec<Rows> {
        let equal = || {
            (0..self.chunks)
                .map(|c| {
                    let start = c * self.rows_per_chunk;
                    Rows {
                        start,
                        rows: self.rows_per_chunk.min(ntok - start),
                    }
                })
                .collect()
        };
        if transfers == ChunkTransfers::Resident || self.chunks < 2 || self.rows_per_chunk < TAPER_MIN_ROWS {
            return equal();
        }
        let edge = round_up(self.rows_per_chunk / 2, TILE_ROWS);
        let mut out = vec![Rows { start: 0, rows: edge }];
        let mut start = edge;
        while start < ntok {
            let rows = self.rows_per_chunk.min(ntok - start);
            if start + rows == ntok && rows >= edge + TILE_ROWS {
                // The last chunk: its tail of `edge` rows goes on its own
                // (a chunk of less than a tile is not worth its launches).
                out.push(Rows {
                    start,
                    rows: rows - edge,
                });
                out.push(Rows {
                    start: ntok - edge,
                    rows: edge,
                });
            } else {
                out.push(Rows { start, rows });
            }
            start += rows;
        }
        out
    }
}

/// Rows per chunk from which [`ChunkPlan::chunk_rows`] halves the host path's
/// first and last chunk (halves of 512 rows still fill the GPU).
pub const TAPER_MIN_ROWS: usize = 1024;

/// Rows of the GEMMs' row tiles that [`plan_chunks`] fills: the default
/// matrix-unit tiles are 128 rows (the others 64, 128 or 256), and a chunk
/// of `m` rows runs `⌈m / 128⌉` of them in both GEMMs.
pub const TILE_ROWS: usize = 128;

/// GEMM rows that chunks of `rows` compute for `ntok` tokens: each chunk's
/// rows rounded up to whole [`TILE_ROWS`] tiles.
fn tile_rows_computed(ntok: usize, rows: usize) -> usize {
    let (full, last) = (ntok / rows, ntok % rows);
    full * round_up(rows, TILE_ROWS) + if last > 0 { round_up(last, TILE_ROWS) } else { 0 }
}

/// Rows per chunk, at most `cap`: of the plans with the fewest chunks `cap`
/// allows and with one more, each with its rows balanced and rounded up to
/// [`ALIGN`] or to [`TILE_ROWS`], the one whose chunks compute the fewest
/// GEMM tile rows; ties go to fewer chunks, then to larger chunks. At shape
/// B the largest chunk that fits the default budget (2288 rows with f16
/// hidden rows) computes
/// 8320 rows of tiles for 8192 tokens; four chunks of 2048 compute 8192.
fn tile_filling_rows(ntok: usize, cap: usize) -> usize {
    let fewest = ntok.div_ceil(cap);
    let score = |rows: usize| (tile_rows_computed(ntok, rows), ntok.div_ceil(rows), usize::MAX - rows);
    let mut best = cap;
    for chunks in [fewest, fewest + 1] {
        for align in [ALIGN, TILE_ROWS] {
            let rows = round_up(ntok.div_ceil(chunks), align);
            if rows <= cap && score(rows) < score(best) {
                best = rows;
            }
        }
    }
    best
}

/// Rows per chunk such that all of `costs` for one chunk fit in `budget`
/// bytes and each buffer fits in `max_binding_bytes`; rows are a multiple
/// of [`ALIGN`] and at most `ntok` rounded up to it, chosen so the chunks
/// leave few partial GEMM row tiles ([`TILE_ROWS`]). `max_rows_per_chunk`
/// forces smaller chunks (a test knob).
pub fn plan_chunks(
    ntok: usize,
    costs: &[RowCost],
    budget: u64,
    max_binding_bytes: u64,
    max_rows_per_chunk: Option<usize>,
) -> Result<ChunkPlan> {
    if ntok == 0 {
        return Err(Error::NoTokens);
    }
    if budget == 0 {
        return Err(Error::BudgetZero);
    }
    let align = ALIGN as u64;
    let mut cap = round_up(ntok, ALIGN) as u64;
    for c in costs {
        let rows = max_binding_bytes / c.bytes_per_row.max(1) / align * align;
        if rows == 0 {
            return Err(Error::BindingTooSmall {
                what: c.what,
                row_bytes: c.bytes_per_row * align,
                max_binding: max_binding_bytes,
            });
        }
        cap = cap.min(rows);
    }
    let per_row: u64 = costs.iter().map(|c| c.bytes_per_row).sum::<u64>().max(1);
    let budget_rows = budget / per_row / align * align;
    if budget_rows == 0 {
        return Err(Error::BudgetTooSmall {
            budget,
            needed: per_row * align,
            rows: ALIGN,
        });
    }
    cap = cap.min(budget_rows);
    if let Some(knob) = max_rows_per_chunk {
        cap = cap.min(((knob / ALIGN).max(1) * ALIGN) as u64);
    }
    let rows_per_chunk = tile_filling_rows(ntok, cap as usize);
    Ok(ChunkPlan {
        rows_per_chunk,
        chunks: ntok.div_ceil(rows_per_chunk),
        scratch_bytes: per_row * rows_per_chunk as u64,
    })
}

/// A dispatch of `count` workgroups folded into `(x, y)` with both under
/// [`MAX_WORKGROUPS_PER_DIM`]; a kernel recovers its index as
/// `wg.x + wg.y * x`, and skips indices `≥ count`.
pub fn fold_workgroups(count: u64) -> (u32, u32) {
    let max = u64::from(MAX_WORKGROUPS_PER_DIM);
    if count <= max {
        return (count.max(1) as u32, 1);
    }
    let y = count.div_ceil(max);
    let x = count.div_ceil(y);
    (x as u32, y as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn costs(v_pad: u64, hs_pad: u64) -> Vec<RowCost> {
        vec![
            RowCost {
                what: "logits",
                bytes_per_row: v_pad * 4,
            },
            RowCost {
                what: "grad",
                bytes_per_row: v_pad * 2,
            },
            RowCost {
                what: "dx",
                bytes_per_row: hs_pad * 4,
            },
        ]
    }

    #[test]
    fn budget_below_one_tile_is_an_error() {
        let e = plan_chunks(100, &costs(1024, 64), 1000, u64::MAX, None).unwrap_err();
        assert!(matches!(e, Error::BudgetTooSmall { rows: 16, .. }), "{e}");
    }

    #[test]
    fn zero_budget_and_zero_tokens_are_errors() {
        assert_eq!(
            plan_chunks(1, &costs(16, 16), 0, u64::MAX, None),
            Err(Error::BudgetZero)
        );
        assert_eq!(
            plan_chunks(0, &costs(16, 16), 1 << 20, u64::MAX, None),
            Err(Error::NoTokens)
        );
    }

    #[test]
    fn chunks_fill_whole_gemm_tiles_where_the_budget_allows() {
        // A budget of 1376 rows: three chunks of them would compute 11
        // tiles each, four of 1024 compute 32 in all.
        let per_row = 1_000_000u64;
        let one = [RowCost {
            what: "logits",
            bytes_per_row: per_row,
        }];
        let p = plan_chunks(4096, &one, 1376 * per_row, u64::MAX, None).unwrap();
        assert_eq!((p.rows_per_chunk, p.chunks), (1024, 4));
        assert_eq!(tile_rows_computed(4096, 1376), 4224);
        assert_eq!(tile_rows_computed(4096, 1024), 4096);
        assert_eq!(p.scratch_bytes, 1024 * per_row);
        // 1408 rows fit: three balanced chunks of 1408 fill their tiles.
        let p = plan_chunks(4096, &one, 1408 * per_row, u64::MAX, None).unwrap();
        assert_eq!((p.rows_per_chunk, p.chunks), (1408, 3));
        // A budget of 2352 rows needs four chunks either way: four of 2048.
        let p = plan_chunks(8192, &one, 2352 * per_row, u64::MAX, None).unwrap();
        assert_eq!((p.rows_per_chunk, p.chunks), (2048, 4));
        // A small call keeps its one chunk.
        let p = plan_chunks(40, &one, 1376 * per_row, u64::MAX, None).unwrap();
        assert_eq!((p.rows_per_chunk, p.chunks), (48, 1));
    }

    #[test]
    fn host_chunks_halve_the_first_and_last_chunk_and_every_path_covers_every_token() {
        let plan = |rows_per_chunk: usize, ntok: usize| ChunkPlan {
            rows_per_chunk,
            chunks: ntok.div_ceil(rows_per_chunk),
            scratch_bytes: 0,
        };
        let host = |rows_per_chunk: usize, ntok: usize| -> Vec<(usize, usize)> {
            let chunks = plan(rows_per_chunk, ntok).chunk_rows(ntok, ChunkTransfers::Host);
            chunks.iter().map(|c| (c.start, c.rows)).collect()
        };
        // Shape B's plan and shape A's.
        assert_eq!(
            host(2048, 8192),
            [(0, 1024), (1024, 2048), (3072, 2048), (5120, 2048), (7168, 1024)]
        );
        assert_eq!(
            host(1024, 4096),
            [(0, 512), (512, 1024), (1536, 1024), (2560, 1024), (3584, 512)]
        );
        // A short last chunk stays whole; one chunk, or small ones, untouched.
        assert_eq!(host(1024, 2000), [(0, 512), (512, 1024), (1536, 464)]);
        assert_eq!(host(2048, 2048), [(0, 2048)]);
        assert_eq!(host(512, 2048), [(0, 512), (512, 512), (1024, 512), (1536, 512)]);
        assert_eq!(host(1024, 1025), [(0, 512), (512, 513)]);
        // The resident path's chunks are equal, the last one short.
        let resident = plan(1024, 4000).chunk_rows(4000, ChunkTransfers::Resident);
        let resident: Vec<_> = resident.iter().map(|c| (c.start, c.rows)).collect();
        assert_eq!(resident, [(0, 1024), (1024, 1024), (2048, 1024), (3072, 928)]);
        for (rows_per_chunk, ntok) in [
            (1024, 1025),
            (1024, 1700),
            (1408, 4096),
            (2048, 8191),
            (1024, 1536),
            (1152, 5000),
        ] {
            for transfers in [ChunkTransfers::Host, ChunkTransfers::Resident] {
                let chunks = plan(rows_per_chunk, ntok).chunk_rows(ntok, transfers);
                let mut next = 0;
                for c in &chunks {
                    assert_eq!(c.start, next, "{rows_per_chunk}:{ntok} {chunks:?}");
                    assert!(
                        c.rows > 0 && c.rows <= rows_per_chunk,
                        "{rows_per_chunk}:{ntok} {chunks:?}"
                    );
                    next += c.rows;
                }
                assert_eq!(next, ntok, "{rows_per_chunk}:{ntok} {chunks:?}");
            }
        }
    }

    #[test]
    fn fold_keeps_small_grids_flat() {
        assert_eq!(fold_workgroups(0), (1, 1));
        assert_eq!(fold_workgroups(65_535), (65_535, 1));
        assert_eq!(fold_workgroups(65_536), (32_768, 2));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, rng_seed: proptest::test_runner::RngSeed::Fixed(11), ..ProptestConfig::default() })]
        #[test]
        fn chunks_fit_budget_and_binding_and_cover(
            ntok in 1usize..100_000,
            v in 1u64..300_000,
            hs in 1u64..8192,
            budget_kib in 1u64..4_000_000,
            binding_mib in 1u64..4096,
            knob in proptest::option::of(1usize..5000),
        ) {
            let (v_pad, hs_pad) = (v.div_ceil(16) * 16, hs.div_ceil(16) * 16);
            let c = costs(v_pad, hs_pad);
            let (budget, binding) = (budget_kib << 10, binding_mib << 20);
            match plan_chunks(ntok, &c, budget, binding, knob) {
                Ok(p) => {
                    prop_assert_eq!(p.rows_per_chunk % ALIGN, 0);
                    prop_assert!(p.rows_per_chunk >= ALIGN);
                    prop_assert!(p.scratch_bytes <= budget);
                    for x in &c { prop_assert!(x.bytes_per_row * p.rows_per_chunk as u64 <= binding); }
                    let covered: usize = p.chunk_rows(ntok, ChunkTransfers::Resident).iter().map(|c| c.rows).sum();
                    prop_assert_eq!(covered, ntok);
                    prop_assert!(p.chunk_rows(ntok, ChunkTransfers::Host).iter().all(|c| c.rows > 0));
                    if let Some(k) = knob { prop_assert!(p.rows_per_chunk <= k.max(ALIGN)); }
                }
                Err(Error::BudgetTooSmall { needed, .. }) => prop_assert!(needed > budget),
                Err(Error::BindingTooSmall { row_bytes, .. }) => prop_assert!(row_bytes > binding),
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }

        #[test]
        fn tile_filling_never_computes_more_than_the_largest_chunks(
            ntok in 1usize..200_000,
            cap_tiles in 1usize..4096,
        ) {
            let cap = cap_tiles * ALIGN;
            let rows = tile_filling_rows(ntok, cap);
            prop_assert!(rows >= ALIGN && rows <= cap && rows.is_multiple_of(ALIGN));
            prop_assert!(tile_rows_computed(ntok, rows) <= tile_rows_computed(ntok, cap));
            prop_assert!(ntok.div_ceil(rows) <= ntok.div_ceil(cap) + 1);
        }

        #[test]
        fn folded_grids_cover_every_workgroup(count in 0u64..(65_535u64 * 65_535)) {
            let (x, y) = fold_workgroups(count);
            prop_assert!(x <= MAX_WORKGROUPS_PER_DIM && y <= MAX_WORKGROUPS_PER_DIM);
            prop_assert!(u64::from(x) * u64::from(y) >= count);
            // no whole row of workgroups is wasted
            prop_assert!(u64::from(x) * u64::from(y - 1) < count.max(1));
        }
    }
}
