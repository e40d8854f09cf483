// Part of the KL row kernel (assembled in kl_rows_state.wgsl's order): the
// divergence terms, τ's powers and pass 1's running folds (max, Σ exp and
// the terms' sums).


fn non_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) >= 0x7f800000u;
}

fn nan_f32() -> f32 {
    return bitcast<f32>(0x7fc00000u);
}

fn div_code() -> u32 {
    return (KL_FLAGS >> F_DIV_SHIFT) & 3u;
}

// One bin of the reverse KL or the JSD (DESIGN §1): (f, f') at the
// student's share q (log_q its log) and the teacher's t. A bin the student
// gives nothing adds nothing (its gradient carries the factor q).
fn div_term(q: f32, log_q: f32, t: f32) -> vec2<f32> {
    if div_code() == DIV_REVERSE {
        if q > 0.0 {
            let r = log_q - log(max(t, TAIL_FLOOR));
            return vec2<f32>(q * r, r + 1.0);
        }
        return vec2<f32>(0.0);
    }
    let beta = params.beta;
    let m = beta * t + (1.0 - beta) * q;
    var out = vec2<f32>(0.0);
    if t > 0.0 {
        out.x = beta * t * (log(t) - log(m));
    }
    if q > 0.0 {
        let r = log_q - log(m);
        out.x += (1.0 - beta) * q * r;
        out.y = (1.0 - beta) * r;
    }
    return out;
}

// The soft term's ∂/∂s at a teacher column (capped logit u, p^τ = pt,
// the teacher's p_t): f_on·p^τ − p_T forward, else q·(f'(q, t) − E).
fn soft_on(u: f32, pt: f32, p_t: f32, lse: f32, f_on: f32) -> f32 {
    if div_code() == 0u {
        return f_on * pt - p_t;
    }
    let log_q = u - lse - row_div.y;
    let q = exp(log_q);
    return q * (div_term(q, log_q, p_t).y - row_div.x);
}

// Logit `j` of the row starting at element `base` (a multiple of 4).
fn logit(base: u32, j: u32) -> f32 {
    return logits[(base + j) / 4u][j % 4u];
}

// (c·tanh(x/c), its slope 1 − tanh²), with `inv_c` = 1/c (uniform, so
// computed once): the builtin tanh and multiplies, no division per logit.
fn capped(x: f32, c: f32, inv_c: f32) -> vec2<f32> {
    let t = tanh(x * inv_c);
    return vec2<f32>(c * t, 1.0 - t * t);
}

// τ when it is 2, 3 or 4 (then e¹ = (e^τ)^τ by multiplication), else 0.
fn tau_pow() -> u32 {
    return (KL_FLAGS >> F_TAU_POW_SHIFT) & F_TAU_POW_MASK;
}

// e^n for the small integer n = tau_pow(), straight-line (a loop here
// left the general loops' words in local memory on the H200).
fn pow_tau(e: f32) -> f32 {
    let e2 = e * e;
    if tau_pow() == 3u {
        return e2 * e;
    }
    if tau_pow() == 4u {
        return e2 * e2;
    }
    return e2;
}

// Logit x as the loss reads it, and d/dx: capped when the softcap is on.
fn scaled2(x: f32) -> vec2<f32> {
    if (KL_FLAGS & F_SOFTCAP) != 0u {
        return capped(x, params.cap, 1.0 / params.cap);
    }
    return vec2<f32>(x, 1.0);
}

fn scaled(x: f32) -> f32 {
    return scaled2(x).x;
}

// Folds x into the running (max, sum of exp(x - max)).
fn fold(ms: vec2<f32>, x: f32) -> vec2<f32> {
    if x > ms.x {
        return vec2<f32>(x, ms.y * exp(ms.x - x) + 1.0);
    }
    return vec2<f32>(ms.x, ms.y + exp(x - ms.x));
}

// Pass 1's running fold: the capped logits u at τ (max m, Σ exp(u − m)),
// at τ = 1 (Σ exp(τ(u − m)): the same max, scaled by τ), Σ u, and whether
// a non-finite logit was seen. The plain fold keeps m, s and bad alone.
struct FoldTerms {
    m: f32,
    s: f32,
    s1: f32,
    sum_u: f32,
    bad: u32,
}

