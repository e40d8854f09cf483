//! The fixed regression cases: [`REGRESSIONS`], a table of named cases,
//! each its parameters, how it is built from them and what it must also
//! show; and their runner.

use headkl_core::toolkit::ChunkTransfers;
use headkl_core::{
    Backend, Divergence, DxSplit, Engine, LossConfig, LossOptions, LossTerms, Reduction, TailMode, TeacherForm,
};

use super::{check_min_chunks, check_min_slices, compare_with, DxCheck};
use crate::generator::{Case, CaseKind, CaseParams, TeacherShape};
use crate::{engine_for, CaseErrors};
use headkl_reference::direct;
use headkl_reference::tolerance::Tolerance;

/// A fixed case with what it must also show.
pub(crate) struct Regression {
    pub(crate) case: Case,
    /// `LossConfig::total` override.
    total: Option<f32>,
    /// `LossConfig::gscale` override.
    gscale: Option<f32>,
    /// The head must be cut into at least this many slices.
    min_slices: usize,
    /// `head_kl` must run in at least this many chunks.
    min_chunks: usize,
    /// `topk` ids that must come back exactly (exact ties).
    exact_ids: Option<Vec<u32>>,
    /// How dx is judged.
    dx_check: DxCheck,
    /// The dx GEMM's split, and the split-K parts each slice must then get
    /// (`None`: the engine's default, unchecked).
    dx_split: Option<(DxSplit, Vec<usize>)>,
    /// The logits GEMMs write row statistics for the KL rows
    /// (`Engine::set_row_stats`; on by default).
    row_stats: bool,
    /// The full-vocabulary divergence: this case's head and hidden rows
    /// are the teacher's (`Engine::head_kl_full_vocab`), and the call is
    /// also made in the top-k mode at k = V.
    teacher_hidden: Option<Case>,
}

/// A regression case's parameters: random teacher, no crafted rows, τ = 1,
/// the default slicing.
pub(crate) const fn params(kind: CaseKind, vocab: usize, hs: usize, ntok: usize, k: usize, seed: u64) -> CaseParams {
    CaseParams {
        kind,
        profile: "regression",
        vocab,
        hs,
        ntok,
        k,
        data_seed: seed,
        teacher: TeacherShape::Random,
        large: false,
        ties: false,
        residue: false,
        masked: false,
        temperature: 1.0,
        hidden_as_f16: false,
        max_rows_per_slice: None,
        max_rows_per_chunk: None,
    }
}

fn plain(case: Case) -> Regression {
    Regression {
        case,
        total: None,
        gscale: None,
        min_slices: 1,
        min_chunks: 1,
        exact_ids: None,
        dx_check: DxCheck::Relative,
        dx_split: None,
        row_stats: true,
        teacher_hidden: None,
    }
}

/// A full-vocabulary regression: the student's case `p` (its teacher rows
/// unused) with `divergence`, and a teacher of hidden size `teacher_hs`
/// over the same vocabulary, its rows as f16 when the student's are.
fn full_vocab(p: CaseParams, divergence: Divergence, teacher_hs: usize) -> Regression {
    let mut r = from(CaseParams { k: 1, ..p });
    r.case.terms.divergence = divergence;
    r.case.name = format!("{}[{}]", r.case.name, divergence.name());
    r.teacher_hidden = Some(full_vocab_teacher(&p, teacher_hs));
    r
}

/// The teacher's case of a full-vocabulary case `p`: its head and hidden
/// rows, of hidden size `teacher_hs`, over the same vocabulary and tokens
/// (its rows as f16 when the student's are), from another seed.
pub(super) fn full_vocab_teacher(p: &CaseParams, teacher_hs: usize) -> Case {
    Case::from_params(&CaseParams {
        hs: teacher_hs,
        data_seed: p.data_seed ^ 0x7ea,
        ..p.clone()
    })
}

fn from(p: CaseParams) -> Regression {
    plain(Case::from_params(&p))
}

/// Every loss term on at once, with `divergence` (the "everything"
/// regression cases).
pub(super) fn every_term(divergence: Divergence) -> LossTerms {
    LossTerms {
        soft_weight: 0.7,
        hard_weight: 0.5,
        label_smoothing: 0.1,
        z_loss: 1e-3,
        softcap: Some(4.0),
        logit_scale: 0.8,
        divergence,
    }
}

