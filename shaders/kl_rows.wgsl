// The KL row kernel (headkl_core::toolkit::KlDesc): one workgroup per token row.
// See shaders/README.md. Each term set is a pipeline of its own: KL_FLAGS
// (params.flags, set by headkl_core::toolkit::Checked::build) is an override, so the
// driver folds every branch on it. With KL_FLAGS = 0 it runs the seed's loss
// (the "plain" loops, compiled without the terms' code); otherwise the
// general loops with the terms the flags name (softcap, tail mode, hard
// label, z-loss, τ ≠ 1).
enable f16;

override KL_FLAGS: u32 = 0u;

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

// FLAGGED_ROW: the coefficient word of a row the device-resident kernels
// flagged (headkl_core::resident::status::FLAGGED_ROW, a quiet NaN's bits).
// Such a row gets a zero gradient row (and an all-clear filter mask)
// whatever its logits, and the word's bits as its loss word (a NaN that
// loss_out tells from bad logits); its lse, soft and hard words are
// computed as for any row. The host path never writes it.
// <row constants: generated from crates/core/src/resident/status.rs (headkl_core::toolkit::kernels::Shader::source)>

// Rows are read 4 logits (16 bytes) at a time: ld is a multiple of 16.
@group(0) @binding(1) var<storage, read> logits: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> probs: array<f32>;
// [rows][2]: the coefficient's f32 bits (FLAGGED_ROW: a flagged row), the
// label (NO_LABEL: none).
@group(0) @binding(4) var<storage, read> row_in: array<u32>;
// [rows][4]: loss, lse at τ = 1, soft part, hard part.
@group(0) @binding(5) var<storage, read_write> loss: array<f32>;
@group(0) @binding(6) var<storage, read_write> grad: array<vec4<f16>>;

const NEG_HUGE: f32 = -3.0e38;

// Bits of KL_FLAGS = params.flags, the divergences' codes (0 is the
// forward KL), the tail modes' codes, and the floors TAIL_FLOOR = 2^-24 on
// the bucket's student mass and the reverse KL's teacher, LOG_PROB_FLOOR
// its log (headkl_core::toolkit::params::row_flags).
// <row flags: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

var<workgroup> red_max: array<f32, WG>;
var<workgroup> red_sum: array<f32, WG>;
var<workgroup> red_bad: array<u32, WG>;
// The τ = 1 fold, and a third sum (Σ u for label smoothing; Σ_k p_S).
var<workgroup> red_max1: array<f32, WG>;
var<workgroup> red_sum1: array<f32, WG>;
var<workgroup> red_aux: array<f32, WG>;
var<workgroup> row_lse: f32;
// Bit 0: the row's logits are not finite; bit 1: the row is flagged (its
// coefficient word is FLAGGED_ROW).
var<workgroup> row_bad: u32;
// The teacher's probability at the label, or -1 when the label is not
// among the k.
var<workgroup> row_label_p: f32;
// Pass 2's row constants: (a, b, h, f_on) and (label_term, lse1, f_off, sum_u).
var<workgroup> row_c0: vec4<f32>;
var<workgroup> row_c1: vec4<f32>;
// Reverse KL and JSD (docs/DESIGN.md §1): E = Σ_bins q·f'(q, t) and
// log N, the student's normalizer on the k (log Σ_k p_S renormalized, else 0).
var<workgroup> row_div: vec2<f32>;
// The block filter (F_FILTER; headkl_core::problem::filter): one segment's mask
// words, each 32 blocks of FILTER_BLOCK vocabulary entries. Only the
// filtered pipeline touches it.
// 16-byte grad words a mask word covers: 32 blocks of FILTER_BLOCK.
const WORD4: u32 = 32u * FILTER_BLOCK / 4u;
const SEG4: u32 = SEG_WORDS * WORD4;
var<workgroup> seg_mask: array<atomic<u32>, SEG_WORDS>;

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

// The running fold and whether a non-finite logit was seen.
struct Fold {
    ms: vec2<f32>,
    bad: u32,
}

// Folds the logits of word j4 (4 logits; those past vocab skipped).
fn fold4(st: Fold, x4: vec4<f32>, j4: u32, vocab: u32) -> Fold {
    var out = st;
    for (var c = 0u; c < 4u; c++) {
        let x = x4[c];
        if j4 * 4u + c >= vocab {
            break;
        }
        if non_finite(x) {
            out.bad = 1u;
        } else {
            out.ms = fold(out.ms, x);
        }
    }
    return out;
}

