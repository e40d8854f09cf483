//! The DESIGN §1 formulas, evaluated directly in f64: no slicing, no
//! chunking, no f16 gradient. Inputs are the f16-rounded head and hidden
//! rows (what a device multiplies), so the only difference between a
//! backend and this module is the backend's own arithmetic.
//!
//! Every function here panics when the head's and the rows' hidden sizes
//! differ, or the teacher's or options' token counts do not match: these are
//! programming errors in a test, not inputs a user can give.

use std::cmp::Ordering;

use headkl_core::{Divergence, HeadWeights, Hidden, LossTerms, ResolvedLoss, TailMode, Teacher, NO_LABEL};

use crate::par;

/// The head `[V][hs]` as f64, rounded to f16 first.
fn head_f64(head: &HeadWeights<'_>) -> Vec<f64> {
    let (vocab, hs) = (head.vocab(), head.hs());
    let mut w = Vec::with_capacity(vocab * hs);
    for j in 0..vocab {
        w.extend((0..hs).map(|c| f64::from(head.get_f16_rounded(j, c))));
    }
    w
}

/// The hidden rows `[ntok][hs]` as f64, rounded to f16 first.
fn hidden_f64(hidden: &Hidden<'_>) -> Vec<f64> {
    let mut x = Vec::with_capacity(hidden.ntok() * hidden.hs());
    for t in 0..hidden.ntok() {
        x.extend(hidden.row_f16_rounded(t).into_iter().map(f64::from));
    }
    x
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `s = x·Wᵀ/τ` for f64 copies of `w` `[vocab][hs]` and `x` `[ntok][hs]`.
/// `x·Wᵀ·scale` in f64.
fn logits_of(w: &[f64], x: &[f64], vocab: usize, hs: usize, scale: f64) -> Vec<f64> {
    let ntok = x.len() / hs;
    let inv_tau = scale;
    let mut s = vec![0f64; ntok * vocab];
    // Split over flattened (token, vocab) pairs so one token still uses both threads.
    let parts = par::map_ranges(ntok * vocab, ntok * vocab * hs, |range| {
        range
            .map(|i| {
                let (t, j) = (i / vocab, i % vocab);
                dot(&x[t * hs..(t + 1) * hs], &w[j * hs..(j + 1) * hs]) * inv_tau
            })
            .collect::<Vec<f64>>()
    });
    for (range, values) in parts {
        s[range].copy_from_slice(&values);
    }
    s
}

fn check_hs(head: &HeadWeights<'_>, hidden: &Hidden<'_>) {
    assert_eq!(
        head.hs(),
        hidden.hs(),
        "direct: the head has hs = {} but the hidden rows have hs = {}",
        head.hs(),
        hidden.hs()
    );
}

/// Student logits `s = x·Wᵀ/τ` `[ntok][V]`, in f64 on the f16-rounded head
/// and rows.
pub fn logits_f64(head: &HeadWeights<'_>, hidden: &Hidden<'_>, temperature: f32) -> Vec<f64> {
    check_hs(head, hidden);
    logits_of(
        &head_f64(head),
        &hidden_f64(hidden),
        head.vocab(),
        head.hs(),
        1.0 / f64::from(temperature),
    )
}

/// `logsumexp` of a row, or NaN when any value is not finite.
fn logsumexp(row: &[f64]) -> f64 {
    if row.iter().any(|v| !v.is_finite()) {
        return f64::NAN;
    }
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    m + row.iter().map(|&v| (v - m).exp()).sum::<f64>().ln()
}

/// The distillation loss of DESIGN §1 with the README's loss terms, in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct DirectLoss {
    /// Per-token loss `L_t` `[ntok]`, unweighted.
    pub loss: Vec<f64>,
    /// `Σ w_t L_t / total`.
    pub mean: f64,
    /// `∂mean/∂x` `[ntok][hs]`.
    pub dx: Vec<f64>,
    /// Per-token `lse(z̃)` at τ = 1 `[ntok]`.
    pub lse: Vec<f64>,
    /// Per-token soft term `[ntok]`.
    pub soft: Vec<f64>,
    /// Per-token hard term `[ntok]` (0 without a label or a hard term).
    pub hard: Vec<f64>,
}