/// `divergence` alone.
pub(super) fn only(divergence: Divergence) -> LossTerms {
    LossTerms {
        divergence,
        ..LossTerms::default()
    }
}

/// `case` with the loss terms: the teacher in `form` and `tail` mode (its
/// rows scaled to 60–90% of the mass outside renormalize, every fourth
/// row to all of it but under the reverse KL, whose floored teacher tail
/// makes a tail of rounding error ill-conditioned), `terms`, and labels
/// when the hard term is on (every fifth token without one).
pub(super) fn with_terms(mut case: Case, form: TeacherForm, tail: TailMode, terms: LossTerms) -> Case {
    let k = case.k;
    for (t, row) in case.teacher_probs.chunks_exact_mut(k).enumerate() {
        let sum: f32 = row.iter().sum();
        let mass = match tail {
            TailMode::Renormalize => 1.0,
            _ if t % 4 == 3 && terms.divergence.effective() != Divergence::Reverse => 1.0,
            _ => 0.6 + 0.03 * ((t * 7) % 10) as f32,
        };
        row.iter_mut().for_each(|p| *p *= mass / sum);
    }
    case.teacher_form = form;
    case.tail = tail;
    case.terms = terms;
    if terms.hard_on() {
        let vocab = case.vocab as i64;
        case.labels = Some(
            (0..case.ntok as i64)
                .map(|t| if t % 5 == 4 { -1 } else { (t * 37 + 11) % vocab })
                .collect(),
        );
    }
    case.name = format!("{}[{} {}]", case.name, form.name(), tail.name());
    case
}

/// How a regression case is built from its parameters.
#[derive(Clone, Copy)]
enum Build {
    /// The case as the parameters give it.
    Plain,
    /// With the loss terms ([`with_terms`]): the teacher's form, the tail
    /// mode and the terms.
    Terms(TeacherForm, TailMode, fn() -> LossTerms),
    /// The full-vocabulary divergence ([`full_vocab`]) from a teacher of
    /// this hidden size.
    FullVocab(Divergence, usize),
}

/// Crafted inputs or checks, applied to the built case last.
type Craft = fn(&mut Regression) -> Result<(), String>;

/// A row of [`REGRESSIONS`]: a named case, its parameters and how it is
/// built ([`Reg::new`] and the knobs after it), and what it must also show
/// (`min_…`, `dx_split`, `no_row_stats`, `craft`).
struct Reg {
    name: &'static str,
    params: CaseParams,
    build: Build,
    min_slices: usize,
    min_chunks: usize,
    dx_split: Option<(DxSplit, &'static [usize])>,
    row_stats: bool,
    craft: Option<Craft>,
}

impl Reg {
    /// The case `name` as `params` give it, with no check of its own.
    const fn new(name: &'static str, params: CaseParams) -> Self {
        Reg {
            name,
            params,
            build: Build::Plain,
            min_slices: 1,
            min_chunks: 1,
            dx_split: None,
            row_stats: true,
            craft: None,
        }
    }

    knobs! {
        flag masked => params.masked;
        flag large => params.large;
        flag ties => params.ties;
        flag residue => params.residue;
        /// The hidden rows go as f16.
        flag f16 => params.hidden_as_f16;
        /// τ.
        set tau: f32 => params.temperature;
        /// Head slices of at most this many vocabulary rows.
        some max_slice: usize => params.max_rows_per_slice;
        /// Chunks of at most this many tokens.
        some max_chunk: usize => params.max_rows_per_chunk;
        set min_slices: usize => min_slices;
        set min_chunks: usize => min_chunks;
        some craft: Craft => craft;
    }

    const fn peaked(mut self) -> Self {
        self.params.teacher = TeacherShape::Peaked;
        self
    }

    const fn terms(mut self, form: TeacherForm, tail: TailMode, terms: fn() -> LossTerms) -> Self {
        self.build = Build::Terms(form, tail, terms);
        self
    }

    const fn full_vocab(mut self, divergence: Divergence, teacher_hs: usize) -> Self {
        self.build = Build::FullVocab(divergence, teacher_hs);
        self
    }

    /// The dx GEMM split in `split`, each slice in `parts` parts.
    const fn dx_split(mut self, split: DxSplit, parts: &'static [usize]) -> Self {
        self.dx_split = Some((split, parts));
        self
    }