// The general fold: the capped logits u at τ (max m, Σ exp(u − m)), at
// τ = 1 (Σ exp(τ(u − m)): the same max, scaled by τ) and Σ u.
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

// Merges two (max, sum of exp(x - max)) pairs.
fn merge(m1: f32, s1: f32, m2: f32, s2: f32) -> vec2<f32> {
    let m = max(m1, m2);
    return vec2<f32>(m, s1 * exp(m1 - m) + s2 * exp(m2 - m));
}

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

// c·∂L/∂s at a teacher column (logit x, teacher probability p_t) in the
// general case: cap'·(α_soft·(f_on·p^τ − p_T) + b·p¹ − h).
fn teacher_grad(x: f32, p_t: f32, c: f32, lse: f32, c0: vec4<f32>, c1: vec4<f32>) -> f32 {
    let us = scaled2(x);
    let pt = exp(us.x - lse);
    var p1 = pt;
    if (KL_FLAGS & F_TAU) != 0u {
        p1 = exp(us.x * params.temperature - c1.y);
    }
    let d = params.soft_weight * soft_on(us.x, pt, p_t, lse, c0.w) + c0.y * p1 - c0.z;
    return c * us.y * d;
}

// c·∂L/∂s at the label's column (logit x; label_p the teacher's
// probability there, or -1 when the label is not among the k), whole.
fn label_grad(x: f32, label_p: f32, c: f32, lse: f32, c0: vec4<f32>, c1: vec4<f32>) -> f32 {
    let us = scaled2(x);
    let pt = exp(us.x - lse);
    var p1 = pt;
    if (KL_FLAGS & F_TAU) != 0u {
        p1 = exp(us.x * params.temperature - c1.y);
    }
    var d = c0.x * pt;
    if label_p >= 0.0 {
        d = params.soft_weight * soft_on(us.x, pt, label_p, lse, c0.w);
    }
    d += c0.y * p1 - c0.z - c1.x;
    return c * us.y * d;
}

