//! The head's gradient `∂mean/∂W` ([`crate::problem::LossConfig::head_grad`]):
//! per chunk, `dW[p] += alpha · Σ_t g[t][p] · x16[t]` over the chunk's
//! tokens, where `g` is the f16 logits gradient `kl_rows` wrote for dx and
//! alpha dx's ([`Scaling`]). The kernel GEMMs take A as `[m][k]` rows, so
//! there the chunk's `g` is first turned into columns (`transpose`, into
//! the logits buffer, which dx has finished with); a backend whose GEMM
//! reads A as columns ([`Backend::gemm_a_columns`], cuBLASLt) takes `g` as
//! it is. The tokens are the reduction and `x16` is B as stored (`[k][n]`,
//! [`HeadLayout::Dx`]).
//!
//! The f32 result builds up on the device over the call's chunks in
//! pieces of rows, each within one binding: the host call reads it back
//! once at the end, rows in the head's natural id order; the resident call
//! copies it into the caller's buffer, or builds it in that buffer itself
//! where the backend can ([`HeadGrad::in_output`]).

use super::deferred_grad::DeferredLayout;
use super::{HeadPlanes, Scaling};
use crate::align::ALIGN;
use crate::error::{Error, Result};
use crate::toolkit::backend::{Backend, GemmDesc, HeadLayout, TransposeDesc};
use crate::toolkit::launch::{Kernels, Launch};
use crate::toolkit::resident_kernels::{HeadGradOutDesc, ResidentBackend};
use crate::toolkit::status::S_DX_MUL;

/// Bytes read back at a time where rows need unpadding or reordering.
const READ_BLOCK_BYTES: usize = 64 << 20;

/// One piece of the head's gradient: rows `[first, first + rows)` of the
/// padded vocabulary (positions in the head's order), `hs_padded` f32
/// columns each.
struct Piece<Buf> {
    first: usize,
    rows: usize,
    buffer: Buf,
}

/// How the chunks' shares become the gradient.
enum Build {
    /// A GEMM per chunk and piece into the f32 pieces, scaled when
    /// written out (the resident call) or read back (the host call).
    PerChunk,
    /// A GEMM per chunk and piece into the caller's buffer, its alpha
    /// read from the status buffer ([`ResidentBackend::gemm_scaled_by_word`]):
    /// nothing is scaled after.
    PerChunkScaled,
    /// The chunks parked in the caller's buffer and one GEMM per part of
    /// the vocabulary after the last ([`DeferredLayout`]).
    Deferred(DeferredLayout),
}

/// The head's gradient on the device while a call's chunks add into it.
pub(crate) struct HeadGrad<B: Backend> {
    pieces: Vec<Piece<B::Buffer>>,
    build: Build,
}

impl<B: Backend> HeadGrad<B> {
    /// The pieces for `head`: each vocabulary slice's padded rows, cut so a
    /// piece's f32 rows fit in one binding.
    pub(crate) fn alloc(backend: &B, head: &HeadPlanes<B>) -> Result<Self> {
        let info = backend.info();
        let max_binding = info.max_binding_bytes.min(info.max_buffer_bytes);
        let row_bytes = (head.hs_padded() * std::mem::size_of::<f32>()) as u64;
        let most_rows = ((max_binding / row_bytes) as usize / ALIGN * ALIGN).max(ALIGN);
        let mut pieces = Vec::new();
        for slice in head.slices() {
            let end = slice.offset + slice.padded_width();
            let mut first = slice.offset;
            while first < end {
                let rows = most_rows.min(end - first);
                let buffer = backend.alloc(rows as u64 * row_bytes, "head_grad")?;
                pieces.push(Piece { first, rows, buffer });
                first += rows;
            }
        }
        Ok(Self {
            pieces,
            build: Build::PerChunk,
        })
    }