    const fn no_row_stats(mut self) -> Self {
        self.row_stats = false;
        self
    }
}

/// The regression cases, in order (seeds are the last of `params`).
#[rustfmt::skip]
const REGRESSIONS: &[Reg] = {
    use headkl_core::Divergence::{Forward, Jsd, Reverse};
    use CaseKind::{HeadKl, Topk};
    use TailMode::{Bucket, Renormalize, Unnormalized};
    use TeacherForm::{Logprobs, Probs};
    &[
        Reg::new("tiny_v1_hs1_head_kl", params(HeadKl, 1, 1, 1, 1, 1)),
        Reg::new("tiny_v1_hs1_topk", params(Topk, 1, 1, 1, 1, 2)),
        Reg::new("v17_hs17_ntok17_k17_head_kl", params(HeadKl, 17, 17, 17, 17, 3)),
        Reg::new("v17_hs17_ntok17_k17_topk", params(Topk, 17, 17, 17, 17, 4)),
        Reg::new("kl_zero_teacher_is_student", params(HeadKl, 50, 20, 5, 50, 5)).craft(teacher_is_student),
        Reg::new("zero_hidden_exact_ties_topk", params(Topk, 300, 24, 3, 40, 6)).craft(zero_hidden),
        Reg::new("k2048_v2048_topk", params(Topk, 2048, 8, 2, 2048, 7)),
        Reg::new("k2048_v2100_head_kl", params(HeadKl, 2100, 8, 2, 2048, 8)),
        Reg::new("residue256_k14_topk", params(Topk, 3841, 24, 9, 14, 9)).residue().ties(),
        Reg::new("residue256_k14_head_kl", params(HeadKl, 3841, 24, 9, 14, 10)).residue(),
        Reg::new("ties_at_boundary_topk", params(Topk, 500, 16, 8, 10, 11)).ties(),
        Reg::new("explicit_total_and_gscale", params(HeadKl, 200, 40, 20, 6, 12)).masked().craft(total_and_gscale),
        Reg::new("one_token_unmasked", params(HeadKl, 130, 33, 20, 5, 13)).craft(one_token),
        Reg::new("large_logits_tau_quarter_head_kl", params(HeadKl, 700, 96, 12, 16, 14)).large().tau(0.25),
        Reg::new("large_logits_tau_quarter_topk", params(Topk, 700, 96, 12, 16, 15)).large().tau(0.25),
        Reg::new("hidden_f16_chunks_head_kl", params(HeadKl, 333, 50, 50, 7, 16)).f16().max_chunk(16).min_chunks(4),
        Reg::new("single_token_eight_slices_head_kl", params(HeadKl, 1000, 40, 1, 12, 17)).max_slice(128).min_slices(8),
        Reg::new("single_token_eight_slices_topk", params(Topk, 1000, 40, 1, 12, 18)).max_slice(128).min_slices(8),
        Reg::new("aligned_v1024_hs128_ntok33", params(HeadKl, 1024, 128, 33, 32, 19)),
        Reg::new("ntok48_chunk16", params(HeadKl, 250, 30, 48, 4, 20)).max_chunk(16).min_chunks(3),
        Reg::new("ntok49_chunk16_topk", params(Topk, 250, 30, 49, 4, 21)).max_chunk(16),
        Reg::new("hs1_v1500_head_kl", params(HeadKl, 1500, 1, 64, 20, 22)),
        Reg::new("hs320_v1500_ntok40_head_kl", params(HeadKl, 1500, 320, 40, 64, 23)).masked(),
        Reg::new("peaked_teacher_large_flat_tau_3_5", params(HeadKl, 999, 77, 30, 33, 24)).peaked().large().tau(3.5),
        // Found by the f32-emulation run: large logits with big hs, where an
        // in-order f32 sum's error nears the 1e-4 bound on probabilities
        // (about 6e-5 in emulation).
        Reg::new("large_ties_hs248_topk", params(Topk, 1408, 248, 57, 38, 25)).large().ties().f16(),
        Reg::new("large_hs304_topk", params(Topk, 1026, 304, 64, 26, 26)).large(),
        Reg::new("flat_v3040_k64_topk", params(Topk, 3040, 16, 2, 64, 27)).craft(flat_v3040),
        // f16 rows whose width needs no padding go up without packing: the
        // rows past ntok in the padded tile keep whatever the scratch held
        // (NaN on the reference backend), which must not reach the results.
        Reg::new("hidden_f16_unpadded_width_head_kl", params(HeadKl, 300, 64, 5, 8, 29)).f16(),
        Reg::new("hidden_f16_unpadded_width_topk", params(Topk, 300, 64, 37, 8, 30)).f16().max_chunk(16),
        // The threshold path at its largest k (one workgroup's invocations).
        Reg::new("k256_v3000_topk", params(Topk, 3000, 32, 5, 256, 28)).ties(),
        // Split-K dx GEMMs against the f64 reference: 5 slices (4 of 256
        // vocabulary rows in parts of 128, then 76 padded to 80 in parts of
        // 64 and 16) summed as 10 blocks, over 3 chunks.
        Reg::new("dx_split2_five_slices_chunks_head_kl", params(HeadKl, 1100, 72, 40, 12, 31))
            .max_slice(256).max_chunk(16).masked().min_slices(5).min_chunks(3).dx_split(DxSplit::Parts(2), &[2; 5]),
        // One slice of 1504 in parts of 512, 512 and 480.
        Reg::new("dx_split3_one_slice_head_kl", params(HeadKl, 1500, 80, 33, 16, 32)).dx_split(DxSplit::Parts(3), &[3]),
        // V 130 (144 padded, parts of 64, 64 and 16) and hs 320: the 3
        // partial blocks (960 f32 a row) outgrow the logits (144) they
        // live in, so the scratch grows for them.
        Reg::new("dx_split3_partials_outgrow_logits_head_kl", params(HeadKl, 130, 320, 20, 8, 33))
            .dx_split(DxSplit::Parts(3), &[3]),
        Reg::new("terms_softcap_tau2_head_kl", params(HeadKl, 300, 40, 20, 8, 34)).large().tau(2.0).masked()
            .terms(Probs, Renormalize, || LossTerms { softcap: Some(3.0), ..LossTerms::default() }),
        Reg::new("terms_bucket_logprobs_head_kl", params(HeadKl, 500, 48, 24, 16, 35))
            .terms(Logprobs, Bucket, LossTerms::default),
        Reg::new("terms_tail_none_head_kl", params(HeadKl, 257, 33, 19, 5, 36))
            .terms(Probs, Unnormalized, LossTerms::default),
        Reg::new("terms_hard_smoothing_head_kl", params(HeadKl, 400, 40, 25, 8, 37)).masked()
            .terms(Probs, Renormalize, || LossTerms { hard_weight: 0.5, label_smoothing: 0.1, ..LossTerms::default() }),
        Reg::new("terms_z_loss_head_kl", params(HeadKl, 350, 24, 17, 6, 38))
            .terms(Probs, Renormalize, || LossTerms { z_loss: 1e-2, ..LossTerms::default() }),
        // τ 1 and no cap: the KL rows take the logits GEMM's row
        // statistics, made on the scaled logits.
        Reg::new("terms_logit_scale_head_kl", params(HeadKl, 330, 40, 21, 7, 47)).masked()
            .terms(Probs, Renormalize, || LossTerms { logit_scale: 1.75, ..LossTerms::default() }),
        // PyTorch's reductions set the total: 1 for the sum (and none),
        // ntok for batchmean, whatever the weights.
        Reg::new("reduction_sum_masked_head_kl", params(HeadKl, 300, 32, 19, 6, 48)).masked()
            .craft(|r| { r.case.reduction = Reduction::Sum; Ok(()) }),
        Reg::new("reduction_batchmean_chunks_head_kl", params(HeadKl, 420, 24, 37, 5, 49)).masked().tau(2.0)
            .max_chunk(16).min_chunks(2).craft(|r| { r.case.reduction = Reduction::BatchMean; Ok(()) }),
        // A teacher whose logits are scaled: top-k at S·z/τ.
        Reg::new("logit_scale_chunks_topk", params(Topk, 520, 32, 35, 9, 50)).tau(1.25).max_chunk(16)
            .craft(|r| { r.case.terms.logit_scale = 1.6; Ok(()) }),
        Reg::new("terms_everything_slices_chunks_head_kl", params(HeadKl, 700, 56, 40, 12, 39)).masked().tau(1.5)
            .max_slice(256).max_chunk(16).terms(Logprobs, Bucket, || every_term(Forward)).min_slices(3).min_chunks(3),
        // The reverse KL and the JSD (DESIGN §1) in each tail mode.
        Reg::new("divergence_reverse_renormalize_head_kl", params(HeadKl, 310, 40, 23, 9, 51)).masked()
            .terms(Probs, Renormalize, || only(Reverse)),
        Reg::new("divergence_reverse_bucket_logprobs_chunks_head_kl", params(HeadKl, 420, 32, 37, 7, 52)).tau(1.5)
            .max_chunk(16).terms(Logprobs, Bucket, || only(Reverse)).min_chunks(2),
        Reg::new("divergence_reverse_tail_none_head_kl", params(HeadKl, 257, 33, 19, 5, 53))
            .terms(Probs, Unnormalized, || only(Reverse)),
        Reg::new("divergence_jsd_renormalize_tau2_head_kl", params(HeadKl, 300, 40, 20, 8, 54)).tau(2.0).masked()
            .terms(Probs, Renormalize, || only(Jsd { beta: 0.5 })),
        Reg::new("divergence_jsd_bucket_everything_slices_head_kl", params(HeadKl, 700, 56, 40, 12, 55)).masked()
            .tau(1.5).max_slice(256).terms(Logprobs, Bucket, || every_term(Jsd { beta: 0.3 })).min_slices(3),
        Reg::new("divergence_jsd_tail_none_head_kl", params(HeadKl, 350, 24, 17, 6, 56))
            .terms(Probs, Unnormalized, || only(Jsd { beta: 0.8 })),
        // The KL rows' own first pass, with the statistics turned off (the
        // other plain-loss cases take it from the logits GEMM's).
        Reg::new("no_row_stats_slices_chunks_head_kl", params(HeadKl, 700, 56, 40, 12, 42)).masked().max_slice(256)
            .max_chunk(16).no_row_stats().min_slices(3).min_chunks(3),
        // Chunks of 1024 rows: the host path halves the first and the last
        // (`ChunkPlan::chunk_rows`: 512, 1024, 252, 512 rows here).
        Reg::new("tapered_chunks_head_kl", params(HeadKl, 130, 24, 2300, 5, 43)).masked().max_chunk(1024).min_chunks(4),
        Reg::new("tapered_chunks_topk", params(Topk, 130, 24, 2300, 5, 44)).max_chunk(1024),
        // The exact full-vocabulary divergence from the teacher's hidden
        // rows (another hidden size), each also in the top-k mode at k = V.
        Reg::new("full_vocab_forward_masked_head_kl", params(HeadKl, 300, 24, 20, 1, 45)).masked()
            .full_vocab(Forward, 40),
        Reg::new("full_vocab_reverse_tau2_slices_chunks_head_kl", params(HeadKl, 700, 56, 40, 1, 46)).tau(2.0)
            .max_slice(256).max_chunk(16).full_vocab(Reverse, 16).min_slices(3).min_chunks(3),
        Reg::new("full_vocab_jsd_logit_scale_slices_chunks_head_kl", params(HeadKl, 1500, 56, 36, 1, 47)).tau(1.5)
            .masked().max_slice(512).max_chunk(16).full_vocab(Jsd { beta: 0.3 }, 72).min_slices(3).min_chunks(3)
            .craft(|r| { r.case.terms.soft_weight = 0.7; r.case.terms.logit_scale = 0.8; Ok(()) }),
        Reg::new("full_vocab_jsd_f16_unpadded_head_kl", params(HeadKl, 130, 20, 9, 1, 48)).f16()
            .full_vocab(Jsd { beta: 0.5 }, 36),
    ]
};

/// Names of the regression cases, in order.
pub(crate) fn regression_names() -> &'static [&'static str] {
    row_names!(REGRESSIONS)
}

