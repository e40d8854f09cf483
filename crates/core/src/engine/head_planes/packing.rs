//! The head's pieces on their way to the device: f16 rows padded to the
//! planes' width, with each row's norm, packed on one thread while the
//! caller uploads the piece before, so the host's conversion and the
//! transfer overlap rather than take turns.

use std::sync::mpsc;

use half::f16;

use crate::engine::head::HeadWeights;
use crate::problem::slicing::VocabSlice;
use crate::problem::vocab_order::VocabOrder;

/// Bytes of host data uploaded per transfer while packing the head, so a
/// multi-GB head never needs a second multi-GB copy on the host (two
/// pieces are alive at once: one packed, one on its way).
const HEAD_UPLOAD_BYTES: usize = 64 << 20;

/// Rows `row..row + rows` of slice `slice`'s plane, packed.
pub(super) struct Piece {
    pub slice: usize,
    pub row: usize,
    /// `rows × hs_padded` f16 values; the pad rows past the slice are 0.
    pub data: Vec<f16>,
    /// The norms of the slice's real rows among them.
    pub norms: Vec<f32>,
}

/// Packs every piece of every slice of `head` (row `p` of the planes
/// being head row `order.id(p)` where an order is given), in order, and
/// hands each to `take` on this thread while the next one is packed on
/// another. Stops at `take`'s first error. The head has passed
/// [`HeadWeights::check_values`].
pub(super) fn for_each_piece<E>(
    head: &HeadWeights<'_>,
    order: Option<&VocabOrder>,
    slices: &[VocabSlice],
    hs_padded: usize,
    mut take: impl FnMut(&Piece) -> Result<(), E>,
) -> Result<(), E> {
    let rows_per_piece = (HEAD_UPLOAD_BYTES / (hs_padded * 2)).max(1);
    let pieces: Vec<(usize, usize)> = slices
        .iter()
        .enumerate()
        .flat_map(|(i, s)| (0..s.padded_width()).step_by(rows_per_piece).map(move |row| (i, row)))
        .collect();
    std::thread::scope(|scope| {
        // A rendezvous: the packer holds one packed piece until this thread
        // has taken the last, and buffers come back to be packed again.
        let (packed_tx, packed_rx) = mpsc::sync_channel::<Piece>(0);
        let (spent_tx, spent_rx) = mpsc::channel::<Vec<f16>>();
        scope.spawn(move || {
            for (slice, row) in pieces {
                let s = &slices[slice];
                let rows = rows_per_piece.min(s.padded_width() - row);
                let real = rows.min(s.width.saturating_sub(row));
                let first = s.offset + row;
                let mut data = spent_rx.try_recv().unwrap_or_default();
                match order {
                    None => head.pack_checked_rows(|r| first + r, real, hs_padded, &mut data),
                    // first + r < vocab = o.len(), which fits in u32.
                    Some(o) => {
                        head.pack_checked_rows(|r| o.id((first + r) as u32) as usize, real, hs_padded, &mut data)
                    }
                }
                let norms = row_norms(&data, hs_padded);
                data.resize(rows * hs_padded, f16::ZERO);
                // A closed channel: the caller stopped at an error.
                if packed_tx
                    .send(Piece {
                        slice,
                        row,
                        data,
                        norms,
                    })
                    .is_err()
                {
                    return;
                }
            }
        });
        for piece in packed_rx {
            take(&piece)?;
            // The packer may have finished; then the buffer is dropped.
            let _ = spent_tx.send(piece.data);
        }
        Ok(())
    })
}

/// Rows a thread of [`row_norms`] takes at a time: a 64 MiB piece of a
/// 5120-wide head is about 50 of them, enough for every core.
const NORM_ROWS_PER_TASK: usize = 128;

/// The L2 norm of each `ld`-wide f16 row of `rows`, on every core (the
/// block filter's bound needs them once, at upload: a 248320 × 5120 head
/// is 1.3 G multiply-adds).
fn row_norms(rows: &[f16], ld: usize) -> Vec<f32> {
    let ld = ld.max(1);
    let mut out = vec![0f32; rows.len() / ld];
    crate::toolkit::host::par_chunks(&mut out, NORM_ROWS_PER_TASK, |i, norms| {
        let mut row = vec![0f32; ld];
        let src = rows.get(i * NORM_ROWS_PER_TASK * ld..).unwrap_or_default();
        for (w, o) in src.chunks_exact(ld).zip(norms) {
            half::slice::HalfFloatSliceExt::convert_to_f32_slice(w, &mut row);
            *o = sum_of_squares(&row).sqrt();
        }
    });
    out
}

