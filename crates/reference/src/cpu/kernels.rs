//! The kernels on host slices. The caller ([`super::CpuBackend`]) has
//! checked every extent against its buffer, so indexing here cannot go out
//! of bounds for a descriptor it accepted.

use half::f16;
use headkl_core::split::k_part_range;
use headkl_core::{ConvertDesc, GemmDesc, HeadLayout, KlDesc, SumPartsDesc, TopkDesc};

use super::Precision;
use crate::par;

/// Columns of B converted to f32 at a time: 64 rows of `k` values stay in
/// cache while every row of A passes over them.
const COL_BLOCK: usize = 64;

/// `Σ a_i·b_i` with f64 accumulation. The operands come from f16, so each
/// product is exact in f32 (11 + 11 significand bits).
fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    // Four independent lanes: the compiler vectorizes them (eight lanes
    // measured slower).
    let mut s = [0f64; 4];
    let (a4, b4) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ar, br) = (a4.remainder(), b4.remainder());
    for (x, y) in a4.zip(b4) {
        for q in 0..4 {
            s[q] += f64::from(x[q] * y[q]);
        }
    }
    let tail: f64 = ar.iter().zip(br).map(|(x, y)| f64::from(x * y)).sum();
    (s[0] + s[1]) + (s[2] + s[3]) + tail
}

/// `Σ a_i·b_i` accumulated in f32, in order: the worst case of a GPU's f32
/// accumulation (a tiled kernel sums shorter runs).
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |s, (x, y)| s + x * y)
}

/// `C (+)= alpha · A · op(B)` on whole buffers (see [`GemmDesc`]): each
/// split-K part as a GEMM of its own into its C block.
pub(crate) fn gemm(a: &[f16], b: &[f16], c: &mut [f32], d: &GemmDesc, precision: Precision) {
    for p in 0..d.k_parts {
        let range = k_part_range(d.k, d.k_parts, p);
        let part = GemmDesc {
            k: range.len(),
            a_offset: d.a_offset + range.start,
            c_offset: d.c_offset + p * d.c_part_stride,
            k_parts: 1,
            c_part_stride: 0,
            ..*d
        };
        if range.is_empty() {
            // alpha · 0, or nothing added.
            if !d.accumulate && d.m > 0 && d.n > 0 {
                for i in 0..d.m {
                    let row = part.c_offset + i * d.ldc;
                    c[row..row + d.n].fill(0.0);
                }
            }
            continue;
        }
        // The part's B starts `start` columns ([n][k]) or rows ([k][n]) in.
        let b_start = match d.b_layout {
            HeadLayout::Logits => range.start,
            HeadLayout::Dx => range.start * d.ldb,
        };
        gemm_one(a, &b[b_start..], c, &part, precision);
    }
}

/// One part of [`gemm`]: `C (+)= alpha · A · op(B)` with `d.k_parts` 1.
fn gemm_one(a: &[f16], b: &[f16], c: &mut [f32], d: &GemmDesc, precision: Precision) {
    let (m, n, k) = (d.m, d.n, d.k);
    if m == 0 || n == 0 {
        return;
    }
    let mut a32 = vec![0f32; m * k];
    for (i, row) in a32.chunks_exact_mut(k.max(1)).enumerate().take(m) {
        let src = &a[d.a_offset + i * d.lda..d.a_offset + i * d.lda + k];
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, row);
    }
    // Split C by columns: each thread converts only its own columns of B.
    let parts = par::map_ranges(n, m * n * k, |cols| {
        let width = cols.len();
        let mut acc = vec![0f64; m * width];
        let mut bt = vec![0f32; COL_BLOCK * k];
        let mut j0 = cols.start;
        while j0 < cols.end {
            let j1 = (j0 + COL_BLOCK).min(cols.end);
            // bt[(j - j0)·k + l] = op(B)[l][j]
            match d.b_layout {
                HeadLayout::Logits => {
                    for j in j0..j1 {
                        let src = &b[j * d.ldb..j * d.ldb + k];
                        half::slice::HalfFloatSliceExt::convert_to_f32_slice(
                            src,
                            &mut bt[(j - j0) * k..(j - j0 + 1) * k],
                        );
                    }
                }
                HeadLayout::Dx => {
                    for l in 0..k {
                        for (jj, v) in b[l * d.ldb + j0..l * d.ldb + j1].iter().enumerate() {
                            bt[jj * k + l] = v.to_f32();
                        }
                    }
                }
            }
            for i in 0..m {
                let arow = &a32[i * k..(i + 1) * k];
                let out = &mut acc[i * width + (j0 - cols.start)..i * width + (j1 - cols.start)];
                for (jj, o) in out.iter_mut().enumerate() {
                    let brow = &bt[jj * k..(jj + 1) * k];
                    *o = match precision {
                        Precision::F64 => dot_f64(arow, brow),
                        Precision::F32 => f64::from(dot_f32(arow, brow)),
                    };
                }
            }
            j0 = j1;
        }
        acc
    });
    for (cols, acc) in parts {
        let width = cols.len();
        for i in 0..m {
            let row = d.c_offset + i * d.ldc;
            let out = &mut c[row + cols.start..row + cols.end];
            for (o, &v) in out.iter_mut().zip(&acc[i * width..(i + 1) * width]) {
                *o = match precision {
                    Precision::F64 => {
                        let prod = f64::from(d.alpha) * v;
                        (if d.accumulate { prod + f64::from(*o) } else { prod }) as f32
                    }
                    Precision::F32 => {
                        let prod = d.alpha * v as f32;
                        if d.accumulate {
                            prod + *o
                        } else {
                            prod
                        }
                    }
                };
            }
        }
    }
}

