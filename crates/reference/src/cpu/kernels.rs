//! The kernels on host slices. The caller ([`super::CpuBackend`]) has
//! checked every extent against its buffer, so indexing here cannot go out
//! of bounds for a descriptor it accepted.

use half::f16;
use headkl_core::resident::status::FLAGGED_ROW;
use headkl_core::toolkit::split::k_part_range;
use headkl_core::toolkit::{
    GemmDesc, GemmRowStats, HeadLayout, KlDesc, RowStats, SumPartsDesc, TopkDesc, TransposeDesc, STATS_GROUP_COLS,
};
use headkl_core::{Divergence, TailMode, NO_LABEL};

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
    if let Some(rs) = &d.row_stats {
        row_stats(c, d, rs);
    }
}

/// The row statistics of C ([`headkl_core::toolkit::RowStats`]) as the GPU GEMMs'
/// epilogue writes them: per row and 32-column group, `(m, Σ exp(x − m))`
/// over the real columns, a NaN sum where one is not finite.
fn row_stats(c: &mut [f32], d: &GemmDesc, rs: &GemmRowStats) {
    for i in 0..d.m {
        for g in 0..d.n.div_ceil(STATS_GROUP_COLS) {
            let cols = g * STATS_GROUP_COLS..((g + 1) * STATS_GROUP_COLS).min(rs.cols);
            let row = &c[d.c_offset + i * d.ldc..];
            let vals = cols.clone().map(|j| row[j]);
            let bad = vals.clone().any(|x| !x.is_finite());
            let m = vals.clone().filter(|x| x.is_finite()).fold(-3.0e38f32, f32::max);
            let sum: f32 = vals.filter(|x| x.is_finite()).map(|x| (x - m).exp()).sum();
            let o = rs.at.offset + i * 2 * rs.at.ld + 2 * (rs.first_group + g);
            c[o] = m;
            c[o + 1] = if bad { f32::NAN } else { sum };
        }
    }
}

/// The log-sum-exp of row `t` from its statistics ([`headkl_core::toolkit::RowStats`]),
/// merged as the GPU kernel merges them (NaN where a group was not finite).
fn lse_from_stats(logits: &[f32], rs: &RowStats, t: usize) -> f32 {
    let pairs = &logits[rs.offset + t * 2 * rs.ld..][..2 * rs.groups];
    let (mut m, mut sum) = (-3.0e38f32, 0f32);
    for pair in pairs.chunks_exact(2) {
        let (m2, s2) = (pair[0], pair[1]);
        if !s2.is_finite() {
            return f32::NAN;
        }
        if s2 > 0.0 {
            let top = m.max(m2);
            sum = sum * (m - top).exp() + s2 * (m2 - top).exp();
            m = top;
        }
    }
    m + sum.ln()
}

