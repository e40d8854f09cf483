// Device-resident gather (headkl_core::toolkit::KernelId::GatherIn and
// GatherOut): both steps copy one 32-bit word per column of a chunk's
// [rows][k + 1] gather rows, between the caller's [ntok][k] and the
// top-k kernel's gather mode. Prepended by resident_common.wgsl.
//
// gather_in, the chunk's first step: the caller's ids (u32) into the gather
// rows. None (0xffffffff, an i32 −1) stays none; an id at or past vocab is
// flagged in the status buffer (S_ID_RANGE, its flat index) and becomes
// none, so the kernel never reads past the row; the last column is none,
// where the kernel writes the row's lse.
//
// gather_out, the chunk's last step: the gather mode's values (f32) back,
// the k log-probabilities into the caller's [ntok][k] and the last column,
// the row's lse, into lse [ntok]; a token whose logits were not finite (a
// NaN first value or a non-finite lse) is flagged in the status buffer.

// gather_in: the caller's ids; gather_out: the chunk's values (f32 bits).
@group(0) @binding(1) var<storage, read> words_in: array<u32>;
@group(0) @binding(2) var<storage, read_write> status: array<atomic<u32>>;
// gather_in: the chunk's ids; gather_out: the caller's log-probabilities.
@group(0) @binding(3) var<storage, read_write> words_out: array<u32>;
// gather_out alone: the caller's lse [ntok].
@group(0) @binding(4) var<storage, read_write> lse: array<f32>;

// params: GatherRowsParams.
@compute @workgroup_size(WG)
fn gather_in(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let at = cell_of(wg, lid, params.rows, params.k + 1u);
    if !at.inside {
        return;
    }
    var id = NONE;
    if at.col < params.k {
        id = words_in[params.ids_offset + at.row * params.k + at.col];
        if id != NONE && id >= params.vocab {
            atomicMin(&status[S_ID_RANGE], (params.token0 + at.row) * params.k + at.col);
            id = NONE;
        }
    }
    words_out[at.i] = id;
}

@compute @workgroup_size(WG)
fn gather_out(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let at = cell_of(wg, lid, params.rows, params.k + 1u);
    if !at.inside {
        return;
    }
    let token = params.token0 + at.row;
    let bits = words_in[at.i];
    if at.col < params.k {
        words_out[params.out_offset + at.row * params.k + at.col] = bits;
        // A NaN by its bits (a float test may be folded); -inf is a none id.
        if at.col == 0u && (bits & 0x7fffffffu) > 0x7f800000u {
            atomicMin(&status[S_LOGITS], token);
        }
    } else {
        let v = bitcast<f32>(bits);
        lse[token] = v;
        if non_finite(v) {
            atomicMin(&status[S_LOGITS], token);
        }
    }
}
