// Device-resident gather, step 1 of a chunk (headkl_core::toolkit::KernelId::GatherIn):
// one invocation per column of the chunk's [rows][k + 1] gather rows copies
// the caller's id (u32 [ntok][k]) for the top-k kernel's gather mode. None
// (0xffffffff, an i32 −1) stays none; an id at or past vocab is flagged in
// the status buffer (S_ID_RANGE, its flat index) and becomes none, so the
// kernel never reads past the row; the last column is none, where the
// kernel writes the row's lse. Prepended by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> status: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> ids_chunk: array<u32>;

// params: GatherRowsParams.
@compute @workgroup_size(WG)
fn gather_in(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let at = cell_of(wg, lid, params.rows, params.k + 1u);
    if !at.inside {
        return;
    }
    var id = NONE;
    if at.col < params.k {
        id = ids[params.ids_offset + at.row * params.k + at.col];
        if id != NONE && id >= params.vocab {
            atomicMin(&status[S_ID_RANGE], (params.token0 + at.row) * params.k + at.col);
            id = NONE;
        }
    }
    ids_chunk[at.i] = id;
}
