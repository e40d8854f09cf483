// Device-resident head_kl with the head's gradient, last step of the call
// (headkl_core::toolkit::KernelId::HeadGradOut): one piece of the gradient's
// f32 rows (ld apart) into the caller's [V][hs] buffer at dst_offset,
// scaled by the coefficient the stats kernel resolved (dx's: the GEMMs ran
// with the logit scale alone, as dx's did). Prepended by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> piece: array<f32>;
@group(0) @binding(2) var<storage, read_write> status: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

// The multiplier, read once for the workgroup: an atomic load from every
// invocation queues on the one cache line that holds it.
var<workgroup> dx_mul_word: u32;

// params: HeadGradOutParams.
@compute @workgroup_size(WG)
fn head_grad_out(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if lid == 0u {
        dx_mul_word = atomicLoad(&status[S_DX_MUL]);
    }
    let dx_mul = bitcast<f32>(workgroupUniformLoad(&dx_mul_word));
    let at = cell_of(wg, lid, params.rows, params.hs);
    if !at.inside {
        return;
    }
    // Rows ld apart; a piece as wide as its rows is one run of words.
    var src = at.i;
    if params.ld != params.hs {
        src = at.row * params.ld + at.col;
    }
    dst[params.dst_offset + at.i] = dx_mul * piece[src];
}
