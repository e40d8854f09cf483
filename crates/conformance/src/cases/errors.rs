//! The error cases ([`ERROR_CASES`]), by the kind of error they check:
//! non-finite hidden rows ([`NON_FINITE`]); the engine around an error and
//! its resources (recovery, downloads in flight, several slices and
//! chunks, memory); the dx block filter on lm-like data; the head's
//! gradient where it is refused.

use headkl_core::{Backend, Engine, Error, HiddenData, LossConfig, LossOptions, LossTerms, TailMode, TeacherForm};

use super::compare;
use super::regression::{params, with_terms};
use crate::generator::{Case, CaseKind, CaseParams};
use crate::overlap::CountInFlight;
use crate::{engine_for, CaseErrors};
use headkl_reference::tolerance::Tolerance;

/// The error cases: `(name, what it checks)`.
pub(crate) const ERROR_CASES: &[(&str, &str)] = &[
    (
        "nan_row_head_kl",
        "NaN in hidden row 21 of 40, chunks of 16: head_kl fails naming token 21",
    ),
    (
        "inf_then_nan_topk",
        "+inf in row 3 and NaN in row 30 of 40, chunks of 16: topk names token 3",
    ),
    (
        "past_f16_range_head_kl",
        "1e5 in f32 row 33 (inf once converted): head_kl and topk name token 33",
    ),
    (
        "f16_rows_nan",
        "f16 rows with NaN in row 5 of 20: head_kl and topk name token 5",
    ),
    (
        "recovers_after_error",
        "a clean call on the engine that just returned NonFiniteHidden matches the reference",
    ),
    (
        "multi_slice_multi_chunk",
        "V=1100 hs=72 ntok=70 in >= 3 slices and >= 4 chunks: head_kl and topk match the reference",
    ),
    (
        "two_chunks_in_flight",
        "40 tokens in chunks of 16: head_kl and topk keep two chunks' downloads in flight and match the reference; \
         NaN in row 21 fails naming token 21 with no download left in flight",
    ),
    (
        "memory_released",
        "dropping an engine returns the backend's memory to what it was before",
    ),
    (
        "filter_lm_dx_within_tolerance",
        "lm-like data (V=4096, hs=32, 80 tokens, 3 slices, chunks of 48): with the dx block filter at \
         ε = 2^-15 a quarter or more of the blocks are skipped, the loss is bit-identical to the unfiltered \
         call's and dx is within the suite's dx tolerance of the f64 reference",
    ),
    (
        "vocab_order_prior",
        "lm-like data (V=4096, 3 slices, chunks of 48) on a head stored in the prior's order: head_kl \
         (with and without the dx block filter at 2^-15) and topk match the f64 reference in token ids, \
         and the filter skips more blocks than in the natural order",
    ),
    (
        "head_grad_refused_by_shards",
        "LossConfig::head_grad with the sharded loss: shard::check_loss_terms and ShardEngine::loss_partials \
         refuse it (ShardUnsupported, option head-grad) before any work, and the shard's engine then runs \
         the same call without it",
    ),
    (
        "filter_eps_zero_bit_identical",
        "the lm-like data, plain and with τ = 2, the hard term and the z-loss: with ε = 0 loss and dx are \
         bit-identical to the unfiltered call's; at ε = 2^-15 the loss is, and dx matches the reference",
    ),
];

/// Runs error case `name`.
pub(crate) fn check_error_case<B: Backend + ?Sized>(
    backend: &B,
    name: &str,
    tol: &Tolerance,
) -> Result<CaseErrors, String> {
    if let Some(c) = NON_FINITE.iter().find(|c| c.name == name) {
        return non_finite(backend, c).map(|()| CaseErrors::default());
    }
    match name {
        "recovers_after_error" => recovers_after_error(backend, tol),
        "two_chunks_in_flight" => two_chunks_in_flight(backend, tol),
        "multi_slice_multi_chunk" => multi_slice_multi_chunk(backend, tol),
        "memory_released" => memory_released(backend, tol),
        "filter_lm_dx_within_tolerance" => filter_lm_dx_within_tolerance(backend, tol),
        "vocab_order_prior" => vocab_order_prior(backend, tol),
        "filter_eps_zero_bit_identical" => filter_eps_zero_bit_identical(backend, tol),
        "head_grad_refused_by_shards" => head_grad_refused_by_shards(backend),
        other => Err(format!("no error case named {other}")),
    }
}

