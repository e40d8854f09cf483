// Device-resident two-phase loss of a vocabulary shard
// (headkl_core::toolkit::KernelId::ShardRows, headkl_core::toolkit::ShardRowsDesc): one
// invocation per token row of a chunk runs one step (params.stage) around
// the unchanged kl_rows. Partials and merged statistics are [ntok][3]:
// lse at τ, lse at τ = 1, the teacher's in-shard terms. Each step touches
// only the buffers it names. Prepended by resident_common.wgsl.

// STAGE_* (headkl_core::toolkit::ShardStage::code) and ALPHA_FLOOR, the floor on
// the shard's softmax share α (2^-40, as the host path), come with the
// parameter block.

// kl_rows' [rows][4]: loss, lse at τ = 1, soft, hard.
@group(0) @binding(1) var<storage, read_write> loss_chunk: array<f32>;
@group(0) @binding(2) var<storage, read> stats: array<f32>;
@group(0) @binding(3) var<storage, read_write> partials: array<f32>;
@group(0) @binding(4) var<storage, read_write> ids: array<u32>;
@group(0) @binding(5) var<storage, read_write> probs: array<f32>;
// [rows][2]: the coefficient's f32 bits, the label.
@group(0) @binding(6) var<storage, read_write> row_in: array<u32>;
@group(0) @binding(7) var<storage, read_write> status: array<atomic<u32>>;

// Maps row `row`'s global ids (teacher_rows' output) to the shard's local
// ids in place, probabilities scaled by `inv_alpha`. An entry outside the
// shard copies the row's first in-shard entry when `duplicate` (the loss
// kernel then writes the same gradient twice) or else gets probability 0;
// with no in-shard entry it is column 0 at probability 0.
fn map_row(row: u32, inv_alpha: f32, duplicate: bool) {
    let k = params.k;
    let base = row * k;
    var first_id = 0u;
    var first_p = 0.0;
    for (var q = 0u; q < k; q++) {
        let id = ids[base + q];
        if id >= params.v0 && id < params.v1 {
            first_id = id - params.v0;
            first_p = probs[base + q] * inv_alpha;
            break;
        }
    }
    if !duplicate {
        first_p = 0.0;
    }
    for (var q = 0u; q < k; q++) {
        let id = ids[base + q];
        if id >= params.v0 && id < params.v1 {
            ids[base + q] = id - params.v0;
            probs[base + q] = probs[base + q] * inv_alpha;
        } else {
            ids[base + q] = first_id;
            probs[base + q] = first_p;
        }
    }
}

// params: ShardRowsParams.
@compute @workgroup_size(WG)
fn shard_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = invocation_index(wg, lid);
    if row >= params.rows {
        return;
    }
    let t = (params.token0 + row) * 3u;
    let stage = params.stage;
    if stage == STAGE_MAP {
        map_row(row, 1.0, false);
    } else if stage == STAGE_PARTIALS {
        let lse = loss_chunk[row * 4u + 1u];
        var mass = 0.0;
        for (var q = 0u; q < params.k; q++) {
            mass += probs[row * params.k + q];
        }
        partials[t] = lse;
        if params.lse1_too != 0u {
            partials[t + 1u] = lse;
        }
        partials[t + 2u] = loss_chunk[row * 4u + 2u] - mass * lse;
        if non_finite(lse) {
            atomicMin(&status[S_LOGITS], params.token0 + row);
        }
    } else if stage == STAGE_LSE1 {
        partials[t + 1u] = loss_chunk[row * 4u + 1u];
    } else if stage == STAGE_MAP_FINISH {
        let alpha = max(exp(partials[t] - stats[t]), ALPHA_FLOOR);
        map_row(row, 1.0 / alpha, true);
        // A flagged row's word stays FLAGGED_ROW (compared as bits: a NaN
        // times α need not keep them).
        let word = row_in[row * 2u];
        if word != FLAGGED_ROW {
            row_in[row * 2u] = bitcast<u32>(bitcast<f32>(word) * alpha);
        }
    } else if stage == STAGE_LOSS {
        // A row with bad logits, or a flagged one (its loss word the
        // marker, for loss_out), stays as kl_rows wrote it.
        if !non_finite(loss_chunk[row * 4u]) {
            let l = stats[t + 2u] + stats[t];
            loss_chunk[row * 4u] = l;
            loss_chunk[row * 4u + 1u] = stats[t + 1u];
            loss_chunk[row * 4u + 2u] = l;
            loss_chunk[row * 4u + 3u] = 0.0;
        }
    }
}
