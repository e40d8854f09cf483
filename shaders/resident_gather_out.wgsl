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
    let i = (wg.x + wg.y * params.grid_x) * WG + lid;
    let cols = params.k + 1u;
    if i >= params.rows * cols {
        return;
    }
    let row = i / cols;
    let col = i % cols;
    let v = values_chunk[i];
    if col < params.k {
        logprobs[params.out_offset + row * params.k + col] = v;
        // A NaN by its bits (a float test may be folded); -inf is a none id.
        if col == 0u && (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u {
            atomicMin(&status[S_LOGITS], params.token0 + row);
        }
    } else {
        lse[params.token0 + row] = v;
        if non_finite(v) {
            atomicMin(&status[S_LOGITS], params.token0 + row);
        }
    }
}
