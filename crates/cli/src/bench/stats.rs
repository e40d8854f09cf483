//! The statistics bench reports (median of sorted times) and its estimate
//! of how long a run will take.

use super::shape::JobKind;

/// The median of sorted values (NaN for none).
pub(crate) fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    }
}

/// `v` in ascending order.
pub(crate) fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Seconds of estimated work past which bench says how long it will take.
pub(super) const ESTIMATE_NOTE_SECS: f64 = 20.0;

/// After a warm call of a job (`warm_ms`, with `calls` calls of the job
/// left counting it): the time the remaining calls will take (and, for
/// head_kl, the topk job after it, about half as much per call), said
/// before committing to minutes.
pub(super) fn announce_estimate(backend: &str, job: JobKind, warm_ms: f64, calls: usize) {
    let rest = warm_ms * 1e-3 * (calls.saturating_sub(1)) as f64;
    let after = if job == JobKind::HeadKl {
        warm_ms * 1e-3 * 0.5 * calls as f64
    } else {
        0.0
    };
    let total = rest + after;
    if total >= ESTIMATE_NOTE_SECS {
        log::info!(
            "bench: {backend} {}: a warm call took {}; the rest of this bench will take about {} \
             (fewer --iters/--warmup or a smaller --shape to shorten; Ctrl-C stops)",
            job.name(),
            fmt_secs(warm_ms * 1e-3),
            fmt_secs(total)
        );
    }
}

/// Seconds in words: `42 s`, `3.5 min`, `2.1 h`.
pub(super) fn fmt_secs(s: f64) -> String {
    if s < 120.0 {
        format!("{s:.0} s")
    } else if s < 7200.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
    }

    #[test]
    fn seconds_read_in_the_right_unit() {
        assert_eq!(fmt_secs(42.0), "42 s");
        assert_eq!(fmt_secs(210.0), "3.5 min");
        assert_eq!(fmt_secs(7560.0), "2.1 h");
    }
}
