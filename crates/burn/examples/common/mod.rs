//! What the examples share (the tests read `uniform` from here too): their
//! seeded values and their flag reading.

/// Uniform values in [-scale, scale), xorshift64* from `seed`.
pub fn uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
            (r as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Walks `--name value` pairs, and `switch`, the one flag without a value:
/// `set(flag, value)` for each (`value` empty for `switch`).
pub fn each_flag(
    mut args: impl Iterator<Item = String>,
    switch: &str,
    mut set: impl FnMut(&str, &str) -> Result<(), String>,
) -> Result<(), String> {
    while let Some(flag) = args.next() {
        if flag == switch {
            set(&flag, "")?;
            continue;
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        set(&flag, &value)?;
    }
    Ok(())
}

/// `value` of `flag` parsed, or an error that names both.
pub fn parsed<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    value.parse().map_err(|e| format!("{flag} {value}: {e}"))
}
