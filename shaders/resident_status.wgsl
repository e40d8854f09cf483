// Device-resident head_kl, after the last chunk
// (headkl_core::toolkit::KernelId::StatusDetail): one invocation describes the first
// bad teacher row or weight the other kernels flagged, in the order the
// host checks them (ids in range over the whole teacher first; then per row
// duplicates, probabilities, the row's sum; then weights), into the status
// buffer's detail words, so the engine can return the host path's error.
// Runs only until a detail is recorded. Prepended by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> ids_in: array<u32>;
@group(0) @binding(2) var<storage, read> probs_in: array<f32>;
@group(0) @binding(3) var<storage, read> weights: array<f32>;
@group(0) @binding(4) var<storage, read_write> status: array<atomic<u32>>;
@group(0) @binding(5) var<storage, read> labels: array<u32>;

fn record(kind: u32, row: u32, a: u32, b: u32, value: u32) {
    atomicStore(&status[S_D_ROW], row);
    atomicStore(&status[S_D_A], a);
    atomicStore(&status[S_D_B], b);
    atomicStore(&status[S_D_VALUE], value);
    atomicStore(&status[S_KIND], kind);
}

// params: StatusDetailParams (rows = ntok; the caller's buffers from their
// first element).
@compute @workgroup_size(1)
fn status_detail() {
    if atomicLoad(&status[S_KIND]) != 0u {
        return;
    }
    let k = params.k;
    let flat = atomicLoad(&status[S_ID_RANGE]);
    if flat != NONE {
        record(KIND_ID_RANGE, flat / k, flat % k, ids_in[flat], 0u);
        return;
    }
    let row = atomicLoad(&status[S_ROW]);
    if row != NONE && row < params.rows {
        let ib = row * k;
        let pb = row * k;
        // The smallest repeated id, at its first two entries.
        var best = NONE;
        var first = 0u;
        var second = 0u;
        for (var q = 1u; q < k; q++) {
            let id = ids_in[ib + q];
            if id >= best {
                continue;
            }
            for (var j = 0u; j < q; j++) {
                if ids_in[ib + j] == id {
                    best = id;
                    first = j;
                    second = q;
                    break;
                }
            }
        }
        if best != NONE {
            record(KIND_DUPLICATE, row, first, second, best);
            return;
        }
        let logprobs = params.logprobs != 0u;
        let tail = params.tail;
        var sum = 0.0;
        for (var q = 0u; q < k; q++) {
            let p = probs_in[pb + q];
            if logprobs {
                if (bitcast<u32>(p) & 0x7fffffffu) > 0x7f800000u || p > 0.0 {
                    record(KIND_LOGPROB, row, q, 0u, bitcast<u32>(p));
                    return;
                }
                sum += exp(p);
                continue;
            }
            if non_finite(p) {
                record(KIND_PROB_NON_FINITE, row, q, 0u, bitcast<u32>(p));
                return;
            }
            if negative(p) {
                record(KIND_PROB_NEGATIVE, row, q, 0u, bitcast<u32>(p));
                return;
            }
            sum += p;
        }
        if tail != TAIL_RENORMALIZE && sum > 1.0 + MASS_TOLERANCE && !non_finite(sum) {
            record(KIND_MASS, row, 0u, tail, bitcast<u32>(sum));
            return;
        }
        record(KIND_ROW_SUM, row, 0u, 0u, bitcast<u32>(sum));
        return;
    }
    let wrow = atomicLoad(&status[S_WEIGHT]);
    if wrow != NONE && wrow < params.rows && params.has_weights != 0u {
        let w = weights[wrow];
        if non_finite(w) {
            record(KIND_WEIGHT_NON_FINITE, wrow, 0u, 0u, bitcast<u32>(w));
        } else {
            record(KIND_WEIGHT_NEGATIVE, wrow, 0u, 0u, bitcast<u32>(w));
        }
        return;
    }
    let lrow = atomicLoad(&status[S_LABEL]);
    if lrow != NONE && lrow < params.rows && params.has_labels != 0u {
        record(KIND_LABEL, lrow, 0u, 0u, labels[lrow]);
    }
}
