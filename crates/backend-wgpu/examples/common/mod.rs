//! What the examples share, headkl-wgpu's and headkl-burn's (headkl-burn's
//! tests read `uniform` from here too): their seeded values, their flag
//! reading ([`field_flags!`] with `#[macro_use]`) and their `main`.

#![allow(dead_code, reason = "each example uses part of this")]

use std::error::Error;

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
/// `set(flag, value)` for each (`value` empty for `switch`), which returns
/// false for a flag it does not know; the error then lists `flags`.
pub fn each_flag(
    mut args: impl Iterator<Item = String>,
    switch: Option<&str>,
    flags: &str,
    mut set: impl FnMut(&str, &str) -> Result<bool, String>,
) -> Result<(), String> {
    while let Some(flag) = args.next() {
        let value = if Some(flag.as_str()) == switch {
            String::new()
        } else {
            args.next().ok_or_else(|| format!("{flag} needs a value"))?
        };
        if !set(&flag, &value)? {
            return Err(format!("unknown flag {flag} (flags: {flags})"));
        }
    }
    Ok(())
}

/// [`each_flag`] for a config whose flags are its fields: `--field value`
/// parsed ([`parsed`]) into `$cfg.field`, and `$switch`, the one flag
/// without a value, running `$on_switch`; an unknown flag's error lists
/// them in that order. `each_flag` and `parsed` must be in scope where it
/// is used (the module is included under different paths).
#[allow(
    unused_macros,
    reason = "the tests that include this module for `uniform` read no flags"
)]
macro_rules! field_flags {
    ($args:expr, $cfg:ident, [$($field:ident),+ $(,)?] $(, $switch:literal => $on_switch:expr)?) => {{
        let flags = [$(concat!("--", stringify!($field)),)+ $($switch)?].join(" ");
        let switch: Option<&str> = None $(.or(Some($switch)))?;
        each_flag($args, switch, &flags, |flag, value| {
            match flag {
                $($switch => $on_switch,)?
                $(concat!("--", stringify!($field)) => $cfg.$field = parsed(flag, value)?,)+
                _ => return Ok(false),
            }
            Ok(true)
        })
    }};
}

/// `value` of `flag` parsed, or an error that names both.
pub fn parsed<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    value.parse().map_err(|e| format!("{flag} {value}: {e}"))
}

/// An example's `main`: `help` for `--help` or `-h`; otherwise the flags
/// through `from_args` (exit 2 on an error), then `run` (exit 1 on an
/// error) and `report` of what it returns. Errors go to stderr after
/// `program: `.
pub fn example_main<C, T>(
    program: &str,
    help: &str,
    from_args: impl FnOnce(std::iter::Skip<std::env::Args>) -> Result<C, String>,
    run: impl FnOnce(&C) -> Result<T, Box<dyn Error>>,
    report: impl FnOnce(T),
) {
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{help}");
        return;
    }
    let cfg = match from_args(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{program}: {e}");
            std::process::exit(2);
        }
    };
    match run(&cfg) {
        Ok(result) => report(result),
        Err(e) => {
            eprintln!("{program}: {e}");
            std::process::exit(1);
        }
    }
}

/// The training examples' report: one line per step, then
/// `loss: first <f> last <f>`.
pub fn print_losses(losses: Vec<f32>) {
    for (i, l) in losses.iter().enumerate() {
        println!("step {i} loss {l:.6}");
    }
    println!("loss: first {} last {}", losses[0], losses[losses.len() - 1]);
}