/// Builds the regression case `name`: its row of [`REGRESSIONS`].
pub(crate) fn regression(name: &str) -> Result<Regression, String> {
    let row = REGRESSIONS
        .iter()
        .find(|row| row.name == name)
        .ok_or_else(|| format!("no regression case named {name}"))?;
    let p = row.params.clone();
    let mut r = match row.build {
        Build::Plain => from(p),
        Build::Terms(form, tail, terms) => plain(with_terms(Case::from_params(&p), form, tail, terms())),
        Build::FullVocab(divergence, teacher_hs) => full_vocab(p, divergence, teacher_hs),
    };
    r.min_slices = row.min_slices;
    r.min_chunks = row.min_chunks;
    r.dx_split = row.dx_split.map(|(split, parts)| (split, parts.to_vec()));
    r.row_stats = row.row_stats;
    if let Some(craft) = row.craft {
        craft(&mut r)?;
    }
    Ok(r)
}

/// k = V and the teacher is the student's own softmax: KL = 0, dx ≈ 0.
fn teacher_is_student(r: &mut Regression) -> Result<(), String> {
    let case = &mut r.case;
    let head = case.head_weights().map_err(|e| e.to_string())?;
    let hidden = case.hidden_rows(&[]).map_err(|e| e.to_string())?;
    let s = direct::logits_f64(&head, &hidden, 1.0);
    case.teacher_ids = (0..case.ntok).flat_map(|_| 0..50u32).collect();
    case.teacher_probs = (0..case.ntok)
        .flat_map(|t| direct::softmax_over(&s[t * 50..(t + 1) * 50], &(0..50u32).collect::<Vec<_>>()))
        .map(|p| p as f32)
        .collect();
    case.name = "head_kl/regression[teacher=student]".into();
    r.dx_check = DxCheck::NearZero(1e-6);
    Ok(())
}

