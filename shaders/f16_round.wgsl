
// ---- Shared by convert.wgsl and resident_hidden.wgsl (the catalogue
// appends this file to both; WGSL has no include).

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
