// Part of the KL row kernel (assembled in kl_rows_state.wgsl's order):
// pass 2's gradient expressions, four logits at a time, plain and with the
// terms.


// c * p_S for word j4's 4 logits, zero past vocab (f32: the filtered pass
// also tests it against ε).
fn grad4_f32(x4: vec4<f32>, j4: u32, vocab: u32, c: f32, lse: f32) -> vec4<f32> {
    var g = vec4<f32>(0.0);
    for (var e = 0u; e < 4u; e++) {
        if j4 * 4u + e < vocab {
            g[e] = c * exp(x4[e] - lse);
        }
    }
    return g;
}

fn grad4(x4: vec4<f32>, j4: u32, vocab: u32, c: f32, lse: f32) -> vec4<f16> {
    return vec4<f16>(grad4_f32(x4, j4, vocab, c, lse));
}

// p¹ = softmax at τ = 1 of the capped logit u, given p^τ = pt: for
// integer τ, pt^τ·exp(τ·lse − lse1) (`k1`, once a row), no exponential.
fn p_one(u: f32, pt: f32, lse1: f32, k1: f32) -> f32 {
    if (KL_FLAGS & F_TAU) == 0u {
        return pt;
    }
    if tau_pow() != 0u {
        return pow_tau(pt) * k1;
    }
    return exp(u * params.temperature - lse1);
}

// The row's constants of pass 2 in the general case.
struct Pass2 {
    c: f32,
    lse: f32,
    // a, b, h: ∂L/∂s_j = cap'·(a·p^τ + b·p¹ − h) off the teacher's ids
    // and the label.
    a: f32,
    b: f32,
    h: f32,
    lse1: f32,
    k1: f32,
}

// c·∂L/∂s for logit x in the general case.
fn grad_x(x: f32, r: Pass2) -> f32 {
    let us = scaled2(x);
    let pt = exp(us.x - r.lse);
    var d = 0.0;
    if (KL_FLAGS & F_TAU) == 0u {
        // p¹ = p^τ: one coefficient.
        d = (r.a + r.b) * pt - r.h;
    } else {
        d = r.a * pt + r.b * p_one(us.x, pt, r.lse1, r.k1) - r.h;
    }
    return r.c * us.y * d;
}

// c·∂L/∂s for word j4's 4 logits in the general case, zero past vocab
// (straight-line: all four computed, the padding's discarded).
fn grad4_terms_f32(x4: vec4<f32>, j4: u32, vocab: u32, r: Pass2) -> vec4<f32> {
    let g = vec4<f32>(grad_x(x4.x, r), grad_x(x4.y, r), grad_x(x4.z, r), grad_x(x4.w, r));
    let j = j4 * 4u;
    let live = vec4<bool>(j < vocab, j + 1u < vocab, j + 2u < vocab, j + 3u < vocab);
    return select(vec4<f32>(0.0), g, live);
}

fn grad4_terms(x4: vec4<f32>, j4: u32, vocab: u32, r: Pass2) -> vec4<f16> {
    return vec4<f16>(grad4_terms_f32(x4, j4, vocab, r));
}

// Pass 2's constants with the terms: Pass2, and the general fold's words
// (row_c0, row_c1; row_label_p the teacher's probability at the label, or
// -1 when the label is not among the k).
struct TermsRow {
    r: Pass2,
    c0: vec4<f32>,
    c1: vec4<f32>,
    label_p: f32,
}

// The row's TermsRow for scale c and lse; every invocation calls it (it
// reads workgroup memory uniformly).
fn terms_row(c: f32, lse: f32) -> TermsRow {
    let c0 = workgroupUniformLoad(&row_c0);
    let c1 = workgroupUniformLoad(&row_c1);
    let label_p = workgroupUniformLoad(&row_label_p);
    return TermsRow(Pass2(c, lse, c0.x, c0.y, c0.z, c1.y, c1.w), c0, c1, label_p);
}

// c·∂L/∂s at a column (logit x) in the general case: cap'·(α_soft·(f_on·p^τ
// − p_T) + b·p¹ − h − one_hot). `p_t` is the teacher's probability there
// when `in_topk`; a column outside the k has c0.x·p^τ for its soft part.
// `one_hot` is c1.x at the label's column, else 0.
fn column_grad(x: f32, in_topk: bool, p_t: f32, one_hot: f32, t: TermsRow) -> f32 {
    let us = scaled2(x);
    let pt = exp(us.x - t.r.lse);
    var p1 = pt;
    if (KL_FLAGS & F_TAU) != 0u {
        p1 = exp(us.x * params.temperature - t.c1.y);
    }
    var d = t.c0.x * pt;
    if in_topk {
        d = params.soft_weight * soft_on(us.x, pt, p_t, t.r.lse, t.c0.w);
    }
    d += t.c0.y * p1 - t.c0.z - one_hot;
    return t.r.c * us.y * d;
}

// c·∂L/∂s at a teacher column (logit x, teacher probability p_t).
fn teacher_grad(x: f32, p_t: f32, t: TermsRow) -> f32 {
    return column_grad(x, true, p_t, 0.0, t);
}

// c·∂L/∂s at the label's column (logit x), whole.
fn label_grad(x: f32, t: TermsRow) -> f32 {
    return column_grad(x, t.label_p >= 0.0, t.label_p, t.c1.x, t);
}