// Folds u with one exponential, exp(−|u − m|), whichever side of the max
// u falls (and, for integer τ, none more for the τ = 1 sum).
fn fold_u(st: FoldTerms, u: f32) -> FoldTerms {
    var out = st;
    let d = u - st.m;
    let e = exp(-abs(d));
    var e1 = e;
    if (KL_FLAGS & F_TAU) != 0u {
        if tau_pow() != 0u {
            e1 = pow_tau(e);
        } else {
            e1 = exp(-abs(d) * params.temperature);
        }
    }
    if d > 0.0 {
        out.m = u;
        out.s = st.s * e + 1.0;
        out.s1 = st.s1 * e1 + 1.0;
    } else {
        out.s = st.s + e;
        out.s1 = st.s1 + e1;
    }
    out.sum_u += u;
    return out;
}

// Folds logit x when `live` (below vocab); a non-finite one only flags.
fn fold_x(st: FoldTerms, x: f32, live: bool) -> FoldTerms {
    var out = st;
    if live {
        if non_finite(x) {
            out.bad = 1u;
        } else {
            out = fold_u(out, scaled(x));
        }
    }
    return out;
}

// Folds the logits of word j4 (those past vocab skipped), straight-line.
fn fold4_terms(st: FoldTerms, x4: vec4<f32>, j4: u32, vocab: u32) -> FoldTerms {
    let j = j4 * 4u;
    var out = fold_x(st, x4.x, j < vocab);
    out = fold_x(out, x4.y, j + 1u < vocab);
    out = fold_x(out, x4.z, j + 2u < vocab);
    return fold_x(out, x4.w, j + 3u < vocab);
}

// Folds the logits of word j4 (4 logits; those past vocab skipped): with
// `terms`, fold4_terms; else the plain fold, of (m, s) and bad alone.
fn fold4(st: FoldTerms, x4: vec4<f32>, j4: u32, vocab: u32, terms: bool) -> FoldTerms {
    if terms {
        return fold4_terms(st, x4, j4, vocab);
    }
    var out = st;
    var ms = vec2<f32>(st.m, st.s);
    for (var c = 0u; c < 4u; c++) {
        let x = x4[c];
        if j4 * 4u + c >= vocab {
            break;
        }
        if non_finite(x) {
            out.bad = 1u;
        } else {
            ms = fold(ms, x);
        }
    }
    out.m = ms.x;
    out.s = ms.y;
    return out;
}

// Merges two (max, sum of exp(x - max)) pairs.
fn merge(m1: f32, s1: f32, m2: f32, s2: f32) -> vec2<f32> {
    let m = max(m1, m2);
    return vec2<f32>(m, s1 * exp(m1 - m) + s2 * exp(m2 - m));
}


// How reduce_folds combines red_aux: left alone, summed, or rescaled with
// (red_max, red_sum) as fold_w's weighted sum.
const AUX_NONE: u32 = 0u;
const AUX_SUM: u32 = 1u;
const AUX_WEIGHTED: u32 = 2u;

// Reduces the workgroup's (red_max, red_sum) as (max, sum) pairs (merge),
// red_bad by or, red_aux as `aux` says and, with `tau1`, (red_max1,
// red_sum1) as pairs too; `aux` and `tau1` are constants at each call.
// Every invocation calls it: it holds barriers.
fn reduce_folds(lid: u32, aux: u32, tau1: bool) {
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride {
            let o = lid + stride;
            let m = max(red_max[lid], red_max[o]);
            let fa = exp(red_max[lid] - m);
            let fb = exp(red_max[o] - m);
            red_max[lid] = m;
            red_sum[lid] = red_sum[lid] * fa + red_sum[o] * fb;
            if aux == AUX_WEIGHTED {
                red_aux[lid] = red_aux[lid] * fa + red_aux[o] * fb;
            } else if aux == AUX_SUM {
                red_aux[lid] += red_aux[o];
            }
            red_bad[lid] |= red_bad[o];
            if tau1 {
                let r1 = merge(red_max1[lid], red_sum1[lid], red_max1[o], red_sum1[o]);
                red_max1[lid] = r1.x;
                red_sum1[lid] = r1.y;
            }
        }
        workgroupBarrier();
    }
}
