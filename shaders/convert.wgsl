// f32 -> f16 conversion of hidden rows into the padded GEMM operand
// (headkl_core::ConvertDesc). See shaders/README.md.
enable f16;

// <params: generated from crates/core/src/params.rs (headkl_core::kernels::Shader::source)>

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f16>;

// Smallest |x| that rounds to f16 infinity (65504 + half an ulp).
const F16_OVERFLOW_BITS: u32 = 0x477ff000u;

// f32 -> f16 decided on the bits: out-of-range values become +-inf (the
// conversion of an f32 infinity) and NaN stays NaN, whatever the driver
// assumes about float arithmetic.
fn to_f16(x: f32) -> f16 {
    let bits = bitcast<u32>(x);
    let mag = bits & 0x7fffffffu;
    if mag < F16_OVERFLOW_BITS || mag > 0x7f800000u {
        return f16(x);
    }
    return f16(bitcast<f32>((bits & 0x80000000u) | 0x7f800000u));
}

@compute @workgroup_size(256)
fn convert_f16(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * params.grid_x) * 256u + lid;
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
