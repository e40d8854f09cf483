//! The frozen head `W` `[V][hs]` as the caller gives it, its one scan for
//! values f16 cannot hold, and its packing into padded f16 planes.

use half::f16;

use crate::error::{Error, Result};

/// Rows a thread checks or packs at a time: a piece of the work the
/// threads take in turn (a head of 2.4 GiB is about a thousand pieces).
const ROWS_PER_PIECE: usize = 256;

/// The element type and data of a head: f32 and bf16 values must fit
/// f16's range (checked when the head is packed).
pub type HeadData<'a> = crate::problem::floats::FloatSlice<'a>;

/// A head `[vocab][hs]` whose length matches its shape.
#[derive(Clone, Copy, Debug)]
pub struct HeadWeights<'a> {
    data: HeadData<'a>,
    vocab: usize,
    hs: usize,
}

impl<'a> HeadWeights<'a> {
    /// Checks the shape (`vocab > 0`, `hs > 0`, `len = vocab · hs`). Values
    /// are checked when the head is packed (upload).
    pub fn new(data: HeadData<'a>, vocab: usize, hs: usize) -> Result<Self> {
        data.check_shape(vocab, hs, Error::VocabZero, crate::error::Field::Head)?;
        Ok(Self { data, vocab, hs })
    }

    /// Rows `[v0, v1)` of this head as a head of their own (a vocabulary
    /// shard's rows, `crate::shard`); an empty or out-of-range span is
    /// [`Error::ShardRange`].
    pub fn rows(&self, v0: usize, v1: usize) -> Result<HeadWeights<'a>> {
        if !(v0 < v1 && v1 <= self.vocab) {
            return Err(Error::ShardRange {
                v0,
                v1,
                vocab: self.vocab,
            });
        }
        Ok(HeadWeights {
            data: self.data.slice(v0 * self.hs..v1 * self.hs),
            vocab: v1 - v0,
            hs: self.hs,
        })
    }

    /// Vocabulary size V.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Hidden size hs.
    pub fn hs(&self) -> usize {
        self.hs
    }

    /// Rows `[first, first + rows)` as f16, each padded with zeros to
    /// `ld ≥ hs` columns, appended to `out`. Fails on the first value that
    /// is not finite or is past f16's range, naming its row and column.
    pub fn pack_rows_f16(&self, first: usize, rows: usize, ld: usize, out: &mut Vec<f16>) -> Result<()> {
        for row in first..first + rows {
            self.check_row(row)?;
            let start = out.len();
            out.resize(start + ld, f16::ZERO);
            self.pack_row(row, &mut out[start..]);
        }
        Ok(())
    }

    /// `rows` rows, row `r` of them being the head's row `row_of(r)`, as
    /// f16 padded with zeros to `ld ≥ hs` columns, into `out` (its length
    /// becomes `rows · ld`), on every core. The values are converted, not
    /// checked: the head has passed [`HeadWeights::check_values`].
    pub(crate) fn pack_checked_rows(
        &self,
        row_of: impl Fn(usize) -> usize + Sync,
        rows: usize,
        ld: usize,
        out: &mut Vec<f16>,
    ) {
        // Every row is written whole (values, then its pad), so a reused
        // buffer is only cut to length: zeroing it first would cost a pass.
        out.truncate(rows * ld);
        out.resize(rows * ld, f16::ZERO);
        crate::toolkit::host::par_chunks(out, ROWS_PER_PIECE * ld.max(1), |piece, block| {
            for (r, dst) in block.chunks_exact_mut(ld.max(1)).enumerate() {
                self.pack_row(row_of(piece * ROWS_PER_PIECE + r), dst);
            }
        });
    }

    /// Row `row` as f16 into `out` (`hs` values, then zeros to its end).
    fn pack_row(&self, row: usize, out: &mut [f16]) {
        let (hs, span) = (self.hs, row * self.hs..(row + 1) * self.hs);
        match self.data {
            HeadData::F16(d) => out[..hs].copy_from_slice(&d[span]),
            HeadData::F32(d) => half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut out[..hs], &d[span]),
            HeadData::Bf16(d) => {
                for (o, v) in out[..hs].iter_mut().zip(&d[span]) {
                    *o = f16::from_f32(v.to_f32());
                }
            }
        }
        out[hs..].fill(f16::ZERO);
    }

    /// Checks every value, without converting, on every core: the first one
    /// (in row order) that is not finite or is past f16's range is an error
    /// naming its row and column.
    pub fn check_values(&self) -> Result<()> {
        let mut found: Vec<Result<()>> = (0..self.vocab.div_ceil(ROWS_PER_PIECE)).map(|_| Ok(())).collect();
        crate::toolkit::host::par_chunks(&mut found, 1, |piece, slot| {
            let rows = piece * ROWS_PER_PIECE..((piece + 1) * ROWS_PER_PIECE).min(self.vocab);
            slot[0] = rows.into_iter().try_for_each(|row| self.check_row(row));
        });
        found.into_iter().find(Result::is_err).unwrap_or(Ok(()))
    }

    /// Checks row `row`'s values (see [`HeadWeights::check_values`]).
    fn check_row(&self, row: usize) -> Result<()> {
        let span = row * self.hs..(row + 1) * self.hs;
        match self.data {
            HeadData::F16(d) => match d[span].iter().position(|v| !v.is_finite()) {
                Some(col) => Err(Error::NonFiniteHead {
                    row,
                    col,
                    value: d[row * self.hs + col].to_f32(),
                }),
                None => Ok(()),
            },
            HeadData::F32(d) => check_f16_range(&d[span], row),
            HeadData::Bf16(d) => d[span]
                .iter()
                .enumerate()
                .try_for_each(|(col, v)| check_value(v.to_f32(), row, col)),
        }
    }

    /// Element `(row, col)` as the device holds it (rounded to f16).
    pub fn get_f16_rounded(&self, row: usize, col: usize) -> f32 {
        self.data.f16_rounded_at(row * self.hs + col)
    }
}

