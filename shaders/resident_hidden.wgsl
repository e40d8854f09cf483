// Hidden rows (f32, f16 or bf16, read as 32-bit words) into the padded f16
// GEMM operand (headkl_core::toolkit::KernelId::HiddenIn): the caller's rows
// on the device-resident paths, the host path's uploaded f32 rows. Prepended
// by resident_common.wgsl.

@group(0) @binding(1) var<storage, read> src: array<u32>;
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

// The 16-bit half `e` of the word array (element index in halves).
fn half_bits(e: u32) -> u32 {
    return (src[e >> 1u] >> ((e & 1u) * 16u)) & 0xffffu;
}

// Element e of the [rows][cols] rows (from params.src_offset) as f16.
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

// params: HiddenInParams (src_offset in elements of the source type). One
// invocation per element i of `dst`, the padded [rows_padded][ld] operand
// (nothing past it): source element r·cols + c for r < rows and c < cols,
// else 0.
@compute @workgroup_size(WG)
fn hidden_in(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = invocation_index(wg, lid);
    if i >= params.rows_padded * params.ld {
        return;
    }
    let r = i / params.ld;
    let c = i % params.ld;
    var v = f16(0.0);
    if r < params.rows && c < params.cols {
        v = source_f16(r * params.cols + c);
    }
    dst[i] = v;
}
