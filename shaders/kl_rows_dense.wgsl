// Part of the KL row kernel (assembled in kl_rows_state.wgsl's order): the
// full-vocabulary teacher's rows (F_DENSE).


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

// A dense row's sums over this invocation's columns: pass 1's (the
// student's fold_w, the teacher's with Σ p_T·(t − s) on the way, the
// student's τ = 1 fold, the non-finite flag), then pass 2's (Σ f, Σ p_S·f')
// for the reverse KL and the JSD.
struct DenseSums {
    fs: vec3<f32>,
    ft: vec3<f32>,
    ms1: vec2<f32>,
    bad: u32,
    div: vec2<f32>,
}

// Column (s, t), the student's and the teacher's logits, into `st`: pass
// 1's folds, or with `second` pass 2's sums at (lse, lse_t).
fn dense_col(st: DenseSums, s: f32, t: f32, second: bool, lse: f32, lse_t: f32) -> DenseSums {
    var out = st;
    if second {
        let ls = s - lse;
        let f = dense_div(ls, t - lse_t);
        out.div += vec2<f32>(f.x, exp(ls) * f.y);
        return out;
    }
    if non_finite(s) || non_finite(t) {
        out.bad = 1u;
        return out;
    }
    out.fs = fold_w(st.fs, s, 0.0);
    out.ft = fold_w(st.ft, t, select(0.0, t - s, div_code() == 0u));
    if (KL_FLAGS & F_TAU) != 0u {
        out.ms1 = fold(st.ms1, s * params.temperature);
    }
    return out;
}

// One pass over this invocation's columns of the row (4 a 16-byte word,
// those past vocab skipped) through dense_col; `second` is a constant at
// each call.
fn dense_sweep(row: u32, lid: u32, second: bool, lse: f32, lse_t: f32) -> DenseSums {
    let vocab = params.vocab;
    let base = row * params.ld;
    let words = (vocab + 3u) / 4u;
    var st = DenseSums(vec3<f32>(NEG_HUGE, 0.0, 0.0), vec3<f32>(NEG_HUGE, 0.0, 0.0), vec2<f32>(NEG_HUGE, 0.0), 0u,
        vec2<f32>(0.0));
    for (var j4 = lid; j4 < words; j4 += WG) {
        let s4 = logits[base / 4u + j4];
        for (var c = 0u; c < 4u; c++) {
            let j = j4 * 4u + c;
            if j >= vocab {
                break;
            }
            st = dense_col(st, s4[c], probs[base + j], second, lse, lse_t);
        }
    }
    return st;
}

fn dense_row(row: u32, lid: u32) {
    let vocab = params.vocab;
    let base = row * params.ld;
    let base4 = base / 4u;
    let forward = div_code() == 0u;
    let tau_on = (KL_FLAGS & F_TAU) != 0u;
    // Pass 1: the student's fold, its τ = 1 fold, and the teacher's (with
    // Σ p_T·(t − s), the forward KL's, on the way).
    let p1 = dense_sweep(row, lid, false, 0.0, 0.0);
    red_max[lid] = p1.fs.x;
    red_sum[lid] = p1.fs.y;
    red_aux[lid] = 0.0;
    red_bad[lid] = p1.bad;
    red_max1[lid] = p1.ms1.x;
    red_sum1[lid] = p1.ms1.y;
    reduce_folds(lid, AUX_WEIGHTED, tau_on);
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
    red_max[lid] = p1.ft.x;
    red_sum[lid] = p1.ft.y;
    red_aux[lid] = p1.ft.z;
    red_bad[lid] = 0u;
    reduce_folds(lid, AUX_WEIGHTED, false);
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
        let p2 = dense_sweep(row, lid, true, lse, lse_t);
        sum_pair(lid, p2.div.x, p2.div.y);
        soft = red_sum[0];
        e = red_aux[0];
    }
    let lse1 = workgroupUniformLoad(&row_div).x;
    if lid == 0u {
        write_loss(row, vec4<f32>(params.soft_weight * soft, lse1, soft, 0.0), (row_state & 1u) != 0u,
            (row_state & 2u) != 0u);
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