impl DirectLoss {
    /// Just the per-token losses and their mean (as a kernel check needs).
    pub fn of_losses(loss: Vec<f64>) -> Self {
        let n = loss.len().max(1) as f64;
        Self {
            mean: loss.iter().sum::<f64>() / n,
            loss,
            dx: Vec::new(),
            lse: Vec::new(),
            soft: Vec::new(),
            hard: Vec::new(),
        }
    }
}

/// One token's loss terms and `∂L_t/∂s`, the gradient with respect to
/// the scaled logits `s = z/τ` the device holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowTerms {
    /// `L_t = α_soft·soft + α_hard·hard + λ·lse²`.
    pub loss: f64,
    /// `lse(z̃)` at τ = 1.
    pub lse: f64,
    /// `L_soft`.
    pub soft: f64,
    /// `L_hard` (0 without a label or a hard term).
    pub hard: f64,
    /// `∂L_t/∂s_j` `[V]`.
    pub grad: Vec<f64>,
}

/// The teacher's k entries of one token as the soft term reads them.
#[derive(Clone, Copy, Debug)]
pub struct RowTeacher<'a> {
    /// Ids, distinct and `< V`.
    pub ids: &'a [u32],
    /// Probabilities (renormalized in [`TailMode::Renormalize`]).
    pub probs: &'a [f32],
    /// How the mass outside the k is read.
    pub tail: TailMode,
}

/// One token's terms, straight from the README's formulas in f64, on the
/// scaled logits `s = z/τ` `[V]`: `z̃ = c·tanh(z/c)` (so `z̃/τ =
/// (c/τ)·tanh(s/(c/τ))`), `log p^τ = z̃/τ − lse(z̃/τ)`, `log p¹ = z̃ −
/// lse(z̃)`; the soft term against the teacher in its tail mode (the
/// bucket's student mass `r_S` summed over the ids outside the k, exactly),
/// the hard term against `label` ([`NO_LABEL`]: none) with label smoothing,
/// the z-loss. A row with a non-finite logit gives NaN everywhere.
pub fn row_terms_f64(s: &[f64], teacher: RowTeacher<'_>, label: u32, temperature: f32, terms: &LossTerms) -> RowTerms {
    let vocab = s.len();
    if s.iter().any(|v| !v.is_finite()) {
        return RowTerms {
            loss: f64::NAN,
            lse: f64::NAN,
            soft: f64::NAN,
            hard: f64::NAN,
            grad: vec![f64::NAN; vocab],
        };
    }
    let tau = f64::from(temperature);
    // u = z̃/τ and du/ds.
    let (u, dcap): (Vec<f64>, Vec<f64>) = match terms.softcap {
        None => (s.to_vec(), vec![1.0; vocab]),
        Some(c) => {
            let c = f64::from(c) / tau;
            s.iter()
                .map(|&x| {
                    let t = (x / c).tanh();
                    (c * t, 1.0 - t * t)
                })
                .unzip()
        }
    };
    let lse_tau = logsumexp(&u);
    let p_tau: Vec<f64> = u.iter().map(|&v| (v - lse_tau).exp()).collect();
    let v1: Vec<f64> = u.iter().map(|&v| v * tau).collect();
    let lse1 = logsumexp(&v1);
    let p1: Vec<f64> = v1.iter().map(|&v| (v - lse1).exp()).collect();

    // Soft term and its factors on p^τ off and on the teacher's ids.
    let mut in_ids = vec![false; vocab];
    let mut p_teacher = vec![0f64; vocab];
    let mut soft = 0f64;
    let mut mass = 0f64;
    for (&id, &p) in teacher.ids.iter().zip(teacher.probs) {
        let p = f64::from(p);
        in_ids[id as usize] = true;
        p_teacher[id as usize] = p;
        mass += p;
        if p > 0.0 {
            soft += p * (p.ln() - (u[id as usize] - lse_tau));
        }
    }
    let r_s: f64 = (0..vocab)
        .filter(|&j| !in_ids[j])
        .map(|j| p_tau[j])
        .sum::<f64>()
        .max(headkl_core::PROB_FLOOR);
    let divergence = terms.divergence.effective();
    // Reverse KL and JSD: `d_soft[j]` is the whole ∂L_soft/∂u_j.
    let mut d_soft_div: Option<Vec<f64>> = None;
    let (f_off, f_on) = if divergence != Divergence::Forward {
        let (loss, grad) = divergence_f64(divergence, teacher, &p_tau, r_s, mass);
        soft = loss;
        d_soft_div = Some(grad);
        (0.0, 0.0)
    } else {
        match teacher.tail {
            TailMode::Renormalize => (1.0, 1.0),
            TailMode::Unnormalized => (mass, mass),
            TailMode::Bucket => {
                let r_t = (1.0 - mass).max(0.0);
                if r_t > 0.0 {
                    soft += r_t * (r_t.ln() - r_s.ln());
                    (1.0 - r_t / r_s, 1.0)
                } else {
                    (1.0, 1.0)
                }
            }
        }
    };

    let labelled = terms.hard_on() && label != NO_LABEL;
    let (alpha_hard, eps) = if labelled {
        (f64::from(terms.hard_weight), f64::from(terms.label_smoothing))
    } else {
        (0.0, 0.0)
    };
    let hard = if labelled {
        let mean_v = v1.iter().sum::<f64>() / vocab as f64;
        lse1 - (1.0 - eps) * v1[label as usize] - eps * mean_v
    } else {
        0.0
    };
    let (alpha_soft, lambda) = (f64::from(terms.soft_weight), f64::from(terms.z_loss));
    let loss = alpha_soft * soft + alpha_hard * hard + lambda * lse1 * lse1;
    let grad = (0..vocab)
        .map(|j| {
            let f = if in_ids[j] { f_on } else { f_off };
            let d_soft = match &d_soft_div {
                Some(g) => g[j],
                None => f * p_tau[j] - p_teacher[j],
            };
            let onehot = if labelled && j == label as usize { 1.0 } else { 0.0 };
            let d_hard = p1[j] - (1.0 - eps) * onehot - eps / vocab as f64;
            let d_z = 2.0 * lambda * lse1 * p1[j];
            dcap[j] * (alpha_soft * d_soft + tau * (alpha_hard * d_hard + d_z))
        })
        .collect();
    RowTerms {
        loss,
        lse: lse1,
        soft,
        hard,
        grad,
    }
}

