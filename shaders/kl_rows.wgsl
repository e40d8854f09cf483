// The KL row kernel (headkl_core::KlDesc): one workgroup per token row.
// See shaders/README.md.
enable f16;

struct RowParams {
    rows: u32,
    vocab: u32,
    ld: u32,
    k: u32,
    grid_x: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> params: RowParams;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> probs: array<f32>;
@group(0) @binding(4) var<storage, read> coef: array<f32>;
@group(0) @binding(5) var<storage, read_write> loss: array<f32>;
@group(0) @binding(6) var<storage, read_write> grad: array<f16>;

const WG: u32 = 256u;
const NEG_HUGE: f32 = -3.0e38;

var<workgroup> red_max: array<f32, WG>;
var<workgroup> red_sum: array<f32, WG>;
var<workgroup> red_bad: array<u32, WG>;
var<workgroup> row_lse: f32;
var<workgroup> row_bad: u32;

fn non_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) >= 0x7f800000u;
}

fn nan_f32() -> f32 {
    return bitcast<f32>(0x7fc00000u);
}

// Merges two (max, sum of exp(x - max)) pairs.
fn merge(m1: f32, s1: f32, m2: f32, s2: f32) -> vec2<f32> {
    let m = max(m1, m2);
    return vec2<f32>(m, s1 * exp(m1 - m) + s2 * exp(m2 - m));
}

@compute @workgroup_size(256)
fn kl_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.x + wg.y * params.grid_x;
    if row >= params.rows {
        return;
    }
    let vocab = params.vocab;
    let base = row * params.ld;

    // Pass 1: online max and sum of exp(s - max), plus a non-finite flag.
    var m = NEG_HUGE;
    var s = 0.0;
    var bad = 0u;
    for (var j = lid; j < vocab; j += WG) {
        let x = logits[base + j];
        if non_finite(x) {
            bad = 1u;
        } else if x > m {
            s = s * exp(m - x) + 1.0;
            m = x;
        } else {
            s += exp(x - m);
        }
    }
    red_max[lid] = m;
    red_sum[lid] = s;
    red_bad[lid] = bad;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride {
            let r = merge(red_max[lid], red_sum[lid], red_max[lid + stride], red_sum[lid + stride]);
            red_max[lid] = r.x;
            red_sum[lid] = r.y;
            red_bad[lid] |= red_bad[lid + stride];
        }
        workgroupBarrier();
    }
    if lid == 0u {
        let total = red_sum[0];
        var b = red_bad[0];
        if non_finite(total) || !(total > 0.0) {
            b = 1u;
        }
        row_bad = b;
        row_lse = red_max[0] + log(total);
    }
    let lse = workgroupUniformLoad(&row_lse);
    let row_is_bad = workgroupUniformLoad(&row_bad);

    // The loss over the teacher's k entries.
    let k = params.k;
    let tbase = row * k;
    var part = 0.0;
    for (var q = lid; q < k; q += WG) {
        let p = probs[tbase + q];
        if p > 0.0 {
            let log_ps = logits[base + ids[tbase + q]] - lse;
            part += p * (log(p) - log_ps);
        }
    }
    red_sum[lid] = part;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride {
            red_sum[lid] += red_sum[lid + stride];
        }
        workgroupBarrier();
    }
    if lid == 0u {
        if row_is_bad != 0u {
            loss[row] = nan_f32();
        } else {
            loss[row] = red_sum[0];
        }
    }

    // Pass 2: grad = c * p_S everywhere, zero in the padding ...
    let c = coef[row];
    for (var j = lid; j < params.ld; j += WG) {
        var g = 0.0;
        if j < vocab {
            g = c * exp(logits[base + j] - lse);
        }
        grad[base + j] = f16(g);
    }
    // ... then c * (p_S - p_T) on the teacher's columns. The barrier orders
    // these stores after the ones above within the workgroup.
    storageBarrier();
    for (var q = lid; q < k; q += WG) {
        let id = ids[tbase + q];
        let ps = exp(logits[base + id] - lse);
        grad[base + id] = f16(c * (ps - probs[tbase + q]));
    }
}