/// x = 0: every logit is exactly 0 on every device, so the ids are 0..k.
fn zero_hidden(r: &mut Regression) -> Result<(), String> {
    r.case.hidden.iter_mut().for_each(|v| *v = 0.0);
    r.case.name = "topk/regression[all logits 0]".into();
    r.exact_ids = Some((0..3).flat_map(|_| 0..40u32).collect());
    Ok(())
}

/// Explicit `LossConfig::total` (three times the weights' sum) and
/// `gscale`.
fn total_and_gscale(r: &mut Regression) -> Result<(), String> {
    let sum: f32 = r.case.weights.as_deref().unwrap_or(&[]).iter().sum();
    r.total = Some(3.0 * sum.max(1.0));
    r.gscale = Some(64.0);
    Ok(())
}

/// One token of 20 weighted, the others masked.
fn one_token(r: &mut Regression) -> Result<(), String> {
    let mut w = vec![0f32; 20];
    w[13] = 0.75;
    r.case.weights = Some(w);
    Ok(())
}

/// Logit 0.5 at ids 0..3000 and 1.0 at ids 3000..3040, k = 64: the
/// threshold from the invocations' largest keys is 0.5, which all 3040
/// keys reach, more than the 2048 the threshold path holds, so the radix
/// select must take over. The answer mixes the last ids (the 40 at 1.0)
/// with the first 24 at 0.5.
fn flat_v3040(r: &mut Regression) -> Result<(), String> {
    let case = &mut r.case;
    let (hs, ntok) = (case.hs, case.ntok);
    for (v, row) in case.head.chunks_exact_mut(hs).enumerate() {
        row.fill(0.0);
        row[0] = if v < 3000 { 0.5 } else { 1.0 };
    }
    for row in case.hidden.chunks_exact_mut(hs) {
        row.fill(0.0);
        row[0] = 1.0;
    }
    case.name = "topk/regression[3000 tied below 40, V 3040]".into();
    let row_ids: Vec<u32> = (3000..3040).chain(0..24).collect();
    r.exact_ids = Some((0..ntok).flat_map(|_| row_ids.clone()).collect());
    Ok(())
}