    /// The GEMM adding one chunk's share into `piece` (see
    /// [`Self::add_chunk`]), reading `grad` as columns where
    /// `columns_read`, else the transposed `columns`.
    fn chunk_desc(
        piece: &Piece<B::Buffer>,
        head: &HeadPlanes<B>,
        (rows, rows_padded): (usize, usize),
        scaling: Scaling,
        (accumulate, columns_read): (bool, bool),
    ) -> GemmDesc {
        let vocab_padded = head.vocab_padded();
        let dense = GemmDesc {
            alpha: scaling.dx_alpha(),
            accumulate,
            ..GemmDesc::dense(piece.rows, head.hs_padded(), rows_padded, HeadLayout::Dx)
        };
        match columns_read {
            // `grad` read as it is, its tokens the reduction: only the
            // real rows, as its pad rows may hold anything (dx discards
            // them; here they would be summed).
            true => GemmDesc {
                k: rows,
                a_offset: piece.first,
                lda: vocab_padded,
                a_columns: true,
                ..dense
            },
            false => GemmDesc {
                a_offset: piece.first * rows_padded,
                lda: rows_padded,
                ..dense
            },
        }
    }

    /// Adds one chunk's share: `grad` holds its f16 logits gradient
    /// (`[rows_padded][vocab_padded]`, `rows` real), `x16` its f16 hidden
    /// rows with zeros past `rows`, and `columns` (the chunk's logits
    /// buffer) takes `grad` turned into columns. The first chunk
    /// (`accumulate` false) overwrites.
    pub(crate) fn add_chunk(
        &self,
        backend: &B,
        head: &HeadPlanes<B>,
        (grad, x16, columns): (&B::Buffer, &B::Buffer, &B::Buffer),
        (rows, rows_padded): (usize, usize),
        scaling: Scaling,
        accumulate: bool,
    ) -> Result<()> {
        let vocab_padded = head.vocab_padded();
        let columns_read = backend.gemm_a_columns();
        if !columns_read {
            let transpose = TransposeDesc {
                rows,
                rows_padded,
                cols: vocab_padded,
                ld_src: vocab_padded,
            };
            backend.transpose(grad, columns, &transpose)?;
        }
        for piece in &self.pieces {
            let desc = Self::chunk_desc(piece, head, (rows, rows_padded), scaling, (accumulate, columns_read));
            let a = if columns_read { grad } else { columns };
            backend.gemm(a, x16, &piece.buffer, &desc)?;
        }
        Ok(())
    }

    /// Reads the gradient into `out` (`[vocab][hs]`, resized; every row
    /// is written), each position's row to its head row. Dense rows in the
    /// natural order go straight into `out`; the others through a block of
    /// [`READ_BLOCK_BYTES`] at a time.
    pub(crate) fn read(&self, backend: &B, head: &HeadPlanes<B>, out: &mut Vec<f32>) -> Result<()> {
        let (vocab, hs, hs_padded) = (head.vocab(), head.hs(), head.hs_padded());
        out.resize(vocab * hs, 0.0);
        let order = head.order();
        let row_bytes = hs_padded * std::mem::size_of::<f32>();
        let block_rows = (READ_BLOCK_BYTES / row_bytes).max(1);
        let mut block = Vec::new();
        for piece in &self.pieces {
            let real = vocab.saturating_sub(piece.first).min(piece.rows);
            if real == 0 {
                continue;
            }
            if order.is_none() && hs_padded == hs {
                let rows = &mut out[piece.first * hs..(piece.first + real) * hs];
                backend.download(&piece.buffer, 0, bytemuck::cast_slice_mut(rows))?;
                continue;
            }
            let mut first = 0;
            while first < real {
                let rows = block_rows.min(real - first);
                block.resize(rows * hs_padded, 0f32);
                let offset = (first * row_bytes) as u64;
                backend.download(&piece.buffer, offset, bytemuck::cast_slice_mut(block.as_mut_slice()))?;
                for (r, row) in block.chunks_exact(hs_padded).enumerate() {
                    let position = piece.first + first + r;
                    let id = order.map_or(position, |o| o.id(position as u32) as usize);
                    out[id * hs..(id + 1) * hs].copy_from_slice(&row[..hs]);
                }
                first += rows;
            }
        }
        Ok(())
    }
}