/// `dst (+)= Σ_p parts[p·stride ..]`, summed in f64 over increasing `p`
/// (the reference for the GPUs' f32 sum).
pub(crate) fn sum_parts(parts: &[f32], dst: &mut [f32], d: &SumPartsDesc) {
    for (i, o) in dst.iter_mut().enumerate().take(d.len) {
        let s: f64 = (0..d.parts).map(|p| f64::from(parts[p * d.part_stride + i])).sum();
        *o = if d.accumulate { f64::from(*o) + s } else { s } as f32;
    }
}

/// f32 → f16 into the padded operand, zeros outside `rows × cols`.
pub(crate) fn convert_f16(src: &[f32], dst: &mut [f16], d: &ConvertDesc) {
    for (r, row) in dst.chunks_exact_mut(d.ld.max(1)).enumerate().take(d.rows_padded) {
        if r < d.rows {
            // `from_f32` rounds to nearest even and turns values past ±65504 into ±inf.
            half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                &mut row[..d.cols],
                &src[r * d.cols..(r + 1) * d.cols],
            );
            row[d.cols..].fill(f16::ZERO);
        } else {
            row.fill(f16::ZERO);
        }
    }
}

/// One row of the KL kernel: returns the loss and writes the gradient row.
#[allow(clippy::too_many_arguments, reason = "one slice per kernel binding")]
fn kl_row(
    s: &[f32],
    ids: &[u32],
    probs: &[f32],
    coef: f32,
    vocab: usize,
    grad: &mut [f16],
    precision: Precision,
) -> f32 {
    grad[vocab..].fill(f16::ZERO);
    if s.iter().any(|v| !v.is_finite()) {
        grad[..vocab].fill(f16::NAN);
        return f32::NAN;
    }
    match precision {
        Precision::F64 => {
            let m = s.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
            let lse = m + s.iter().map(|&v| (f64::from(v) - m).exp()).sum::<f64>().ln();
            let c = f64::from(coef);
            let mut loss = 0f64;
            for (&id, &p) in ids.iter().zip(probs) {
                let p = f64::from(p);
                if p > 0.0 {
                    loss += p * (p.ln() - (f64::from(s[id as usize]) - lse));
                }
            }
            for (g, &v) in grad[..vocab].iter_mut().zip(s) {
                *g = f16::from_f64(c * (f64::from(v) - lse).exp());
            }
            for (&id, &p) in ids.iter().zip(probs) {
                let ps = (f64::from(s[id as usize]) - lse).exp();
                grad[id as usize] = f16::from_f64(c * (ps - f64::from(p)));
            }
            loss as f32
        }
        Precision::F32 => {
            let m = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let lse = m + s.iter().map(|&v| (v - m).exp()).fold(0f32, |a, e| a + e).ln();
            let mut loss = 0f32;
            for (&id, &p) in ids.iter().zip(probs) {
                if p > 0.0 {
                    loss += p * (p.ln() - (s[id as usize] - lse));
                }
            }
            for (g, &v) in grad[..vocab].iter_mut().zip(s) {
                *g = f16::from_f32(coef * (v - lse).exp());
            }
            for (&id, &p) in ids.iter().zip(probs) {
                let ps = (s[id as usize] - lse).exp();
                grad[id as usize] = f16::from_f32(coef * (ps - p));
            }
            loss
        }
    }
}