fn check_f16_range(values: &[f32], row: usize) -> Result<()> {
    // One comparison per value on the common path; NaN fails `<=` too.
    let limit = f16::MAX.to_f32();
    if values.iter().all(|v| v.abs() <= limit) {
        return Ok(());
    }
    for (col, &value) in values.iter().enumerate() {
        check_value(value, row, col)?;
    }
    Ok(())
}

fn check_value(value: f32, row: usize, col: usize) -> Result<()> {
    if !value.is_finite() {
        Err(Error::NonFiniteHead { row, col, value })
    } else if value.abs() > f16::MAX.to_f32() {
        Err(Error::HeadOutOfF16Range { row, col, value })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_pads_and_rounds() {
        let w = [1.0f32, 2.5, -3.0, 4.0, 5.0, 6.0];
        let h = HeadWeights::new(HeadData::F32(&w), 2, 3).unwrap();
        let mut out = Vec::new();
        h.pack_rows_f16(1, 1, 4, &mut out).unwrap();
        assert_eq!(
            out.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            vec![4.0, 5.0, 6.0, 0.0]
        );
    }

    /// The parallel pack gives each row where `row_of` puts it, padded,
    /// across pieces (the last one short); the parallel check names the
    /// first bad value in row order whichever thread found it.
    #[test]
    fn the_parallel_pack_and_check_match_row_by_row() {
        let (vocab, hs, ld) = (3 * ROWS_PER_PIECE + 5, 3, 4);
        let mut w: Vec<f32> = (0..vocab * hs).map(|i| (i % 1000) as f32 - 500.0).collect();
        let h = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
        h.check_values().unwrap();
        let mut packed = vec![f16::NAN; 7];
        h.pack_checked_rows(|r| vocab - 1 - r, vocab, ld, &mut packed);
        let mut one_by_one = Vec::new();
        for r in 0..vocab {
            h.pack_rows_f16(vocab - 1 - r, 1, ld, &mut one_by_one).unwrap();
        }
        assert_eq!(packed.len(), vocab * ld);
        assert!(packed.iter().zip(&one_by_one).all(|(a, b)| a.to_bits() == b.to_bits()));
        // Bad values in two pieces: the earlier row is the one named.
        w[(2 * ROWS_PER_PIECE + 7) * hs + 1] = f32::NAN;
        w[(ROWS_PER_PIECE + 3) * hs + 2] = 1e6;
        let h = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
        match h.check_values() {
            Err(Error::HeadOutOfF16Range { row, col, .. }) => assert_eq!((row, col), (ROWS_PER_PIECE + 3, 2)),
            other => panic!("expected the out-of-range value first, got {other:?}"),
        }
    }
}