/// The reverse KL or the JSD of one token over its bins (DESIGN §1), in
/// f64 from the definitions: the student's bins `q` (`p_S` at the k, the
/// tail `r_S` in bucket mode; over the k renormalized to 1 in renormalize
/// mode), the teacher's `t` (its tail `1 − Σ_k p_T`), `L = Σ_bins f(q, t)`
/// and, by the chain rule through the softmax, `∂L/∂u_j = Σ_i f'_i ∂q_i/∂u_j`.
/// Returns the loss and `∂L/∂u` `[V]`.
fn divergence_f64(divergence: Divergence, teacher: RowTeacher<'_>, p: &[f64], r_s: f64, mass: f64) -> (f64, Vec<f64>) {
    let vocab = p.len();
    let renormalize = teacher.tail == TailMode::Renormalize;
    let norm: f64 = if renormalize {
        teacher.ids.iter().map(|&id| p[id as usize]).sum()
    } else {
        1.0
    };
    // (f, f') of one bin.
    let bin = |q: f64, t: f64| -> (f64, f64) {
        match divergence {
            Divergence::Reverse if q > 0.0 => {
                let r = (q / t.max(headkl_core::PROB_FLOOR)).ln();
                (q * r, r + 1.0)
            }
            Divergence::Reverse => (0.0, 0.0),
            _ => {
                let beta = f64::from(divergence.beta());
                let m = beta * t + (1.0 - beta) * q;
                let teacher_side = if t > 0.0 { beta * t * (t / m).ln() } else { 0.0 };
                let (student_side, slope) = if q > 0.0 {
                    ((1.0 - beta) * q * (q / m).ln(), (1.0 - beta) * (q / m).ln())
                } else {
                    (0.0, 0.0)
                };
                (teacher_side + student_side, slope)
            }
        }
    };
    let mut loss = 0.0;
    // ∂L/∂q per bin: the k, then the tail (bucket mode).
    let mut slopes = Vec::with_capacity(teacher.ids.len());
    for (&id, &t) in teacher.ids.iter().zip(teacher.probs) {
        let (f, slope) = bin(p[id as usize] / norm, f64::from(t));
        loss += f;
        slopes.push(slope);
    }
    let tail_slope = if teacher.tail == TailMode::Bucket {
        let (f, slope) = bin(r_s, (1.0 - mass).max(0.0));
        loss += f;
        slope
    } else {
        0.0
    };
    // Renormalized, ∂q_i/∂u_j = q_i(δ_ij − q_j) for j in the k and 0
    // outside; otherwise ∂p_i/∂u_j = p_i(δ_ij − p_j) and ∂r_S/∂u_j =
    // p_j([j ∉ k] − r_S).
    let mut grad = vec![0f64; vocab];
    let in_k: Vec<Option<usize>> = {
        let mut at = vec![None; vocab];
        for (q, &id) in teacher.ids.iter().enumerate() {
            at[id as usize] = Some(q);
        }
        at
    };
    let q_of = |j: usize| p[j] / norm;
    let e_k: f64 = teacher
        .ids
        .iter()
        .zip(&slopes)
        .map(|(&id, s)| q_of(id as usize) * s)
        .sum();
    for (j, g) in grad.iter_mut().enumerate() {
        *g = if renormalize {
            match in_k[j] {
                Some(q) => q_of(j) * (slopes[q] - e_k),
                None => 0.0,
            }
        } else {
            let own = match in_k[j] {
                Some(q) => p[j] * slopes[q],
                None => 0.0,
            };
            let tail = if teacher.tail == TailMode::Bucket {
                tail_slope * p[j] * (f64::from(u8::from(in_k[j].is_none())) - r_s)
            } else {
                0.0
            };
            own - p[j] * e_k + tail
        };
    }
    (loss, grad)
}

