//! Two-way parallelism for the O(ntok·V·hs) loops, with `std::thread::scope`
//! only: the reference stays dependency-free. Small jobs stay on the calling
//! thread, where a spawn would cost more than it saves.

use std::ops::Range;

/// Threads the CPU loops use (the CI machines have two cores).
pub(crate) const THREADS: usize = 2;

/// Rough multiply-adds below which a job runs on one thread.
const MIN_PARALLEL_WORK: usize = 1 << 15;

/// Calls `f(first_row, rows)` on up to [`THREADS`] disjoint, contiguous row
/// ranges of `out` (rows of `row_len` elements), in parallel when `work`
/// (multiply-adds, roughly) is worth it.
pub(crate) fn for_row_blocks<T: Send>(out: &mut [T], row_len: usize, work: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let rows = out.len().checked_div(row_len).unwrap_or(0);
    if rows < 2 || work < MIN_PARALLEL_WORK {
        f(0, out);
        return;
    }
    let mid = rows.div_ceil(THREADS);
    let (first, second) = out.split_at_mut(mid * row_len);
    // The second half waits in a slot, so a failed spawn (no threads left)
    // can still run it here.
    let slot = std::sync::Mutex::new(Some(second));
    let run_second = || {
        let taken = slot.lock().map(|mut g| g.take()).unwrap_or(None);
        if let Some(part) = taken {
            f(mid, part);
        }
    };
    std::thread::scope(|s| {
        let spawned = std::thread::Builder::new().spawn_scoped(s, run_second);
        f(0, first);
        match spawned {
            Ok(handle) => {
                if let Err(payload) = handle.join() {
                    std::panic::resume_unwind(payload);
                }
            }
            Err(_) => run_second(),
        }
    });
}

/// Runs `f` on up to [`THREADS`] contiguous parts of `0..n`, in parallel
/// when `work` is worth it, and returns the parts' results in order with
/// their ranges.
pub(crate) fn map_ranges<R: Send>(
    n: usize,
    work: usize,
    f: impl Fn(Range<usize>) -> R + Sync,
) -> Vec<(Range<usize>, R)> {
    if n < 2 || work < MIN_PARALLEL_WORK {
        return vec![(0..n, f(0..n))];
    }
    let mid = n.div_ceil(THREADS);
    let f = &f;
    std::thread::scope(|s| {
        let spawned = std::thread::Builder::new().spawn_scoped(s, move || f(mid..n));
        let first = f(0..mid);
        let second = match spawned {
            Ok(handle) => match handle.join() {
                Ok(r) => r,
                // The worker panicked: re-raise it here, as a plain call would.
                Err(payload) => std::panic::resume_unwind(payload),
            },
            Err(_) => f(mid..n),
        };
        vec![(0..mid, first), (mid..n, second)]
    })
}
