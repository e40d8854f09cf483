//! Seeded data whose logits look like a trained language model's, for the
//! bench (`headkl bench --data lm`) and the block filter's tests: a
//! Zipf-like unigram prior over the vocabulary, a few contextual peaks per
//! token, a Gaussian background, all at a chosen mean student entropy, and
//! a teacher top-k that agrees with the student up to noise.
//!
//! The logits are `s_tj = x_t·W_j` with
//! - `W_j` uniform in `±0.02·√3` (the bench's random head) except its last
//!   column, `b_j / BIAS_SCALE`, where `b_j = −α·ln(1 + r_j)` is the log
//!   prior of a token of frequency rank `r_j` (over `r0`, `zipf_offset`); the ids are the ranks
//!   perturbed by log-normal noise (`order_noise`), so the natural order
//!   is close to, but not, the frequency order (a tokenizer's merges);
//! - `x_t = λ·(Σ_c a_c·W̃_c/‖W̃_c‖² + η·n_t, BIAS_SCALE)`: `W̃` is a head row
//!   without its last column, `c` a few peaks drawn from the prior with
//!   strengths `a_c`, `n_t` standard normal with `η` set so the background
//!   has standard deviation `background` nats (with the peaks' cross-talk),
//!   and `λ` an inverse
//!   temperature found by bisection for the target entropy.
//!
//! So `s_tj ≈ λ·(b_j + a_c·[j = c] + background·z_tj)`. [`LmStats`]
//! measures what the block filter sees on a sample of real rows (logits
//! computed on the host from the f16 head).

use half::f16;

use crate::rng::XorShift64;

/// Scale of the prior column: the hidden rows carry it as one massive
/// activation (as trained LMs' hidden states have a few), so the head's
/// column `b_j / BIAS_SCALE` stays as small as its other entries' sum and
/// the prior's share of dx stays in proportion.
const BIAS_SCALE: f32 = 256.0;

/// The published statistics the generator is calibrated to (Qwen2.5-0.5B,
/// real text): entries with `|p_S − p_T| ≥ 2⁻¹²`, and
/// 128×128 tiles holding one, in natural, frequency-sorted and random
/// vocabulary order.
pub const PUBLISHED: LmTargets = LmTargets {
    kept_entries: 0.00125,
    tiles_natural: 0.61,
    tiles_sorted: 0.49,
    tiles_random: 0.99,
};

/// The statistics [`LmStats`] is compared with.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LmTargets {
    /// Fraction of entries with `|p_S − p_T| ≥ 2⁻¹²`.
    pub kept_entries: f64,
    /// Fraction of 128×128 tiles with such an entry, natural order.
    pub tiles_natural: f64,
    /// The same with the vocabulary sorted by the prior.
    pub tiles_sorted: f64,
    /// The same under a random permutation.
    pub tiles_random: f64,
}

/// What to generate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LmSpec {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size (at least 2: the last column carries the prior).
    pub hs: usize,
    /// Tokens.
    pub ntok: usize,
    /// Teacher entries per token.
    pub k: usize,
    /// Seed.
    pub seed: u64,
    /// Zipf exponent α of the prior.
    pub zipf: f32,
    /// Zipf–Mandelbrot offset `r0`: `b = −α·ln(1 + r/r0)`, so the `r0`
    /// most frequent tokens share the top of the prior.
    pub zipf_offset: f32,
    /// Standard deviation of the log-normal noise between rank and id.
    pub order_noise: f32,
    /// Contextual peaks per token.
    pub peaks: usize,
    /// The strongest peak's height above the prior, in nats (before λ);
    /// the others get a uniform 30–100% of it.
    pub peak_logit: f32,
    /// Peaks are drawn from the prior raised to this power (1: the prior;
    /// smaller: rarer tokens come up in context more often).
    pub peak_flatness: f32,
    /// Standard deviation of the per-token background, in nats (before λ),
    /// the peaks' cross-talk included.
    pub background: f32,
    /// Target mean student entropy in nats (`None`: λ = 1).
    pub entropy: Option<f32>,
    /// Standard deviation of the teacher's logit noise, in nats.
    pub teacher_noise: f32,
}

