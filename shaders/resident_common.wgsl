// Shared by the resident_*.wgsl kernels: each backend prepends this file to
// them (WGSL has no include). See shaders/README.md, "Device-resident kernels".
enable f16;

// <params: generated from crates/core/src/params.rs (headkl_core::kernels::Shader::source)>

// Words of the status buffer (headkl_core::resident::status).
const NONE: u32 = 0xffffffffu;
const S_ID_RANGE: u32 = 0u;
const S_ROW: u32 = 1u;
const S_WEIGHT: u32 = 2u;
const S_LOGITS: u32 = 3u;
const S_TOTAL_BAD: u32 = 4u;
const S_TOTAL_BITS: u32 = 5u;
const S_LABEL: u32 = 6u;
const S_COEF_MUL: u32 = 16u;
const S_DX_MUL: u32 = 17u;

fn non_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) >= 0x7f800000u;
}

// Negative and not -0 (decided on the bits).
fn negative(x: f32) -> bool {
    let b = bitcast<u32>(x);
    return (b & 0x80000000u) != 0u && (b & 0x7fffffffu) != 0u;
}
