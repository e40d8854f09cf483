//! Shards as a trainer's ranks, on threads of one process: each rank's
//! two phases on a thread of its own, this thread the collective between
//! them. The command's `--shards` and the conformance suite's threaded
//! drive run their shards through it.

use crate::toolkit::panic_message;
use std::sync::mpsc;

/// How one rank's thread ended.
enum RankEnd<O, E> {
    Done(O),
    /// Its own error.
    Failed(E),
    /// Told to stop: another rank failed, or the merge did.
    Stopped,
}

/// Runs a two-phase job on one thread per input, as ranks would:
/// `phase_one(rank, input)` on the rank's thread gives its state and its
/// partials; `merge` on this thread turns every rank's partials (in rank
/// order) into what each rank gets back, one per rank (the collective);
/// `phase_two(state, merged)` finishes on the rank's thread.
///
/// When a rank fails phase one the merge does not run and the others stop.
/// The error returned is the first rank's own error in rank order, else
/// the first panic (`panicked(rank, message)`: a panicking thread is an
/// error, not a panic here), else the merge's, else `stopped()`.
pub fn two_phases_on_threads<I, S, P, M, O, E>(
    inputs: Vec<I>,
    phase_one: impl Fn(usize, I) -> Result<(S, P), E> + Sync,
    merge: impl FnOnce(Vec<P>) -> Result<Vec<M>, E>,
    phase_two: impl Fn(S, M) -> Result<O, E> + Sync,
    panicked: impl Fn(usize, String) -> E,
    stopped: impl Fn() -> E,
) -> Result<Vec<O>, E>
where
    I: Send,
    P: Send,
    M: Send,
    O: Send,
    E: Send,
{
    let n = inputs.len();
    let (phase_one, phase_two) = (&phase_one, &phase_two);
    std::thread::scope(|s| {
        let (to_merge, from_ranks) = mpsc::channel::<(usize, Option<P>)>();
        let mut to_ranks = Vec::with_capacity(n);
        let threads: Vec<_> = inputs
            .into_iter()
            .enumerate()
            .map(|(rank, input)| {
                let (tx, rx) = mpsc::channel::<M>();
                to_ranks.push(tx);
                let to_merge = to_merge.clone();
                s.spawn(move || -> RankEnd<O, E> {
                    let (state, partials) = match phase_one(rank, input) {
                        Ok(x) => x,
                        Err(e) => {
                            let _ = to_merge.send((rank, None));
                            return RankEnd::Failed(e);
                        }
                    };
                    let _ = to_merge.send((rank, Some(partials)));
                    // Dropped before waiting, so a rank that panics before
                    // sending ends the merge's wait instead of hanging it.
                    drop(to_merge);
                    let Ok(merged) = rx.recv() else {
                        return RankEnd::Stopped;
                    };
                    match phase_two(state, merged) {
                        Ok(out) => RankEnd::Done(out),
                        Err(e) => RankEnd::Failed(e),
                    }
                })
            })
            .collect();
        drop(to_merge);
        let mut parts: Vec<Option<P>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            match from_ranks.recv() {
                Ok((rank, Some(p))) => parts[rank] = Some(p),
                // A rank failed or panicked in phase one.
                Ok((_, None)) | Err(_) => break,
            }
        }
        let merged = parts.into_iter().collect::<Option<Vec<P>>>().map(merge);
        let merge_error = match merged {
            Some(Ok(each)) => {
                for (tx, m) in to_ranks.iter().zip(each) {
                    // A rank that has gone has its own end to report.
                    let _ = tx.send(m);
                }
                None
            }
            Some(Err(e)) => Some(e),
            None => None,
        };
        drop(to_ranks);
        let ends: Vec<Result<RankEnd<O, E>, String>> = threads
            .into_iter()
            .map(|t| t.join().map_err(|payload| panic_message(payload.as_ref())))
            .collect();
        let mut outs = Vec::with_capacity(n);
        let mut first_panic = None;
        let mut any_stopped = false;
        for (rank, end) in ends.into_iter().enumerate() {
            match end {
                Ok(RankEnd::Done(o)) => outs.push(o),
                Ok(RankEnd::Failed(e)) => return Err(e),
                Ok(RankEnd::Stopped) => any_stopped = true,
                Err(message) => {
                    first_panic.get_or_insert((rank, message));
                }
            }
        }
        if let Some((rank, message)) = first_panic {
            return Err(panicked(rank, message));
        }
        if let Some(e) = merge_error {
            return Err(e);
        }
        if any_stopped || outs.len() != n {
            return Err(stopped());
        }
        Ok(outs)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    type Run = Result<Vec<u64>, String>;

    /// Ranks with inputs 1..=n: phase one gives 10·input, the merge sends
    /// each rank the sum, phase two adds its input. `fail` names a rank
    /// and a phase that fails (1, 2), panics (3, 4), or the merge (0).
    fn run(n: u64, fail: Option<(usize, u8)>) -> Run {
        let bad = |rank: usize, phase: u8| fail == Some((rank, phase));
        two_phases_on_threads(
            (1..=n).collect(),
            |rank, input| {
                if bad(rank, 1) {
                    return Err(format!("rank {rank} failed phase one"));
                }
                assert!(!bad(rank, 3), "rank {rank} panicked in phase one");
                Ok((input, 10 * input))
            },
            |parts: Vec<u64>| {
                if fail.is_some_and(|(_, phase)| phase == 0) {
                    return Err("the merge failed".to_string());
                }
                let sum: u64 = parts.iter().sum();
                Ok(vec![sum; parts.len()])
            },
            |input, sum| {
                let rank = (input - 1) as usize;
                if bad(rank, 2) {
                    return Err(format!("rank {rank} failed phase two"));
                }
                assert!(!bad(rank, 4), "rank {rank} panicked in phase two");
                Ok(sum + input)
            },
            |rank, message| format!("rank {rank} panicked: {message}"),
            || "stopped".to_string(),
        )
    }

    #[test]
    fn ranks_meet_at_the_merge_and_finish_in_rank_order() {
        assert_eq!(run(3, None), Ok(vec![61, 62, 63]));
        assert_eq!(run(1, None), Ok(vec![11]));
        assert_eq!(run(0, None), Ok(vec![]));
    }

    #[test]
    fn a_rank_s_own_error_wins_over_the_others_stopping() {
        // The last rank fails: the ones before it stop, yet its error is
        // the one reported.
        assert_eq!(run(3, Some((2, 1))), Err("rank 2 failed phase one".into()));
        assert_eq!(run(3, Some((1, 2))), Err("rank 1 failed phase two".into()));
        assert_eq!(run(3, Some((0, 0))), Err("the merge failed".into()));
    }

    #[test]
    fn a_panicking_rank_is_an_error_and_nothing_hangs() {
        for phase in [3, 4] {
            let got = run(3, Some((1, phase))).unwrap_err();
            assert!(got.starts_with("rank 1 panicked: rank 1 panicked in phase"), "{got}");
        }
    }
}