impl LmSpec {
    /// The calibrated defaults for a shape (see [`LmStats`] and
    /// `docs/PERFORMANCE.md` for how they match [`PUBLISHED`]).
    pub fn new(vocab: usize, hs: usize, ntok: usize, k: usize, seed: u64) -> Self {
        Self {
            vocab,
            hs,
            ntok,
            k,
            seed,
            zipf: 2.5,
            zipf_offset: 400.0,
            order_noise: 0.6,
            peaks: 36,
            peak_logit: 9.0,
            peak_flatness: 0.42,
            background: 4.5,
            entropy: Some(3.3),
            teacher_noise: 0.5,
        }
    }
}

/// Generated data.
#[derive(Clone, Debug)]
pub struct LmData {
    /// Head `[vocab][hs]`.
    pub head: Vec<f16>,
    /// Hidden rows `[ntok][hs]`.
    pub hidden: Vec<f16>,
    /// Teacher ids `[ntok][k]` (distinct per row).
    pub ids: Vec<u32>,
    /// Teacher probabilities `[ntok][k]` (each row sums to 1).
    pub probs: Vec<f32>,
    /// Log prior `b_j` `[vocab]`.
    pub log_prior: Vec<f32>,
    /// The inverse temperature λ found.
    pub inv_temp: f32,
    /// What the filter sees on the sample rows.
    pub stats: LmStats,
}

impl LmData {
    /// Its statistics beside [`PUBLISHED`], one line each (what `headkl
    /// bench --data lm` and the `lm_stats` example print).
    pub fn report(&self) -> String {
        let (st, p) = (&self.stats, PUBLISHED);
        let m = st.measured;
        format!(
            "lm data, {} sample tokens: mean student entropy {:.2} nats (top token {:.2}), λ = {:.3}\n\
             lm data vs published (Qwen2.5-0.5B, real text):\n\
             \x20 entries |p_S - p_T| >= 2^-12   {:>7.3}%   published {:.3}%\n\
             \x20 128x128 tiles kept, natural    {:>7.1}%   published {:.0}%\n\
             \x20 128x128 tiles kept, sorted     {:>7.1}%   published {:.0}%\n\
             \x20 128x128 tiles kept, random     {:>7.1}%   published {:.0}%\n\
             \x20 dx blocks kept at 2^-15 (rows x 64): 64 rows {:.1}%, 128 rows {:.1}%, 128 rows sorted {:.1}%, \
             64 rows sorted {:.1}%\n\
             \x20 sorted prefix holding every entry >= 2^-15: all sample rows {:.1}%, the median row {:.1}%",
            st.tokens,
            st.entropy,
            st.top_prob,
            self.inv_temp,
            100.0 * m.kept_entries,
            100.0 * p.kept_entries,
            100.0 * m.tiles_natural,
            100.0 * p.tiles_natural,
            100.0 * m.tiles_sorted,
            100.0 * p.tiles_sorted,
            100.0 * m.tiles_random,
            100.0 * p.tiles_random,
            100.0 * st.filter_kept_64,
            100.0 * st.filter_kept_128,
            100.0 * st.filter_kept_128_sorted,
            100.0 * st.filter_kept_64_sorted,
            100.0 * st.kept_prefix_sorted,
            100.0 * st.kept_prefix_sorted_median_row,
        )
    }
}

/// Statistics of a sample of rows (the first up to 128 tokens).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LmStats {
    /// Tokens sampled.
    pub tokens: usize,
    /// Mean student entropy, nats.
    pub entropy: f64,
    /// Mean student probability of the top token.
    pub top_prob: f64,
    /// What [`PUBLISHED`] measures, on this data.
    pub measured: LmTargets,
    /// Fraction of the dx GEMM's (64-row tile × 64-entry block) pairs the
    /// filter keeps at ε = 2⁻¹⁵, natural order.
    pub filter_kept_64: f64,
    /// The same with 128-row tiles (the default matrix-unit tile).
    pub filter_kept_128: f64,
    /// The same with 128-row tiles, the vocabulary sorted by the prior.
    pub filter_kept_128_sorted: f64,
    /// The same with 64-row tiles, the vocabulary sorted by the prior.
    pub filter_kept_64_sorted: f64,
    /// The shortest prefix of the prior-sorted vocabulary, in whole filter
    /// blocks (`headkl_core::problem::filter::BLOCK` entries), that holds every entry at or above ε of all the
    /// sample rows (a fraction of the vocabulary): what a dx GEMM over the
    /// kept prefix alone (a smaller K) would reduce over, for a chunk of
    /// these rows. A chunk of more rows needs at least as much.
    pub kept_prefix_sorted: f64,
    /// The same for the median sample row alone.
    pub kept_prefix_sorted_median_row: f64,
}

