// Part of the KL row kernel (assembled in kl_rows_state.wgsl's order): the
// entry point, one workgroup per token row (pass 1 folds the row's logits,
// pass 2 writes its gradient), and the steps it calls outside its hot loops.


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
    var ms = vec2<f32>(NEG_HUGE, 0.0);
    var bad = 0u;
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
                bad = 1u;
            } else if pair.y > 0.0 {
                ms = merge(ms.x, ms.y, pair.x, pair.y);
            }
        }
    } else {
        let ft = fold_row(base4, words, lid, vocab, fold_terms);
        ms = vec2<f32>(ft.m, ft.s);
        bad = ft.bad;
        if fold_terms {
            // The τ = 1 fold as (max, sum): its max is τ·m.
            // (max with NEG_HUGE: an invocation that saw no logit stays at it.)
            ms1 = vec2<f32>(max(ft.m * params.temperature, NEG_HUGE), ft.s1);
            sum_u = ft.sum_u;
        }
    }
    red_max[lid] = ms.x;
    red_sum[lid] = ms.y;
    red_bad[lid] = bad;
    if fold_terms {
        red_max1[lid] = ms1.x;
        red_sum1[lid] = ms1.y;
        red_aux[lid] = sum_u;
    }
    reduce_folds(lid, select(AUX_NONE, AUX_SUM, fold_terms), fold_terms);
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
    let row_is_bad = (row_state & 1u) != 0u;
    let flagged = (row_state & 2u) != 0u;

    // The soft term over the teacher's k entries (red_sum[0]) and, outside
    // the plain case, their mass and the student's mass on them.
    let kept_mass = teacher_sums(row, lid, base, lse, plain, labelled, label);
    let mass_k = kept_mass.x;
    let student_k = kept_mass.y;
    var log_norm = 0.0;
    if div_code() != 0u {
        log_norm = divergence_sums(row, lid, base, lse, tail, student_k);
    }
    if lid == 0u {
        if plain {
            // The plain case: no hard part.
            write_loss(row, vec4<f32>(red_sum[0], lse, red_sum[0], 0.0), row_is_bad, flagged);
        } else {
            write_terms_loss(row, base, lse, vec2<f32>(mass_k, student_k), log_norm, row_is_bad, flagged, label);
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
            let x = words4(base4, g4);
            grad[base4 + g4] = grad4(x.a, g4, vocab, c, lse);
            grad[base4 + g4 + WG] = grad4(x.b, g4 + WG, vocab, c, lse);
            grad[base4 + g4 + 2u * WG] = grad4(x.c, g4 + 2u * WG, vocab, c, lse);
            grad[base4 + g4 + 3u * WG] = grad4(x.d, g4 + 3u * WG, vocab, c, lse);
        }
        for (; g4 < padded; g4 += WG) {
            grad[base4 + g4] = grad4(logits[base4 + g4], g4, vocab, c, lse);
        }
        // ... then c * (p_S - p_T) on the teacher's columns. The barrier orders
        // these stores after the ones above within the workgroup.
        storageBarrier();
        let tbase = row * params.k;
        for (var q = lid; q < params.k; q += WG) {
            let id = ids[tbase + q];
            let ps = exp(logit(base, id) - lse);
            grad[(base + id) / 4u][id % 4u] = f16(c * (ps - probs[tbase + q]));
        }
        return;
    }
    terms_grad(row, lid, c, lse, labelled, label);
}

// Pass 1: this invocation's fold of the row's words, four 16-byte loads in
// flight; the general fold with `terms` (a cap, τ ≠ 1, the hard term),
// else the plain one (fold4). `terms` is constant per pipeline, so each
// compiles one loop.
fn fold_row(base4: u32, words: u32, lid: u32, vocab: u32, terms: bool) -> FoldTerms {
    var ft = FoldTerms(NEG_HUGE, 0.0, 0.0, 0.0, 0u);
    var j4 = lid;
    for (; j4 + 3u * WG < words; j4 += 4u * WG) {
        let x = words4(base4, j4);
        ft = fold4(ft, x.a, j4, vocab, terms);
        ft = fold4(ft, x.b, j4 + WG, vocab, terms);
        ft = fold4(ft, x.c, j4 + 2u * WG, vocab, terms);
        ft = fold4(ft, x.d, j4 + 3u * WG, vocab, terms);
    }
    for (; j4 < words; j4 += WG) {
        ft = fold4(ft, logits[base4 + j4], j4, vocab, terms);
    }
    return ft;
}

