// The distill_step example's own kernels: the student's forward pass
// (hidden = features · map), plain SGD on the map from headkl's dx, and the
// step's mean loss into a history buffer, so no step needs the host.

struct Step {
    ntok: u32,
    d: u32,
    hs: u32,
    step: u32,
    lr: f32,
    pad0: f32,
    pad1: f32,
    pad2: f32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> feats: array<f32>;        // [ntok][d]
@group(0) @binding(2) var<storage, read_write> map: array<f32>;    // [d][hs]
@group(0) @binding(3) var<storage, read_write> rows: array<f32>;   // [ntok][hs]: hidden out, or dx in
@group(0) @binding(4) var<storage, read_write> loss: array<f32>;   // [ntok]
@group(0) @binding(5) var<storage, read_write> history: array<f32>; // [steps]

// Σ_q feats[f0 + q·fs] · x[q·hs + j] over q < n, in order: x is the map
// (`of_map`) or the rows.
fn feats_dot(of_map: bool, f0: u32, fs: u32, j: u32, n: u32) -> f32 {
    var s = 0.0;
    for (var q = 0u; q < n; q++) {
        var x = 0.0;
        if of_map {
            x = map[q * step.hs + j];
        } else {
            x = rows[q * step.hs + j];
        }
        s += feats[f0 + q * fs] * x;
    }
    return s;
}

// hidden[t][j] = sum_c feats[t][c] * map[c][j]
@compute @workgroup_size(64)
fn forward(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < step.ntok * step.hs {
        rows[i] = feats_dot(true, (i / step.hs) * step.d, 1u, i % step.hs, step.d);
    }
}

// map[c][j] -= lr * sum_t feats[t][c] * dx[t][j]
@compute @workgroup_size(64)
fn sgd(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < step.d * step.hs {
        map[i] -= step.lr * feats_dot(false, i / step.hs, step.d, i % step.hs, step.ntok);
    }
}

var<workgroup> partial: array<f32, 64>;

// history[step] = mean of loss (one workgroup)
@compute @workgroup_size(64)
fn record_loss(@builtin(local_invocation_index) lid: u32) {
    var s = 0.0;
    for (var t = lid; t < step.ntok; t += 64u) {
        s += loss[t];
    }
    partial[lid] = s;
    workgroupBarrier();
    for (var h = 32u; h > 0u; h >>= 1u) {
        if lid < h {
            partial[lid] += partial[lid + h];
        }
        workgroupBarrier();
    }
    if lid == 0u {
        history[step.step] = partial[0] / f32(step.ntok);
    }
}