impl<B: ResidentBackend> HeadGrad<B> {
    /// The gradient built in the resident call's output `dst` itself,
    /// where the backend makes windows, copies rows and reads a GEMM's
    /// alpha from the device ([`ResidentBackend::defers_head_grad`]) and
    /// neither the rows nor the vocabulary need padding (`hs` and `vocab`
    /// multiples of [`ALIGN`], as every large head's are): so the gradient
    /// takes no device memory beyond the caller's (5 GB at shape A), the
    /// call allocates (and frees, which waits for the device) nothing, and
    /// nothing is scaled after. Where the `tokens` rows' inputs fit in
    /// `dst`, they are parked there and the GEMMs run after the last chunk
    /// ([`DeferredLayout`], its last part's inputs copied into the chunk
    /// scratch of `scratch_bytes`; `kl_rows` writing the gradient's rows
    /// there itself where `rows_parkable`, as where no block mask follows
    /// them); else a GEMM per chunk adds into windows of `dst`. `None`
    /// where it cannot be done.
    pub(crate) fn in_output(
        backend: &B,
        head: &HeadPlanes<B>,
        dst: &B::Buffer,
        (tokens, scratch_bytes): (usize, u64),
        rows_parkable: bool,
    ) -> Option<Self> {
        let (vocab, hs) = (head.vocab(), head.hs());
        let defers = backend.defers_head_grad() && backend.gemm_a_columns();
        if !defers || hs != head.hs_padded() || vocab != head.vocab_padded() {
            return None;
        }
        let budget = (scratch_bytes, max_binding(backend));
        if let Some(layout) = DeferredLayout::plan(tokens, (vocab, hs), budget, rows_parkable) {
            return Some(Self {
                pieces: Vec::new(),
                build: Build::Deferred(layout),
            });
        }
        let row_bytes = (hs * std::mem::size_of::<f32>()) as u64;
        let most_rows = ((max_binding(backend) / row_bytes) as usize / ALIGN * ALIGN).max(ALIGN);
        let mut pieces = Vec::new();
        let mut first = 0;
        while first < vocab {
            let rows = most_rows.min(vocab - first);
            let buffer = backend.window(dst, first as u64 * row_bytes, rows as u64 * row_bytes)?;
            pieces.push(Piece { first, rows, buffer });
            first += rows;
        }
        Some(Self {
            pieces,
            build: Build::PerChunkScaled,
        })
    }

    /// Where `kl_rows` writes the logits gradient of the chunk of
    /// `rows_padded` rows from token `start`: a window of `dst` where the
    /// gradient's rows are parked there ([`super::deferred_grad::Parking::Rows`], whose dx waits
    /// for [`Self::parked_grad`]); `None` where the chunk's own buffer
    /// takes it.
    pub(crate) fn chunk_grad(
        &self,
        backend: &B,
        dst: &B::Buffer,
        (start, rows_padded): (usize, usize),
    ) -> Result<Option<B::Buffer>> {
        match &self.build {
            Build::Deferred(layout) => layout.chunk_grad(backend, dst, (start, rows_padded)),
            _ => Ok(None),
        }
    }

    /// Every token's logits gradient rows, parked in `dst`, for the one dx
    /// GEMM after the last chunk (which must run before
    /// [`Self::write_out`] overwrites them); `None` where each chunk ran
    /// its own.
    pub(crate) fn parked_grad(&self, backend: &B, dst: &B::Buffer) -> Result<Option<B::Buffer>> {
        match &self.build {
            Build::Deferred(layout) => layout.all_grad(backend, dst),
            _ => Ok(None),
        }
    }

