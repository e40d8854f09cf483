// Device-resident head_kl, step 2b (headkl_core::toolkit::KernelId::LabelsIn):
// one invocation per token row of a chunk copies the caller's label into the
// KL kernel's per-row inputs (word 1 of [rows][2]), NONE where no labels are
// given. A label that is neither below vocab nor NONE is flagged in the
// status buffer and becomes NONE, so the KL kernel never reads past the
// row, and the row's coefficient (word 0, teacher_rows') becomes
// FLAGGED_ROW, as for a bad teacher row: a zero gradient and a NaN loss.
// Prepended by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> labels: array<u32>;
@group(0) @binding(2) var<storage, read_write> status: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> row_in: array<u32>;

// params: LabelsInParams.
@compute @workgroup_size(WG)
fn labels_in(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = invocation_index(wg, lid);
    if row >= params.rows {
        return;
    }
    var label = NONE;
    if params.has_labels != 0u {
        label = labels[params.labels_offset + row];
        if label != NONE && label >= params.vocab {
            atomicMin(&status[S_LABEL], params.token0 + row);
            label = NONE;
            row_in[row * 2u] = FLAGGED_ROW;
        }
    }
    row_in[row * 2u + 1u] = label;
}
