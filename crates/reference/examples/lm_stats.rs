//! The `lm` data's statistics at a shape, computed on the host (no GPU):
//! what `headkl bench --data lm` prints, and the dx block filter's kept
//! blocks in natural and prior-sorted vocabulary order, and the prior-sorted
//! prefix of the vocabulary that holds every kept entry.
//!
//! `cargo run --release -p headkl-reference --example lm_stats -- VOCAB:HS:NTOK:K`
//! (NTOK at least 128: the statistics use the first 128 tokens; the seed is
//! the bench's).

fn main() -> Result<(), String> {
    let arg = std::env::args().nth(1).unwrap_or_else(|| "151936:896:128:64".into());
    let dims: Vec<usize> = arg
        .split(':')
        .map(|v| v.parse().map_err(|e| format!("{arg}: {e}")))
        .collect::<Result<_, _>>()?;
    let [vocab, hs, ntok, k] = dims[..] else {
        return Err(format!("{arg}: want VOCAB:HS:NTOK:K"));
    };
    let start = std::time::Instant::now();
    let spec = headkl_reference::lm::LmSpec::new(vocab, hs, ntok, k, 0x5EED_4EAD);
    let d = headkl_reference::lm::generate(&spec)?;
    println!("lm {vocab}:{hs}:{ntok}:{k} ({:.0} s)", start.elapsed().as_secs_f64());
    println!("{}", d.report());
    Ok(())
}
