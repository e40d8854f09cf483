// Device-resident head_kl, step 2 (headkl_core::toolkit::KernelId::TeacherRows): one
// workgroup per token row of a chunk checks the caller's teacher row, writes
// it clamped and renormalized into the engine's scratch with the row's
// KL coefficient, and flags a bad row in the status buffer. A bad row gets
// zero probabilities, so whatever its bytes it reads and writes nothing out
// of bounds, and the coefficient word FLAGGED_ROW
// (headkl_core::resident::status::FLAGGED_ROW), as does a row of bad
// weight and, when total is not positive (the stats kernel's multiplier
// word is FLAGGED_ROW then), every row: kl_rows gives such a row a zero
// gradient and a NaN loss. The values are probabilities or
// log-probabilities over the full vocabulary (each ≤ 0, -inf is 0),
// renormalized over the k in the renormalize tail mode and kept as given in the others, where a row whose mass is above 1 +
// MASS_TOLERANCE is bad. The row's coefficient goes into the KL kernel's
// per-row inputs, word 0 of [rows][2] (word 1, the label, is labels_in's).
// Prepended by resident_common.wgsl; reduce_sum_max_min:
// resident_reduce.wgsl, appended.

@group(0) @binding(1) var<storage, read> ids_in: array<u32>;
@group(0) @binding(2) var<storage, read> probs_in: array<f32>;
@group(0) @binding(3) var<storage, read> weights: array<f32>;
@group(0) @binding(4) var<storage, read_write> status: array<atomic<u32>>;
@group(0) @binding(5) var<storage, read_write> ids_out: array<u32>;
@group(0) @binding(6) var<storage, read_write> probs_out: array<f32>;
@group(0) @binding(7) var<storage, read_write> row_in: array<u32>;

// Whether value v is bad for the teacher's form, and its probability.
fn teacher_value(v: f32, logprobs: bool) -> vec2<f32> {
    if logprobs {
        // NaN (by its bits) or above 0 (+inf included).
        if (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u || v > 0.0 {
            return vec2<f32>(1.0, 0.0);
        }
        return vec2<f32>(0.0, exp(v));
    }
    if non_finite(v) || negative(v) {
        return vec2<f32>(1.0, 0.0);
    }
    return vec2<f32>(0.0, v);
}

var<workgroup> row_ids: array<u32, MAX_K>;

// params: TeacherRowsParams (offsets: the chunk's first id, probability and
// weight in the caller's buffers).
@compute @workgroup_size(WG)
fn teacher_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.x + wg.y * params.grid_x;
    if row >= params.rows {
        return;
    }
    let k = params.k;
    let logprobs = params.logprobs != 0u;
    let renormalize = params.tail == TAIL_RENORMALIZE;
    let base_a = params.ids_offset + row * k;
    let base_b = params.probs_offset + row * k;
    var s = 0.0;
    var bad = 0u;
    var first_range = NONE;
    for (var q = lid; q < k; q += WG) {
        let id = ids_in[base_a + q];
        row_ids[q] = id;
        if id >= params.vocab {
            first_range = min(first_range, q);
        }
        let bp = teacher_value(probs_in[base_b + q], logprobs);
        if bp.x != 0.0 {
            bad = 1u;
        } else {
            s += bp.y;
        }
    }
    workgroupBarrier();
    for (var q = lid; q < k; q += WG) {
        let id = row_ids[q];
        for (var j = 0u; j < q; j++) {
            if row_ids[j] == id {
                bad = 1u;
            }
        }
    }
    // The row's sum, whether some entry is bad (as 0 or 1), and its first
    // id out of range.
    let red = reduce_sum_max_min(lid, s, f32(bad), first_range);
    let sum = red.sum;
    let mass_bad = !renormalize && sum > 1.0 + MASS_TOLERANCE;
    let row_bad = red.max != 0.0 || !(sum > 0.0) || non_finite(sum) || mass_bad;
    let range_bad = red.min != NONE;
    let any_bad = row_bad || range_bad;
    var inv = 0.0;
    if !any_bad {
        inv = 1.0 / sum;
        if !renormalize {
            inv = 1.0;
        }
    }
    for (var q = lid; q < k; q += WG) {
        ids_out[row * k + q] = min(row_ids[q], params.vocab - 1u);
        var p = 0.0;
        if !any_bad {
            p = teacher_value(probs_in[base_b + q], logprobs).y * inv;
        }
        probs_out[row * k + q] = p;
    }
    if lid != 0u {
        return;
    }
    let token = params.token0 + row;
    if range_bad {
        atomicMin(&status[S_ID_RANGE], token * k + red.min);
    }
    if row_bad {
        atomicMin(&status[S_ROW], token);
    }
    var w = 1.0;
    var w_bad = false;
    if params.has_weights != 0u {
        w = weights[params.weights_offset + row];
        // Flagged by the stats kernel (S_WEIGHT).
        w_bad = non_finite(w) || negative(w);
    }
    // Compared as bits: FLAGGED_ROW is a NaN.
    let coef_mul = atomicLoad(&status[S_COEF_MUL]);
    var c = FLAGGED_ROW;
    if !any_bad && !w_bad && coef_mul != FLAGGED_ROW {
        c = bitcast<u32>(w * bitcast<f32>(coef_mul));
    }
    row_in[row * 2u] = c;
}
