//! A burn tensor as headkl's head: checked (finite, within f16's range,
//! headkl's error naming the first bad row and column), rounded to f16 and
//! copied into the engine's planes on the device. [`crate::HeadKl::from_tensor`]
//! makes an engine this way once; [`crate::HeadKl::loss_with_head`] rewrites
//! the planes in place on every call.

use burn::backend::Cube;
use burn::prelude::Tensor;
use burn::tensor::{DType, FloatDType};
use headkl_core::DevicePlane;
use headkl_wgpu::WgpuBuffer;

use crate::bridge::{self, FloatParts};
use crate::device::SharedDevice;
use crate::{check_device, contiguous, dtype_error, Binding, Result};

/// f16's largest finite value, as headkl's head check uses it.
const F16_MAX: f32 = 65504.0;

/// `w`'s dims, checked with its device and dtype; `w` taken apart.
pub(crate) fn check(w: &Tensor<2>, shared: &SharedDevice) -> Result<([usize; 2], FloatParts)> {
    let [vocab, hs] = w.dims();
    check_device("head", &w.device(), &shared.device())?;
    if !matches!(w.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(dtype_error("head", w.dtype(), "f32, f16 or bf16"));
    }
    if vocab == 0 {
        return Err(headkl_core::Error::VocabZero.into());
    }
    if hs == 0 {
        return Err(headkl_core::Error::HiddenSizeZero.into());
    }
    Ok(([vocab, hs], bridge::float_parts(w.clone(), "head")?))
}

/// A head ready for the planes: its f16 values and their rows' norms.
pub(crate) struct Prepared {
    /// The head rounded to f16 `[vocab][hs]`, outside any graph.
    pub w16: Tensor<2>,
    /// The f16 rows' Euclidean norms `[vocab]` (the dx block filter's).
    pub norms: Vec<f32>,
}

/// The head `plain` (outside any graph) checked and rounded to f16, with
/// one host read: each row's norm and count of values that are not finite
/// or past f16's range. A bad row costs a second read (that row), for the
/// error naming its first bad column.
pub(crate) fn prepare(plain: Tensor<2>) -> Result<Prepared> {
    let [vocab, hs] = plain.dims();
    let w32 = plain.clone().cast(FloatDType::F32);
    let bad = w32.clone().abs().greater_elem(F16_MAX).bool_or(w32.clone().is_nan());
    let bad_per_row = bad.float().sum_dim(1);
    let w16 = plain.cast(FloatDType::F16);
    let norms = w16.clone().cast(FloatDType::F32).powi_scalar(2).sum_dim(1).sqrt();
    let read = Tensor::cat(vec![norms, bad_per_row], 1)
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| bridge::backend_error("the head's row norms", format!("{e:?}")))?;
    if let Some(row) = (0..vocab).find(|&r| read.get(2 * r + 1).is_some_and(|&n| n > 0.0)) {
        let values = w32
            .slice([row..row + 1, 0..hs])
            .into_data()
            .try_to_vec::<f32>()
            .map_err(|e| bridge::backend_error("the head's bad row", format!("{e:?}")))?;
        let (col, value) = values
            .iter()
            .copied()
            .enumerate()
            .find(|(_, v)| v.is_nan() || v.abs() > F16_MAX)
            .unwrap_or((0, f32::NAN));
        let e = if value.is_finite() {
            headkl_core::Error::HeadOutOfF16Range { row, col, value }
        } else {
            headkl_core::Error::NonFiniteHead { row, col, value }
        };
        return Err(e.into());
    }
    let norms = read.chunks_exact(2).map(|pair| pair[0]).collect();
    Ok(Prepared { w16, norms })
}

/// Writes `plane` from `w16` (its rows, zero-padded) with a device copy
/// after burn's queued work; the bytes copied.
pub(crate) fn fill_plane(
    w16: &Tensor<2>,
    plane: DevicePlane<'_, WgpuBuffer>,
    shared: &SharedDevice,
) -> headkl_core::Result<u64> {
    let hs = w16.dims()[1];
    let rows = plane.first_row..plane.first_row + plane.rows;
    let part = w16.clone().slice([rows, 0..hs]);
    let padded = Tensor::<2>::zeros([plane.padded_rows, plane.hs_padded], &shared.device())
        .cast(FloatDType::F16)
        .slice_assign([0..plane.rows, 0..hs], part);
    let inner = bridge::float_parts(padded, "head")?.inner;
    let cube = contiguous(bridge::resolve_float(&inner), &mut Binding::default());
    let bytes = (plane.padded_rows * plane.hs_padded * 2) as u64;
    let handles = (shared.wgpu_device(), shared.queue());
    bridge::copy_into(&cube, handles, plane.buffer.raw(), plane.buffer.offset(), bytes)?;
    Ok(bytes)
}

/// `inner` (a head's fusion primitive) as a burn tensor outside any graph.
pub(crate) fn plain(inner: bridge::Primitive) -> Tensor<2> {
    Tensor::from_primitive::<Cube>(inner)
}