@compute @workgroup_size(WG)
fn kl_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.x + wg.y * params.grid_x;
    if row >= params.rows {
        return;
    }
    if (KL_FLAGS & F_DENSE) != 0u {
        dense_row(row, lid);
        return;
    }
    let vocab = params.vocab;
    let base = row * params.ld;
    let flags = KL_FLAGS;
    // The filter changes what pass 2 writes, not what is computed.
    let plain = (flags & ~F_FILTER) == 0u;
    // The general fold is needed for a cap, τ ≠ 1 (the τ = 1 softmax) and
    // the hard term (Σ u for label smoothing).
    let fold_terms = (flags & (F_SOFTCAP | F_TAU | F_HARD)) != 0u;
    let tail = (flags >> F_TAIL_SHIFT) & 3u;
    // NO_LABEL (or any label past vocab) is no label; read only with the
    // hard term on.
    var label = 0xffffffffu;
    if (flags & F_HARD) != 0u {
        label = row_in[row * 2u + 1u];
    }
    let labelled = label < vocab;

    // Pass 1: online max and sum of exp(s - max), plus a non-finite flag,
    // over 4 logits at a time (those past vocab skipped).
    var st = Fold(vec2<f32>(NEG_HUGE, 0.0), 0u);
    var ms1 = vec2<f32>(NEG_HUGE, 0.0);
    var sum_u = 0.0;
    let base4 = base / 4u;
    let words = (vocab + 3u) / 4u;
    if !fold_terms && params.stats_offset != 0u {
        // The logits GEMM wrote the row's statistics (headkl_core::toolkit::RowStats):
        // one (max, sum) pair per 32 columns, a NaN sum where a logit was
        // not finite. Merging them is this pass; the logits are read once.
        let sbase = params.stats_offset / 4u + row * (params.stats_ld / 2u);
        for (var g = lid; g < params.stats_groups; g += WG) {
            let w = logits[sbase + g / 2u];
            var pair = w.xy;
            if (g & 1u) != 0u {
                pair = w.zw;
            }
            if non_finite(pair.y) {
                st.bad = 1u;
            } else if pair.y > 0.0 {
                st.ms = merge(st.ms.x, st.ms.y, pair.x, pair.y);
            }
        }
    } else if !fold_terms {
        // Four 16-byte loads in flight per invocation.
        var j4 = lid;
        for (; j4 + 3u * WG < words; j4 += 4u * WG) {
            let xa = logits[base4 + j4];
            let xb = logits[base4 + j4 + WG];
            let xc = logits[base4 + j4 + 2u * WG];
            let xd = logits[base4 + j4 + 3u * WG];
            st = fold4(st, xa, j4, vocab);
            st = fold4(st, xb, j4 + WG, vocab);
            st = fold4(st, xc, j4 + 2u * WG, vocab);
            st = fold4(st, xd, j4 + 3u * WG, vocab);
        }
        for (; j4 < words; j4 += WG) {
            st = fold4(st, logits[base4 + j4], j4, vocab);
        }
    } else {
        // Four loads in flight here too: this pipeline's registers are its
        // own.
        var ft = FoldTerms(NEG_HUGE, 0.0, 0.0, 0.0, 0u);
        var j4 = lid;
        for (; j4 + 3u * WG < words; j4 += 4u * WG) {
            let xa = logits[base4 + j4];
            let xb = logits[base4 + j4 + WG];
            let xc = logits[base4 + j4 + 2u * WG];
            let xd = logits[base4 + j4 + 3u * WG];
            ft = fold4_terms(ft, xa, j4, vocab);
            ft = fold4_terms(ft, xb, j4 + WG, vocab);
            ft = fold4_terms(ft, xc, j4 + 2u * WG, vocab);
            ft = fold4_terms(ft, xd, j4 + 3u * WG, vocab);
        }
        for (; j4 < words; j4 += WG) {
            ft = fold4_terms(ft, logits[base4 + j4], j4, vocab);
        }
        st = Fold(vec2<f32>(ft.m, ft.s), ft.bad);
        // The τ = 1 fold as (max, sum): its max is τ·m.
        // (max with NEG_HUGE: an invocation that saw no logit stays at it.)
        ms1 = vec2<f32>(max(ft.m * params.temperature, NEG_HUGE), ft.s1);
        sum_u = ft.sum_u;
    }
    let ms = st.ms;
    let bad = st.bad;
    red_max[lid] = ms.x;
    red_sum[lid] = ms.y;
    red_bad[lid] = bad;
    if fold_terms {
        red_max1[lid] = ms1.x;
        red_sum1[lid] = ms1.y;
        red_aux[lid] = sum_u;
    }
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride {
            let r = merge(red_max[lid], red_sum[lid], red_max[lid + stride], red_sum[lid + stride]);
            red_max[lid] = r.x;
            red_sum[lid] = r.y;
            red_bad[lid] |= red_bad[lid + stride];
            if fold_terms {
                let r1 = merge(red_max1[lid], red_sum1[lid], red_max1[lid + stride], red_sum1[lid + stride]);
                red_max1[lid] = r1.x;
                red_sum1[lid] = r1.y;
                red_aux[lid] += red_aux[lid + stride];
            }
        }
        workgroupBarrier();
    }
    if lid == 0u {
        let total = red_sum[0];
        var b = red_bad[0];
        if non_finite(total) || !(total > 0.0) {
            b = 1u;
        }
        // The word's bits, never a float NaN test (which may be folded).
        if row_in[row * 2u] == FLAGGED_ROW {
            b |= 2u;
        }
        row_bad = b;
        row_lse = red_max[0] + log(total);
        row_label_p = -1.0;
        if !plain {
            var lse1 = row_lse;
            if (flags & F_TAU) != 0u {
                lse1 = red_max1[0] + log(red_sum1[0]);
            }
            row_c1 = vec4<f32>(0.0, lse1, 1.0, red_aux[0]);
        }
    }
    let lse = workgroupUniformLoad(&row_lse);
    let row_state = workgroupUniformLoad(&row_bad);
    let row_is_bad = row_state & 1u;
    let flagged = (row_state & 2u) != 0u;

    // The soft term over the teacher's k entries (and, outside the plain
    // case, their mass and the student's mass on them).
    let k = params.k;
    let tbase = row * k;
    var part = 0.0;
    var mass = 0.0;
    var student = 0.0;
    for (var q = lid; q < k; q += WG) {
        let p = probs[tbase + q];
        let id = ids[tbase + q];
        let log_ps = scaled(logit(base, id)) - lse;
        if p > 0.0 {
            part += p * (log(p) - log_ps);
        }
        if !plain {
            mass += p;
            student += exp(log_ps);
            if labelled && id == label {
                row_label_p = p;
            }
        }
    }
    red_sum[lid] = part;
    if !plain {
        red_max[lid] = mass;
        red_aux[lid] = student;
    }
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride {
            red_sum[lid] += red_sum[lid + stride];
            if !plain {
                red_max[lid] += red_max[lid + stride];
                red_aux[lid] += red_aux[lid + stride];
            }
        }
        workgroupBarrier();
    }
    let mass_k = red_max[0];
    let student_k = red_aux[0];
    // The reverse KL and the JSD need the row's student mass on the k
    // first (renormalized: q = p_S/Σ_k p_S): a second pass over the k sums
    // the bins' f (into red_sum) and q·f' (into red_aux).
    var log_norm = 0.0;
    if div_code() != 0u {
        if tail == 0u {
            log_norm = log(max(student_k, 1e-37));
        }
        workgroupBarrier();
        var f_sum = 0.0;
        var e_sum = 0.0;
        for (var q = lid; q < k; q += WG) {
            let log_q = scaled(logit(base, ids[tbase + q])) - lse - log_norm;
            let qv = exp(log_q);
            let ft = div_term(qv, log_q, probs[tbase + q]);
            f_sum += ft.x;
            e_sum += qv * ft.y;
        }
        red_sum[lid] = f_sum;
        red_aux[lid] = e_sum;
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
            if lid < stride {
                red_sum[lid] += red_sum[lid + stride];
                red_aux[lid] += red_aux[lid + stride];
            }
            workgroupBarrier();
        }
    }
    if lid == 0u {
        if plain {
            var out = vec4<f32>(red_sum[0], lse, red_sum[0], 0.0);
            if row_is_bad != 0u {
                out = vec4<f32>(nan_f32());
            }
            if flagged {
                // The marker's bits, from the word itself (not a constant
                // NaN, which WGSL cannot write).
                out.x = bitcast<f32>(row_in[row * 2u]);
            }
            loss[row * 4u] = out.x;
            loss[row * 4u + 1u] = out.y;
            loss[row * 4u + 2u] = out.z;
            loss[row * 4u + 3u] = out.w;
        } else {
            let tau = params.temperature;
            let lse1 = row_c1.y;
            var soft = red_sum[0];
            var f_off = 1.0;
            var f_on = 1.0;
            if div_code() != 0u {
                // f_off: the factor on p^τ off the k, f'(tail) − E with a
                // tail bin, −E over the k alone, 0 renormalized (q over the
                // k does not depend on the logits outside it).
                var e = red_aux[0];
                f_off = 0.0;
                if tail == TAIL_BUCKET {
                    let r_t = max(1.0 - mass_k, 0.0);
                    let r_s = max(1.0 - student_k, TAIL_FLOOR);
                    let ft = div_term(r_s, log(r_s), r_t);
                    soft += ft.x;
                    e += r_s * ft.y;
                    f_off = ft.y - e;
                } else if tail == TAIL_NONE {
                    f_off = -e;
                }
                row_div = vec2<f32>(e, log_norm);
            } else if tail == TAIL_NONE {
                f_off = mass_k;
                f_on = mass_k;
            } else if tail == TAIL_BUCKET {
                let r_t = max(1.0 - mass_k, 0.0);
                let r_s = max(1.0 - student_k, TAIL_FLOOR);
                if r_t > 0.0 {
                    soft += r_t * (log(r_t) - log(r_s));
                    f_off = 1.0 - r_t / r_s;
                }
            }
            var alpha_hard = 0.0;
            var eps = 0.0;
            var hard = 0.0;
            if labelled {
                alpha_hard = params.hard_weight;
                eps = params.smoothing;
                let sum_u = row_c1.w;
                let u_y = scaled(logit(base, label));
                hard = lse1 - (1.0 - eps) * tau * u_y - eps * tau * sum_u / f32(vocab);
            }
            let lambda = params.z_loss;
            let total_loss = params.soft_weight * soft + alpha_hard * hard + lambda * lse1 * lse1;
            var out = vec4<f32>(total_loss, lse1, soft, hard);
            if row_is_bad != 0u {
                out = vec4<f32>(nan_f32());
            }
            if flagged {
                out.x = bitcast<f32>(row_in[row * 2u]);
            }
            loss[row * 4u] = out.x;
            loss[row * 4u + 1u] = out.y;
            loss[row * 4u + 2u] = out.z;
            loss[row * 4u + 3u] = out.w;
            let a = params.soft_weight * f_off;
            let b = tau * (alpha_hard + 2.0 * lambda * lse1);
            let h = tau * alpha_hard * eps / f32(vocab);
            row_c0 = vec4<f32>(a, b, h, f_on);
            // k1 = exp(τ·lse − lse1): p¹ = (p^τ)^τ·k1 (p_one).
            row_c1 = vec4<f32>(tau * alpha_hard * (1.0 - eps), lse1, f_off, exp(tau * lse - lse1));
        }
    }

    // A flagged row contributes nothing (flagged is uniform: all return).
    if flagged {
        zero_row(row, lid);
        return;
    }
    // Pass 2: grad = c * ∂L/∂s everywhere (c * p_S in the plain case), zero
    // in the padding, 4 at a time ...
    let c = bitcast<f32>(row_in[row * 2u]);
    let padded = params.ld / 4u;
    if (flags & F_FILTER) != 0u {
        filtered_grad(row, lid, c, lse, plain, labelled, label);
        return;
    }
    if plain {
        var g4 = lid;
        for (; g4 + 3u * WG < padded; g4 += 4u * WG) {
            let xa = logits[base4 + g4];
            let xb = logits[base4 + g4 + WG];
            let xc = logits[base4 + g4 + 2u * WG];
            let xd = logits[base4 + g4 + 3u * WG];
            grad[base4 + g4] = grad4(xa, g4, vocab, c, lse);
            grad[base4 + g4 + WG] = grad4(xb, g4 + WG, vocab, c, lse);
            grad[base4 + g4 + 2u * WG] = grad4(xc, g4 + 2u * WG, vocab, c, lse);
            grad[base4 + g4 + 3u * WG] = grad4(xd, g4 + 3u * WG, vocab, c, lse);
        }
        for (; g4 < padded; g4 += WG) {
            grad[base4 + g4] = grad4(logits[base4 + g4], g4, vocab, c, lse);
        }
        // ... then c * (p_S - p_T) on the teacher's columns. The barrier orders
        // these stores after the ones above within the workgroup.
        storageBarrier();
        for (var q = lid; q < k; q += WG) {
            let id = ids[tbase + q];
            let ps = exp(logit(base, id) - lse);
            grad[(base + id) / 4u][id % 4u] = f16(c * (ps - probs[tbase + q]));
        }
        return;
    }
    let c0 = workgroupUniformLoad(&row_c0);
    let c1 = workgroupUniformLoad(&row_c1);
    let label_p = workgroupUniformLoad(&row_label_p);
    let lse1 = c1.y;
    let r = Pass2(c, lse, c0.x, c0.y, c0.z, lse1, c1.w);
    var g4 = lid;
    for (; g4 + 3u * WG < padded; g4 += 4u * WG) {
        let xa = logits[base4 + g4];
        let xb = logits[base4 + g4 + WG];
        let xc = logits[base4 + g4 + 2u * WG];
        let xd = logits[base4 + g4 + 3u * WG];
        grad[base4 + g4] = grad4_terms(xa, g4, vocab, r);
        grad[base4 + g4 + WG] = grad4_terms(xb, g4 + WG, vocab, r);
        grad[base4 + g4 + 2u * WG] = grad4_terms(xc, g4 + 2u * WG, vocab, r);
        grad[base4 + g4 + 3u * WG] = grad4_terms(xd, g4 + 3u * WG, vocab, r);
    }
    for (; g4 < padded; g4 += WG) {
        grad[base4 + g4] = grad4_terms(logits[base4 + g4], g4, vocab, r);
    }
    // ... then the teacher's columns: cap'·(α_soft·(f_on·p^τ − p_T) + b·p¹ − h)
    // (the barrier orders these stores after the ones above) ...
    storageBarrier();
    for (var q = lid; q < k; q += WG) {
        let id = ids[tbase + q];
        grad[(base + id) / 4u][id % 4u] = f16(teacher_grad(logit(base, id), probs[tbase + q], c, lse, c0, c1));
    }
    // ... then the label's column, whole, over whatever was written there
    // (the barrier is outside the label's branch: uniform control flow).
    storageBarrier();
    if labelled && lid == 0u {
        grad[(base + label) / 4u][label % 4u] = f16(label_grad(logit(base, label), label_p, c, lse, c0, c1));
    }
}

