// The KL row kernel (headkl_core::toolkit::KlDesc): one workgroup per token row.
// See shaders/README.md. Each term set is a pipeline of its own: KL_FLAGS
// (params.flags, set by headkl_core::toolkit::Checked::build) is an override, so the
// driver folds every branch on it. With KL_FLAGS = 0 it runs the seed's loss
// (the "plain" loops, compiled without the terms' code); otherwise the
// general loops with the terms the flags name (softcap, tail mode, hard
// label, z-loss, τ ≠ 1).
//
// The kernel is assembled from parts by the catalogue
// (headkl_core::toolkit::kernels::KL_ROWS_WGSL), in this order: this file
// (the bindings and the workgroup state), kl_rows_fold.wgsl (the divergence
// terms and pass 1's folds), kl_rows_grad.wgsl (pass 2's gradient
// expressions), kl_rows.wgsl (the entry point), kl_rows_filter.wgsl (pass 2
// of a flagged row and with the block filter) and kl_rows_dense.wgsl (the
// full-vocabulary teacher).
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

// The workgroup's sums of `a` and `b` (each invocation's part), left in
// red_sum[0] and red_aux[0]. Every invocation calls it: it holds barriers.
fn sum_pair(lid: u32, a: f32, b: f32) {
    red_sum[lid] = a;
    red_aux[lid] = b;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride {
            red_sum[lid] += red_sum[lid + stride];
            red_aux[lid] += red_aux[lid + stride];
        }
        workgroupBarrier();
    }
}

// Four of a row's 16-byte logit words, WG apart from word j4: the hot
// loops' four loads in flight per invocation.
struct Words4 {
    a: vec4<f32>,
    b: vec4<f32>,
    c: vec4<f32>,
    d: vec4<f32>,
}

fn words4(base4: u32, j4: u32) -> Words4 {
    return Words4(logits[base4 + j4], logits[base4 + j4 + WG], logits[base4 + j4 + 2u * WG], logits[base4 + j4 + 3u * WG]);
}
