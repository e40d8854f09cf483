//! The one comparator of backend results against [`crate::direct`]
//! (DESIGN §5): relative errors with the design's bounds, small absolute
//! floors where a relative error would judge noise, the top-k tie rule, and
//! a failure message that prints the worst elements.

use std::fmt;

use crate::direct::{softmax_over, DirectLoss, DirectTopK};

/// Floor on the per-token RMS of the reference loss in the loss error's
/// denominator: `‖got − want‖₂ / max(‖want‖₂, LOSS_FLOOR·√ntok)`. A KL near 0
/// (student equal to teacher) is then judged by an absolute error of
/// `loss_rel · LOSS_FLOOR` = 1e-5 per token, which an f32 softmax meets.
/// The mean uses `max(|mean|, LOSS_FLOOR)` alike.
pub const LOSS_FLOOR: f64 = 0.1;

/// Floor on the per-element RMS of the reference gradient in the dx
/// error's denominator: `‖got − want‖₂ / max(‖want‖₂, DX_FLOOR·√len)`, so an
/// all-zero (fully masked) or near-zero gradient is judged absolutely.
pub const DX_FLOOR: f64 = 1e-5;

/// Floor on the per-element RMS of the reference head gradient in its
/// error's denominator, as [`DX_FLOOR`] for dx. dW's elements are smaller
/// than dx's (`dW_j` carries `p_S,j`, of order 1/V, where `dx_t` carries
/// `Σ_j |∂L_t/∂s_j| ≤ 2`), so dx's floor would judge a large vocabulary's
/// dW absolutely, and loosely. What an all-zero dW picks up on a device is
/// far below this: the f16 gradient's absolute rounding near 0 (its
/// subnormal spacing, 2^-24 of the scaled gradient) times
/// `alpha = S/(gscale·τ)` is about 2^-38·S/(τ·total) per token.
pub const HEAD_GRAD_FLOOR: f64 = 1e-9;

/// Floor on a reference probability in its relative error: probabilities
/// below it (f32 underflows near 1e-38) are judged absolutely.
pub const PROB_FLOOR: f64 = 1e-30;

/// Elements a [`Mismatch`] keeps for its message.
const WORST: usize = 5;

/// Error bounds of DESIGN §5.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Relative L2 error of the per-token losses and of the mean (1e-4).
    pub loss_rel: f64,
    /// Relative L2 error of dx over the whole tensor (3e-3).
    pub dx_rel: f64,
    /// Relative L2 error of the head's gradient `∂mean/∂W` over the whole
    /// tensor (3e-3, as dx: see [`Tolerance::check_head_grad`]).
    pub head_grad_rel: f64,
    /// Relative error of each top-k probability (1e-4).
    pub prob_rel: f64,
    /// Top-k ids may differ from the reference where the two logits differ
    /// by less than `tie_gap · (|logit| + 1)` (1e-3).
    pub tie_gap: f64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Self {
            loss_rel: 1e-4,
            dx_rel: 3e-3,
            head_grad_rel: 3e-3,
            prob_rel: 1e-4,
            tie_gap: 1e-3,
        }
    }
}

/// One element of a failed comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct Element {
    /// Flat index into the compared tensor.
    pub index: usize,
    /// The backend's value (an id for top-k ids).
    pub got: f64,
    /// The reference value (an id for top-k ids).
    pub want: f64,
}

/// A comparison that failed: what, the error measured against its bound,
/// and the worst elements.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// Which quantity (`loss`, `mean loss`, `dx`, `topk ids`, `topk probs`, …).
    pub what: String,
    /// The error measured (`inf` for a structural failure such as a length
    /// mismatch or a duplicate id).
    pub error: f64,
    /// The bound it exceeded.
    pub bound: f64,
    /// Extra explanation (may be empty).
    pub detail: String,
    /// Row length of the tensor, to print indices as `[row][col]`.
    pub row_len: Option<usize>,
    /// Up to five worst elements, worst first.
    pub worst: Vec<Element>,
}