/// The calls a non-finite case makes.
#[derive(Clone, Copy)]
enum Calls {
    /// `head_kl` on the case's own engine.
    HeadKl,
    /// `topk` on the case's own engine.
    Topk,
    /// Both ([`both_fail`]).
    Both,
}

/// A case of non-finite hidden rows: [`error_base`] of `kind` and `ntok`
/// tokens, its rows as f16 when `f16`, with `poison` entries `(row,
/// column, value)`; `calls` must fail naming `token`.
struct NonFinite {
    name: &'static str,
    kind: CaseKind,
    ntok: usize,
    f16: bool,
    poison: &'static [(usize, usize, f32)],
    calls: Calls,
    token: usize,
}

/// The non-finite cases.
#[rustfmt::skip]
const NON_FINITE: &[NonFinite] = &[
    NonFinite {
        name: "nan_row_head_kl", kind: CaseKind::HeadKl, ntok: 40, f16: false,
        poison: &[(21, 7, f32::NAN)], calls: Calls::HeadKl, token: 21,
    },
    NonFinite {
        name: "inf_then_nan_topk", kind: CaseKind::Topk, ntok: 40, f16: false,
        poison: &[(3, 0, f32::INFINITY), (30, 39, f32::NAN)], calls: Calls::Topk, token: 3,
    },
    NonFinite {
        name: "past_f16_range_head_kl", kind: CaseKind::HeadKl, ntok: 40, f16: false,
        poison: &[(33, 11, 1e5)], calls: Calls::Both, token: 33,
    },
    NonFinite {
        name: "f16_rows_nan", kind: CaseKind::HeadKl, ntok: 20, f16: true,
        poison: &[(5, 2, f32::NAN)], calls: Calls::Both, token: 5,
    },
];

/// Runs the non-finite case `c`.
fn non_finite<B: Backend + ?Sized>(backend: &B, c: &NonFinite) -> Result<(), String> {
    let mut case = error_base(c.kind, c.ntok);
    if c.f16 {
        case.hidden_as_f16 = true;
    }
    for &(row, column, value) in c.poison {
        case.hidden[row * case.hs + column] = value;
    }
    if c.f16 {
        let f16_rows = case.hidden_f16();
        let hidden = case.hidden_rows(&f16_rows).map_err(|e| e.to_string())?;
        if !matches!(hidden.data(), HiddenData::F16(_)) {
            return Err("the case must pass f16 rows".into());
        }
    }
    match c.calls {
        Calls::HeadKl => {
            let mut engine = engine_for(backend, &case)?;
            let hidden = case.hidden_rows(&[]).map_err(|e| e.to_string())?;
            let teacher = case.teacher().map_err(|e| e.to_string())?;
            let got = engine.head_kl(&hidden, &teacher, &case.loss_options());
            expect_non_finite("head_kl", got, c.token)
        }
        Calls::Topk => {
            let mut engine = engine_for(backend, &case)?;
            let hidden = case.hidden_rows(&[]).map_err(|e| e.to_string())?;
            expect_non_finite("topk", engine.topk(&hidden, &case.topk_options()), c.token)
        }
        Calls::Both => both_fail(backend, &case, c.token),
    }
}

/// A clean call on the engine that just returned `NonFiniteHidden`.
fn recovers_after_error<B: Backend + ?Sized>(backend: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
    let clean = error_base(CaseKind::HeadKl, 40);
    let mut poisoned = clean.clone();
    poisoned.hidden[17 * clean.hs] = f32::NAN;
    let mut engine = engine_for(backend, &clean)?;
    let hidden = poisoned.hidden_rows(&[]).map_err(|e| e.to_string())?;
    let teacher = clean.teacher().map_err(|e| e.to_string())?;
    expect_non_finite("head_kl", engine.head_kl(&hidden, &teacher, &clean.loss_options()), 17)?;
    expect_non_finite("topk", engine.topk(&hidden, &clean.topk_options()), 17)?;
    let kl = compare(&mut engine, &clean, &clean.loss_options(), tol).map_err(|e| format!("after the error: {e}"))?;
    let topk_case = Case {
        kind: CaseKind::Topk,
        ..clean.clone()
    };
    let top =
        compare(&mut engine, &topk_case, &clean.loss_options(), tol).map_err(|e| format!("after the error: {e}"))?;
    Ok(CaseErrors { prob: top.prob, ..kl })
}