/// A full-vocabulary case: `Engine::head_kl_full_vocab` against the f64
/// reference (the top-k mode at k = V with the teacher's softmax), then
/// the engine's own top-k mode on that teacher against the same.
fn compare_full_vocab<B: Backend>(
    engine: &mut Engine<B>,
    case: &Case,
    teacher_case: &Case,
    opts: &LossOptions,
    tol: &Tolerance,
) -> Result<CaseErrors, String> {
    let head = case.head_weights().map_err(|e| format!("case head: {e}"))?;
    let f16_rows = case.hidden_f16();
    let hidden = case.hidden_rows(&f16_rows).map_err(|e| format!("case hidden: {e}"))?;
    let t_head = teacher_case.head_weights().map_err(|e| format!("teacher head: {e}"))?;
    let t_f16 = teacher_case.hidden_f16();
    let t_hidden = teacher_case
        .hidden_rows(&t_f16)
        .map_err(|e| format!("teacher hidden: {e}"))?;
    engine
        .set_teacher_head(&t_head, teacher_case.slice_options())
        .map_err(|e| format!("set_teacher_head: {e}"))?;
    let out = engine
        .head_kl_full_vocab(&hidden, &t_hidden, opts)
        .map_err(|e| format!("head_kl_full_vocab: {e}"))?;
    let resolved = opts.resolve(case.ntok).map_err(|e| format!("case options: {e}"))?;
    let want = direct::head_kl_full_vocab_f64(&head, &hidden, (&t_head, &t_hidden), &resolved);
    let loss = tol.check_loss(&out.loss, out.mean, &want).map_err(|e| e.to_string())?;
    let dx = tol
        .check_dx_rows(&out.dx, &want.dx, Some(case.hs))
        .map_err(|e| e.to_string())?;
    // The same teacher at k = V through the top-k mode.
    let (ids, probs) = direct::dense_teacher_f64(&t_head, &t_hidden, case.temperature);
    let teacher = headkl_core::Teacher::new(&ids, &probs, case.ntok, case.vocab, case.vocab)
        .map_err(|e| format!("dense teacher: {e}"))?;
    let top_k = engine
        .head_kl(&hidden, &teacher, opts)
        .map_err(|e| format!("head_kl at k = V: {e}"))?;
    tol.check_loss(&top_k.loss, top_k.mean, &want)
        .map_err(|e| format!("the top-k mode at k = V: {e}"))?;
    Ok(CaseErrors {
        loss: Some(loss),
        dx: Some(dx),
        ..CaseErrors::default()
    })
}

