//! The `lm` data's statistics at a shape, computed on the host (no GPU):
//! what `headkl bench --data lm` prints, and the dx block filter's kept
//! blocks in natural and prior-sorted vocabulary order.
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
    let (st, p) = (d.stats, headkl_reference::lm::PUBLISHED);
    println!(
        "lm {vocab}:{hs}:{ntok}:{k} ({:.0} s): {} sample tokens, entropy {:.2} nats, top {:.2}, lambda {:.3}",
        start.elapsed().as_secs_f64(),
        st.tokens,
        st.entropy,
        st.top_prob,
        d.inv_temp
    );
    let m = st.measured;
    println!(
        "  entries >= 2^-12: {:.3}% (published {:.3}%)",
        100.0 * m.kept_entries,
        100.0 * p.kept_entries
    );
    println!(
        "  128x128 tiles kept: natural {:.1}% ({:.0}%), sorted {:.1}% ({:.0}%), random {:.1}% ({:.0}%)",
        100.0 * m.tiles_natural,
        100.0 * p.tiles_natural,
        100.0 * m.tiles_sorted,
        100.0 * p.tiles_sorted,
        100.0 * m.tiles_random,
        100.0 * p.tiles_random
    );
    println!(
        "  dx blocks kept at 2^-15 (rows x 64): 64 rows natural {:.1}%, 128 rows natural {:.1}%, 128 rows prior-sorted {:.1}%",
        100.0 * st.filter_kept_64,
        100.0 * st.filter_kept_128,
        100.0 * st.filter_kept_128_sorted
    );
    Ok(())
}
