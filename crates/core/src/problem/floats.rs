//! Caller-owned values in the three float types a model holds, the head's
//! and the hidden rows' alike.

use std::ops::Range;

use half::{bf16, f16};

use crate::error::{Error, Field, Result};

/// A slice of f32, f16 or bf16 values, borrowed from the caller. The
/// device holds them as f16: f32 and bf16 values are rounded on the way up.
#[derive(Clone, Copy, Debug)]
pub enum FloatSlice<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values.
    F16(&'a [f16]),
    /// bf16 values (what models emit).
    Bf16(&'a [bf16]),
}

impl<'a> FloatSlice<'a> {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            FloatSlice::F32(d) => d.len(),
            FloatSlice::F16(d) => d.len(),
            FloatSlice::Bf16(d) => d.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks that these values are a `[rows][hs]` matrix: `rows > 0` (else
    /// `no_rows`), `hs > 0`, and `rows · hs` values ([`Field`] `field`).
    pub(crate) fn check_shape(&self, rows: usize, hs: usize, no_rows: Error, field: Field) -> Result<()> {
        if rows == 0 {
            return Err(no_rows);
        }
        if hs == 0 {
            return Err(Error::HiddenSizeZero);
        }
        field.check_len(rows * hs, self.len())
    }

    /// Values `range` (panics past the end, as slicing does).
    pub fn slice(&self, range: Range<usize>) -> FloatSlice<'a> {
        match self {
            FloatSlice::F32(d) => FloatSlice::F32(&d[range]),
            FloatSlice::F16(d) => FloatSlice::F16(&d[range]),
            FloatSlice::Bf16(d) => FloatSlice::Bf16(&d[range]),
        }
    }

    /// Value `i` as the device holds it (rounded to f16), in f32.
    pub fn f16_rounded_at(&self, i: usize) -> f32 {
        match self {
            FloatSlice::F32(d) => f16::from_f32(d[i]).to_f32(),
            FloatSlice::F16(d) => d[i].to_f32(),
            FloatSlice::Bf16(d) => f16::from_f32(d[i].to_f32()).to_f32(),
        }
    }

    /// Values `range` as the device holds them (rounded to f16), in f32.
    pub fn f16_rounded(&self, range: Range<usize>) -> Vec<f32> {
        range.map(|i| self.f16_rounded_at(i)).collect()
    }
}
