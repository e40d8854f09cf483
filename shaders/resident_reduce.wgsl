
// ---- shaders/resident_reduce.wgsl: appended by the catalogue to the
// device-resident kernels that reduce over their workgroup
// (resident_stats.wgsl, resident_teacher.wgsl; WGSL has no include).

var<workgroup> red_sum: array<f32, WG>;
var<workgroup> red_max: array<f32, WG>;
var<workgroup> red_min: array<u32, WG>;

// The workgroup's sum of s, max of m and min of n.
struct Reduced {
    sum: f32,
    max: f32,
    min: u32,
}

// Reduces every invocation's (s, m, n) over the workgroup (a tree in
// workgroup memory; every invocation gets the result). Call from uniform
// control flow.
fn reduce_sum_max_min(lid: u32, s: f32, m: f32, n: u32) -> Reduced {
    red_sum[lid] = s;
    red_max[lid] = m;
    red_min[lid] = n;
    workgroupBarrier();
    for (var h = WG / 2u; h > 0u; h >>= 1u) {
        if lid < h {
            red_sum[lid] += red_sum[lid + h];
            red_max[lid] = max(red_max[lid], red_max[lid + h]);
            red_min[lid] = min(red_min[lid], red_min[lid + h]);
        }
        workgroupBarrier();
    }
    return Reduced(red_sum[0], red_max[0], red_min[0]);
}
