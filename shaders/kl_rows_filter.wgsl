// Part of the KL row kernel (assembled in kl_rows_state.wgsl's order):
// pass 2 of a flagged row, and pass 2 with the dx GEMM's block filter
// (F_FILTER).


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
    let vocab = params.vocab;
    let base = row * params.ld;
    let base4 = base / 4u;
    let padded = params.ld / 4u;
    let tbase = row * params.k;
    let t = terms_row(c, lse);
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
                g = grad4_terms_f32(x4, g4, vocab, t.r);
            }
            grad[base4 + g4] = vec4<f16>(g);
            if kept(g.x, c) || kept(g.y, c) || kept(g.z, c) || kept(g.w, c) {
                mark(g4 * 4u, col0);
            }
        }
        // The teacher's columns over the bulk's stores (ordered by the
        // barrier) ...
        storageBarrier();
        for (var q = lid; q < params.k; q += WG) {
            let id = ids[tbase + q];
            if id < col0 || id >= col1 {
                continue;
            }
            var gv = 0.0;
            if plain {
                let ps = exp(logit(base, id) - lse);
                gv = c * (ps - probs[tbase + q]);
            } else {
                gv = teacher_grad(logit(base, id), probs[tbase + q], t);
            }
            grad[(base + id) / 4u][id % 4u] = f16(gv);
            if kept(gv, c) {
                mark(id, col0);
            }
        }
        // ... then the label's column, whole (general case only).
        storageBarrier();
        if !plain && labelled && lid == 0u && label >= col0 && label < col1 {
            let gv = label_grad(logit(base, label), t);
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