    /// [`Self::add_chunk`] in a resident call: the chunk of the tokens from
    /// `start` parked in `dst` where the GEMMs are deferred, its GEMMs
    /// scaled by `status`'s dx multiplier where they write `dst` in place.
    #[allow(clippy::too_many_arguments, reason = "add_chunk's inputs and the call's buffers")]
    pub(crate) fn add_resident_chunk(
        &self,
        backend: &B,
        head: &HeadPlanes<B>,
        (grad, x16, columns): (&B::Buffer, &B::Buffer, &B::Buffer),
        (start, rows, rows_padded): (usize, usize, usize),
        scaling: Scaling,
        accumulate: bool,
        (dst, status): (&B::Buffer, &B::Buffer),
    ) -> Result<()> {
        match &self.build {
            Build::Deferred(layout) => layout.park(backend, (grad, head.vocab_padded(), x16), dst, (start, rows)),
            Build::PerChunkScaled => {
                for piece in &self.pieces {
                    let desc = Self::chunk_desc(piece, head, (rows, rows_padded), scaling, (accumulate, true));
                    backend.gemm_scaled_by_word((grad, x16, &piece.buffer), &desc, (status, S_DX_MUL))?;
                }
                Ok(())
            }
            Build::PerChunk => self.add_chunk(
                backend,
                head,
                (grad, x16, columns),
                (rows, rows_padded),
                scaling,
                accumulate,
            ),
        }
    }

    /// The device-resident call's last step: every piece's rows of the
    /// head into the caller's `[vocab][hs]` buffer `dst`, scaled by the
    /// status buffer's dx multiplier (`resident_head_grad_out.wgsl`). The
    /// resident calls take no vocabulary order, so positions are ids.
    /// Where `dst` is past one binding, each piece's rows go through a
    /// window of `dst` ([`ResidentBackend::window`], which
    /// [`Self::fits_out`] asked for). A deferred gradient's GEMMs run
    /// here, its last part's inputs copied into `scratch` (the chunks'
    /// logits buffer, free by now).
    pub(crate) fn write_out(
        &self,
        backend: &B,
        head: &HeadPlanes<B>,
        (status, dst, scratch): (&B::Buffer, &B::Buffer, &B::Buffer),
        scaling: Scaling,
    ) -> Result<()> {
        match &self.build {
            Build::Deferred(layout) => return layout.finish(backend, (dst, scratch, status), scaling.dx_alpha()),
            Build::PerChunkScaled => return Ok(()),
            Build::PerChunk => {}
        }
        let (vocab, hs) = (head.vocab(), head.hs());
        // The criterion `fits_out` checked: the gradient's bytes, not the
        // buffer's (a larger buffer is bound whole where the gradient fits).
        let windowed = (vocab * hs * 4) as u64 > max_binding(backend);
        for piece in &self.pieces {
            let rows = vocab.saturating_sub(piece.first).min(piece.rows);
            if rows == 0 {
                continue;
            }
            let (offset, len) = (4 * (piece.first * hs) as u64, 4 * (rows * hs) as u64);
            let window = match windowed {
                true => Some(backend.window(dst, offset, len).ok_or(Error::HeadGradUnsupported {
                    entry: OUT_PAST_BINDING,
                    hint: HOST_CALL,
                })?),
                false => None,
            };
            backend.dispatch(Launch::HeadGradOut {
                piece: &piece.buffer,
                status,
                dst: window.as_ref().unwrap_or(dst),
                desc: HeadGradOutDesc {
                    rows,
                    hs,
                    ld: head.hs_padded(),
                    dst_offset: if windowed { 0 } else { piece.first * hs },
                },
            })?;
        }
        Ok(())
    }

    /// Whether the resident call can write `head`'s f32 gradient into a
    /// buffer of `bytes`: within one binding, or a binding a piece at a
    /// time through windows the backend makes; else the typed error.
    pub(crate) fn fits_out(backend: &B, bytes: u64, dst: &B::Buffer) -> Result<()> {
        if bytes <= max_binding(backend) || backend.window(dst, 0, 4).is_some() {
            return Ok(());
        }
        Err(Error::HeadGradUnsupported {
            entry: OUT_PAST_BINDING,
            hint: HOST_CALL,
        })
    }
}

/// The largest buffer one kernel binding may span on `backend`.
fn max_binding<B: Backend>(backend: &B) -> u64 {
    let info = backend.info();
    info.max_binding_bytes.min(info.max_buffer_bytes)
}

/// [`Error::HeadGradUnsupported`]'s words where the gradient is past one
/// binding and the backend makes no windows.
const OUT_PAST_BINDING: &str =
    "the device-resident loss at this head's size (its f32 gradient is past the device's largest binding)";
const HOST_CALL: &str = "the host call (Engine::head_kl) returns it";