impl Mismatch {
    fn index(&self, i: usize) -> String {
        match self.row_len {
            Some(n) if n > 0 => format!("[{}][{}]", i / n, i % n),
            _ => format!("[{i}]"),
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: error {:.3e} exceeds bound {:.3e}",
            self.what, self.error, self.bound
        )?;
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        if !self.worst.is_empty() {
            write!(f, "; worst:")?;
            for e in &self.worst {
                write!(f, " {} got {} want {};", self.index(e.index), show(e.got), show(e.want))?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for Mismatch {}

/// Integers (ids, exact values) as integers, everything else with seven
/// significant digits.
fn show(v: f64) -> String {
    if v.is_finite() && v == v.trunc() && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.6e}")
    }
}

/// `|a − b|`, with NaN (anywhere) as +inf so it ranks worst.
fn abs_diff(a: f64, b: f64) -> f64 {
    let d = (a - b).abs();
    if d.is_nan() {
        f64::INFINITY
    } else {
        d
    }
}

/// The `WORST` elements with the largest `score`, worst first.
fn worst_by(
    n: usize,
    score: impl Fn(usize) -> f64,
    got: impl Fn(usize) -> f64,
    want: impl Fn(usize) -> f64,
) -> Vec<Element> {
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
    idx.into_iter()
        .take(WORST)
        .map(|index| Element {
            index,
            got: got(index),
            want: want(index),
        })
        .collect()
}

fn length_mismatch(what: &str, got: usize, want: usize) -> Mismatch {
    Mismatch {
        what: what.into(),
        error: f64::INFINITY,
        bound: 0.0,
        detail: format!("length {got}, reference has {want}"),
        row_len: None,
        worst: Vec::new(),
    }
}

/// `‖got − want‖₂ / max(‖want‖₂, floor·√n)`; NaN in `got` gives NaN.
fn rel_l2(got: &[f32], want: &[f64], floor: f64) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    num.sqrt() / den.sqrt().max(floor * (want.len() as f64).sqrt())
}

/// Fails unless `error ≤ bound` (NaN fails).
fn within(error: f64, bound: f64) -> bool {
    error <= bound
}

/// A gradient `what` against the reference: [`rel_l2`] with `floor`
/// within `bound`, the worst elements printed as `[row][col]` for rows of
/// `row_len`. The one relative-L2 comparison of dx and the head's gradient.
fn rel_l2_within(
    what: &str,
    got: &[f32],
    want: &[f64],
    (floor, bound): (f64, f64),
    row_len: Option<usize>,
) -> Result<f64, Mismatch> {
    if got.len() != want.len() {
        return Err(length_mismatch(what, got.len(), want.len()));
    }
    let err = rel_l2(got, want, floor);
    if !within(err, bound) {
        let d = |i: usize| abs_diff(f64::from(got[i]), want[i]);
        return Err(Mismatch {
            what: what.into(),
            error: err,
            bound,
            detail: format!("relative L2 over {} elements", got.len()),
            row_len,
            worst: worst_by(got.len(), d, |i| f64::from(got[i]), |i| want[i]),
        });
    }
    Ok(err)
}

impl Tolerance {
    /// Per-token losses and the mean against the reference: the relative L2
    /// error over tokens (denominator floored at [`LOSS_FLOOR`]`·√ntok`) and
    /// the mean's relative error (floored at [`LOSS_FLOOR`]), each within
    /// `loss_rel`. Returns the larger of the two.
    pub fn check_loss(&self, got: &[f32], got_mean: f64, want: &DirectLoss) -> Result<f64, Mismatch> {
        if got.len() != want.loss.len() {
            return Err(length_mismatch("loss", got.len(), want.loss.len()));
        }
        let err = rel_l2(got, &want.loss, LOSS_FLOOR);
        if !within(err, self.loss_rel) {
            let d = |i: usize| abs_diff(f64::from(got[i]), want.loss[i]);
            return Err(Mismatch {
                what: "loss".into(),
                error: err,
                bound: self.loss_rel,
                detail: format!("relative L2 over {} tokens", got.len()),
                row_len: None,
                worst: worst_by(got.len(), d, |i| f64::from(got[i]), |i| want.loss[i]),
            });
        }
        let mean_err = abs_diff(got_mean, want.mean) / want.mean.abs().max(LOSS_FLOOR);
        if !within(mean_err, self.loss_rel) {
            return Err(Mismatch {
                what: "mean loss".into(),
                error: mean_err,
                bound: self.loss_rel,
                detail: String::new(),
                row_len: None,
                worst: vec![Element {
                    index: 0,
                    got: got_mean,
                    want: want.mean,
                }],
            });
        }
        Ok(err.max(mean_err))
    }