/// `Σ v²` in 16 independent partial sums, so the compiler can keep them in
/// vector registers (one running sum is a chain of dependent adds, 3.5×
/// slower on one core of this machine).
fn sum_of_squares(values: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut partial = [0f32; LANES];
    let lanes = values.chunks_exact(LANES);
    let tail: f32 = lanes.remainder().iter().map(|v| v * v).sum();
    for block in lanes {
        for (p, v) in partial.iter_mut().zip(block) {
            *p += v * v;
        }
    }
    partial.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::head::HeadData;

    #[test]
    fn row_norms_cover_every_row_across_the_threads() {
        // 1300 rows (three chunks, the last short) of width 4: row r holds
        // (3, 4, 0, 0)·(r % 7 + 1), norm 5·(r % 7 + 1).
        let rows: Vec<f16> = (0..1300)
            .flat_map(|r| {
                let s = (r % 7 + 1) as f32;
                [3.0 * s, 4.0 * s, 0.0, 0.0].map(f16::from_f32)
            })
            .collect();
        let norms = row_norms(&rows, 4);
        assert_eq!(norms.len(), 1300);
        for (r, &n) in norms.iter().enumerate() {
            assert_eq!(n, 5.0 * (r % 7 + 1) as f32, "row {r}");
        }
    }

    #[test]
    fn sum_of_squares_takes_every_value_with_a_tail() {
        // 37 values (two blocks of 16 and a tail of 5): v = i + 1, so the
        // sum is 37·38·75/6 = 17575, exact in f32.
        let values: Vec<f32> = (1..=37).map(|v| v as f32).collect();
        assert_eq!(sum_of_squares(&values), 17575.0);
        assert_eq!(sum_of_squares(&values[..5]), 55.0);
        assert_eq!(sum_of_squares(&[]), 0.0);
    }

    /// Pieces cover every plane row once, in order, across slices that
    /// span several pieces (the last one short, with pad rows), and an
    /// error stops the packer without a hang.
    #[test]
    fn pieces_cover_the_planes_in_order_and_stop_at_an_error() {
        // A small head takes one 64 MiB piece a slice; rows padded from 3
        // to 8192 columns make a piece 4096 rows, so the first slice spans
        // two pieces and the last piece of each carries pad rows.
        let (vocab, hs) = (5000, 3);
        let w: Vec<f32> = (0..vocab * hs).map(|i| (i % 97) as f32 / 16.0).collect();
        let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).expect("head");
        let hs_padded = 8192; // 4096 rows a piece
        let slices = [
            VocabSlice { offset: 0, width: 4100 },
            VocabSlice {
                offset: 4100,
                width: 900,
            },
        ];
        let mut seen = Vec::new();
        let done: Result<(), ()> = for_each_piece(&head, None, &slices, hs_padded, |p| {
            let rows = p.data.len() / hs_padded;
            let s = &slices[p.slice];
            let real = rows.min(s.width.saturating_sub(p.row));
            assert_eq!(p.norms.len(), real, "slice {} row {}", p.slice, p.row);
            for r in 0..rows {
                let got = &p.data[r * hs_padded..(r + 1) * hs_padded];
                let want: Vec<f16> = if r < real {
                    let v = s.offset + p.row + r;
                    (0..hs_padded)
                        .map(|c| f16::from_f32(if c < hs { w[v * hs + c] } else { 0.0 }))
                        .collect()
                } else {
                    vec![f16::ZERO; hs_padded]
                };
                assert_eq!(got, &want[..], "slice {} plane row {}", p.slice, p.row + r);
            }
            seen.push((p.slice, p.row, rows));
            Ok(())
        });
        assert_eq!(done, Ok(()));
        let pad = |w: usize| crate::align::round_up(w, crate::align::ALIGN);
        assert_eq!(seen, vec![(0, 0, 4096), (0, 4096, pad(4100) - 4096), (1, 0, pad(900))]);
        let mut calls = 0;
        let stopped = for_each_piece(&head, None, &slices, hs_padded, |_| {
            calls += 1;
            Err("device lost")
        });
        assert_eq!((stopped, calls), (Err("device lost"), 1));
    }
}
