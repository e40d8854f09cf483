//! Driver-level cases: a [`Case`] through [`Engine`] against
//! [`headkl_reference::direct`]; the fixed regression list ([`mod@regression`]); the
//! head's gradient ([`head_grad`]); the error cases ([`errors`]).

/// The `name`s of a case table's rows (a `const` slice of rows with a
/// `name` field), in order, as a `&'static [&'static str]` built at
/// compile time. Before the modules, which use it.
macro_rules! row_names {
    ($table:expr) => {{
        const NAMES: [&str; $table.len()] = {
            let mut names = [""; $table.len()];
            let mut i = 0;
            while i < names.len() {
                names[i] = $table[i].name;
                i += 1;
            }
            names
        };
        &NAMES
    }};
}

/// A case table row's builder methods that each set one field, `const` so
/// the tables stay `const`: `flag name => field` sets it true, `set
/// name: T => field` to the argument, `some name: T => field` to
/// `Some(argument)`. Before the modules, which use it.
macro_rules! knobs {
    ($($(#[$doc:meta])* $how:ident $name:ident $(: $ty:ty)? => $($field:ident).+;)*) => {
        $(knobs!(@one $(#[$doc])* $how $name $(: $ty)? => $($field).+);)*
    };
    (@one $(#[$doc:meta])* flag $name:ident => $($field:ident).+) => {
        $(#[$doc])*
        const fn $name(mut self) -> Self {
            self.$($field).+ = true;
            self
        }
    };
    (@one $(#[$doc:meta])* set $name:ident: $ty:ty => $($field:ident).+) => {
        $(#[$doc])*
        const fn $name(mut self, value: $ty) -> Self {
            self.$($field).+ = value;
            self
        }
    };
    (@one $(#[$doc:meta])* some $name:ident: $ty:ty => $($field:ident).+) => {
        $(#[$doc])*
        const fn $name(mut self, value: $ty) -> Self {
            self.$($field).+ = Some(value);
            self
        }
    };
}

mod errors;
mod head_grad;
mod regression;

use headkl_core::{Backend, Engine, LossOptions};

pub(crate) use errors::{check_error_case, lm_case, ERROR_CASES};
pub(crate) use head_grad::{check_head_grad_case, describe_head_grad_case, head_grad_names};
pub(super) use regression::params;
pub(crate) use regression::{check_regression, regression, regression_names};

use super::{engine_for, CaseErrors};
use crate::generator::{Case, CaseKind};
use headkl_reference::direct::{self, DirectLoss};
use headkl_reference::tolerance::Tolerance;

/// Runs `case` through the driver and compares with the reference.
pub(crate) fn check_case<B: Backend + ?Sized>(backend: &B, case: &Case, tol: &Tolerance) -> Result<CaseErrors, String> {
    let mut engine = engine_for(backend, case)?;
    compare(&mut engine, case, &case.loss_options(), tol)
}

/// Checks that `engine` cut the head into at least `min` slices (what
/// the case is there to reach).
fn check_min_slices<B: Backend>(engine: &Engine<B>, min: usize) -> Result<(), String> {
    let slices = engine.slices().len();
    if slices < min {
        return Err(format!(
            "the head was cut into {slices} slice(s); this case needs at least {min}"
        ));
    }
    Ok(())
}

/// Checks that the host path runs at least `min` chunks (`chunks` of
/// them).
fn check_min_chunks(chunks: usize, min: usize) -> Result<(), String> {
    if chunks < min {
        return Err(format!("{chunks} chunk(s); this case needs at least {min}"));
    }
    Ok(())
}

/// How a case judges dx.
#[derive(Clone, Copy, Debug, PartialEq)]
enum DxCheck {
    /// Relative to the reference ([`Tolerance::check_dx`]).
    Relative,
    /// The reference is zero up to rounding: the RMS of dx must stay below
    /// this. (A relative error would judge the f32 noise of `exp`.)
    NearZero(f64),
}

fn compare<B: Backend>(
    engine: &mut Engine<B>,
    case: &Case,
    opts: &LossOptions,
    tol: &Tolerance,
) -> Result<CaseErrors, String> {
    compare_with(engine, case, opts, tol, DxCheck::Relative)
}

/// One call on an existing engine, compared with the reference. For
/// `head_kl`, `opts` are the loss options (the case's, or overrides).
fn compare_with<B: Backend>(
    engine: &mut Engine<B>,
    case: &Case,
    opts: &LossOptions,
    tol: &Tolerance,
    dx_check: DxCheck,
) -> Result<CaseErrors, String> {
    let head = case.head_weights().map_err(|e| format!("case head: {e}"))?;
    let f16_rows = case.hidden_f16();
    let hidden = case.hidden_rows(&f16_rows).map_err(|e| format!("case hidden: {e}"))?;
    match case.kind {
        CaseKind::HeadKl => {
            let teacher = case.teacher().map_err(|e| format!("case teacher: {e}"))?;
            let out = engine
                .head_kl(&hidden, &teacher, opts)
                .map_err(|e| format!("head_kl: {e}"))?;
            if !opts.config.head_grad && !out.head_grad.is_empty() {
                return Err(format!(
                    "head_kl without head_grad returned {} values of the head's gradient, want none",
                    out.head_grad.len()
                ));
            }
            let resolved = opts.resolve(case.ntok).map_err(|e| format!("case options: {e}"))?;
            let want = direct::head_kl_f64(&head, &hidden, &teacher, &resolved);
            let loss = tol.check_loss(&out.loss, out.mean, &want);
            let dx = match dx_check {
                DxCheck::Relative => tol
                    .check_dx_rows(&out.dx, &want.dx, Some(case.hs))
                    .map_err(|e| e.to_string()),
                DxCheck::NearZero(bound) => {
                    let rms = (out.dx.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / out.dx.len() as f64).sqrt();
                    if rms <= bound {
                        Ok(rms)
                    } else {
                        Err(format!(
                            "dx: RMS {rms:.3e} exceeds {bound:.1e}; the reference gradient is 0"
                        ))
                    }
                }
            };
            match (loss, dx) {
                (Ok(l), Ok(d)) => Ok(CaseErrors {
                    loss: Some(l),
                    dx: Some(d),
                    ..CaseErrors::default()
                }),
                (Err(e), Ok(_)) => Err(e.to_string()),
                (Ok(_), Err(e)) => Err(e),
                (Err(e1), Err(e2)) => Err(format!("{e1}\n    {e2}")),
            }
        }
        CaseKind::Topk => {
            let out = engine
                .topk(&hidden, &case.topk_options())
                .map_err(|e| format!("topk: {e}"))?;
            if (out.ntok, out.k) != (case.ntok, case.k) {
                return Err(format!(
                    "topk returned ntok = {}, k = {}; want {}, {}",
                    out.ntok, out.k, case.ntok, case.k
                ));
            }
            let want = direct::topk_f64(&head, &hidden, case.k, case.topk_temperature());
            let prob = tol.check_topk(&out.ids, &out.probs, &want).map_err(|e| e.to_string())?;
            let gathered = check_gather(engine, case, &head, &hidden, &out.ids, tol)?;
            Ok(CaseErrors {
                prob: Some(prob),
                loss: Some(gathered),
                ..CaseErrors::default()
            })
        }
    }
}

/// `Engine::logprobs_at` on a top-k case, against the f64 log-softmax: at
/// the top ids in the first half of each row, other ids (repeats allowed)
/// in the second, and none (−1, which must come back `-inf`) in the last
/// column when k > 1. Returns the worst error of the log-probabilities and
/// lse, judged as losses are.
fn check_gather<B: Backend>(
    engine: &mut Engine<B>,
    case: &Case,
    head: &headkl_core::HeadWeights<'_>,
    hidden: &headkl_core::Hidden<'_>,
    top_ids: &[u32],
    tol: &Tolerance,
) -> Result<f64, String> {
    let (k, vocab) = (case.k, case.vocab);
    let ids: Vec<i64> = top_ids
        .iter()
        .enumerate()
        .map(|(i, &id)| match i % k {
            q if k > 1 && q == k - 1 => -1,
            q if q >= k / 2 => ((u64::from(id) * 7 + 3) % vocab as u64) as i64,
            _ => i64::from(id),
        })
        .collect();
    let out = engine
        .logprobs_at(hidden, &ids, &case.topk_options())
        .map_err(|e| format!("logprobs_at: {e}"))?;
    let (want_lp, want_lse) = direct::logprobs_at_f64(head, hidden, &ids, k, case.topk_temperature());
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for (i, (&g, &w)) in out.logprobs.iter().zip(&want_lp).enumerate() {
        if w == f64::NEG_INFINITY {
            if g != f32::NEG_INFINITY {
                return Err(format!("logprobs_at[{}][{}] = {g} for id −1, want -inf", i / k, i % k));
            }
        } else {
            got.push(g);
            want.push(w);
        }
    }
    got.extend_from_slice(&out.lse);
    want.extend_from_slice(&want_lse);
    let mean = got.iter().map(|&v| f64::from(v)).sum::<f64>() / got.len().max(1) as f64;
    tol.check_loss(&got, mean, &DirectLoss::of_losses(want))
        .map_err(|e| format!("logprobs_at (log-probabilities, then lse): {e}"))
}