    /// The input gradient against the reference: relative L2 error over the
    /// whole tensor (denominator floored at [`DX_FLOOR`]`·√len`) within
    /// `dx_rel`.
    pub fn check_dx(&self, got: &[f32], want: &[f64]) -> Result<f64, Mismatch> {
        self.check_dx_rows(got, want, None)
    }

    /// [`Tolerance::check_dx`], printing indices as `[token][column]` for
    /// rows of `hs` elements.
    pub fn check_dx_rows(&self, got: &[f32], want: &[f64], hs: Option<usize>) -> Result<f64, Mismatch> {
        rel_l2_within("dx", got, want, (DX_FLOOR, self.dx_rel), hs)
    }

    /// The head's gradient `∂mean/∂W` `[V][hs]` against the reference
    /// ([`crate::direct::head_kl_and_head_grad_f64`]): relative L2 error
    /// over the whole tensor (denominator floored at
    /// [`HEAD_GRAD_FLOOR`]`·√len`) within `head_grad_rel`; indices print
    /// as `[id][column]`.
    ///
    /// The bound is dx's, for dx's reasons. A device computes
    /// `dW_j = alpha · Σ_t ĝ_tj · x̂_t` in f32 with `alpha = S/(gscale·τ)`,
    /// `ĝ` the f16 logits gradient dx reads and `x̂` the f16 hidden rows;
    /// the reference takes the same f16 `x̂` and `W` (which reaches dW only
    /// through the logits), so what differs is:
    /// - ĝ's rounding to f16, a relative `δ_tj` with `|δ| ≤ u = 2^-11`
    ///   (gscale keeps the bulk of `|g|` normal and below 2^14): dW's error
    ///   is `Σ_t δ_tj g_tj x̂_t`, element for element the terms dx's error
    ///   sums (`Σ_j δ_tj g_tj W_j`), over the tokens instead of the
    ///   vocabulary. Rounding errors of different elements add in
    ///   quadrature, about `u/√3 ≈ 2.8e-4` of `‖dW‖`; neither reduction
    ///   cancels systematically (`dW_j`'s tokens have hidden rows of either
    ///   sign, as `dx_t`'s vocabulary rows do), and the bound, dx's 3e-3 ≈ 6u,
    ///   leaves the same room for partial cancellation;
    /// - the f32 logits and softmax, which move `g` by the loss's errors
    ///   (1e-4 relative at most, DESIGN §5) in both gradients alike;
    /// - the f32 sum over the tokens (within a chunk, then across chunks
    ///   into the f32 result) in place of dx's over the vocabulary: at
    ///   most `ntok·2^-24` relative, about 1e-4 for the suite's 2300
    ///   tokens, and `√ntok·2^-24` in practice; `alpha`'s one rounding to
    ///   f32 adds 2^-24.
    pub fn check_head_grad(&self, got: &[f32], want: &[f64], hs: usize) -> Result<f64, Mismatch> {
        rel_l2_within("head_grad", got, want, (HEAD_GRAD_FLOOR, self.head_grad_rel), Some(hs))
    }

