// A split-K GEMM's partial blocks summed (headkl_core::toolkit::SumPartsDesc):
// dst[i] (+)= parts[i] + parts[stride + i] + ..., in increasing part, in f32,
// 4 elements (16 bytes) per invocation. See shaders/README.md.

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

@group(0) @binding(1) var<storage, read> parts: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn sum_parts(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * params.grid_x) * WG + lid;
    if i >= params.len / 4u {
        return;
    }
    let stride = params.part_stride / 4u;
    var s = parts[i];
    for (var p = 1u; p < params.parts; p++) {
        s += parts[p * stride + i];
    }
    if params.accumulate != 0u {
        s = dst[i] + s;
    }
    dst[i] = s;
}