/// The loss, its mean and its input gradient, straight from DESIGN §1 and
/// the README's loss terms:
///
/// ```text
/// L_t  = α_soft·L_soft + α_hard·L_hard + λ·lse(z̃)²     (row_terms_f64)
/// mean = Σ_t w_t L_t / total
/// dx_t = (w_t·S / (τ·total)) · Σ_j ∂L_t/∂s_j · W_j     (s = S·x·Wᵀ/τ)
/// ```
///
/// With the default terms `L_t = Σ_k p_T,k · (log p_T,k − log p_S,id_k)`
/// and `∂L_t/∂s_j = p_S,j − p_T,j`. The teacher's probabilities are the
/// f32 values the device receives; weights, total, τ, labels and terms
/// come from `resolved` (`gscale` plays no part: it only protects the
/// device's f16 gradient). A token whose logits are not finite gets NaN
/// loss and gradient.
pub fn head_kl_f64(
    head: &HeadWeights<'_>,
    hidden: &Hidden<'_>,
    teacher: &Teacher,
    resolved: &ResolvedLoss,
) -> DirectLoss {
    head_kl_of(head, hidden, teacher, resolved, false).0
}

/// [`head_kl_f64`] and the head's gradient `∂mean/∂W` `[V][hs]` (what
/// `LossConfig::head_grad` asks of a backend), from the same per-token
/// `∂L_t/∂s_j` and the same coefficient as dx:
///
/// ```text
/// dW_j = Σ_t (w_t·S / (τ·total)) · ∂L_t/∂s_j · x_t
/// ```
///
/// with `x_t` the f16-rounded hidden row. A token whose loss is not finite
/// (its dx row is NaN) makes every element of dW NaN, whatever its weight:
/// every row of the head meets it. It costs about as much again as
/// [`head_kl_f64`] (one more O(ntok·V·hs) pass), so only the callers that
/// check the head's gradient pay for it.
pub fn head_kl_and_head_grad_f64(
    head: &HeadWeights<'_>,
    hidden: &Hidden<'_>,
    teacher: &Teacher,
    resolved: &ResolvedLoss,
) -> (DirectLoss, Vec<f64>) {
    head_kl_of(head, hidden, teacher, resolved, true)
}

