//! The head's gradient (`LossConfig::head_grad`, `LossOutput::head_grad`)
//! against the f64 reference ([`direct::head_kl_and_head_grad_f64`]):
//! [`HEAD_GRAD`], a table of named cases over the ways a call reaches it
//! (the divergences and terms, weights and reductions, chunks, slices and
//! the dx split, a vocabulary order, each hidden dtype, the
//! full-vocabulary teacher, the block filter), and their runner.
//!
//! Each case makes its calls on one engine and one output: the gradient
//! on (the loss, dx and the gradient against the reference); on again
//! into the same output (the same bits: nothing of the first call's sum
//! is left, on the device or in the output); off into it again (the
//! gradient comes back empty, the loss and dx bit for bit as with it on:
//! asking for it changes nothing else); with the block filter, on again
//! (the gradient bit for bit as without the filter: it is exact).

use half::{bf16, f16};
use headkl_core::toolkit::ChunkTransfers;
use headkl_core::{
    Backend, DxSplit, Engine, Hidden, LossConfig, LossOptions, LossOutput, LossTerms, Reduction, TailMode, TeacherForm,
    VocabOrder,
};

use super::errors::lm_case_and_prior;
use super::regression::{every_term, full_vocab_teacher, only, params, with_terms};
use super::{check_min_chunks, check_min_slices};
use crate::generator::{Case, CaseKind, CaseParams};
use crate::CaseErrors;
use headkl_reference::direct;
use headkl_reference::tolerance::Tolerance;

/// How the hidden rows go to the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Input {
    F32,
    F16,
    Bf16,
}

/// Where a case's data comes from.
enum Source {
    /// [`Case::from_params`].
    Params(CaseParams),
    /// [`lm_case`]: lm-like data at V = 4096, hs = 32, with this many
    /// tokens, slices and chunks (and the generator's prior as the
    /// vocabulary order, with [`Hg::order`]).
    Lm {
        ntok: usize,
        max_rows_per_slice: Option<usize>,
        max_rows_per_chunk: Option<usize>,
    },
}

/// The teacher's form and tail mode, and the loss terms.
type Terms = (TeacherForm, TailMode, fn() -> LossTerms);

/// A row of [`HEAD_GRAD`]: a named case, built by [`Hg::new`] (or
/// [`Hg::lm`]) and the knobs after it.
struct Hg {
    name: &'static str,
    source: Source,
    input: Input,
    /// The teacher's form and tail, and the terms ([`with_terms`]).
    terms: Option<Terms>,
    reduction: Reduction,
    /// `LossConfig::total` as this many times the weights' sum.
    total_times: Option<f32>,
    gscale: Option<f32>,
    /// The full-vocabulary divergence from a teacher of this hidden size
    /// (`Engine::head_kl_full_vocab`; the divergence is the terms').
    full_vocab: Option<usize>,
    /// The head stored in a vocabulary order.
    order: bool,
    /// Also a call with the block filter at 2^-15.
    filter: bool,
    dx_split: Option<DxSplit>,
    min_slices: usize,
    min_chunks: usize,
    /// The last chunk's rows are not a multiple of 16.
    ragged_last_chunk: bool,
}

impl Hg {
    /// The case `name` as `params` give it (f32 rows, the default terms).
    const fn new(name: &'static str, params: CaseParams) -> Self {
        Hg {
            name,
            source: Source::Params(params),
            input: Input::F32,
            terms: None,
            reduction: Reduction::Mean,
            total_times: None,
            gscale: None,
            full_vocab: None,
            order: false,
            filter: false,
            dx_split: None,
            min_slices: 1,
            min_chunks: 1,
            ragged_last_chunk: false,
        }
    }

    /// The lm-like case of `ntok` tokens in slices and chunks of at most
    /// these many rows.
    const fn lm(name: &'static str, ntok: usize, slice: Option<usize>, chunk: Option<usize>) -> Self {
        Hg {
            source: Source::Lm {
                ntok,
                max_rows_per_slice: slice,
                max_rows_per_chunk: chunk,
            },
            ..Hg::new(name, params(CaseKind::HeadKl, 1, 1, 1, 1, 0))
        }
    }

    /// Some tokens masked (weights 0), the others weighted.
    const fn masked(mut self) -> Self {
        if let Source::Params(p) = &mut self.source {
            p.masked = true;
        }
        self
    }

