//! The uniform-parameter blocks of the shared WGSL kernels in `shaders/`,
//! byte for byte. Both GPU backends fill these; the shaders declare the same
//! structs at `@group(0) @binding(0)`. Every field is 4 bytes and each block
//! is a multiple of 16 bytes, so the std140 and std430 layouts agree.
//! Blocks are made only by the descriptor checks (`crate::checks`), which
//! refuse extents past 32 bits instead of truncating them.

use bytemuck::{Pod, Zeroable};

/// `shaders/gemm*.wgsl`: `C (+)= alpha · A · op(B)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct GemmParams {
    /// Rows of A and C.
    pub m: u32,
    /// Columns of C.
    pub n: u32,
    /// Reduction length.
    pub k: u32,
    /// First element of A.
    pub a_offset: u32,
    /// Row stride of A.
    pub lda: u32,
    /// Row stride of B.
    pub ldb: u32,
    /// First element of C.
    pub c_offset: u32,
    /// Row stride of C.
    pub ldc: u32,
    /// Scale of the product.
    pub alpha: f32,
    /// 1: add into C; 0: overwrite.
    pub accumulate: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: u32,
}

/// `shaders/kl_rows.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct RowParams {
    /// Rows to process.
    pub rows: u32,
    /// Real vocabulary size.
    pub vocab: u32,
    /// Row stride of logits (and grad).
    pub ld: u32,
    /// Teacher or top-k entries per row.
    pub k: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: [u32; 3],
}

/// `shaders/convert.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ConvertParams {
    /// Real rows in src.
    pub rows: u32,
    /// Real columns in src.
    pub cols: u32,
    /// Rows written in dst.
    pub rows_padded: u32,
    /// Row stride of dst.
    pub ld: u32,
    /// Workgroups along x of the (folded) dispatch grid.
    pub grid_x: u32,
    /// Padding to 16 bytes.
    pub _pad: [u32; 3],
}

/// One field of a parameter block: its name in the shader's struct and its
/// byte offset (padding fields are left out).
pub type ParamField = (&'static str, usize);

macro_rules! param_fields {
    ($t:ty: $($f:ident),*) => {
        impl $t {
            /// The fields the shader reads, with their byte offsets.
            pub const FIELDS: &'static [ParamField] = &[$((stringify!($f), std::mem::offset_of!($t, $f))),*];

            /// The block with the dispatch's folded grid width.
            pub const fn with_grid(mut self, grid_x: u32) -> Self {
                self.grid_x = grid_x;
                self
            }
        }
    };
}

param_fields!(GemmParams: m, n, k, a_offset, lda, ldb, c_offset, ldc, alpha, accumulate, grid_x);
param_fields!(RowParams: rows, vocab, ld, k, grid_x);
param_fields!(ConvertParams: rows, cols, rows_padded, ld, grid_x);
