//! The uniform-parameter blocks of the shared WGSL kernels in `shaders/`,
//! byte for byte. Both GPU backends fill these; the shaders declare the same
//! structs at `@group(0) @binding(0)`. Every field is 4 bytes and each block
//! is a multiple of 16 bytes, so the std140 and std430 layouts agree.

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

impl GemmParams {
    /// The block for `desc`, with the dispatch's folded grid width.
    pub fn new(desc: &crate::GemmDesc, grid_x: u32) -> Self {
        Self {
            m: desc.m as u32,
            n: desc.n as u32,
            k: desc.k as u32,
            a_offset: desc.a_offset as u32,
            lda: desc.lda as u32,
            ldb: desc.ldb as u32,
            c_offset: desc.c_offset as u32,
            ldc: desc.ldc as u32,
            alpha: desc.alpha,
            accumulate: u32::from(desc.accumulate),
            grid_x,
            _pad: 0,
        }
    }
}

impl RowParams {
    /// The block for a KL or top-k row dispatch.
    pub fn new(rows: usize, vocab: usize, ld: usize, k: usize, grid_x: u32) -> Self {
        Self {
            rows: rows as u32,
            vocab: vocab as u32,
            ld: ld as u32,
            k: k as u32,
            grid_x,
            _pad: [0; 3],
        }
    }
}

impl ConvertParams {
    /// The block for `desc`.
    pub fn new(desc: &crate::ConvertDesc, grid_x: u32) -> Self {
        Self {
            rows: desc.rows as u32,
            cols: desc.cols as u32,
            rows_padded: desc.rows_padded as u32,
            ld: desc.ld as u32,
            grid_x,
            _pad: [0; 3],
        }
    }
}

/// `shaders/resident_*.wgsl`: one block for every device-resident kernel
/// ([`crate::resident::ResidentKernel`]); each kernel's doc comment in its
/// shader says which fields it reads.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct ResidentParams {
    /// Rows to process.
    pub rows: u32,
    /// Entries per row (k, or the hidden size).
    pub cols: u32,
    /// Real vocabulary size.
    pub vocab: u32,
    /// Row stride of the padded scratch operand.
    pub ld: u32,
    /// Global index of the first row (for the status buffer).
    pub token0: u32,
    /// Element offsets into the caller's buffers, kernel by kernel.
    pub off_a: u32,
    /// See `off_a`.
    pub off_b: u32,
    /// See `off_a`.
    pub off_c: u32,
    /// See `off_a`.
    pub off_d: u32,
    /// Bit 0: weights given; bit 1: accumulate into dx; bits 2-3: hidden
    /// dtype (0 f32, 1 f16, 2 bf16).
    pub flags: u32,
    /// Rows written in the padded operand.
    pub rows_padded: u32,
    /// Workgroups along x of the (folded) dispatch grid (the backend fills
    /// it in).
    pub grid_x: u32,
    /// Float operands, kernel by kernel.
    pub f0: f32,
    /// See `f0`.
    pub f1: f32,
    /// See `f0`.
    pub f2: f32,
    /// See `f0`.
    pub f3: f32,
}