/// [`head_kl_f64`], and with `head_grad` the head's gradient (else an
/// empty vector).
fn head_kl_of(
    head: &HeadWeights<'_>,
    hidden: &Hidden<'_>,
    teacher: &Teacher,
    resolved: &ResolvedLoss,
    head_grad: bool,
) -> (DirectLoss, Vec<f64>) {
    check_hs(head, hidden);
    let (vocab, hs, ntok, k) = (head.vocab(), head.hs(), hidden.ntok(), teacher.k());
    assert_eq!(
        teacher.ntok(),
        ntok,
        "direct: teacher has {} rows, hidden {ntok}",
        teacher.ntok()
    );
    assert_eq!(
        resolved.weights.len(),
        ntok,
        "direct: {} weights for {ntok} tokens",
        resolved.weights.len()
    );
    let w = head_f64(head);
    let x = hidden_f64(hidden);
    let total = f64::from(resolved.total);
    let tau = f64::from(resolved.temperature);
    // z = S·x·Wᵀ: s = z/τ, and ds/dx (and ds/dW) carries S/τ.
    let scale = f64::from(resolved.terms.logit_scale);
    let s = logits_of(&w, &x, vocab, hs, scale / tau);
    // dx's (and dW's) coefficient of token t.
    let coef: Vec<f64> = resolved
        .weights
        .iter()
        .map(|&wt| f64::from(wt) * scale / (tau * total))
        .collect();

    // Each token's row of (terms, dx) is independent: split tokens over threads.
    let mut rows: Vec<(RowTerms, Vec<f64>)> = vec![(RowTerms::default(), Vec::new()); ntok];
    par::for_row_blocks(&mut rows, 1, ntok * vocab * hs, |first, block| {
        for (i, (terms_t, dx_t)) in block.iter_mut().enumerate() {
            let t = first + i;
            let row_teacher = RowTeacher {
                ids: &teacher.ids()[t * k..(t + 1) * k],
                probs: &teacher.probs()[t * k..(t + 1) * k],
                tail: teacher.tail(),
            };
            let label = resolved.labels.get(t).copied().unwrap_or(NO_LABEL);
            let row = &s[t * vocab..(t + 1) * vocab];
            let r = row_terms_f64(row, row_teacher, label, resolved.temperature, &resolved.terms);
            let mut g = vec![0f64; hs];
            if !r.loss.is_finite() {
                g.fill(f64::NAN);
            } else if coef[t] != 0.0 {
                for (j, &d) in r.grad.iter().enumerate() {
                    for (gc, &wc) in g.iter_mut().zip(&w[j * hs..(j + 1) * hs]) {
                        *gc += d * wc;
                    }
                }
                g.iter_mut().for_each(|v| *v *= coef[t]);
            }
            *dx_t = g;
            *terms_t = r;
        }
    });
    let dw = if head_grad {
        head_grad_of(&rows, &coef, &x, vocab, hs)
    } else {
        Vec::new()
    };
    let mut out = DirectLoss {
        loss: Vec::with_capacity(ntok),
        mean: 0.0,
        dx: Vec::with_capacity(ntok * hs),
        lse: Vec::with_capacity(ntok),
        soft: Vec::with_capacity(ntok),
        hard: Vec::with_capacity(ntok),
    };
    for (r, g) in rows {
        out.loss.push(r.loss);
        out.lse.push(r.lse);
        out.soft.push(r.soft);
        out.hard.push(r.hard);
        out.dx.extend(g);
    }
    out.mean = out
        .loss
        .iter()
        .zip(&resolved.weights)
        .map(|(&l, &wt)| if wt == 0.0 { 0.0 } else { l * f64::from(wt) })
        .sum::<f64>()
        / total;
    (out, dw)
}