/// Runs a regression case.
pub(crate) fn check_regression<B: Backend + ?Sized>(
    backend: &B,
    r: &Regression,
    tol: &Tolerance,
) -> Result<CaseErrors, String> {
    let case = &r.case;
    let mut engine = engine_for(backend, case)?;
    engine.set_row_stats(r.row_stats);
    if let Some((split, want)) = &r.dx_split {
        engine.set_dx_split(*split);
        let parts = engine.dx_parts(headkl_core::ALIGN);
        if &parts != want {
            return Err(format!("dx split {split}: {parts:?} part(s) per slice, want {want:?}"));
        }
    }
    check_min_slices(&engine, r.min_slices)?;
    let opts = LossOptions {
        config: LossConfig {
            total: r.total,
            gscale: r.gscale,
            ..case.loss_options().config
        },
        ..case.loss_options()
    };
    if case.kind == CaseKind::HeadKl && r.min_chunks > 1 {
        let f32_input = !case.hidden_as_f16;
        let plan = engine
            .loss_plan(case.ntok, case.k, f32_input, &opts)
            .map_err(|e| format!("loss_plan: {e}"))?;
        // The chunks the host path runs.
        check_min_chunks(plan.chunk_rows(case.ntok, ChunkTransfers::Host).len(), r.min_chunks)?;
    }
    let measured = match &r.teacher_hidden {
        Some(teacher_case) => compare_full_vocab(&mut engine, case, teacher_case, &opts, tol)?,
        None => compare_with(&mut engine, case, &opts, tol, r.dx_check)?,
    };
    if let Some(want) = &r.exact_ids {
        let f16_rows = case.hidden_f16();
        let hidden = case.hidden_rows(&f16_rows).map_err(|e| e.to_string())?;
        let out = engine
            .topk(&hidden, &case.topk_options())
            .map_err(|e| format!("topk: {e}"))?;
        if let Some(i) = (0..want.len()).find(|&i| out.ids[i] != want[i]) {
            return Err(format!(
                "exact ties must go to the lowest id: ids[{}][{}] = {}, want {}",
                i / case.k,
                i % case.k,
                out.ids[i],
                want[i]
            ));
        }
    }
    Ok(measured)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regression_names_are_unique() {
        let names = regression_names();
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "a regression name appears twice");
    }
}