/// Two chunks' downloads in flight, and none left after an error.
fn two_chunks_in_flight<B: Backend + ?Sized>(backend: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
    let counted = CountInFlight::new(backend);
    let clean = error_base(CaseKind::HeadKl, 40);
    let mut engine = engine_for(&counted, &clean)?;
    let mut measured = CaseErrors::default();
    for kind in [CaseKind::HeadKl, CaseKind::Topk] {
        let case = Case { kind, ..clean.clone() };
        let m = compare(&mut engine, &case, &clean.loss_options(), tol)?;
        // Two outputs per chunk, two chunks: four copies out at once.
        let most = counted.take_most();
        if most < 4 || counted.pending() != 0 {
            return Err(format!(
                "{kind:?}: at most {most} downloads in flight (want 4: two chunks' outputs), {} left after the call",
                counted.pending()
            ));
        }
        measured = CaseErrors {
            prob: m.prob.or(measured.prob),
            loss: m.loss.or(measured.loss),
            dx: m.dx.or(measured.dx),
            head_grad: m.head_grad.or(measured.head_grad),
        };
    }
    let mut poisoned = clean.clone();
    poisoned.hidden[21 * clean.hs + 3] = f32::NAN;
    let hidden = poisoned.hidden_rows(&[]).map_err(|e| e.to_string())?;
    let teacher = clean.teacher().map_err(|e| e.to_string())?;
    let got = engine.head_kl(&hidden, &teacher, &clean.loss_options());
    expect_non_finite("head_kl", got, 21)?;
    let got = engine.topk(&hidden, &clean.topk_options());
    expect_non_finite("topk", got, 21)?;
    if counted.pending() != 0 {
        return Err(format!(
            "{} download(s) left in flight after the error",
            counted.pending()
        ));
    }
    Ok(measured)
}

/// Both jobs over at least 3 slices and 4 chunks.
fn multi_slice_multi_chunk<B: Backend + ?Sized>(backend: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
    let mut measured = CaseErrors::default();
    for kind in [CaseKind::HeadKl, CaseKind::Topk] {
        let case = Case::from_params(&CaseParams {
            max_rows_per_slice: Some(256),
            max_rows_per_chunk: Some(16),
            masked: true,
            temperature: 1.5,
            ..params(kind, 1100, 72, 70, 24, 0x51C)
        });
        let mut engine = engine_for(backend, &case)?;
        if engine.slices().len() < 3 {
            return Err(format!("{} slice(s), want >= 3", engine.slices().len()));
        }
        let plan = engine
            .loss_plan(case.ntok, case.k, true, &case.loss_options())
            .map_err(|e| e.to_string())?;
        if plan.chunks < 4 {
            return Err(format!("{} chunk(s), want >= 4", plan.chunks));
        }
        let m = compare(&mut engine, &case, &case.loss_options(), tol)?;
        measured.loss = measured.loss.or(m.loss);
        measured.dx = measured.dx.or(m.dx);
        measured.prob = measured.prob.or(m.prob);
    }
    Ok(measured)
}

/// Dropping an engine returns the backend's memory.
fn memory_released<B: Backend + ?Sized>(backend: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
    let before = backend.memory().current;
    {
        let case = error_base(CaseKind::HeadKl, 40);
        let mut engine = engine_for(backend, &case)?;
        compare(&mut engine, &case, &case.loss_options(), tol)?;
        if backend.memory().current <= before {
            return Err(format!(
                "memory().current = {} with an engine alive, not above {before}",
                backend.memory().current
            ));
        }
    }
    let after = backend.memory().current;
    if after != before {
        return Err(format!(
            "memory().current = {after} after the engine was dropped, was {before}"
        ));
    }
    Ok(CaseErrors::default())
}

/// On a backend whose dx GEMM cannot skip blocks
/// ([`headkl_core::Backend::gemm_block_filter`]): asking for the filter
/// changes no bit of the results and gives no filter statistics, and the
/// call is within tolerance of the reference.
fn filter_not_run<B: Backend>(engine: &mut Engine<B>, case: &Case, tol: &Tolerance) -> Result<CaseErrors, String> {
    let eps = headkl_core::problem::filter::AUTO_EPS;
    let (out, plain) = filtered_and_not(engine, case, &case.loss_options(), eps)?;
    same_bits(&out, &plain, true)?;
    if out.filter.is_some() {
        return Err("filter statistics from a backend that runs no filter".into());
    }
    compare(engine, case, &with_filter(case.loss_options(), eps), tol)
}