/// One part of [`gemm`]: `C (+)= alpha · A · op(B)` with `d.k_parts` 1.
fn gemm_one(a: &[f16], b: &[f16], c: &mut [f32], d: &GemmDesc, precision: Precision) {
    let (m, n, k) = (d.m, d.n, d.k);
    if m == 0 || n == 0 {
        return;
    }
    let mut a32 = vec![0f32; m * k];
    for (i, row) in a32.chunks_exact_mut(k.max(1)).enumerate().take(m) {
        match d.a_columns {
            // A's row i is element i of each of the buffer's k rows.
            true => {
                for (l, v) in row.iter_mut().enumerate() {
                    *v = a[d.a_offset + l * d.lda + i].to_f32();
                }
            }
            false => {
                let src = &a[d.a_offset + i * d.lda..d.a_offset + i * d.lda + k];
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, row);
            }
        }
    }
    if d.mask_rows > 0 {
        skip_clear_blocks(a, &mut a32, d);
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

/// Row tile of the block filter on the CPU: the fallback GEMM's 64 rows
/// (what [`headkl_core::Backend::gemm_tile`]'s `None` means).
const FILTER_TILE: usize = 64;

/// The block filter ([`GemmDesc::mask_rows`]): zeroes, in the part's A
/// rows `a32`, every 64-column block that is clear in all the masked rows
/// of its 64-row tile: the products a GPU tile skips.
fn skip_clear_blocks(a: &[f16], a32: &mut [f32], d: &GemmDesc) {
    use headkl_core::problem::filter::{mask_words, or_rows, BLOCK};
    let (m, k) = (d.m, d.k);
    let mask = a.get(d.m * d.lda..).unwrap_or_default();
    let mut tile_or = vec![0u32; mask_words(d.lda)];
    for t0 in (0..m).step_by(FILTER_TILE) {
        let rows = t0..(t0 + FILTER_TILE).min(m);
        tile_or.fill(0);
        or_rows(mask, rows.start..rows.end.min(d.mask_rows), &mut tile_or);
        let mut kk = 0;
        while kk < k {
            // The part's K index kk is column a_offset + kk (A starts in row 0).
            let col = d.a_offset + kk;
            let block = col / BLOCK;
            let end = ((block + 1) * BLOCK - d.a_offset).min(k);
            let live = tile_or.get(block / 32).is_some_and(|w| w & (1u32 << (block % 32)) != 0);
            if !live {
                for r in rows.clone() {
                    a32[r * k + kk..r * k + end].fill(0.0);
                }
            }
            kk = end;
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

/// f16 rows into columns, zeros for the rows past `rows`
/// ([`TransposeDesc`]).
pub(crate) fn transpose(src: &[f16], dst: &mut [f16], d: &TransposeDesc) {
    for c in 0..d.cols {
        let column = &mut dst[c * d.rows_padded..(c + 1) * d.rows_padded];
        for (r, o) in column.iter_mut().enumerate() {
            *o = if r < d.rows { src[r * d.ld_src + c] } else { f16::ZERO };
        }
    }
}

/// The arithmetic a KL row runs in: f64 (the reference) or f32 (a GPU's).
trait Real:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
{
    const ZERO: Self;
    const ONE: Self;
    fn of(v: f32) -> Self;
    fn of_usize(v: usize) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn abs(self) -> Self;
    fn to_f32(self) -> f32;
    fn to_f16(self) -> f16;
}

macro_rules! real {
    ($t:ty, $f16:path) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            fn of(v: f32) -> Self {
                Self::from(v)
            }
            fn of_usize(v: usize) -> Self {
                v as Self
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn to_f32(self) -> f32 {
                self as f32
            }
            fn to_f16(self) -> f16 {
                $f16(self)
            }
        }
    };
}
real!(f32, f16::from_f32);
real!(f64, f16::from_f64);

/// The kernels' floor on the bucket's student mass `r_S = 1 − Σ_k p_S`
/// ([`KlDesc`]): f32 resolves it to about this, and the floor keeps the
/// bucket's gradient factor `r_T/r_S` times `p_S,j ≤ r_S` bounded.
const TAIL_FLOOR: f32 = 1.0 / (1u32 << 24) as f32;

/// `(c·tanh(x/c), d/dx)` from `e = exp(−2|x/c|)`, which cannot overflow.
fn softcap<T: Real>(x: T, c: T) -> (T, T) {
    let e = (T::ZERO - T::of(2.0) * (x / c).abs()).exp();
    let t = (T::ONE - e) / (T::ONE + e);
    let t = if x < T::ZERO { T::ZERO - t } else { t };
    (c * t, T::of(4.0) * e / ((T::ONE + e) * (T::ONE + e)))
}

/// One bin of the reverse KL or the JSD (`kl_rows_fold.wgsl`'s `div_term`):
/// `(f, f')` at the student's share `q` (`log_q` its log) and the
/// teacher's `t`.
fn div_term<T: Real>(divergence: Divergence, q: T, log_q: T, t: T) -> (T, T) {
    match divergence {
        Divergence::Reverse => {
            if q > T::ZERO {
                let floor = T::of(TAIL_FLOOR);
                let r = log_q - (if t > floor { t } else { floor }).ln();
                (q * r, r + T::ONE)
            } else {
                (T::ZERO, T::ZERO)
            }
        }
        _ => {
            let beta = T::of(divergence.beta());
            let m = beta * t + (T::ONE - beta) * q;
            let (mut f, mut slope) = (T::ZERO, T::ZERO);
            if t > T::ZERO {
                f = beta * t * (t.ln() - m.ln());
            }
            if q > T::ZERO {
                let r = log_q - m.ln();
                f += (T::ONE - beta) * q * r;
                slope = (T::ONE - beta) * r;
            }
            (f, slope)
        }
    }
}

/// logsumexp of a non-empty `u`.
fn lse_of<T: Real>(u: &[T]) -> T {
    let m = u.iter().copied().fold(u[0], |m, v| if v > m { v } else { m });
    let mut sum = T::ZERO;
    for &v in u {
        sum += (v - m).exp();
    }
    m + sum.ln()
}

/// One row of the KL kernel ([`KlDesc`]): returns `[L_t, lse, soft, hard]`
/// and writes the gradient row, in arithmetic `T`. A row whose coefficient
/// word is [`FLAGGED_ROW`] (flagged by the resident kernels) gets a zero
/// gradient row and mask whatever its logits, and the marker's bits as its
/// loss word (`kl_rows.wgsl`).
#[allow(clippy::too_many_arguments, reason = "the row's slices, its inputs and its outputs")]
fn kl_row<T: Real>(
    s: &[f32],
    ids: &[u32],
    probs: &[f32],
    [coef, label]: [u32; 2],
    d: &KlDesc,
    stats_lse: Option<f32>,
    grad: &mut [f16],
    mask: &mut [u32],
) -> [f32; 4] {
    if coef == FLAGGED_ROW {
        let mut out = kl_row::<T>(s, ids, probs, [0f32.to_bits(), label], d, stats_lse, grad, mask);
        grad.fill(f16::ZERO);
        mask.fill(0);
        out[0] = f32::from_bits(FLAGGED_ROW);
        return out;
    }
    let vocab = d.vocab;
    grad[vocab..].fill(f16::ZERO);
    mask.fill(0);
    let on = f32::from_bits(coef) != 0.0;
    // The block filter: block of column j kept when |∂L/∂s_j| > ε or not a
    // number (`kl_rows_filter.wgsl`'s `kept`), never in a row with c = 0.
    let mut mark = |j: usize, v: T| {
        let within = v.abs() <= T::of(d.filter.map_or(0.0, |f| f.eps));
        if on && !within {
            if let Some(w) = mask.get_mut(j / headkl_core::problem::filter::WORD_VOCAB) {
                *w |= 1 << ((j / headkl_core::problem::filter::BLOCK) % 32);
            }
        }
    };
    if s.iter().any(|v| !v.is_finite()) || stats_lse.is_some_and(|v| !v.is_finite()) {
        grad[..vocab].fill(f16::NAN);
        for j in (0..vocab).step_by(headkl_core::problem::filter::BLOCK) {
            mark(j, T::of(f32::NAN));
        }
        return [f32::NAN; 4];
    }
    let t = &d.terms;
    let tau = T::of(d.temperature);
    let (u, dcap): (Vec<T>, Vec<T>) = match t.softcap {
        None => (s.iter().map(|&v| T::of(v)).collect(), Vec::new()),
        Some(c) => {
            let c = T::of(c) / tau;
            s.iter().map(|&v| softcap(T::of(v), c)).unzip()
        }
    };
    // The GEMM's row statistics stand in for the first pass where given.
    let lse_tau = stats_lse.map_or_else(|| lse_of(&u), T::of);
    let tau_on = d.temperature != 1.0;
    let lse1 = if tau_on {
        lse_of(&u.iter().map(|&v| v * tau).collect::<Vec<T>>())
    } else {
        lse_tau
    };
    let p_tau = |j: usize| (u[j] - lse_tau).exp();
    let p_one = |j: usize| if tau_on { (u[j] * tau - lse1).exp() } else { p_tau(j) };

    let mut soft = T::ZERO;
    let (mut mass, mut student) = (T::ZERO, T::ZERO);
    for (&id, &p) in ids.iter().zip(probs) {
        let p = T::of(p);
        mass += p;
        student += p_tau(id as usize);
        if p > T::ZERO {
            soft += p * (p.ln() - (u[id as usize] - lse_tau));
        }
    }
    let floor = T::of(TAIL_FLOOR);
    let r_t = if mass < T::ONE { T::ONE - mass } else { T::ZERO };
    let r_s = if T::ONE - student > floor {
        T::ONE - student
    } else {
        floor
    };
    let divergence = t.divergence.effective();
    // Reverse and JSD: the bins' E = Σ q·f' and the student's log-normalizer
    // on the k (renormalized), as the shader's second pass over the k.
    let mut div = (T::ZERO, T::ZERO);
    let (f_off, f_on) = if divergence != Divergence::Forward {
        let log_norm = if d.tail == TailMode::Renormalize {
            let tiny = T::of(1e-37);
            (if student > tiny { student } else { tiny }).ln()
        } else {
            T::ZERO
        };
        soft = T::ZERO;
        let mut e = T::ZERO;
        for (&id, &p) in ids.iter().zip(probs) {
            let log_q = u[id as usize] - lse_tau - log_norm;
            let q = log_q.exp();
            let (f, slope) = div_term(divergence, q, log_q, T::of(p));
            soft += f;
            e += q * slope;
        }
        let f_off = match d.tail {
            TailMode::Renormalize => T::ZERO,
            TailMode::Unnormalized => T::ZERO - e,
            TailMode::Bucket => {
                let (f, slope) = div_term(divergence, r_s, r_s.ln(), r_t);
                soft += f;
                e += r_s * slope;
                slope - e
            }
        };
        div = (e, log_norm);
        (f_off, T::ONE)
    } else {
        match d.tail {
            TailMode::Renormalize => (T::ONE, T::ONE),
            TailMode::Unnormalized => (mass, mass),
            TailMode::Bucket => {
                if r_t > T::ZERO {
                    soft += r_t * (r_t.ln() - r_s.ln());
                    (T::ONE - r_t / r_s, T::ONE)
                } else {
                    (T::ONE, T::ONE)
                }
            }
        }
    };
    // The soft term's ∂/∂s at a teacher column (`kl_rows_fold.wgsl`'s `soft_on`).
    let soft_on = |j: usize, p: f32| {
        if divergence == Divergence::Forward {
            f_on * p_tau(j) - T::of(p)
        } else {
            let log_q = u[j] - lse_tau - div.1;
            let q = log_q.exp();
            q * (div_term(divergence, q, log_q, T::of(p)).1 - div.0)
        }
    };
    let labelled = t.hard_on() && label != NO_LABEL;
    let (alpha_hard, eps) = if labelled {
        (T::of(t.hard_weight), T::of(t.label_smoothing))
    } else {
        (T::ZERO, T::ZERO)
    };
    let v = T::of_usize(vocab);
    let hard = if labelled {
        let mut sum_u = T::ZERO;
        for &x in &u {
            sum_u += x;
        }
        lse1 - (T::ONE - eps) * tau * u[label as usize] - eps * tau * sum_u / v
    } else {
        T::ZERO
    };
    let (alpha_soft, lambda) = (T::of(t.soft_weight), T::of(t.z_loss));
    let loss = alpha_soft * soft + alpha_hard * hard + lambda * lse1 * lse1;

    // grad_j = c·cap'_j·(a·p^τ_j + b·p¹_j − h) off the teacher's ids and the
    // label, as the shader computes it.
    let c = T::of(f32::from_bits(coef));
    let a = alpha_soft * f_off;
    let b = tau * (alpha_hard + T::of(2.0) * lambda * lse1);
    let h = tau * alpha_hard * eps / v;
    let cap = |j: usize| if dcap.is_empty() { T::ONE } else { dcap[j] };
    for (j, g) in grad[..vocab].iter_mut().enumerate() {
        // The gradient's expression as without the filter (the same bits).
        let x = a * p_tau(j) + b * p_one(j) - h;
        *g = (c * cap(j) * x).to_f16();
        if d.filter.is_some() {
            mark(j, cap(j) * x);
        }
    }
    let label_term = tau * alpha_hard * (T::ONE - eps);
    let mut label_in_ids = false;
    for (&id, &p) in ids.iter().zip(probs) {
        let j = id as usize;
        let mut d = alpha_soft * soft_on(j, p) + b * p_one(j) - h;
        if labelled && id == label {
            d = d - label_term;
            label_in_ids = true;
        }
        grad[j] = (c * cap(j) * d).to_f16();
        mark(j, cap(j) * d);
    }
    if labelled && !label_in_ids {
        let j = label as usize;
        let x = a * p_tau(j) + b * p_one(j) - h - label_term;
        grad[j] = (c * cap(j) * x).to_f16();
        mark(j, cap(j) * x);
    }
    [loss.to_f32(), lse1.to_f32(), soft.to_f32(), hard.to_f32()]
}

/// One row of the KL kernel with a dense teacher ([`KlDesc::dense_teacher`]:
/// `t` the teacher's logits at τ): the exact divergence over the whole
/// vocabulary in log space, `[α_soft·L, lse, L, 0]`, and the gradient row
/// `c·α_soft·∂L/∂s`. A flagged row is handled as in [`kl_row`].
fn dense_row<T: Real>(s: &[f32], t: &[f32], coef: u32, d: &KlDesc, grad: &mut [f16]) -> [f32; 4] {
    let vocab = d.vocab;
    grad[vocab..].fill(f16::ZERO);
    if s.iter().chain(t).any(|v| !v.is_finite()) {
        grad[..vocab].fill(f16::NAN);
        return [f32::NAN; 4];
    }
    let u: Vec<T> = s.iter().map(|&v| T::of(v)).collect();
    let w: Vec<T> = t.iter().map(|&v| T::of(v)).collect();
    let (lse, lse_t) = (lse_of(&u), lse_of(&w));
    let tau = T::of(d.temperature);
    let lse1 = if d.temperature != 1.0 {
        lse_of(&u.iter().map(|&v| v * tau).collect::<Vec<T>>())
    } else {
        lse
    };
    let log_s: Vec<T> = u.iter().map(|&v| v - lse).collect();
    let log_t: Vec<T> = w.iter().map(|&v| v - lse_t).collect();
    let divergence = d.terms.divergence.effective();
    // (f, f') of one column of the reverse KL (its teacher floored as in
    // `div_term`) or the JSD, with the logs exact.
    let log_floor = T::of(headkl_core::PROB_FLOOR.ln() as f32);
    let div = |ls: T, lt: T| -> (T, T) {
        let q = ls.exp();
        if divergence == Divergence::Reverse {
            let r = ls - if lt > log_floor { lt } else { log_floor };
            return if q > T::ZERO {
                (q * r, r + T::ONE)
            } else {
                (T::ZERO, T::ZERO)
            };
        }
        let (beta, p) = (T::of(divergence.beta()), lt.exp());
        let log_m = (beta * p + (T::ONE - beta) * q).ln();
        let (mut f, mut slope) = (T::ZERO, T::ZERO);
        if p > T::ZERO {
            f += beta * p * (lt - log_m);
        }
        if q > T::ZERO {
            f += (T::ONE - beta) * q * (ls - log_m);
            slope = (T::ONE - beta) * (ls - log_m);
        }
        (f, slope)
    };
    let (mut soft, mut e) = (T::ZERO, T::ZERO);
    for (&ls, &lt) in log_s.iter().zip(&log_t) {
        if divergence == Divergence::Forward {
            soft += lt.exp() * (lt - ls);
        } else {
            let (f, slope) = div(ls, lt);
            soft += f;
            e += ls.exp() * slope;
        }
    }
    let cw = T::of(f32::from_bits(coef)) * T::of(d.terms.soft_weight);
    for ((g, &ls), &lt) in grad[..vocab].iter_mut().zip(&log_s).zip(&log_t) {
        let dl = match divergence {
            Divergence::Forward => ls.exp() - lt.exp(),
            _ => ls.exp() * (div(ls, lt).1 - e),
        };
        *g = (cw * dl).to_f16();
    }
    let mut out = [
        (T::of(d.terms.soft_weight) * soft).to_f32(),
        lse1.to_f32(),
        soft.to_f32(),
        0.0,
    ];
    if coef == FLAGGED_ROW {
        grad.fill(f16::ZERO);
        out[0] = f32::from_bits(FLAGGED_ROW);
    }
    out
}

/// The KL row kernel on whole buffers (see [`KlDesc`]).
#[allow(clippy::too_many_arguments, reason = "one slice per kernel binding")]
pub(crate) fn kl_rows(
    logits: &[f32],
    ids: &[u32],
    probs: &[f32],
    row_in: &[u32],
    loss: &mut [f32],
    grad: &mut [f16],
    d: &KlDesc,
    precision: Precision,
) {
    let (rows, ld, k, vocab) = (d.rows, d.ld, d.k, d.vocab);
    let stats = d.row_stats.filter(|_| KlDesc::stats_suffice(&d.terms, d.temperature));
    // The block filter's mask, one row of words per token (written only
    // with `d.filter`).
    let words = match d.filter {
        Some(_) => headkl_core::problem::filter::mask_words(ld),
        None => 0,
    };
    let mut masks = vec![0u32; rows * words];
    /// One row's loss, gradient and mask.
    type Row<'a> = ((&'a mut [f32], &'a mut [f16]), &'a mut [u32]);
    let mut work: Vec<Row<'_>> = loss[..rows * 4]
        .chunks_exact_mut(4)
        .zip(grad[..rows * ld].chunks_exact_mut(ld.max(1)))
        .zip(
            masks
                .chunks_mut(words.max(1))
                .chain(std::iter::repeat_with(|| &mut [][..])),
        )
        .collect();
    par::for_row_blocks(&mut work, 1, rows * vocab * 8, |first, block| {
        for (i, ((l, g), mask)) in block.iter_mut().enumerate() {
            let t = first + i;
            let s = &logits[t * ld..t * ld + vocab];
            let inputs = [row_in[2 * t], row_in[2 * t + 1]];
            if d.dense_teacher {
                let teacher = &probs[t * ld..t * ld + vocab];
                let out = match precision {
                    Precision::F64 => dense_row::<f64>(s, teacher, inputs[0], d, g),
                    Precision::F32 => dense_row::<f32>(s, teacher, inputs[0], d, g),
                };
                l.copy_from_slice(&out);
                continue;
            }
            let (ids_t, probs_t) = (&ids[t * k..(t + 1) * k], &probs[t * k..(t + 1) * k]);
            let stats_lse = stats.map(|rs| lse_from_stats(logits, &rs, t));
            let out = match precision {
                Precision::F64 => kl_row::<f64>(s, ids_t, probs_t, inputs, d, stats_lse, g, mask),
                Precision::F32 => kl_row::<f32>(s, ids_t, probs_t, inputs, d, stats_lse, g, mask),
            };
            l.copy_from_slice(&out);
        }
    });
    if let Some(f) = d.filter {
        for (i, &w) in masks.iter().enumerate() {
            grad[f.mask_at + 4 * i..f.mask_at + 4 * i + 4].copy_from_slice(&headkl_core::problem::filter::halves_of(w));
        }
    }
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

/// The values of one top-k row in arithmetic `T`: the softmax over the k
/// of the (capped) logits, or their log-probabilities over the full row.
fn topk_values<T: Real>(s: &[f32], top: &[u32], d: &TopkDesc, out: &mut [f32]) {
    let value = |v: f32| match d.cap {
        Some(c) => softcap(T::of(v), T::of(c)).0,
        None => T::of(v),
    };
    let m = value(s[top[0] as usize]);
    let mut z = T::ZERO;
    if d.logprobs {
        for &v in s {
            z += (value(v) - m).exp();
        }
        let log_z = z.ln();
        for (p, &j) in out.iter_mut().zip(top) {
            *p = (value(s[j as usize]) - m - log_z).to_f32();
        }
    } else {
        for &j in top {
            z += (value(s[j as usize]) - m).exp();
        }
        for (p, &j) in out.iter_mut().zip(top) {
            *p = ((value(s[j as usize]) - m).exp() / z).to_f32();
        }
    }
}

/// One row of the gather ([`TopkDesc::gather`]): the log-probabilities
/// over the row at the ids of the first `k − 1` columns (`-inf` for an id
/// at or past the vocabulary), the lse in the last.
fn gather_values<T: Real>(s: &[f32], ids: &[u32], d: &TopkDesc, out: &mut [f32]) {
    let value = |v: f32| match d.cap {
        Some(c) => softcap(T::of(v), T::of(c)).0,
        None => T::of(v),
    };
    let values: Vec<T> = s.iter().map(|&v| value(v)).collect();
    let lse = lse_of(&values);
    // k ≥ 1 (the descriptor's check): the last column is the lse's.
    let Some((last, firsts)) = out.split_last_mut() else {
        return;
    };
    for (p, &id) in firsts.iter_mut().zip(ids) {
        *p = match values.get(id as usize) {
            Some(&v) => (v - lse).to_f32(),
            None => f32::NEG_INFINITY,
        };
    }
    *last = lse.to_f32();
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
            if d.gather {
                if s.iter().any(|v| !v.is_finite()) {
                    probs_t[0] = f32::NAN;
                    continue;
                }
                match precision {
                    Precision::F64 => gather_values::<f64>(s, ids_t, d, probs_t),
                    Precision::F32 => gather_values::<f32>(s, ids_t, d, probs_t),
                }
                continue;
            }
            if s.iter().any(|v| !v.is_finite()) {
                for (q, id) in ids_t.iter_mut().enumerate() {
                    *id = q as u32;
                }
                probs_t.fill(f32::NAN);
                continue;
            }
            let top = topk_indices_f32(s, k);
            match precision {
                Precision::F64 => topk_values::<f64>(s, &top, d, probs_t),
                Precision::F32 => topk_values::<f32>(s, &top, d, probs_t),
            }
            ids_t.copy_from_slice(&top);
        }
    });
}