    /// Logits of about ±60.
    const fn large(mut self) -> Self {
        if let Source::Params(p) = &mut self.source {
            p.large = true;
        }
        self
    }

    const fn terms(mut self, form: TeacherForm, tail: TailMode, terms: fn() -> LossTerms) -> Self {
        self.terms = Some((form, tail, terms));
        self
    }

    knobs! {
        set input: Input => input;
        set reduction: Reduction => reduction;
        some total_times: f32 => total_times;
        some gscale: f32 => gscale;
        some full_vocab: usize => full_vocab;
        flag order => order;
        flag filter => filter;
        some dx_split: DxSplit => dx_split;
        set min_slices: usize => min_slices;
        set min_chunks: usize => min_chunks;
        flag ragged_last_chunk => ragged_last_chunk;
    }
}

/// `params` with τ, slices and chunks: the knobs most rows set.
const fn shaped(p: CaseParams, temperature: f32, slice: Option<usize>, chunk: Option<usize>) -> CaseParams {
    CaseParams {
        temperature,
        max_rows_per_slice: slice,
        max_rows_per_chunk: chunk,
        ..p
    }
}

/// The head-gradient cases, in order (seeds are the last of `params`).
#[rustfmt::skip]
const HEAD_GRAD: &[Hg] = {
    use headkl_core::Divergence::{Forward, Jsd, Reverse};
    use CaseKind::HeadKl;
    use Input::{Bf16, F16};
    use Reduction::Sum;
    use TailMode::{Bucket, Renormalize, Unnormalized};
    use TeacherForm::{Logprobs, Probs};
    &[
        // The forward KL alone, ragged V and hs, one chunk and one slice.
        Hg::new("forward_ragged_v257_hs33", params(HeadKl, 257, 33, 19, 8, 0x4701)),
        // Per-token weights (some masked), large logits.
        Hg::new("forward_masked_large", params(HeadKl, 300, 40, 23, 8, 0x4702)).masked().large(),
        // Each divergence in a tail mode, and JSD's β.
        Hg::new("reverse_bucket_logprobs_chunks", shaped(params(HeadKl, 420, 32, 37, 7, 0x4703), 1.5, None, Some(16)))
            .terms(Logprobs, Bucket, || only(Reverse)).min_chunks(3),
        Hg::new("reverse_renormalize", params(HeadKl, 310, 40, 23, 9, 0x4704)).masked()
            .terms(Probs, Renormalize, || only(Reverse)),
        Hg::new("jsd_beta03_renormalize_tau2", shaped(params(HeadKl, 300, 40, 20, 8, 0x4705), 2.0, None, None))
            .terms(Probs, Renormalize, || only(Jsd { beta: 0.3 })),
        Hg::new("jsd_beta08_tail_none", params(HeadKl, 350, 24, 17, 6, 0x4706))
            .terms(Probs, Unnormalized, || only(Jsd { beta: 0.8 })),
        // Every term at once (hard term with labels and smoothing, z-loss,
        // softcap, logit scale, soft weight), forward and JSD.
        Hg::new("every_term_forward_bucket", shaped(params(HeadKl, 400, 40, 25, 8, 0x4707), 1.5, None, None)).masked()
            .terms(Logprobs, Bucket, || every_term(Forward)),
        Hg::new("every_term_jsd_slices_chunks", shaped(params(HeadKl, 700, 56, 40, 12, 0x4708), 1.5, Some(256), Some(16)))
            .masked().terms(Logprobs, Bucket, || every_term(Jsd { beta: 0.3 })).min_slices(3).min_chunks(3),
        // The hard term alone: the gradient from the labels only.
        Hg::new("hard_only_labels", params(HeadKl, 330, 32, 21, 6, 0x4709))
            .terms(Probs, Renormalize, || LossTerms { soft_weight: 0.0, hard_weight: 1.0, label_smoothing: 0.1,
                ..LossTerms::default() }),
        // The logit scale alone (τ 1, no cap: the KL rows take the logits
        // GEMM's row statistics).
        Hg::new("logit_scale_row_stats", params(HeadKl, 330, 40, 21, 7, 0x470A)).masked()
            .terms(Probs, Renormalize, || LossTerms { logit_scale: 1.75, ..LossTerms::default() }),
        Hg::new("z_loss_softcap", params(HeadKl, 350, 24, 17, 6, 0x470B))
            .terms(Probs, Renormalize, || LossTerms { z_loss: 1e-2, softcap: Some(3.0), ..LossTerms::default() }),
        // The reductions: the sum (total 1), and the mean over an explicit
        // total (three times the weights' sum) with an explicit gscale.
        Hg::new("reduction_sum_masked", params(HeadKl, 300, 32, 19, 6, 0x470C)).masked().reduction(Sum),
        Hg::new("reduction_mean_total_gscale_chunks", shaped(params(HeadKl, 300, 32, 35, 6, 0x470D), 1.0, None, Some(16)))
            .masked().total_times(3.0).gscale(64.0).min_chunks(3),
        // Chunks: three, the last of 13 rows (accumulation across chunks,
        // and a padded last tile).
        Hg::new("chunks_ragged_last", shaped(params(HeadKl, 300, 40, 45, 4, 0x470E), 1.0, None, Some(16)))
            .min_chunks(3).ragged_last_chunk(),
        // Chunks of 1024 rows, tapered (512, 1024, 252, 512): 2300 tokens
        // in the f32 sum, a chunk of 252.
        Hg::new("tapered_chunks_2300_tokens", shaped(params(HeadKl, 130, 24, 2300, 5, 0x470F), 1.0, None, Some(1024)))
            .masked().min_chunks(4),
        // Slices: 5 (4 of 256 rows, then 76 padded to 80), with chunks,
        // and the dx GEMM split (its partials live where the gradient is
        // turned into columns).
        Hg::new("slices_chunks", shaped(params(HeadKl, 1100, 72, 40, 12, 0x4710), 1.0, Some(256), Some(16)))
            .masked().min_slices(5).min_chunks(3).ragged_last_chunk(),
        Hg::new("dx_split3_slices_chunks", shaped(params(HeadKl, 1100, 72, 40, 12, 0x4711), 1.25, Some(256), Some(16)))
            .dx_split(DxSplit::Parts(3)).min_slices(5).min_chunks(3),
        // A vocabulary order over several slices and chunks: rows come back
        // in id order.
        Hg::new("vocab_order_slices_chunks", shaped(params(HeadKl, 700, 56, 37, 12, 0x4712), 1.0, Some(256), Some(16)))
            .masked().order().min_slices(3).min_chunks(3).ragged_last_chunk(),
        // The hidden dtypes. f16 at hs 64 (a multiple of 16) goes up
        // unpacked: the rows past ntok in the padded tile must be zeros
        // for the gradient's reduction over tokens (5 of 16, then 37 in
        // chunks of 16).
        Hg::new("f16_hs64_one_partial_tile", params(HeadKl, 300, 64, 5, 8, 0x4713)).input(F16),
        Hg::new("f16_hs64_chunks", shaped(params(HeadKl, 300, 64, 37, 8, 0x4714), 1.0, None, Some(16)))
            .input(F16).min_chunks(3).ragged_last_chunk(),
        Hg::new("f16_ragged_v257_hs33", params(HeadKl, 257, 33, 19, 5, 0x4715)).input(F16),
        Hg::new("bf16_ragged_chunks", shaped(params(HeadKl, 301, 40, 29, 6, 0x4716), 1.0, None, Some(16)))
            .input(Bf16).masked().min_chunks(2).ragged_last_chunk(),
        Hg::new("bf16_hs64", params(HeadKl, 257, 64, 21, 6, 0x4717)).input(Bf16),
        // The full-vocabulary teacher (its hidden rows and head).
        Hg::new("full_vocab_forward_masked", params(HeadKl, 300, 24, 20, 1, 0x4718)).masked().full_vocab(40),
        Hg::new("full_vocab_reverse_tau2_slices_chunks", shaped(params(HeadKl, 700, 56, 40, 1, 0x4719), 2.0,
            Some(256), Some(16))).terms(Probs, Renormalize, || only(Reverse)).full_vocab(16).min_slices(3).min_chunks(3),
        Hg::new("full_vocab_jsd_f16_logit_scale", params(HeadKl, 130, 20, 9, 1, 0x471A)).input(F16)
            .terms(Probs, Renormalize, || LossTerms { soft_weight: 0.7, logit_scale: 0.8,
                ..only(Jsd { beta: 0.5 }) }).full_vocab(36),
        // The block filter on lm-like data (3 slices, chunks of 48 and 27),
        // in the natural order and in the prior's.
        Hg::lm("filter_lm", 75, Some(1536), Some(48)).filter().min_slices(3).min_chunks(2).ragged_last_chunk(),
        Hg::lm("filter_lm_vocab_order", 75, Some(1536), Some(48)).filter().order().min_slices(3),
    ]
};

