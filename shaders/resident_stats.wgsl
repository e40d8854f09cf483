// Device-resident head_kl, step 1 (headkl_core::toolkit::KernelId::WeightStats): one
// workgroup sums and maxes the token weights on the device, flags the first
// bad weight, and resolves total and gscale into the status buffer's
// coefficient words; when total is not positive the KL multiplier word is
// FLAGGED_ROW, so teacher_rows flags every row of the call (and the dx
// multiplier 0). Prepended by resident_common.wgsl; reduce_sum_max_min:
// resident_reduce.wgsl, appended.

@group(0) @binding(1) var<storage, read> weights: array<f32>;
@group(0) @binding(2) var<storage, read_write> status: array<atomic<u32>>;

// params (WeightStatsParams): rows = ntok; total and gscale are the caller's
// (0: the weights' sum, and 2^14 * total / max weight / grad_bound).
@compute @workgroup_size(WG)
fn weight_stats(@builtin(local_invocation_index) lid: u32) {
    let has_w = params.has_weights != 0u;
    var s = 0.0;
    var m = 0.0;
    var bad = NONE;
    for (var t = lid; t < params.rows; t += WG) {
        var w = 1.0;
        if has_w {
            w = weights[t];
        }
        if non_finite(w) || negative(w) {
            bad = min(bad, t);
            w = 0.0;
        }
        s += w;
        m = max(m, w);
    }
    // The weights' sum and max, and the first bad one.
    let red = reduce_sum_max_min(lid, s, m, bad);
    if lid != 0u {
        return;
    }
    if red.min != NONE {
        atomicMin(&status[S_WEIGHT], red.min);
    }
    var total = red.sum;
    if params.total > 0.0 {
        total = params.total;
    }
    let max_w = red.max;
    var gscale = 1.0;
    if params.gscale > 0.0 {
        gscale = params.gscale;
    } else if max_w > 0.0 {
        gscale = 16384.0 * (total / max_w) / max(params.grad_bound, 1.0);
    }
    var coef_mul = FLAGGED_ROW;
    var dx_mul = 0.0;
    if total > 0.0 && !non_finite(total) && !non_finite(gscale) && gscale > 0.0 {
        coef_mul = bitcast<u32>(gscale / total);
        dx_mul = params.inv_temperature / gscale;
    } else {
        atomicStore(&status[S_TOTAL_BAD], 1u);
        atomicStore(&status[S_TOTAL_BITS], bitcast<u32>(total));
    }
    atomicStore(&status[S_COEF_MUL], coef_mul);
    atomicStore(&status[S_DX_MUL], bitcast<u32>(dx_mul));
}