/// `dW_j = Σ_t coef_t · ∂L_t/∂s_j · x_t` `[vocab][hs]` from each token's
/// terms (`rows`), split over the head's rows. A token with a non-finite
/// loss has a NaN gradient in every column, so it turns every row NaN,
/// masked or not (`0 · NaN` is NaN), as its dx row is NaN.
fn head_grad_of(rows: &[(RowTerms, Vec<f64>)], coef: &[f64], x: &[f64], vocab: usize, hs: usize) -> Vec<f64> {
    let mut dw = vec![0f64; vocab * hs];
    if hs == 0 {
        return dw;
    }
    par::for_row_blocks(&mut dw, hs, rows.len() * vocab * hs, |first, block| {
        for (t, ((r, _), &c)) in rows.iter().zip(coef).enumerate() {
            let finite = r.loss.is_finite();
            if finite && c == 0.0 {
                continue;
            }
            let x_t = &x[t * hs..(t + 1) * hs];
            for (i, dw_j) in block.chunks_exact_mut(hs).enumerate() {
                let a = if finite { c * r.grad[first + i] } else { f64::NAN };
                if a != 0.0 {
                    for (o, &xc) in dw_j.iter_mut().zip(x_t) {
                        *o += a * xc;
                    }
                }
            }
        }
    });
    dw
}

/// The dense teacher of the full-vocabulary divergence as a top-k teacher
/// at k = V: every id in order and `softmax(x_T·W_Tᵀ/τ)` in f64, rounded
/// to f32 (`[ntok][V]` each). DESIGN §1 defines the full-vocabulary mode as
/// the top-k mode at k = V, so this is its reference teacher.
pub fn dense_teacher_f64(head: &HeadWeights<'_>, hidden: &Hidden<'_>, temperature: f32) -> (Vec<u32>, Vec<f32>) {
    let vocab = head.vocab();
    let t = logits_f64(head, hidden, temperature);
    let mut probs = Vec::with_capacity(t.len());
    for row in t.chunks_exact(vocab) {
        let lse = logsumexp(row);
        probs.extend(row.iter().map(|&v| (v - lse).exp() as f32));
    }
    let ids = (0..hidden.ntok()).flat_map(|_| 0..vocab as u32).collect();
    (ids, probs)
}

/// The exact full-vocabulary divergence in f64: [`head_kl_f64`] against
/// [`dense_teacher_f64`] in renormalize mode (k = V); `teacher` is the teacher's
/// head and its hidden rows.
pub fn head_kl_full_vocab_f64(
    head: &HeadWeights<'_>,
    hidden: &Hidden<'_>,
    (teacher_head, teacher_hidden): (&HeadWeights<'_>, &Hidden<'_>),
    resolved: &ResolvedLoss,
) -> DirectLoss {
    full_vocab_of(head, hidden, (teacher_head, teacher_hidden), resolved, false).0
}

/// [`head_kl_full_vocab_f64`] and the head's gradient, as
/// [`head_kl_and_head_grad_f64`] gives it (the teacher's head gets none).
pub fn head_kl_full_vocab_and_head_grad_f64(
    head: &HeadWeights<'_>,
    hidden: &Hidden<'_>,
    (teacher_head, teacher_hidden): (&HeadWeights<'_>, &Hidden<'_>),
    resolved: &ResolvedLoss,
) -> (DirectLoss, Vec<f64>) {
    full_vocab_of(head, hidden, (teacher_head, teacher_hidden), resolved, true)
}

fn full_vocab_of(
    head: &HeadWeights<'_>,
    hidden: &Hidden<'_>,
    (teacher_head, teacher_hidden): (&HeadWeights<'_>, &Hidden<'_>),
    resolved: &ResolvedLoss,
    head_grad: bool,
) -> (DirectLoss, Vec<f64>) {
    let (vocab, ntok) = (head.vocab(), hidden.ntok());
    assert_eq!(teacher_head.vocab(), vocab, "direct: the heads' vocabularies differ");
    assert_eq!(
        teacher_hidden.ntok(),
        ntok,
        "direct: the hidden rows' token counts differ"
    );
    let (ids, probs) = dense_teacher_f64(teacher_head, teacher_hidden, resolved.temperature);
    let teacher =
        Teacher::new(&ids, &probs, ntok, vocab, vocab).expect("direct: the dense teacher is a valid top-k teacher");
    head_kl_of(head, hidden, &teacher, resolved, head_grad)
}

/// The teacher's exact top-k in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct DirectTopK {
    /// Ids `[ntok][k]`: descending logit, ties lowest id first.
    pub ids: Vec<u32>,
    /// Softmax over the k `[ntok][k]`.
    pub probs: Vec<f64>,
    /// All logits `s = x·Wᵀ/τ` `[ntok][V]` (for the tie rule).
    pub logits: Vec<f64>,
    /// Tokens.
    pub ntok: usize,
    /// Entries per row.
    pub k: usize,
}