/// Names of the head-gradient cases, in order.
pub(crate) fn head_grad_names() -> &'static [&'static str] {
    row_names!(HEAD_GRAD)
}

/// A built case: its data, the teacher's (full vocabulary), the order
/// and the options with the gradient on.
struct Built {
    case: Case,
    teacher_case: Option<Case>,
    order: Option<VocabOrder>,
    opts: LossOptions,
}

fn build(row: &Hg) -> Result<Built, String> {
    let (mut case, prior) = match &row.source {
        Source::Params(p) => (Case::from_params(p), None),
        &Source::Lm {
            ntok,
            max_rows_per_slice,
            max_rows_per_chunk,
        } => {
            let (case, prior) = lm_case_and_prior(ntok, max_rows_per_slice, max_rows_per_chunk)?;
            (case, Some(prior))
        }
    };
    if let Some((form, tail, terms)) = row.terms {
        case = with_terms(case, form, tail, terms());
    }
    case.reduction = row.reduction;
    case.name = format!("head_grad/{}", row.name);
    let teacher_case = row.full_vocab.map(|teacher_hs| {
        let Source::Params(p) = &row.source else {
            return Err("a full-vocabulary case needs parameters".to_string());
        };
        Ok(full_vocab_teacher(p, teacher_hs))
    });
    let teacher_case = teacher_case.transpose()?;
    let order = match (row.order, prior) {
        (false, _) => None,
        (true, Some(prior)) => Some(VocabOrder::by_score(&prior).map_err(|e| e.to_string())?),
        // A stride through the ids (7919 is prime, above every V here).
        (true, None) => {
            let v = case.vocab as u64;
            let order = (0..v).map(|p| ((p * 7919 + 11) % v) as u32).collect();
            Some(VocabOrder::new(order).map_err(|e| e.to_string())?)
        }
    };
    let base = case.loss_options();
    let sum: f32 = case.weights.as_deref().map_or(case.ntok as f32, |w| w.iter().sum());
    let opts = LossOptions {
        config: LossConfig {
            total: row.total_times.map(|t| t * sum.max(1.0)),
            gscale: row.gscale,
            head_grad: true,
            ..base.config
        },
        ..base
    };
    Ok(Built {
        case,
        teacher_case,
        order,
        opts,
    })
}

