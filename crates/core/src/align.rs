//! The one alignment of every padded device extent.

/// Alignment of every padded device extent (token rows, hidden columns,
/// vocabulary columns): the 16×16 matrix-unit tile edge. GEMM kernels may
/// read and write whole 16×16 tiles.
pub const ALIGN: usize = 16;

/// `x` rounded up to a multiple of `to`.
pub const fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}