// Pass 2 of a flagged row: its gradient row 0 (padding included) whatever
// its logits, and with the filter (F_FILTER) its mask all clear.
fn zero_row(row: u32, lid: u32) {
    let base4 = row * params.ld / 4u;
    for (var g4 = lid; g4 < params.ld / 4u; g4 += WG) {
        grad[base4 + g4] = vec4<f16>();
    }
    if (KL_FLAGS & F_FILTER) != 0u {
        for (var w = lid; w < params.mask_ld; w += WG) {
            grad[params.mask_off4 + row * params.mask_ld + w] = vec4<f16>();
        }
    }
}

// Whether c·∂L/∂s = g keeps its block: |∂L/∂s| above ε, or not a number.
fn kept(g: f32, c: f32) -> bool {
    return !(abs(g) <= params.filter_eps * abs(c));
}

// Marks the block of column `j` in the segment starting at column `col0`.
fn mark(j: u32, col0: u32) {
    let b = (j - col0) / FILTER_BLOCK;
    atomicOr(&seg_mask[b / 32u], 1u << (b % 32u));
}

// Pass 2 with the block filter (F_FILTER): the gradient exactly as the
// unfiltered pass writes it (same expressions, same bits), and the row's
// block mask (headkl_core::problem::filter), one segment of SEG_WORDS mask words at
// a time. A block's bit is set when some entry keeps it (`kept`): the
// bulk by c·p_S (plain) or its value, the teacher's and the label's
// columns by their final values too (a superset: never a block the
// gradient needs). A row with c = 0 keeps none: its gradient is zero.
fn filtered_grad(row: u32, lid: u32, c: f32, lse: f32, plain: bool, labelled: bool, label: u32) {
    let c0 = workgroupUniformLoad(&row_c0);
    let c1 = workgroupUniformLoad(&row_c1);
    let label_p = workgroupUniformLoad(&row_label_p);
    let lse1 = c1.y;
    let r = Pass2(c, lse, c0.x, c0.y, c0.z, lse1, c1.w);
    let vocab = params.vocab;
    let base = row * params.ld;
    let base4 = base / 4u;
    let padded = params.ld / 4u;
    let k = params.k;
    let tbase = row * k;
    for (var s4 = 0u; s4 < padded; s4 += SEG4) {
        let e4 = min(s4 + SEG4, padded);
        let col0 = s4 * 4u;
        let col1 = e4 * 4u;
        if lid < SEG_WORDS {
            atomicStore(&seg_mask[lid], 0u);
        }
        workgroupBarrier();
        for (var g4 = s4 + lid; g4 < e4; g4 += WG) {
            let x4 = logits[base4 + g4];
            var g = vec4<f32>(0.0);
            if plain {
                g = grad4_f32(x4, g4, vocab, c, lse);
            } else {
                g = grad4_terms_f32(x4, g4, vocab, r);
            }
            grad[base4 + g4] = vec4<f16>(g);
            if kept(g.x, c) || kept(g.y, c) || kept(g.z, c) || kept(g.w, c) {
                mark(g4 * 4u, col0);
            }
        }
        // The teacher's columns over the bulk's stores (ordered by the
        // barrier) ...
        storageBarrier();
        for (var q = lid; q < k; q += WG) {
            let id = ids[tbase + q];
            if id < col0 || id >= col1 {
                continue;
            }
            var gv = 0.0;
            if plain {
                let ps = exp(logit(base, id) - lse);
                gv = c * (ps - probs[tbase + q]);
            } else {
                gv = teacher_grad(logit(base, id), probs[tbase + q], c, lse, c0, c1);
            }
            grad[(base + id) / 4u][id % 4u] = f16(gv);
            if kept(gv, c) {
                mark(id, col0);
            }
        }
        // ... then the label's column, whole (general case only).
        storageBarrier();
        if !plain && labelled && lid == 0u && label >= col0 && label < col1 {
            let gv = label_grad(logit(base, label), label_p, c, lse, c0, c1);
            grad[(base + label) / 4u][label % 4u] = f16(gv);
            if kept(gv, c) {
                mark(label, col0);
            }
        }
        workgroupBarrier();
        let w = s4 / WORD4 + lid;
        if lid < SEG_WORDS && w < params.mask_ld {
            let bits = atomicLoad(&seg_mask[lid]);
            let h = vec4<u32>(bits & 255u, (bits >> 8u) & 255u, (bits >> 16u) & 255u, bits >> 24u);
            grad[params.mask_off4 + row * params.mask_ld + w] = vec4<f16>(vec4<f32>(h));
        }
        workgroupBarrier();
    }
}