/// A case's hidden rows in their dtype.
enum Rows {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Rows {
    fn of(case: &Case, input: Input) -> Self {
        match input {
            Input::F32 => Rows::F32(case.hidden.clone()),
            Input::F16 => Rows::F16(case.hidden.iter().map(|&v| f16::from_f32(v)).collect()),
            Input::Bf16 => Rows::Bf16(case.hidden.iter().map(|&v| bf16::from_f32(v)).collect()),
        }
    }

    fn hidden(&self, case: &Case) -> Result<Hidden<'_>, String> {
        let (ntok, hs) = (case.ntok, case.hs);
        match self {
            Rows::F32(v) => Hidden::f32(v, ntok, hs),
            Rows::F16(v) => Hidden::f16(v, ntok, hs),
            Rows::Bf16(v) => Hidden::bf16(v, ntok, hs),
        }
        .map_err(|e| format!("{} hidden rows: {e}", case.name))
    }
}

/// `opts` with the gradient on or off and the block filter at `eps`.
fn with(opts: &LossOptions, head_grad: bool, filter_eps: Option<f32>) -> LossOptions {
    LossOptions {
        config: LossConfig {
            head_grad,
            filter_eps,
            ..opts.config
        },
        ..opts.clone()
    }
}

/// The first element where `a` and `b` differ in bits (or their lengths).
fn first_difference(a: &[f32], b: &[f32]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("{} elements against {}", a.len(), b.len()));
    }
    let i = a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits())?;
    Some(format!("[{i}] = {:e} against {:e}", a[i], b[i]))
}

