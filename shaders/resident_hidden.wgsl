// Device-resident entry points: the caller's hidden rows (f32, f16 or bf16,
// read as 32-bit words) into the padded f16 GEMM operand
// (headkl_core::toolkit::KernelId::HiddenIn). Prepended by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f16>;

// to_f16: f16_round.wgsl, appended by the catalogue.

// The 16-bit half `e` of the word array (element index in halves).
fn half_bits(e: u32) -> u32 {
    return (src[e >> 1u] >> ((e & 1u) * 16u)) & 0xffffu;
}

// params: HiddenInParams (src_offset in elements of the source type).
@compute @workgroup_size(WG)
fn hidden_in(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * params.grid_x) * WG + lid;
    if i >= params.rows_padded * params.ld {
        return;
    }
    let r = i / params.ld;
    let c = i % params.ld;
    var v = f16(0.0);
    if r < params.rows && c < params.cols {
        let e = params.src_offset + r * params.cols + c;
        if params.dtype == DTYPE_F32 {
            v = to_f16(bitcast<f32>(src[e]));
        } else if params.dtype == DTYPE_F16 {
            v = f16(unpack2x16float(half_bits(e)).x);
        } else {
            v = to_f16(bitcast<f32>(half_bits(e) << 16u));
        }
    }
    dst[i] = v;
}