/// `Σ a_i·b_i` in f32 with eight lanes (vectorized by the compiler).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        for q in 0..8 {
            s[q] += x[q] * y[q];
        }
    }
    s.iter().sum::<f32>() + tail
}

/// Entropy (nats) and top probability of softmax(`scale`·`s`).
fn entropy_of(s: &[f32], scale: f32) -> (f64, f64) {
    let m = s.iter().fold(f32::MIN, |m, &v| m.max(v)) * scale;
    let mut z = 0f64;
    let mut ez = 0f64;
    for &v in s {
        let u = f64::from(v * scale - m);
        let e = u.exp();
        z += e;
        ez += e * u;
    }
    (z.ln() - ez / z, 1.0 / z)
}

/// Generates `spec`'s data on every core.
pub fn generate(spec: &LmSpec) -> Result<LmData, String> {
    let LmSpec { vocab, hs, ntok, k, .. } = *spec;
    if hs < 2 || vocab == 0 || ntok == 0 || k == 0 || k > vocab {
        return Err(format!(
            "lm data needs hs >= 2 and 1 <= k <= vocab (got vocab {vocab}, hs {hs}, ntok {ntok}, k {k})"
        ));
    }
    let hw = hs - 1;
    // The prior, from ranks perturbed per id.
    let mut rng = XorShift64::new(spec.seed);
    let log_prior: Vec<f32> = (0..vocab)
        .map(|j| -spec.zipf * (1.0 + j as f32 * (spec.order_noise * rng.normal()).exp() / spec.zipf_offset).ln())
        .collect();
    // The head, 64 Ki elements a seeded chunk.
    let mut head = vec![f16::ZERO; vocab * hs];
    let amp = 0.02 * 3f32.sqrt();
    let rows_per_chunk = (1 << 16) / hs + 1;
    headkl_core::toolkit::host::par_chunks(&mut head, rows_per_chunk * hs, |i, chunk| {
        let mut r = XorShift64::new(spec.seed ^ 0xA5A5_0000 ^ (i as u64).wrapping_mul(0x9E37_79B9));
        for (q, row) in chunk.chunks_exact_mut(hs).enumerate() {
            for v in &mut row[..hw] {
                *v = f16::from_f32((r.unit_open() * 2.0 - 1.0) * amp);
            }
            row[hw] = f16::from_f32(log_prior[i * rows_per_chunk + q] / BIAS_SCALE);
        }
    });
    // Peaks drawn from the flattened prior, the teacher's extra ids from
    // the prior: their CDFs.
    let cdf_of = |power: f32| {
        let mut acc = 0f64;
        let cdf: Vec<f64> = log_prior
            .iter()
            .map(|&b| {
                acc += f64::from(b * power).exp();
                acc
            })
            .collect();
        cdf
    };
    let (cdf_peak, cdf) = (cdf_of(spec.peak_flatness), cdf_of(1.0));
    let pick = |cdf: &[f64], r: &mut XorShift64| {
        let u = f64::from(r.unit_open()) * cdf[vocab - 1];
        cdf.partition_point(|&c| c < u).min(vocab - 1)
    };
    let draw = |r: &mut XorShift64| pick(&cdf, r);
    // The peaks' cross-talk already gives every logit a Gaussian part of
    // variance Σ a_c² / hw (a random head row against a peak's direction):
    // the background tops it up to `background`, so the data do not depend
    // on hs (as long as the cross-talk alone stays below it).
    let mean_a2 = spec.peak_logit.powi(2) * (1.0 + (spec.peaks as f32 - 1.0) * 0.43) / spec.peaks.max(1) as f32;
    let crosstalk = spec.peaks as f32 * mean_a2 / hw as f32;
    let eta = (spec.background.powi(2) - crosstalk).max(0.0).sqrt() / (0.02 * (hw as f32).sqrt());
    // Hidden rows before λ, f32, and each token's peaks.
    let mut x0 = vec![0f32; ntok * hs];
    let mut peaks = vec![0usize; ntok * spec.peaks];
    for t in 0..ntok {
        let mut r = XorShift64::new(spec.seed ^ 0x5EED_0000_0000 ^ (t as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        let row = &mut x0[t * hs..(t + 1) * hs];
        for v in &mut row[..hw] {
            *v = eta * r.normal();
        }
        row[hw] = BIAS_SCALE;
        for p in 0..spec.peaks {
            let strength = if p == 0 {
                spec.peak_logit
            } else {
                spec.peak_logit * (0.3 + 0.7 * r.unit_open())
            };
            let c = pick(&cdf_peak, &mut r);
            peaks[t * spec.peaks + p] = c;
            let w = &head[c * hs..c * hs + hw];
            let norm2: f32 = w.iter().map(|v| v.to_f32() * v.to_f32()).sum();
            for (o, v) in row[..hw].iter_mut().zip(w) {
                *o += strength * v.to_f32() / norm2;
            }
        }
    }
    // Exact logits of the sample rows at λ = 1, on the host.
    let sample = ntok.min(128);
    let logits0 = host_logits(&head, vocab, hs, &x0[..sample * hs]);
    let inv_temp = match spec.entropy {
        None => 1.0,
        Some(target) => {
            // On up to 32 rows: the bisection's cost is its exps.
            let rows = sample.min(32);
            let mean_h = |lam: f32| {
                logits0[..rows * vocab]
                    .chunks_exact(vocab)
                    .map(|s| entropy_of(s, lam).0)
                    .sum::<f64>()
                    / rows as f64
            };
            let (mut lo, mut hi) = (0.05f32, 20f32);
            for _ in 0..24 {
                let mid = (lo * hi).sqrt();
                if mean_h(mid) > f64::from(target) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            (lo * hi).sqrt()
        }
    };
    let hidden: Vec<f16> = x0.iter().map(|&v| f16::from_f32(v * inv_temp)).collect();
    // The teacher: the peaks, then ids drawn from the prior, its logits the
    // student's exact ones plus noise.
    let mut ids = vec![0u32; ntok * k];
    let mut probs = vec![0f32; ntok * k];
    {
        let mut rows: Vec<(&mut [u32], &mut [f32])> = ids.chunks_exact_mut(k).zip(probs.chunks_exact_mut(k)).collect();
        headkl_core::toolkit::host::par_chunks(&mut rows, 64, |i, block| {
            let mut w32 = vec![0f32; hs];
            let mut x32 = vec![0f32; hs];
            for (q, (row_ids, row_p)) in block.iter_mut().enumerate() {
                let t = i * 64 + q;
                let mut r =
                    XorShift64::new(spec.seed ^ 0x7EAC_0000_0000 ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let mut n = 0;
                for &c in &peaks[t * spec.peaks..(t + 1) * spec.peaks] {
                    if n < k && !row_ids[..n].contains(&(c as u32)) {
                        row_ids[n] = c as u32;
                        n += 1;
                    }
                }
                while n < k {
                    // Past half the vocabulary the prior's tail is too thin
                    // to finish quickly: any id will do there.
                    let c = if k * 2 > vocab {
                        r.below(vocab as u64) as usize
                    } else {
                        draw(&mut r)
                    } as u32;
                    if !row_ids[..n].contains(&c) {
                        row_ids[n] = c;
                        n += 1;
                    }
                }
                for (o, v) in x32.iter_mut().zip(&hidden[t * hs..(t + 1) * hs]) {
                    *o = v.to_f32();
                }
                for (p, &id) in row_p.iter_mut().zip(row_ids.iter()) {
                    let w = &head[id as usize * hs..(id as usize + 1) * hs];
                    for (o, v) in w32.iter_mut().zip(w) {
                        *o = v.to_f32();
                    }
                    *p = dot(&x32, &w32) + spec.teacher_noise * r.normal();
                }
                let m = row_p.iter().fold(f32::MIN, |m, &v| m.max(v));
                let mut sum = 0f32;
                for p in row_p.iter_mut() {
                    *p = (*p - m).exp();
                    sum += *p;
                }
                row_p.iter_mut().for_each(|p| *p /= sum);
            }
        });
    }
    let stats = measure(&logits0, inv_temp, &ids, &probs, &log_prior, vocab, k, spec.seed);
    Ok(LmData {
        head,
        hidden,
        ids,
        probs,
        log_prior,
        inv_temp,
        stats,
    })
}

/// `x · Wᵀ` for a few f32 rows `x` `[rows][hs]` against the f16 head, on
/// every core: `[rows][vocab]`.
fn host_logits(head: &[f16], vocab: usize, hs: usize, x: &[f32]) -> Vec<f32> {
    let rows = x.len() / hs;
    const BLOCK: usize = 256;
    // Vocabulary blocks, each `[rows][BLOCK]`, transposed afterwards.
    let blocks = vocab.div_ceil(BLOCK);
    let mut out_blocks = vec![0f32; blocks * rows * BLOCK];
    headkl_core::toolkit::host::par_chunks(&mut out_blocks, rows * BLOCK, |b, out| {
        let mut w32 = vec![0f32; hs];
        for j in b * BLOCK..((b + 1) * BLOCK).min(vocab) {
            for (o, v) in w32.iter_mut().zip(&head[j * hs..(j + 1) * hs]) {
                *o = v.to_f32();
            }
            for t in 0..rows {
                out[t * BLOCK + j - b * BLOCK] = dot(&x[t * hs..(t + 1) * hs], &w32);
            }
        }
    });
    let mut out = vec![0f32; rows * vocab];
    for t in 0..rows {
        for b in 0..blocks {
            let (j0, j1) = (b * BLOCK, ((b + 1) * BLOCK).min(vocab));
            let src = &out_blocks[(b * rows + t) * BLOCK..(b * rows + t) * BLOCK + (j1 - j0)];
            out[t * vocab + j0..t * vocab + j1].copy_from_slice(src);
        }
    }
    out
}

/// The statistics of the sample rows (logits `lam · logits0`).
#[allow(clippy::too_many_arguments, reason = "the sample and what to compare it by")]
fn measure(
    logits0: &[f32],
    lam: f32,
    ids: &[u32],
    probs: &[f32],
    log_prior: &[f32],
    vocab: usize,
    k: usize,
    seed: u64,
) -> LmStats {
    let rows = logits0.len() / vocab;
    let big = 1.0 / 4096.0f64;
    let eps = f64::from(headkl_core::problem::filter::AUTO_EPS);
    // |p_S − p_T| per sample entry.
    let mut diff = vec![0f32; rows * vocab];
    let (mut entropy, mut top) = (0.0, 0.0);
    for t in 0..rows {
        let s = &logits0[t * vocab..(t + 1) * vocab];
        let (h, p_top) = entropy_of(s, lam);
        entropy += h;
        top += p_top;
        let m = s.iter().fold(f32::MIN, |m, &v| m.max(v)) * lam;
        let z: f64 = s.iter().map(|&v| f64::from(v * lam - m).exp()).sum();
        let d = &mut diff[t * vocab..(t + 1) * vocab];
        for (o, &v) in d.iter_mut().zip(s) {
            *o = (f64::from(v * lam - m).exp() / z) as f32;
        }
        for q in 0..k {
            let id = ids[t * k + q] as usize;
            d[id] -= probs[t * k + q];
        }
        d.iter_mut().for_each(|v| *v = v.abs());
    }
    let kept = diff.iter().filter(|&&v| f64::from(v) >= big).count();
    // Tiles of `tile_rows` × `tile_cols` under an order `perm` (position →
    // id) with an entry at or above `thr`.
    let tiles = |perm: &[usize], tile_rows: usize, tile_cols: usize, thr: f64| {
        let (mut total, mut hit) = (0usize, 0usize);
        for t0 in (0..rows).step_by(tile_rows) {
            let t1 = (t0 + tile_rows).min(rows);
            for c0 in (0..vocab).step_by(tile_cols) {
                total += 1;
                let any = perm[c0..(c0 + tile_cols).min(vocab)]
                    .iter()
                    .any(|&j| (t0..t1).any(|t| f64::from(diff[t * vocab + j]) >= thr));
                hit += usize::from(any);
            }
        }
        hit as f64 / total.max(1) as f64
    };
    let natural: Vec<usize> = (0..vocab).collect();
    let mut sorted = natural.clone();
    sorted.sort_by(|&a, &b| log_prior[b].total_cmp(&log_prior[a]).then(a.cmp(&b)));
    let mut random = natural.clone();
    let mut r = XorShift64::new(seed ^ 0x9E4D);
    for i in (1..vocab).rev() {
        random.swap(i, r.below(i as u64 + 1) as usize);
    }
    // Each sample row's kept prefix in the sorted order, in whole filter
    // blocks, ascending.
    let block = headkl_core::problem::filter::BLOCK;
    let mut prefixes: Vec<f64> = (0..rows)
        .map(|t| {
            let last = sorted.iter().rposition(|&j| f64::from(diff[t * vocab + j]) >= eps);
            let blocks = last.map_or(0, |p| p / block + 1);
            (blocks * block).min(vocab) as f64 / vocab as f64
        })
        .collect();
    prefixes.sort_by(f64::total_cmp);
    // The published tiles are 128 tokens by 128 entries; a smaller sample
    // uses all its rows.
    LmStats {
        tokens: rows,
        entropy: entropy / rows.max(1) as f64,
        top_prob: top / rows.max(1) as f64,
        measured: LmTargets {
            kept_entries: kept as f64 / diff.len().max(1) as f64,
            tiles_natural: tiles(&natural, 128, 128, big),
            tiles_sorted: tiles(&sorted, 128, 128, big),
            tiles_random: tiles(&random, 128, 128, big),
        },
        filter_kept_64: tiles(&natural, 64, 64, eps),
        filter_kept_128: tiles(&natural, 128, 64, eps),
        filter_kept_128_sorted: tiles(&sorted, 128, 64, eps),
        filter_kept_64_sorted: tiles(&sorted, 64, 64, eps),
        kept_prefix_sorted: prefixes.last().copied().unwrap_or(0.0),
        kept_prefix_sorted_median_row: prefixes.get(prefixes.len() / 2).copied().unwrap_or(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lm_data_is_seeded_valid_and_peaked() {
        // A steep prior, so even V = 3000 leaves blocks to skip.
        let spec = LmSpec {
            zipf: 3.0,
            zipf_offset: 5.0,
            peaks: 3,
            peak_flatness: 1.0,
            background: 0.5,
            entropy: Some(1.0),
            ..LmSpec::new(3000, 48, 40, 16, 7)
        };
        let a = generate(&spec).unwrap();
        let b = generate(&spec).unwrap();
        assert_eq!(a.hidden, b.hidden);
        assert_eq!(a.ids, b.ids);
        for row in a.ids.chunks_exact(16) {
            let mut r = row.to_vec();
            r.sort_unstable();
            r.dedup();
            assert_eq!(r.len(), 16, "teacher ids repeat");
        }
        for row in a.probs.chunks_exact(16) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-4);
        }
        // The target entropy is met on the sample and the filter has work.
        assert!((a.stats.entropy - 1.0).abs() < 0.3, "{:?}", a.stats);
        assert!(a.stats.measured.kept_entries < 0.2, "{:?}", a.stats);
        assert!(a.stats.filter_kept_128_sorted < 0.8, "{:?}", a.stats);
        // Fewer rows a tile keep no more blocks; all the rows' kept prefix
        // holds the median row's, and both are whole blocks of 64 (or V).
        let st = a.stats;
        assert!(st.filter_kept_64_sorted <= st.filter_kept_128_sorted, "{st:?}");
        assert!(st.kept_prefix_sorted_median_row <= st.kept_prefix_sorted, "{st:?}");
        assert!(
            st.kept_prefix_sorted_median_row > 0.0 && st.kept_prefix_sorted <= 1.0,
            "{st:?}"
        );
        for prefix in [st.kept_prefix_sorted, st.kept_prefix_sorted_median_row] {
            let entries = (prefix * 3000.0).round() as usize;
            assert!(entries.is_multiple_of(64) || entries == 3000, "{prefix}");
        }
        assert!(generate(&LmSpec { hs: 1, ..spec }).is_err());
    }
}