/// The KL row kernel on whole buffers (see [`KlDesc`]).
#[allow(clippy::too_many_arguments, reason = "one slice per kernel binding")]
pub(crate) fn kl_rows(
    logits: &[f32],
    ids: &[u32],
    probs: &[f32],
    coef: &[f32],
    loss: &mut [f32],
    grad: &mut [f16],
    d: &KlDesc,
    precision: Precision,
) {
    let (rows, ld, k, vocab) = (d.rows, d.ld, d.k, d.vocab);
    let mut work: Vec<(&mut f32, &mut [f16])> = loss[..rows]
        .iter_mut()
        .zip(grad[..rows * ld].chunks_exact_mut(ld.max(1)))
        .collect();
    par::for_row_blocks(&mut work, 1, rows * vocab * 8, |first, block| {
        for (i, (l, g)) in block.iter_mut().enumerate() {
            let t = first + i;
            **l = kl_row(
                &logits[t * ld..t * ld + vocab],
                &ids[t * k..(t + 1) * k],
                &probs[t * k..(t + 1) * k],
                coef[t],
                vocab,
                g,
                precision,
            );
        }
    });
}

/// Column indices of the `k` largest of `s`, descending, ties lowest id
/// first (`-0.0` ties `0.0`). `s` must be free of NaN.
fn topk_indices_f32(s: &[f32], k: usize) -> Vec<u32> {
    let cmp = |a: &u32, b: &u32| {
        let (x, y) = (s[*a as usize] + 0.0, s[*b as usize] + 0.0);
        y.total_cmp(&x).then(a.cmp(b))
    };
    let mut idx: Vec<u32> = (0..s.len() as u32).collect();
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
    }
    idx.truncate(k);
    idx.sort_unstable_by(cmp);
    idx
}

/// The exact top-k row kernel on whole buffers (see [`TopkDesc`]).
pub(crate) fn topk_rows(logits: &[f32], ids: &mut [u32], probs: &mut [f32], d: &TopkDesc, precision: Precision) {
    let (rows, ld, k, vocab) = (d.rows, d.ld, d.k, d.vocab);
    let mut work: Vec<(&mut [u32], &mut [f32])> = ids[..rows * k]
        .chunks_exact_mut(k.max(1))
        .zip(probs[..rows * k].chunks_exact_mut(k.max(1)))
        .collect();
    par::for_row_blocks(&mut work, 1, rows * vocab * 4, |first, block| {
        for (i, (ids_t, probs_t)) in block.iter_mut().enumerate() {
            let s = &logits[(first + i) * ld..(first + i) * ld + vocab];
            if s.iter().any(|v| !v.is_finite()) {
                for (q, id) in ids_t.iter_mut().enumerate() {
                    *id = q as u32;
                }
                probs_t.fill(f32::NAN);
                continue;
            }
            let top = topk_indices_f32(s, k);
            let m = s[top[0] as usize];
            match precision {
                Precision::F64 => {
                    let e: Vec<f64> = top
                        .iter()
                        .map(|&j| (f64::from(s[j as usize]) - f64::from(m)).exp())
                        .collect();
                    let z: f64 = e.iter().sum();
                    for (p, v) in probs_t.iter_mut().zip(e) {
                        *p = (v / z) as f32;
                    }
                }
                Precision::F32 => {
                    let e: Vec<f32> = top.iter().map(|&j| (s[j as usize] - m).exp()).collect();
                    let z = e.iter().fold(0f32, |a, &v| a + v);
                    for (p, v) in probs_t.iter_mut().zip(e) {
                        *p = v / z;
                    }
                }
            }
            ids_t.copy_from_slice(&top);
        }
    });
}