/// `opts` with the dx block filter at `eps`.
fn with_filter(opts: LossOptions, eps: f32) -> LossOptions {
    LossOptions {
        config: LossConfig {
            filter_eps: Some(eps),
            ..opts.config
        },
        ..opts
    }
}

/// The block filter on lm-like data: blocks skipped, the loss unchanged,
/// dx within tolerance.
fn filter_lm_dx_within_tolerance<B: Backend + ?Sized>(backend: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
    let case = lm_case(80, Some(1536), Some(48))?;
    let mut engine = engine_for(backend, &case)?;
    if engine.slices().len() < 3 {
        return Err(format!("{} slice(s), want >= 3", engine.slices().len()));
    }
    let eps = headkl_core::problem::filter::AUTO_EPS;
    if !backend.gemm_block_filter() {
        return filter_not_run(&mut engine, &case, tol);
    }
    let (out, plain) = filtered_and_not(&mut engine, &case, &case.loss_options(), eps)?;
    same_bits(&out, &plain, false)?;
    let stats = out.filter.ok_or("no filter statistics with the filter on")?;
    if stats.skipped_fraction() < 0.25 {
        return Err(format!(
            "the filter skipped {:.1}% of {} blocks, want >= 25% on this data",
            100.0 * stats.skipped_fraction(),
            stats.blocks
        ));
    }
    let m = compare(&mut engine, &case, &with_filter(case.loss_options(), eps), tol)?;
    log::info!(
        "filter_lm_dx_within_tolerance: skipped {:.1}% of {} blocks, dx err {:.2e} (tolerance {:.0e})",
        100.0 * stats.skipped_fraction(),
        stats.blocks,
        m.dx.unwrap_or(f64::NAN),
        tol.dx_rel
    );
    Ok(m)
}

/// A head stored in the prior's order: the results match, and the filter
/// skips more blocks than in the natural order.
fn vocab_order_prior<B: Backend + ?Sized>(backend: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
    let (case, prior) = lm_case_and_prior(80, Some(1536), Some(48))?;
    let order = headkl_core::VocabOrder::by_score(&prior).map_err(|e| e.to_string())?;
    let head = case.head_weights().map_err(|e| format!("case head: {e}"))?;
    let mut ordered = Engine::with_vocab_order(backend, &head, case.slice_options(), Some(order))
        .map_err(|e| format!("Engine::with_vocab_order: {e}"))?;
    let mut natural = engine_for(backend, &case)?;
    let filtered = with_filter(case.loss_options(), headkl_core::problem::filter::AUTO_EPS);
    let mut measured = compare(&mut ordered, &case, &case.loss_options(), tol)?;
    let m = compare(&mut ordered, &case, &filtered, tol)?;
    measured.dx = measured.dx.into_iter().chain(m.dx).reduce(f64::max);
    let top = Case {
        kind: CaseKind::Topk,
        ..case.clone()
    };
    measured.prob = compare(&mut ordered, &top, &top.loss_options(), tol)?.prob;
    if !backend.gemm_block_filter() {
        filter_not_run(&mut natural, &case, tol)?;
        return Ok(measured);
    }
    let hidden = case.hidden_rows(&[]).map_err(|e| e.to_string())?;
    let teacher = case.teacher().map_err(|e| e.to_string())?;
    let skipped = |engine: &mut Engine<&B>| -> Result<f64, String> {
        let out = engine
            .head_kl(&hidden, &teacher, &filtered)
            .map_err(|e| format!("head_kl: {e}"))?;
        Ok(out.filter.ok_or("no filter statistics")?.skipped_fraction())
    };
    let (by_prior, by_id) = (skipped(&mut ordered)?, skipped(&mut natural)?);
    log::info!(
        "vocab_order_prior: the filter skipped {:.1}% of the blocks in the prior's order, {:.1}% in the natural order",
        100.0 * by_prior,
        100.0 * by_id
    );
    if by_prior <= by_id {
        return Err(format!(
            "the prior's order skipped {:.1}% of the blocks, the natural order {:.1}%: no gain",
            100.0 * by_prior,
            100.0 * by_id
        ));
    }
    Ok(measured)
}