/// Checks `out`'s loss outputs and dx are `base`'s bit for bit.
fn same_loss_and_dx(out: &LossOutput, base: &LossOutput, what: &str) -> Result<(), String> {
    for (name, x, y) in [
        ("loss", &out.loss, &base.loss),
        ("lse", &out.lse, &base.lse),
        ("soft", &out.soft, &base.soft),
        ("hard", &out.hard, &base.hard),
        ("dx", &out.dx, &base.dx),
    ] {
        if let Some(d) = first_difference(x, y) {
            return Err(format!("{what}: {name}{d} with the head's gradient on"));
        }
    }
    Ok(())
}

/// Runs head-gradient case `name`.
pub(crate) fn check_head_grad_case<B: Backend + ?Sized>(
    backend: &B,
    name: &str,
    tol: &Tolerance,
) -> Result<CaseErrors, String> {
    let row = HEAD_GRAD
        .iter()
        .find(|row| row.name == name)
        .ok_or_else(|| format!("no head-gradient case named {name}"))?;
    let Built {
        case,
        teacher_case,
        order,
        opts,
    } = build(row)?;
    let head = case.head_weights().map_err(|e| format!("case head: {e}"))?;
    let mut engine = Engine::with_vocab_order(backend, &head, case.slice_options(), order)
        .map_err(|e| format!("Engine::with_vocab_order: {e}"))?;
    if let Some(split) = row.dx_split {
        engine.set_dx_split(split);
    }
    check_min_slices(&engine, row.min_slices)?;
    let plan = engine
        .loss_plan(case.ntok, case.k, row.input == Input::F32, &opts)
        .map_err(|e| format!("loss_plan: {e}"))?;
    let chunks = plan.chunk_rows(case.ntok, ChunkTransfers::Host);
    check_min_chunks(chunks.len(), row.min_chunks)?;
    let last = chunks.last().map_or(0, |c| c.rows);
    if row.ragged_last_chunk && last.is_multiple_of(headkl_core::ALIGN) {
        return Err(format!(
            "the last chunk has {last} rows, a multiple of {}",
            headkl_core::ALIGN
        ));
    }
    let rows = Rows::of(&case, row.input);
    let hidden = rows.hidden(&case)?;
    let resolved = opts.resolve(case.ntok).map_err(|e| format!("case options: {e}"))?;
    let teacher_rows = teacher_case.as_ref().map(|t| Rows::of(t, row.input));
    if let Some(t) = &teacher_case {
        let t_head = t.head_weights().map_err(|e| format!("teacher head: {e}"))?;
        engine
            .set_teacher_head(&t_head, t.slice_options())
            .map_err(|e| format!("set_teacher_head: {e}"))?;
    }
    // One call into `out`, top-k teacher or full vocabulary.
    let mut call = |opts: &LossOptions, out: &mut LossOutput| -> Result<(), String> {
        match (&teacher_case, &teacher_rows) {
            (Some(t), Some(t_rows)) => {
                let t_hidden = t_rows.hidden(t)?;
                engine
                    .head_kl_full_vocab_into(&hidden, &t_hidden, opts, out)
                    .map_err(|e| format!("head_kl_full_vocab: {e}"))
            }
            _ => {
                let teacher = case.teacher().map_err(|e| format!("case teacher: {e}"))?;
                engine
                    .head_kl_into(&hidden, &teacher, opts, out)
                    .map_err(|e| format!("head_kl: {e}"))
            }
        }
    };
    let (want, want_dw) = match (&teacher_case, &teacher_rows) {
        (Some(t), Some(t_rows)) => {
            let t_head = t.head_weights().map_err(|e| format!("teacher head: {e}"))?;
            let t_hidden = t_rows.hidden(t)?;
            direct::head_kl_full_vocab_and_head_grad_f64(&head, &hidden, (&t_head, &t_hidden), &resolved)
        }
        _ => {
            let teacher = case.teacher().map_err(|e| format!("case teacher: {e}"))?;
            direct::head_kl_and_head_grad_f64(&head, &hidden, &teacher, &resolved)
        }
    };
    let mut first = LossOutput::default();
    call(&opts, &mut first)?;
    // All three judged, every failure reported.
    let (loss, dx, head_grad) = match (
        tol.check_loss(&first.loss, first.mean, &want),
        tol.check_dx_rows(&first.dx, &want.dx, Some(case.hs)),
        tol.check_head_grad(&first.head_grad, &want_dw, case.hs),
    ) {
        (Ok(loss), Ok(dx), Ok(head_grad)) => (loss, dx, head_grad),
        (loss, dx, head_grad) => {
            let failed: Vec<String> = [loss.err(), dx.err(), head_grad.err()]
                .into_iter()
                .flatten()
                .map(|e| e.to_string())
                .collect();
            return Err(failed.join("\n    "));
        }
    };
    // Again into the same output: nothing of the first sum may be left.
    let mut out = first.clone();
    call(&opts, &mut out)?;
    if let Some(d) = first_difference(&out.head_grad, &first.head_grad) {
        return Err(format!(
            "a second call with the head's gradient on: head_grad{d} in the first"
        ));
    }
    // Off, into the output that held it: empty, and nothing else changes.
    call(&with(&opts, false, None), &mut out)?;
    if !out.head_grad.is_empty() {
        return Err(format!(
            "head_grad off: {} values came back (the last call's), want none",
            out.head_grad.len()
        ));
    }
    same_loss_and_dx(&first, &out, "the call with the gradient on against the one without")?;
    let mut errors = CaseErrors {
        loss: Some(loss),
        dx: Some(dx),
        head_grad: Some(head_grad),
        ..CaseErrors::default()
    };
    if row.filter {
        let eps = headkl_core::problem::filter::AUTO_EPS;
        call(&with(&opts, true, Some(eps)), &mut out)?;
        let skipped = out.filter.map_or(0.0, |f| f.skipped_fraction());
        if !backend.gemm_block_filter() {
            // No filter runs (the dx GEMM cannot skip blocks): asking for it
            // changes nothing, and no statistics claim otherwise.
            if out.filter.is_some() {
                return Err("filter statistics from a backend that runs no filter".into());
            }
            same_loss_and_dx(&first, &out, "the call asking for the filter on a backend without it")?;
        } else if skipped <= 0.0 {
            return Err("the block filter skipped no block: this case checks nothing".into());
        }
        if let Some(d) = first_difference(&out.head_grad, &first.head_grad) {
            return Err(format!(
                "with the block filter ({:.1}% of the blocks skipped): head_grad{d} without it",
                100.0 * skipped
            ));
        }
        let dx_filtered = tol
            .check_dx_rows(&out.dx, &want.dx, Some(case.hs))
            .map_err(|e| format!("with the block filter: {e}"))?;
        errors.dx = Some(dx.max(dx_filtered));
    }
    Ok(errors)
}

