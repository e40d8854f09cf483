// Device-resident entry points: the caller's hidden rows (f32, f16 or bf16,
// read as 32-bit words) into the padded f16 GEMM operand
// (headkl_core::toolkit::KernelId::HiddenIn). Prepended by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f16>;

// to_f16 and store_padded: f16_round.wgsl, appended by the catalogue.

// The 16-bit half `e` of the word array (element index in halves).
fn half_bits(e: u32) -> u32 {
    return (src[e >> 1u] >> ((e & 1u) * 16u)) & 0xffffu;
}

// Element e of the caller's [rows][cols] rows (from params.src_offset)
// as f16.
fn source_f16(e: u32) -> f16 {
    let at = params.src_offset + e;
    if params.dtype == DTYPE_F32 {
        return to_f16(bitcast<f32>(src[at]));
    }
    if params.dtype == DTYPE_F16 {
        return f16(unpack2x16float(half_bits(at)).x);
    }
    return to_f16(bitcast<f32>(half_bits(at) << 16u));
}

// params: HiddenInParams (src_offset in elements of the source type).
@compute @workgroup_size(WG)
fn hidden_in(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    store_padded(invocation_index(wg, lid));
}