/// The filter at ε = 0 changes no bit; at the default ε only dx moves.
fn filter_eps_zero_bit_identical<B: Backend + ?Sized>(backend: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
    let case = lm_case(40, None, Some(32))?;
    let mut engine = engine_for(backend, &case)?;
    let mut measured = CaseErrors::default();
    let terms = LossTerms {
        hard_weight: 0.5,
        z_loss: 1e-3,
        ..LossTerms::default()
    };
    let general = with_terms(
        Case {
            temperature: 2.0,
            ..case.clone()
        },
        TeacherForm::Probs,
        TailMode::Renormalize,
        terms,
    );
    for c in [&case, &general] {
        if !backend.gemm_block_filter() {
            let m = filter_not_run(&mut engine, c, tol)?;
            measured.loss = measured.loss.into_iter().chain(m.loss).reduce(f64::max);
            measured.dx = measured.dx.into_iter().chain(m.dx).reduce(f64::max);
            continue;
        }
        let (zero, plain) = filtered_and_not(&mut engine, c, &c.loss_options(), 0.0)?;
        same_bits(&zero, &plain, true)?;
        let (auto, _) = filtered_and_not(
            &mut engine,
            c,
            &c.loss_options(),
            headkl_core::problem::filter::AUTO_EPS,
        )?;
        same_bits(&auto, &plain, false)?;
        let opts = with_filter(c.loss_options(), headkl_core::problem::filter::AUTO_EPS);
        let m = compare(&mut engine, c, &opts, tol)?;
        let worst = |a: Option<f64>, b: Option<f64>| a.into_iter().chain(b).reduce(f64::max);
        measured.loss = worst(measured.loss, m.loss);
        measured.dx = worst(measured.dx, m.dx);
    }
    Ok(measured)
}

/// The sharded loss refuses the head's gradient, naming the option, and
/// the shard's engine is usable after the refusal.
fn head_grad_refused_by_shards<B: Backend + ?Sized>(backend: &B) -> Result<CaseErrors, String> {
    use headkl_core::shard::{check_loss_terms, HeadShard, ShardEngine};
    let case = error_base(CaseKind::HeadKl, 40);
    let head = case.head_weights().map_err(|e| e.to_string())?;
    let hidden = case.hidden_rows(&[]).map_err(|e| e.to_string())?;
    let teacher = case.teacher().map_err(|e| e.to_string())?;
    let plain = case.loss_options();
    let opts = LossOptions {
        config: LossConfig {
            head_grad: true,
            ..plain.config
        },
        ..plain.clone()
    };
    fn refused<T>(what: &str, got: headkl_core::Result<T>) -> Result<(), String> {
        match got {
            Err(Error::ShardUnsupported {
                option: "head-grad", ..
            }) => Ok(()),
            Err(e) => Err(format!(
                "{what} with head_grad: got error \"{e}\", want ShardUnsupported {{ option: \"head-grad\" }}"
            )),
            Ok(_) => Err(format!("{what} with head_grad: succeeded, want ShardUnsupported")),
        }
    }
    refused("shard::check_loss_terms", check_loss_terms(teacher.tail(), &opts))?;
    let shard = HeadShard::new(0, 160, case.vocab).map_err(|e| e.to_string())?;
    let rows = head.rows(shard.v0(), shard.v1()).map_err(|e| e.to_string())?;
    let mut engine = ShardEngine::new(backend, &rows, shard, case.slice_options()).map_err(|e| e.to_string())?;
    refused(
        "ShardEngine::loss_partials",
        engine.loss_partials(&hidden, &teacher, &opts),
    )?;
    let partials = engine
        .loss_partials(&hidden, &teacher, &plain)
        .map_err(|e| format!("loss_partials without head_grad, after the refusal: {e}"))?;
    if partials.lse.len() != case.ntok {
        return Err(format!(
            "loss_partials after the refusal: {} rows, want {}",
            partials.lse.len(),
            case.ntok
        ));
    }
    Ok(CaseErrors::default())
}

/// The base case of the error checks: V = 300, hs = 40, 40 tokens in
/// chunks of 16.
fn error_base(kind: CaseKind, ntok: usize) -> Case {
    Case::from_params(&CaseParams {
        max_rows_per_chunk: Some(16),
        ..params(kind, 300, 40, ntok, 4, 0xE44)
    })
}

fn expect_non_finite<T>(what: &str, got: headkl_core::Result<T>, token: usize) -> Result<(), String> {
    match got {
        Err(Error::NonFiniteHidden { token: t }) if t == token => Ok(()),
        Err(e) => Err(format!(
            "{what}: got error \"{e}\", want NonFiniteHidden {{ token: {token} }}"
        )),
        Ok(_) => Err(format!("{what}: succeeded, want NonFiniteHidden {{ token: {token} }}")),
    }
}