impl DirectTopK {
    /// Vocabulary size (the logits' row length).
    pub fn vocab(&self) -> usize {
        self.logits.len().checked_div(self.ntok).unwrap_or(0)
    }
}

/// The order of top-k: larger logit first, then the lower id. `-0.0` and
/// `0.0` tie; NaN sorts first so a poisoned row is visible.
pub fn topk_order(a: (f64, u32), b: (f64, u32)) -> Ordering {
    (b.0 + 0.0).total_cmp(&(a.0 + 0.0)).then(a.1.cmp(&b.1))
}

/// Indices of the `k` largest of `row` in [`topk_order`].
pub fn topk_of_row(row: &[f64], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| topk_order((row[*a as usize], *a), (row[*b as usize], *b));
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.truncate(k);
    idx.sort_unstable_by(cmp);
    idx
}

/// Softmax of `row` restricted to `ids`, in f64.
pub fn softmax_over(row: &[f64], ids: &[u32]) -> Vec<f64> {
    let m = ids.iter().map(|&i| row[i as usize]).fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = ids.iter().map(|&i| (row[i as usize] - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|v| v / z).collect()
}

/// `log_softmax(s)` over the full vocabulary at `ids` `[ntok][k]` (a
/// negative id: `-inf`), and each row's lse, with `s = x·Wᵀ/τ` in f64:
/// what `Engine::logprobs_at` computes (no softcap).
pub fn logprobs_at_f64(
    head: &HeadWeights<'_>,
    hidden: &Hidden<'_>,
    ids: &[i64],
    k: usize,
    temperature: f32,
) -> (Vec<f64>, Vec<f64>) {
    let vocab = head.vocab();
    let s = logits_f64(head, hidden, temperature);
    let mut logprobs = Vec::with_capacity(ids.len());
    let mut lse = Vec::with_capacity(hidden.ntok());
    for (t, row) in s.chunks_exact(vocab).enumerate() {
        let row_lse = logsumexp(row);
        lse.push(row_lse);
        logprobs.extend(ids[t * k..(t + 1) * k].iter().map(|&id| match usize::try_from(id) {
            Ok(j) => row[j] - row_lse,
            Err(_) => f64::NEG_INFINITY,
        }));
    }
    (logprobs, lse)
}

/// The exact top-k of `s = x·Wᵀ/τ` per row (descending logit, ties lowest
/// id first) and the softmax over those k.
pub fn topk_f64(head: &HeadWeights<'_>, hidden: &Hidden<'_>, k: usize, temperature: f32) -> DirectTopK {
    let vocab = head.vocab();
    assert!(k >= 1 && k <= vocab, "direct: k = {k} must be in 1..={vocab}");
    let logits = logits_f64(head, hidden, temperature);
    let ntok = hidden.ntok();
    let mut ids = Vec::with_capacity(ntok * k);
    let mut probs = Vec::with_capacity(ntok * k);
    for t in 0..ntok {
        let row = &logits[t * vocab..(t + 1) * vocab];
        let top = topk_of_row(row, k);
        probs.extend(softmax_over(row, &top));
        ids.extend(top);
    }
    DirectTopK {
        ids,
        probs,
        logits,
        ntok,
        k,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_of_row_breaks_ties_by_lowest_id() {
        let row = [1.0, 3.0, 3.0, -0.0, 0.0, 3.0];
        assert_eq!(topk_of_row(&row, 4), vec![1, 2, 5, 0]);
        assert_eq!(topk_of_row(&row, 6), vec![1, 2, 5, 0, 3, 4]);
        assert_eq!(topk_of_row(&row, 1), vec![1]);
    }

    #[test]
    fn softmax_over_sums_to_one() {
        let p = softmax_over(&[0.0, 1.0, 2.0], &[2, 0]);
        assert!((p[0] + p[1] - 1.0).abs() < 1e-15);
        assert!((p[0] / p[1] - 2f64.exp()).abs() < 1e-12);
    }
}