// The soft term's sum over the row's k teacher entries into red_sum[0]
// and, outside the plain case, (Σ_k p_T, Σ_k p_S) (and the teacher's
// probability at the label into row_label_p).
fn teacher_sums(row: u32, lid: u32, base: u32, lse: f32, plain: bool, labelled: bool, label: u32) -> vec2<f32> {
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
    return vec2<f32>(red_max[0], red_aux[0]);
}

// The reverse KL and the JSD need the row's student mass on the k first
// (renormalized: q = p_S/Σ_k p_S): a second pass over the k sums the bins'
// f (into red_sum[0]) and q·f' (into red_aux[0]). Returns log N.
fn divergence_sums(row: u32, lid: u32, base: u32, lse: f32, tail: u32, student_k: f32) -> f32 {
    let k = params.k;
    let tbase = row * k;
    var log_norm = 0.0;
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
    sum_pair(lid, f_sum, e_sum);
    return log_norm;
}

// A row's loss words (lane 0): loss, lse at τ = 1, soft part, hard part;
// NaN for bad logits, the marker's bits (from the word itself: WGSL cannot
// write a constant NaN) for a flagged row.
fn write_loss(row: u32, words: vec4<f32>, row_is_bad: bool, flagged: bool) {
    var out = words;
    if row_is_bad {
        out = vec4<f32>(nan_f32());
    }
    if flagged {
        out.x = bitcast<f32>(row_in[row * 2u]);
    }
    loss[row * 4u] = out.x;
    loss[row * 4u + 1u] = out.y;
    loss[row * 4u + 2u] = out.z;
    loss[row * 4u + 3u] = out.w;
}

// The loss words with the terms (lane 0), and pass 2's row constants
// (row_c0, row_c1; row_div for the reverse KL and the JSD). `kept_mass` is
// (Σ_k p_T, Σ_k p_S), `log_norm` the divergences' log N; red_sum[0] holds
// the soft term's sum and red_aux[0] the divergences' E.
fn write_terms_loss(row: u32, base: u32, lse: f32, kept_mass: vec2<f32>, log_norm: f32, row_is_bad: bool, flagged: bool, label: u32) {
    let vocab = params.vocab;
    let labelled = label < vocab;
    let tail = (KL_FLAGS >> F_TAIL_SHIFT) & 3u;
    let mass_k = kept_mass.x;
    let student_k = kept_mass.y;
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
    write_loss(row, vec4<f32>(total_loss, lse1, soft, hard), row_is_bad, flagged);
    let a = params.soft_weight * f_off;
    let b = tau * (alpha_hard + 2.0 * lambda * lse1);
    let h = tau * alpha_hard * eps / f32(vocab);
    row_c0 = vec4<f32>(a, b, h, f_on);
    // k1 = exp(τ·lse − lse1): p¹ = (p^τ)^τ·k1 (p_one).
    row_c1 = vec4<f32>(tau * alpha_hard * (1.0 - eps), lse1, f_off, exp(tau * lse - lse1));
}

// Pass 2 with the terms: grad = c·∂L/∂s over the row, then the teacher's
// columns, then the label's.
fn terms_grad(row: u32, lid: u32, c: f32, lse: f32, labelled: bool, label: u32) {
    let t = terms_row(c, lse);
    let r = t.r;
    let vocab = params.vocab;
    let base = row * params.ld;
    let base4 = base / 4u;
    let padded = params.ld / 4u;
    let tbase = row * params.k;
    var g4 = lid;
    for (; g4 + 3u * WG < padded; g4 += 4u * WG) {
        let x = words4(base4, g4);
        grad[base4 + g4] = grad4_terms(x.a, g4, vocab, r);
        grad[base4 + g4 + WG] = grad4_terms(x.b, g4 + WG, vocab, r);
        grad[base4 + g4 + 2u * WG] = grad4_terms(x.c, g4 + 2u * WG, vocab, r);
        grad[base4 + g4 + 3u * WG] = grad4_terms(x.d, g4 + 3u * WG, vocab, r);
    }
    for (; g4 < padded; g4 += WG) {
        grad[base4 + g4] = grad4_terms(logits[base4 + g4], g4, vocab, r);
    }
    // ... then the teacher's columns: cap'·(α_soft·(f_on·p^τ − p_T) + b·p¹ − h)
    // (the barrier orders these stores after the ones above) ...
    storageBarrier();
    for (var q = lid; q < params.k; q += WG) {
        let id = ids[tbase + q];
        grad[(base + id) / 4u][id % 4u] = f16(teacher_grad(logit(base, id), probs[tbase + q], t));
    }
    // ... then the label's column, whole, over whatever was written there
    // (the barrier is outside the label's branch: uniform control flow).
    storageBarrier();
    if labelled && lid == 0u {
        grad[(base + label) / 4u][label % 4u] = f16(label_grad(logit(base, label), t));
    }
}
