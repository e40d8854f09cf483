
// ---- Shared by convert.wgsl and resident_hidden.wgsl (the catalogue
// appends this file to both; WGSL has no include): the f16 rounding and
// the padded operand's store.

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

// Element i of `dst`, the padded [rows_padded][ld] f16 operand (one
// invocation per element; nothing past it): the source's element
// r·cols + c, read by the kernel's own `source_f16`, for r < rows and
// c < cols, else 0.
fn store_padded(i: u32) {
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
