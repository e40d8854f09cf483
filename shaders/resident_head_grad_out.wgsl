// Device-resident head_kl with the head's gradient, last step of the call
// (headkl_core::toolkit::KernelId::HeadGradOut): one piece of the gradient's
// f32 rows (ld apart) into the caller's [V][hs] buffer at dst_offset,
// scaled by the coefficient the stats kernel resolved (dx's: the GEMMs ran
// with the logit scale alone, as dx's did). Prepended by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> piece: array<f32>;
@group(0) @binding(2) var<storage, read_write> status: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

// params: HeadGradOutParams.
@compute @workgroup_size(WG)
fn head_grad_out(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let at = cell_of(wg, lid, params.rows, params.hs);
    if !at.inside {
        return;
    }
    dst[params.dst_offset + at.i] = bitcast<f32>(atomicLoad(&status[S_DX_MUL])) * piece[at.row * params.ld + at.col];
}