/// Runs both jobs on `case` (as given) and expects `NonFiniteHidden { token }`.
fn both_fail<B: Backend + ?Sized>(backend: &B, case: &Case, token: usize) -> Result<(), String> {
    let mut engine = engine_for(backend, case)?;
    let f16_rows = case.hidden_f16();
    let hidden = case.hidden_rows(&f16_rows).map_err(|e| e.to_string())?;
    let kl = error_base(CaseKind::HeadKl, case.ntok);
    let teacher = kl.teacher().map_err(|e| e.to_string())?;
    expect_non_finite("head_kl", engine.head_kl(&hidden, &teacher, &kl.loss_options()), token)?;
    let top = error_base(CaseKind::Topk, case.ntok);
    expect_non_finite("topk", engine.topk(&hidden, &top.topk_options()), token)
}

/// lm-like data ([`headkl_reference::lm`]) small enough for the f64 reference, with
/// a steep prior so the block filter has blocks to skip even at V = 4096:
/// `ntok` tokens, k = 16.
pub(crate) fn lm_case(
    ntok: usize,
    max_rows_per_slice: Option<usize>,
    max_rows_per_chunk: Option<usize>,
) -> Result<Case, String> {
    lm_case_and_prior(ntok, max_rows_per_slice, max_rows_per_chunk).map(|(case, _)| case)
}

/// [`lm_case`] and the generator's log prior over the vocabulary.
pub(super) fn lm_case_and_prior(
    ntok: usize,
    max_rows_per_slice: Option<usize>,
    max_rows_per_chunk: Option<usize>,
) -> Result<(Case, Vec<f32>), String> {
    let spec = headkl_reference::lm::LmSpec {
        zipf: 3.0,
        zipf_offset: 5.0,
        order_noise: 0.3,
        peaks: 3,
        peak_flatness: 1.0,
        background: 0.5,
        entropy: Some(1.0),
        teacher_noise: 1.5,
        ..headkl_reference::lm::LmSpec::new(4096, 32, ntok, 16, 0x1F17)
    };
    let d = headkl_reference::lm::generate(&spec)?;
    let mut case = Case::from_params(&CaseParams {
        max_rows_per_slice,
        max_rows_per_chunk,
        ..params(CaseKind::HeadKl, spec.vocab, spec.hs, ntok, spec.k, 0x1F17)
    });
    case.head = d.head.iter().map(|v| v.to_f32()).collect();
    case.hidden = d.hidden.iter().map(|v| v.to_f32()).collect();
    case.teacher_ids = d.ids;
    case.teacher_probs = d.probs;
    case.name = "head_kl/lm".into();
    Ok((case, d.log_prior))
}

/// `head_kl` on `case` with the block filter at `eps` and without: the
/// filtered output and the unfiltered one.
fn filtered_and_not<B: Backend>(
    engine: &mut Engine<B>,
    case: &Case,
    opts: &LossOptions,
    eps: f32,
) -> Result<(headkl_core::LossOutput, headkl_core::LossOutput), String> {
    let hidden = case.hidden_rows(&[]).map_err(|e| e.to_string())?;
    let teacher = case.teacher().map_err(|e| e.to_string())?;
    let plain = engine
        .head_kl(&hidden, &teacher, opts)
        .map_err(|e| format!("head_kl: {e}"))?;
    let filtered = LossOptions {
        config: LossConfig {
            filter_eps: Some(eps),
            ..opts.config
        },
        ..opts.clone()
    };
    let out = engine
        .head_kl(&hidden, &teacher, &filtered)
        .map_err(|e| format!("head_kl with the filter: {e}"))?;
    Ok((out, plain))
}

/// Whether two outputs agree bit for bit (loss, lse, soft, hard, and dx
/// too when `dx`).
fn same_bits(a: &headkl_core::LossOutput, b: &headkl_core::LossOutput, dx: bool) -> Result<(), String> {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (name, x, y) in [
        ("loss", &a.loss, &b.loss),
        ("lse", &a.lse, &b.lse),
        ("soft", &a.soft, &b.soft),
        ("hard", &a.hard, &b.hard),
    ] {
        if bits(x) != bits(y) {
            return Err(format!("{name} differs from the unfiltered call's"));
        }
    }
    if dx {
        if let Some(i) = a.dx.iter().zip(&b.dx).position(|(x, y)| x.to_bits() != y.to_bits()) {
            return Err(format!(
                "dx[{i}] = {:e} with the filter at ε = 0, {:e} without",
                a.dx[i], b.dx[i]
            ));
        }
    }
    Ok(())
}