/// A case's one-line description (its data and knobs).
pub(crate) fn describe_head_grad_case(name: &str) -> String {
    let Some(row) = HEAD_GRAD.iter().find(|row| row.name == name) else {
        return format!("no head-gradient case named {name}");
    };
    match build(row) {
        Ok(b) => {
            let mut s = b.case.describe();
            s.push_str(&format!(" input={:?}", row.input));
            if let Some(t) = b.teacher_case {
                s.push_str(&format!(" full_vocab(teacher hs={})", t.hs));
            }
            if b.order.is_some() {
                s.push_str(" vocab_order");
            }
            if row.filter {
                s.push_str(" filter=2^-15");
            }
            if let Some(split) = row.dx_split {
                s.push_str(&format!(" dx_split={split}"));
            }
            if let Some(t) = row.total_times {
                s.push_str(&format!(" total={t}·Σw"));
            }
            if let Some(g) = row.gscale {
                s.push_str(&format!(" gscale={g}"));
            }
            s
        }
        Err(e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_grad_names_are_unique() {
        let names = head_grad_names();
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "a head-gradient case name appears twice");
    }

    #[test]
    fn every_case_builds() {
        for row in HEAD_GRAD {
            let b = build(row).unwrap_or_else(|e| panic!("{}: {e}", row.name));
            b.case.validate().unwrap_or_else(|e| panic!("{}: {e}", row.name));
            assert!(b.opts.config.head_grad);
        }
    }
}
