// Device-resident head_kl, last step of a chunk
// (headkl_core::toolkit::KernelId::LossOut): the chunk's per-token loss and dx
// into the caller's buffers (dx scaled by the coefficient the stats kernel
// resolved, overwritten or accumulated), and the first token whose logits
// were not finite (NaN loss from kl_rows) into the status buffer.
// A flagged row (kl_rows wrote FLAGGED_ROW's bits as its loss word) gets NaN
// loss and terms; its dx row is already 0. Its logits are judged by its lse
// word instead (NaN exactly when kl_rows found them not finite), so a row
// whose only fault is the flag does not also read as bad logits in
// S_LOGITS. Prepended by resident_common.wgsl.

// [rows][4]: loss, lse, soft, hard (kl_rows); the loss is word 0.
@group(0) @binding(1) var<storage, read> loss_chunk: array<f32>;
@group(0) @binding(2) var<storage, read> dx_chunk: array<f32>;
@group(0) @binding(3) var<storage, read_write> status: array<atomic<u32>>;
@group(0) @binding(4) var<storage, read_write> loss_dst: array<f32>;
@group(0) @binding(5) var<storage, read_write> dx_dst: array<f32>;
// [ntok][3]: lse, soft, hard (written with params.write_terms).
@group(0) @binding(6) var<storage, read_write> terms_dst: array<f32>;

// dx's multiplier, read once for the workgroup (as in
// resident_head_grad_out.wgsl).
var<workgroup> dx_mul_word: u32;

// params: LossOutParams.
@compute @workgroup_size(WG)
fn loss_out(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if lid == 0u {
        dx_mul_word = atomicLoad(&status[S_DX_MUL]);
    }
    let dx_mul = bitcast<f32>(workgroupUniformLoad(&dx_mul_word));
    let at = cell_of(wg, lid, params.rows, params.hs);
    let i = at.i;
    if i < params.rows {
        let l = loss_chunk[i * 4u];
        // The bits, never a float NaN test (which may be folded).
        let flagged = bitcast<u32>(l) == FLAGGED_ROW;
        // l is a NaN for a flagged row.
        loss_dst[params.loss_offset + i] = l;
        if params.write_terms != 0u {
            for (var c = 0u; c < 3u; c++) {
                var v = loss_chunk[i * 4u + 1u + c];
                if flagged {
                    v = l;
                }
                terms_dst[(params.loss_offset + i) * 3u + c] = v;
            }
        }
        var logits_word = l;
        if flagged {
            logits_word = loss_chunk[i * 4u + 1u];
        }
        if non_finite(logits_word) {
            atomicMin(&status[S_LOGITS], params.token0 + i);
        }
    }
    if !at.inside {
        return;
    }
    let v = dx_mul * dx_chunk[at.row * params.ld + at.col];
    let o = params.dx_offset + i;
    if params.accumulate != 0u {
        dx_dst[o] = dx_dst[o] + v;
    } else {
        dx_dst[o] = v;
    }
}
