// The KL row kernel (headkl_core::KlDesc): one workgroup per token row.
// See shaders/README.md.
enable f16;

// <params: generated from crates/core/src/params.rs (headkl_core::kernels::Shader::source)>

// Rows are read 4 logits (16 bytes) at a time: ld is a multiple of 16.
@group(0) @binding(1) var<storage, read> logits: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> probs: array<f32>;
@group(0) @binding(4) var<storage, read> coef: array<f32>;
@group(0) @binding(5) var<storage, read_write> loss: array<f32>;
@group(0) @binding(6) var<storage, read_write> grad: array<vec4<f16>>;

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

// Logit `j` of the row starting at element `base` (a multiple of 4).
fn logit(base: u32, j: u32) -> f32 {
    return logits[(base + j) / 4u][j % 4u];
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

// Merges two (max, sum of exp(x - max)) pairs.
fn merge(m1: f32, s1: f32, m2: f32, s2: f32) -> vec2<f32> {
    let m = max(m1, m2);
    return vec2<f32>(m, s1 * exp(m1 - m) + s2 * exp(m2 - m));
}

// c * p_S for word j4's 4 logits, zero past vocab.
fn grad4(x4: vec4<f32>, j4: u32, vocab: u32, c: f32, lse: f32) -> vec4<f16> {
    var g = vec4<f32>(0.0);
    for (var e = 0u; e < 4u; e++) {
        if j4 * 4u + e < vocab {
            g[e] = c * exp(x4[e] - lse);
        }
    }
    return vec4<f16>(g);
}

@compute @workgroup_size(256)
fn kl_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.x + wg.y * params.grid_x;
    if row >= params.rows {
        return;
    }
    let vocab = params.vocab;
    let base = row * params.ld;

    // Pass 1: online max and sum of exp(s - max), plus a non-finite flag,
    // over 4 logits at a time (those past vocab skipped).
    var st = Fold(vec2<f32>(NEG_HUGE, 0.0), 0u);
    let base4 = base / 4u;
    let words = (vocab + 3u) / 4u;
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
    let ms = st.ms;
    let bad = st.bad;
    let m = ms.x;
    let s = ms.y;
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
            let log_ps = logit(base, ids[tbase + q]) - lse;
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

    // Pass 2: grad = c * p_S everywhere, zero in the padding, 4 at a time ...
    let c = coef[row];
    let padded = params.ld / 4u;
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
}