// ---- The dense teacher (F_DENSE; DESIGN §1 "The teacher's hidden rows"):
// `probs` holds the teacher's logits at τ, [rows][ld] as the student's,
// and the soft term is the exact divergence over the whole vocabulary.
// Only the soft term, its weight, τ and the divergence apply.

// Folds x into the running (max, Σ exp(x − max), Σ exp(x − max)·w): the
// weighted sum rescales with the max, so Σ p·w = A/S once the row is seen.
fn fold_w(st: vec3<f32>, x: f32, w: f32) -> vec3<f32> {
    if x > st.x {
        let f = exp(st.x - x);
        return vec3<f32>(x, st.y * f + 1.0, st.z * f + w);
    }
    let e = exp(x - st.x);
    return vec3<f32>(st.x, st.y + e, st.z + e * w);
}

// Merges two fold_w states.
fn merge_w(a: vec3<f32>, b: vec3<f32>) -> vec3<f32> {
    let m = max(a.x, b.x);
    let fa = exp(a.x - m);
    let fb = exp(b.x - m);
    return vec3<f32>(m, a.y * fa + b.y * fb, a.z * fa + b.z * fb);
}

// One column of the dense reverse KL or JSD: (f, f' = ∂f/∂q) at the
// student's log-probability ls and the teacher's lt, as div_term's.
fn dense_div(ls: f32, lt: f32) -> vec2<f32> {
    let q = exp(ls);
    if div_code() == DIV_REVERSE {
        if q > 0.0 {
            let r = ls - max(lt, LOG_PROB_FLOOR);
            return vec2<f32>(q * r, r + 1.0);
        }
        return vec2<f32>(0.0);
    }
    let beta = params.beta;
    let t = exp(lt);
    let log_m = log(beta * t + (1.0 - beta) * q);
    var out = vec2<f32>(0.0);
    if t > 0.0 {
        out.x = beta * t * (lt - log_m);
    }
    if q > 0.0 {
        out.x += (1.0 - beta) * q * (ls - log_m);
        out.y = (1.0 - beta) * (ls - log_m);
    }
    return out;
}