    /// Top-k ids and probabilities against the reference.
    ///
    /// - Every id is `< V` and the ids of a row are distinct.
    /// - At each position the id equals the reference's, or the two ids'
    ///   reference logits differ by less than `tie_gap · (|logit| + 1)` (a
    ///   near-tie the device may order either way, at the k-th boundary too).
    /// - Each probability is within `prob_rel` (relative, floored at
    ///   [`PROB_FLOOR`]) of the f64 softmax over the *returned* ids at the
    ///   reference logits, so a legal near-tie swap does not fail.
    ///
    /// Returns the worst probability error.
    pub fn check_topk(&self, got_ids: &[u32], got_probs: &[f32], want: &DirectTopK) -> Result<f64, Mismatch> {
        let (ntok, k, vocab) = (want.ntok, want.k, want.vocab());
        if got_ids.len() != ntok * k {
            return Err(length_mismatch("topk ids", got_ids.len(), ntok * k));
        }
        if got_probs.len() != ntok * k {
            return Err(length_mismatch("topk probs", got_probs.len(), ntok * k));
        }
        let structural = |detail: String, index: usize| Mismatch {
            what: "topk ids".into(),
            error: f64::INFINITY,
            bound: 0.0,
            detail,
            row_len: Some(k),
            worst: vec![Element {
                index,
                got: f64::from(got_ids[index]),
                want: f64::from(want.ids[index]),
            }],
        };
        // Ids: in range and distinct per row.
        let mut seen = vec![usize::MAX; vocab];
        for t in 0..ntok {
            for q in 0..k {
                let i = t * k + q;
                let id = got_ids[i] as usize;
                if id >= vocab {
                    return Err(structural(format!("id {id} is not below V = {vocab}"), i));
                }
                if seen[id] == t {
                    return Err(structural(format!("id {id} appears twice in row {t}"), i));
                }
                seen[id] = t;
            }
        }
        // Ids: equal to the reference up to near-ties.
        let mut gaps = vec![0f64; ntok * k];
        let mut worst_gap = 0f64;
        for t in 0..ntok {
            let row = &want.logits[t * vocab..(t + 1) * vocab];
            for q in 0..k {
                let i = t * k + q;
                let (g, w) = (got_ids[i] as usize, want.ids[i] as usize);
                if g != w {
                    let gap = (row[g] - row[w]).abs() / (row[w].abs() + 1.0);
                    if gap.is_nan() || gap >= self.tie_gap {
                        gaps[i] = if gap.is_nan() { f64::INFINITY } else { gap };
                        worst_gap = worst_gap.max(gaps[i]);
                    }
                }
            }
        }
        if worst_gap > 0.0 {
            let i = (0..gaps.len())
                .max_by(|&a, &b| gaps[a].total_cmp(&gaps[b]).then(b.cmp(&a)))
                .unwrap_or(0);
            let (t, q) = (i / k, i % k);
            let row = &want.logits[t * vocab..(t + 1) * vocab];
            let (g, w) = (got_ids[i] as usize, want.ids[i] as usize);
            let bad = gaps.iter().filter(|&&x| x > 0.0).count();
            return Err(Mismatch {
                what: "topk ids".into(),
                error: worst_gap,
                bound: self.tie_gap,
                detail: format!(
                    "{bad} position(s) differ by more than a near-tie (logit gap / (|logit| + 1)); \
                     at [{t}][{q}] got id {g} with logit {:.6}, reference id {w} with logit {:.6}",
                    row[g], row[w]
                ),
                row_len: Some(k),
                worst: worst_by(
                    gaps.len(),
                    |i| gaps[i],
                    |i| f64::from(got_ids[i]),
                    |i| f64::from(want.ids[i]),
                ),
            });
        }
        // Probabilities: against the softmax over the returned ids.
        let mut expected = Vec::with_capacity(ntok * k);
        for t in 0..ntok {
            let row = &want.logits[t * vocab..(t + 1) * vocab];
            expected.extend(softmax_over(row, &got_ids[t * k..(t + 1) * k]));
        }
        let rel = |i: usize| abs_diff(f64::from(got_probs[i]), expected[i]) / expected[i].max(PROB_FLOOR);
        let worst = (0..ntok * k).map(rel).fold(0f64, f64::max);
        if !within(worst, self.prob_rel) {
            return Err(Mismatch {
                what: "topk probs".into(),
                error: worst,
                bound: self.prob_rel,
                detail: "relative, against the f64 softmax over the returned ids".into(),
                row_len: Some(k),
                worst: worst_by(ntok * k, rel, |i| f64::from(got_probs[i]), |i| expected[i]),
            });
        }
        Ok(worst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loss_ref() -> DirectLoss {
        DirectLoss {
            loss: vec![0.5, 1.25, 2.0, 0.75],
            mean: 1.125,
            dx: vec![0.1, -0.2, 0.3, 0.05, 0.0, -0.4],
            ..DirectLoss::of_losses(Vec::new())
        }
    }

    /// Three tokens over V = 6 with k = 3; logits chosen so that ids 2 and
    /// 4 of row 0 nearly tie and row 1 has a clear order.
    fn topk_ref() -> DirectTopK {
        let logits = vec![
            5.0,
            1.0,
            3.0,
            -2.0,
            3.0 + 1e-5,
            0.0, // row 0: 0, 4, 2 (4 and 2 nearly tie)
            0.0,
            9.0,
            8.0,
            7.0,
            1.0,
            6.0, // row 1: 1, 2, 3
            2.0,
            2.0,
            2.0,
            2.0,
            2.0,
            2.0, // row 2: exact ties: 0, 1, 2
        ];
        let ids = vec![0, 4, 2, 1, 2, 3, 0, 1, 2];
        let mut probs = Vec::new();
        for t in 0..3 {
            probs.extend(softmax_over(&logits[t * 6..(t + 1) * 6], &ids[t * 3..(t + 1) * 3]));
        }
        DirectTopK {
            ids,
            probs,
            logits,
            ntok: 3,
            k: 3,
        }
    }

    fn as_f32(v: &[f64]) -> Vec<f32> {
        v.iter().map(|&x| x as f32).collect()
    }

    #[test]
    fn equal_data_passes() {
        let tol = Tolerance::default();
        let want = loss_ref();
        assert!(tol.check_loss(&as_f32(&want.loss), want.mean, &want).unwrap() < 1e-7);
        assert!(tol.check_dx(&as_f32(&want.dx), &want.dx).unwrap() < 1e-7);
        let top = topk_ref();
        assert!(tol.check_topk(&top.ids, &as_f32(&top.probs), &top).unwrap() < 1e-6);
    }

    #[test]
    fn planted_loss_error_fails_and_names_the_worst_token() {
        let tol = Tolerance::default();
        let want = loss_ref();
        let mut got = as_f32(&want.loss);
        got[2] += 0.01;
        got[1] += 0.001;
        let e = tol.check_loss(&got, want.mean, &want).unwrap_err();
        assert_eq!(e.what, "loss");
        assert_eq!(e.worst[0].index, 2);
        assert_eq!(e.worst[1].index, 1);
        let msg = e.to_string();
        assert!(
            msg.contains("loss: error") && msg.contains("exceeds bound 1.000e-4"),
            "{msg}"
        );
        assert!(msg.contains("[2] got 2.010000e0 want 2;"), "{msg}");
    }

    #[test]
    fn mean_error_fails_alone() {
        let tol = Tolerance::default();
        let want = loss_ref();
        let e = tol
            .check_loss(&as_f32(&want.loss), want.mean * 1.001, &want)
            .unwrap_err();
        assert_eq!(e.what, "mean loss");
    }

    #[test]
    fn nan_fails_everywhere() {
        let tol = Tolerance::default();
        let want = loss_ref();
        let mut got = as_f32(&want.loss);
        got[3] = f32::NAN;
        let e = tol.check_loss(&got, want.mean, &want).unwrap_err();
        assert_eq!(e.worst[0].index, 3);
        let mut dx = as_f32(&want.dx);
        dx[5] = f32::NAN;
        let e = tol.check_dx_rows(&dx, &want.dx, Some(3)).unwrap_err();
        assert!(e.to_string().contains("[1][2] got NaN"), "{e}");
        let top = topk_ref();
        let mut probs = as_f32(&top.probs);
        probs[4] = f32::NAN;
        let e = tol.check_topk(&top.ids, &probs, &top).unwrap_err();
        assert_eq!(e.what, "topk probs");
        assert!(e.to_string().contains("[1][1] got NaN"), "{e}");
    }

    #[test]
    fn planted_dx_error_fails_and_small_noise_passes() {
        let tol = Tolerance::default();
        let want = loss_ref();
        let mut got = as_f32(&want.dx);
        got[4] = 0.01;
        let e = tol.check_dx(&got, &want.dx).unwrap_err();
        assert_eq!(e.worst[0].index, 4);
        assert!(e.to_string().contains("[4] got 1.000000e-2 want 0;"), "{e}");
        let noisy: Vec<f32> = want.dx.iter().map(|&v| (v * (1.0 + 1e-4)) as f32).collect();
        assert!(tol.check_dx(&noisy, &want.dx).is_ok());
    }

    #[test]
    fn floors_judge_near_zero_absolutely() {
        let tol = Tolerance::default();
        let want = DirectLoss {
            loss: vec![1e-9, 0.0, 2e-9],
            mean: 1e-9,
            dx: vec![0.0; 8],
            ..DirectLoss::of_losses(Vec::new())
        };
        // absolute errors of 1e-6 on a KL near zero are f32 noise, not failures
        let got = [1e-6f32, -1e-6, 2e-6];
        assert!(tol.check_loss(&got, 1e-6, &want).is_ok());
        // a real error on a near-zero KL still fails
        assert!(tol.check_loss(&[0.01, 0.0, 0.0], 0.0, &want).is_err());
        // an all-zero gradient: zeros pass, a visible value fails
        assert!(tol.check_dx(&[0.0; 8], &want.dx).is_ok());
        let mut dx = [0f32; 8];
        dx[3] = 1e-4;
        assert!(tol.check_dx(&dx, &want.dx).is_err());
    }

    #[test]
    fn head_grad_is_judged_as_dx_with_its_own_floor_and_names() {
        let tol = Tolerance::default();
        // [V = 3][hs = 2]
        let want = vec![2e-7, -1e-7, 0.0, 4e-8, -3e-7, 1e-8];
        assert!(tol.check_head_grad(&as_f32(&want), &want, 2).unwrap() < 1e-6);
        let noisy: Vec<f32> = want.iter().map(|&v| (v * (1.0 + 5e-4)) as f32).collect();
        assert!(tol.check_head_grad(&noisy, &want, 2).is_ok());
        // One row's gradient 2% off: well within dx's floor, not dW's.
        let mut got = as_f32(&want);
        got[4] *= 1.02;
        let e = tol.check_head_grad(&got, &want, 2).unwrap_err();
        assert_eq!(e.what, "head_grad");
        assert!(
            e.to_string().contains("head_grad: error") && e.to_string().contains("[2][0] got"),
            "{e}"
        );
        assert!(tol.check_dx(&got, &want).is_ok(), "dx's floor judges this absolutely");
        // NaN and a length mismatch fail.
        got[4] = f32::NAN;
        assert!(tol.check_head_grad(&got, &want, 2).is_err());
        let e = tol.check_head_grad(&[0.0; 4], &want, 2).unwrap_err();
        assert!(
            e.to_string().contains("head_grad") && e.to_string().contains("length 4"),
            "{e}"
        );
        // An all-zero reference: zeros pass, a visible value fails.
        assert!(tol.check_head_grad(&[0.0; 6], &[0.0; 6], 2).is_ok());
        assert!(tol
            .check_head_grad(&[0.0, 0.0, 0.0, 1e-9, 0.0, 0.0], &[0.0; 6], 2)
            .is_err());
    }

    #[test]
    fn length_mismatch_fails() {
        let tol = Tolerance::default();
        let want = loss_ref();
        let e = tol.check_loss(&[0.0; 3], want.mean, &want).unwrap_err();
        assert!(e.to_string().contains("length 3, reference has 4"), "{e}");
    }

    #[test]
    fn near_tie_swap_is_accepted() {
        let tol = Tolerance::default();
        let top = topk_ref();
        // swap the near-tied ids 4 and 2 of row 0, and ids of the exact tie in row 2
        let ids = vec![0, 2, 4, 1, 2, 3, 0, 2, 5];
        let mut probs = Vec::new();
        for t in 0..3 {
            probs.extend(softmax_over(&top.logits[t * 6..(t + 1) * 6], &ids[t * 3..(t + 1) * 3]));
        }
        let err = tol.check_topk(&ids, &as_f32(&probs), &top).unwrap();
        assert!(err < 1e-6, "{err}");
    }

    #[test]
    fn real_swap_is_rejected() {
        let tol = Tolerance::default();
        let top = topk_ref();
        // row 1: 2 and 3 swapped (logits 8 and 7: no tie)
        let ids = vec![0, 4, 2, 1, 3, 2, 0, 1, 2];
        let e = tol.check_topk(&ids, &as_f32(&top.probs), &top).unwrap_err();
        assert_eq!(e.what, "topk ids");
        // gaps relative to the reference logit: |7 − 8|/9 at [1][1], |8 − 7|/8 at [1][2]
        assert_eq!(e.worst[0].index, 5, "{e}");
        assert_eq!(e.worst[1].index, 4, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("[1][2] got 2 want 3") && msg.contains("[1][1] got 3 want 2"),
            "{msg}"
        );
        assert!(msg.contains("2 position(s)"), "{msg}");
        // a wrong id at the boundary (id 5, logit 6, instead of id 3, logit 7)
        let ids = vec![0, 4, 2, 1, 2, 5, 0, 1, 2];
        let e = tol.check_topk(&ids, &as_f32(&top.probs), &top).unwrap_err();
        assert_eq!(e.worst[0].index, 5, "{e}");
    }

    #[test]
    fn out_of_range_and_duplicate_ids_are_rejected() {
        let tol = Tolerance::default();
        let top = topk_ref();
        let probs = as_f32(&top.probs);
        let mut ids = top.ids.clone();
        ids[7] = 6;
        let e = tol.check_topk(&ids, &probs, &top).unwrap_err();
        assert!(e.to_string().contains("not below V = 6"), "{e}");
        let mut ids = top.ids.clone();
        ids[8] = 0;
        let e = tol.check_topk(&ids, &probs, &top).unwrap_err();
        assert!(e.to_string().contains("appears twice in row 2"), "{e}");
    }

    #[test]
    fn planted_prob_error_fails() {
        let tol = Tolerance::default();
        let top = topk_ref();
        let mut probs = as_f32(&top.probs);
        probs[3] *= 1.001;
        let e = tol.check_topk(&top.ids, &probs, &top).unwrap_err();
        assert_eq!(e.what, "topk probs");
        assert_eq!(e.worst[0].index, 3);
        assert!(e.error > 9e-4 && e.error < 1.1e-3, "{}", e.error);
    }
}
