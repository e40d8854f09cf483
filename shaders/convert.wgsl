// f32 -> f16 conversion of hidden rows into the padded GEMM operand
// (headkl_core::toolkit::ConvertDesc). See shaders/README.md.
enable f16;

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f16>;

// to_f16: f16_round.wgsl, appended by the catalogue.

@compute @workgroup_size(WG)
fn convert_f16(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * params.grid_x) * WG + lid;
    if i >= params.rows_padded * params.ld {
        return;
    }
    let r = i / params.ld;
    let c = i % params.ld;
    var v = f16(0.0);
    if r < params.rows && c < params.cols {
        v = to_f16(src[r * params.cols + c]);
    }
    dst[i] = v;
}