// Reduces the workgroup's (red_max, red_sum, red_aux) as fold_w states and
// red_bad by or; with `tau1`, (red_max1, red_sum1) as folds too.
fn reduce_w(lid: u32, tau1: bool) {
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride {
            let r = merge_w(
                vec3<f32>(red_max[lid], red_sum[lid], red_aux[lid]),
                vec3<f32>(red_max[lid + stride], red_sum[lid + stride], red_aux[lid + stride]),
            );
            red_max[lid] = r.x;
            red_sum[lid] = r.y;
            red_aux[lid] = r.z;
            red_bad[lid] |= red_bad[lid + stride];
            if tau1 {
                let r1 = merge(red_max1[lid], red_sum1[lid], red_max1[lid + stride], red_sum1[lid + stride]);
                red_max1[lid] = r1.x;
                red_sum1[lid] = r1.y;
            }
        }
        workgroupBarrier();
    }
}

fn dense_row(row: u32, lid: u32) {
    let vocab = params.vocab;
    let base = row * params.ld;
    let base4 = base / 4u;
    let words = (vocab + 3u) / 4u;
    let forward = div_code() == 0u;
    let tau_on = (KL_FLAGS & F_TAU) != 0u;
    // Pass 1: the student's fold, its τ = 1 fold, and the teacher's (with
    // Σ p_T·(t − s), the forward KL's, on the way).
    var fs = vec3<f32>(NEG_HUGE, 0.0, 0.0);
    var ft = vec3<f32>(NEG_HUGE, 0.0, 0.0);
    var ms1 = vec2<f32>(NEG_HUGE, 0.0);
    var bad = 0u;
    for (var j4 = lid; j4 < words; j4 += WG) {
        let s4 = logits[base4 + j4];
        for (var c = 0u; c < 4u; c++) {
            let j = j4 * 4u + c;
            if j >= vocab {
                break;
            }
            let s = s4[c];
            let t = probs[base + j];
            if non_finite(s) || non_finite(t) {
                bad = 1u;
                continue;
            }
            fs = fold_w(fs, s, 0.0);
            ft = fold_w(ft, t, select(0.0, t - s, forward));
            if tau_on {
                ms1 = fold(ms1, s * params.temperature);
            }
        }
    }
    red_max[lid] = fs.x;
    red_sum[lid] = fs.y;
    red_aux[lid] = 0.0;
    red_bad[lid] = bad;
    red_max1[lid] = ms1.x;
    red_sum1[lid] = ms1.y;
    reduce_w(lid, tau_on);
    if lid == 0u {
        var b = red_bad[0];
        if non_finite(red_sum[0]) || !(red_sum[0] > 0.0) {
            b = 1u;
        }
        if row_in[row * 2u] == FLAGGED_ROW {
            b |= 2u;
        }
        row_bad = b;
        row_lse = red_max[0] + log(red_sum[0]);
        var lse1 = row_lse;
        if tau_on {
            lse1 = red_max1[0] + log(red_sum1[0]);
        }
        row_div = vec2<f32>(lse1, 0.0);
    }
    workgroupBarrier();
    red_max[lid] = ft.x;
    red_sum[lid] = ft.y;
    red_aux[lid] = ft.z;
    red_bad[lid] = 0u;
    reduce_w(lid, false);
    if lid == 0u {
        let lse_t = red_max[0] + log(red_sum[0]);
        if non_finite(lse_t) {
            row_bad |= 1u;
        }
        // (lse_t, Σ p_T·(t − s)).
        row_c0 = vec4<f32>(lse_t, red_aux[0] / red_sum[0], 0.0, 0.0);
    }
    let lse = workgroupUniformLoad(&row_lse);
    let c0 = workgroupUniformLoad(&row_c0);
    let lse_t = c0.x;
    let row_state = workgroupUniformLoad(&row_bad);
    // The divergence L: forward from pass 1; the reverse KL and the JSD
    // in pass 2, with E = Σ p_S·f' for their gradient.
    var soft = c0.y - lse_t + lse;
    var e = 0.0;
    if !forward {
        var f_sum = 0.0;
        var e_sum = 0.0;
        for (var j4 = lid; j4 < words; j4 += WG) {
            let s4 = logits[base4 + j4];
            for (var c = 0u; c < 4u; c++) {
                let j = j4 * 4u + c;
                if j >= vocab {
                    break;
                }
                let ls = s4[c] - lse;
                let f = dense_div(ls, probs[base + j] - lse_t);
                f_sum += f.x;
                e_sum += exp(ls) * f.y;
            }
        }
        red_sum[lid] = f_sum;
        red_aux[lid] = e_sum;
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
            if lid < stride {
                red_sum[lid] += red_sum[lid + stride];
                red_aux[lid] += red_aux[lid + stride];
            }
            workgroupBarrier();
        }
        soft = red_sum[0];
        e = red_aux[0];
    }
    let lse1 = workgroupUniformLoad(&row_div).x;
    if lid == 0u {
        var out = vec4<f32>(params.soft_weight * soft, lse1, soft, 0.0);
        if (row_state & 1u) != 0u {
            out = vec4<f32>(nan_f32());
        }
        if (row_state & 2u) != 0u {
            out.x = bitcast<f32>(row_in[row * 2u]);
        }
        loss[row * 4u] = out.x;
        loss[row * 4u + 1u] = out.y;
        loss[row * 4u + 2u] = out.z;
        loss[row * 4u + 3u] = out.w;
    }
    if (row_state & 2u) != 0u {
        zero_row(row, lid);
        return;
    }
    // Pass 3: grad = c·α_soft·∂L/∂s: p_S − p_T forward, p_S·(f' − E)
    // otherwise; zero in the padding.
    let cw = bitcast<f32>(row_in[row * 2u]) * params.soft_weight;
    for (var g4 = lid; g4 < params.ld / 4u; g4 += WG) {
        let s4 = logits[base4 + g4];
        var g = vec4<f32>(0.0);
        for (var c = 0u; c < 4u; c++) {
            let j = g4 * 4u + c;
            if j >= vocab {
                break;
            }
            let ls = s4[c] - lse;
            let lt = probs[base + j] - lse_t;
            if forward {
                g[c] = cw * (exp(ls) - exp(lt));
            } else {
                g[c] = cw * exp(ls) * (dense_div(ls, lt).y - e);
            }
        }
        grad[base4 + g4] = vec4<f16>(g);
    }
}
