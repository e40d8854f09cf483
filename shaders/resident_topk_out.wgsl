// Device-resident topk, last step of a chunk
// (headkl_core::toolkit::KernelId::TopkOut): the chunk's ids and probabilities
// into the caller's buffers, and the first token whose logits were not
// finite (NaN first probability from topk_rows) into the status buffer.
// Prepended by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> ids_chunk: array<u32>;
@group(0) @binding(2) var<storage, read> probs_chunk: array<f32>;
@group(0) @binding(3) var<storage, read_write> status: array<atomic<u32>>;
@group(0) @binding(4) var<storage, read_write> ids_dst: array<u32>;
@group(0) @binding(5) var<storage, read_write> probs_dst: array<f32>;

// params: TopkOutParams.
@compute @workgroup_size(WG)
fn topk_out(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let at = cell_of(wg, lid, params.rows, params.k);
    if !at.inside {
        return;
    }
    let p = probs_chunk[at.i];
    ids_dst[params.ids_offset + at.i] = ids_chunk[at.i];
    probs_dst[params.probs_offset + at.i] = p;
    if at.col == 0u && non_finite(p) {
        atomicMin(&status[S_LOGITS], params.token0 + at.row);
    }
}
