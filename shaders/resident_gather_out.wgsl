// Device-resident gather, last step of a chunk
// (headkl_core::toolkit::KernelId::GatherOut): one invocation per column of the
// chunk's [rows][k + 1] values from the top-k kernel's gather mode copies
// the k log-probabilities into the caller's [ntok][k] and the last column,
// the row's lse, into [ntok]; a token whose logits were not finite (a NaN
// first value or a non-finite lse) is flagged in the status buffer.
// Prepended by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> values_chunk: array<f32>;
@group(0) @binding(2) var<storage, read_write> status: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> logprobs: array<f32>;
@group(0) @binding(4) var<storage, read_write> lse: array<f32>;

// params: GatherRowsParams.
@compute @workgroup_size(WG)
fn gather_out(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let at = cell_of(wg, lid, params.rows, params.k + 1u);
    if !at.inside {
        return;
    }
    let token = params.token0 + at.row;
    let v = values_chunk[at.i];
    if at.col < params.k {
        logprobs[params.out_offset + at.row * params.k + at.col] = v;
        // A NaN by its bits (a float test may be folded); -inf is a none id.
        if at.col == 0u && (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u {
            atomicMin(&status[S_LOGITS], token);
        }
    } else {
        lse[token] = v;
        if non_finite(v) {
            atomicMin(&status[S_LOGITS], token);
        }
    }
}
