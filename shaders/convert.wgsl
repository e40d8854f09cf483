// f32 -> f16 conversion of hidden rows into the padded GEMM operand
// (headkl_core::toolkit::ConvertDesc). See shaders/README.md.
enable f16;

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f16>;

// to_f16 and store_padded: f16_round.wgsl, appended by the catalogue.

// Element e of the [rows][cols] source as f16.
fn source_f16(e: u32) -> f16 {
    return to_f16(src[e]);
}

@compute @workgroup_size(WG)
fn convert_f16(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    store_padded((wg.x + wg.y * params.grid_x) * WG + lid);
}
