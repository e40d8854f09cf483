//! Driver-level cases: a [`Case`] through [`Engine`] against
//! [`crate::direct`]; the fixed regression list; the error cases.

use headkl_core::{
    Backend, Divergence, DxSplit, Engine, Error, HiddenData, LossConfig, LossOptions, LossTerms, TailMode, TeacherForm,
};

use super::overlap::CountInFlight;
use super::{engine_for, CaseErrors};
use crate::direct::{self, DirectLoss};
use crate::generator::{Case, CaseKind, CaseParams, TeacherShape};
use crate::tolerance::Tolerance;

/// Runs `case` through the driver and compares with the reference.
pub(crate) fn check_case<B: Backend + ?Sized>(backend: &B, case: &Case, tol: &Tolerance) -> Result<CaseErrors, String> {
    let mut engine = engine_for(backend, case)?;
    compare(&mut engine, case, &case.loss_options(), tol)
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
pub(super) fn params(kind: CaseKind, vocab: usize, hs: usize, ntok: usize, k: usize, seed: u64) -> CaseParams {
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
    r.teacher_hidden = Some(Case::from_params(&CaseParams {
        hs: teacher_hs,
        data_seed: p.data_seed ^ 0x7ea,
        ..p
    }));
    r
}

fn from(p: CaseParams) -> Regression {
    plain(Case::from_params(&p))
}

/// Names of the regression cases, in order.
pub(crate) fn regression_names() -> &'static [&'static str] {
    &[
        "tiny_v1_hs1_head_kl",
        "tiny_v1_hs1_topk",
        "v17_hs17_ntok17_k17_head_kl",
        "v17_hs17_ntok17_k17_topk",
        "kl_zero_teacher_is_student",
        "zero_hidden_exact_ties_topk",
        "k2048_v2048_topk",
        "k2048_v2100_head_kl",
        "residue256_k14_topk",
        "residue256_k14_head_kl",
        "ties_at_boundary_topk",
        "explicit_total_and_gscale",
        "one_token_unmasked",
        "large_logits_tau_quarter_head_kl",
        "large_logits_tau_quarter_topk",
        "hidden_f16_chunks_head_kl",
        "single_token_eight_slices_head_kl",
        "single_token_eight_slices_topk",
        "aligned_v1024_hs128_ntok33",
        "ntok48_chunk16",
        "ntok49_chunk16_topk",
        "hs1_v1500_head_kl",
        "hs320_v1500_ntok40_head_kl",
        "peaked_teacher_large_flat_tau_3_5",
        "large_ties_hs248_topk",
        "large_hs304_topk",
        "flat_v3040_k64_topk",
        "hidden_f16_unpadded_width_head_kl",
        "hidden_f16_unpadded_width_topk",
        "k256_v3000_topk",
        "dx_split2_five_slices_chunks_head_kl",
        "dx_split3_one_slice_head_kl",
        "dx_split3_partials_outgrow_logits_head_kl",
        "terms_softcap_tau2_head_kl",
        "terms_bucket_logprobs_head_kl",
        "terms_tail_none_head_kl",
        "terms_hard_smoothing_head_kl",
        "terms_z_loss_head_kl",
        "terms_logit_scale_head_kl",
        "reduction_sum_masked_head_kl",
        "reduction_batchmean_chunks_head_kl",
        "logit_scale_chunks_topk",
        "terms_everything_slices_chunks_head_kl",
        "divergence_reverse_renormalize_head_kl",
        "divergence_reverse_bucket_logprobs_chunks_head_kl",
        "divergence_reverse_tail_none_head_kl",
        "divergence_jsd_renormalize_tau2_head_kl",
        "divergence_jsd_bucket_everything_slices_head_kl",
        "divergence_jsd_tail_none_head_kl",
        "no_row_stats_slices_chunks_head_kl",
        "tapered_chunks_head_kl",
        "tapered_chunks_topk",
        "full_vocab_forward_masked_head_kl",
        "full_vocab_reverse_tau2_slices_chunks_head_kl",
        "full_vocab_jsd_logit_scale_slices_chunks_head_kl",
        "full_vocab_jsd_f16_unpadded_head_kl",
    ]
}

/// Every loss term on at once, with `divergence` (the "everything"
/// regression cases).
fn every_term(divergence: Divergence) -> LossTerms {
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

/// `case` with the loss terms: the teacher in `form` and `tail` mode (its
/// rows scaled to 60–90% of the mass outside renormalize, every fourth
/// row to all of it but under the reverse KL, whose floored teacher tail
/// makes a tail of rounding error ill-conditioned), `terms`, and labels
/// when the hard term is on (every fifth token without one).
fn with_terms(mut case: Case, form: TeacherForm, tail: TailMode, terms: LossTerms) -> Case {
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

/// Builds the regression case `name`.
pub(crate) fn regression(name: &str) -> Result<Regression, String> {
    use CaseKind::{HeadKl, Topk};
    let r = match name {
        "tiny_v1_hs1_head_kl" => from(params(HeadKl, 1, 1, 1, 1, 1)),
        "tiny_v1_hs1_topk" => from(params(Topk, 1, 1, 1, 1, 2)),
        "v17_hs17_ntok17_k17_head_kl" => from(params(HeadKl, 17, 17, 17, 17, 3)),
        "v17_hs17_ntok17_k17_topk" => from(params(Topk, 17, 17, 17, 17, 4)),
        "kl_zero_teacher_is_student" => {
            // k = V and the teacher is the student's own softmax: KL = 0, dx ≈ 0.
            let mut case = Case::from_params(&params(HeadKl, 50, 20, 5, 50, 5));
            let head = case.head_weights().map_err(|e| e.to_string())?;
            let hidden = case.hidden_rows(&[]).map_err(|e| e.to_string())?;
            let s = direct::logits_f64(&head, &hidden, 1.0);
            case.teacher_ids = (0..case.ntok).flat_map(|_| 0..50u32).collect();
            case.teacher_probs = (0..case.ntok)
                .flat_map(|t| direct::softmax_over(&s[t * 50..(t + 1) * 50], &(0..50u32).collect::<Vec<_>>()))
                .map(|p| p as f32)
                .collect();
            case.name = "head_kl/regression[teacher=student]".into();
            Regression {
                dx_check: DxCheck::NearZero(1e-6),
                ..plain(case)
            }
        }
        "zero_hidden_exact_ties_topk" => {
            // x = 0: every logit is exactly 0 on every device, so the ids are 0..k.
            let mut case = Case::from_params(&params(Topk, 300, 24, 3, 40, 6));
            case.hidden.iter_mut().for_each(|v| *v = 0.0);
            case.name = "topk/regression[all logits 0]".into();
            let mut r = plain(case);
            r.exact_ids = Some((0..3).flat_map(|_| 0..40u32).collect());
            r
        }
        "k2048_v2048_topk" => from(params(Topk, 2048, 8, 2, 2048, 7)),
        "k2048_v2100_head_kl" => from(params(HeadKl, 2100, 8, 2, 2048, 8)),
        "residue256_k14_topk" => from(CaseParams {
            residue: true,
            ties: true,
            ..params(Topk, 3841, 24, 9, 14, 9)
        }),
        "residue256_k14_head_kl" => from(CaseParams {
            residue: true,
            ..params(HeadKl, 3841, 24, 9, 14, 10)
        }),
        "ties_at_boundary_topk" => from(CaseParams {
            ties: true,
            ..params(Topk, 500, 16, 8, 10, 11)
        }),
        "explicit_total_and_gscale" => {
            let case = Case::from_params(&CaseParams {
                masked: true,
                ..params(HeadKl, 200, 40, 20, 6, 12)
            });
            let sum: f32 = case.weights.as_deref().unwrap_or(&[]).iter().sum();
            Regression {
                total: Some(3.0 * sum.max(1.0)),
                gscale: Some(64.0),
                ..plain(case)
            }
        }
        "one_token_unmasked" => {
            let mut case = Case::from_params(&params(HeadKl, 130, 33, 20, 5, 13));
            let mut w = vec![0f32; 20];
            w[13] = 0.75;
            case.weights = Some(w);
            plain(case)
        }
        "large_logits_tau_quarter_head_kl" => from(CaseParams {
            large: true,
            temperature: 0.25,
            ..params(HeadKl, 700, 96, 12, 16, 14)
        }),
        "large_logits_tau_quarter_topk" => from(CaseParams {
            large: true,
            temperature: 0.25,
            ..params(Topk, 700, 96, 12, 16, 15)
        }),
        "hidden_f16_chunks_head_kl" => {
            let mut r = from(CaseParams {
                hidden_as_f16: true,
                max_rows_per_chunk: Some(16),
                ..params(HeadKl, 333, 50, 50, 7, 16)
            });
            r.min_chunks = 4;
            r
        }
        "single_token_eight_slices_head_kl" => {
            let mut r = from(CaseParams {
                max_rows_per_slice: Some(128),
                ..params(HeadKl, 1000, 40, 1, 12, 17)
            });
            r.min_slices = 8;
            r
        }
        "single_token_eight_slices_topk" => {
            let mut r = from(CaseParams {
                max_rows_per_slice: Some(128),
                ..params(Topk, 1000, 40, 1, 12, 18)
            });
            r.min_slices = 8;
            r
        }
        "aligned_v1024_hs128_ntok33" => from(params(HeadKl, 1024, 128, 33, 32, 19)),
        "ntok48_chunk16" => {
            let mut r = from(CaseParams {
                max_rows_per_chunk: Some(16),
                ..params(HeadKl, 250, 30, 48, 4, 20)
            });
            r.min_chunks = 3;
            r
        }
        "ntok49_chunk16_topk" => from(CaseParams {
            max_rows_per_chunk: Some(16),
            ..params(Topk, 250, 30, 49, 4, 21)
        }),
        "hs1_v1500_head_kl" => from(params(HeadKl, 1500, 1, 64, 20, 22)),
        "hs320_v1500_ntok40_head_kl" => from(CaseParams {
            masked: true,
            ..params(HeadKl, 1500, 320, 40, 64, 23)
        }),
        "peaked_teacher_large_flat_tau_3_5" => from(CaseParams {
            teacher: TeacherShape::Peaked,
            large: true,
            temperature: 3.5,
            ..params(HeadKl, 999, 77, 30, 33, 24)
        }),
        // Found by the f32-emulation run: large logits with big hs, where an
        // in-order f32 sum's error nears the 1e-4 bound on probabilities
        // (about 6e-5 in emulation).
        "large_ties_hs248_topk" => from(CaseParams {
            large: true,
            ties: true,
            hidden_as_f16: true,
            ..params(Topk, 1408, 248, 57, 38, 25)
        }),
        "large_hs304_topk" => from(CaseParams {
            large: true,
            ..params(Topk, 1026, 304, 64, 26, 26)
        }),
        "flat_v3040_k64_topk" => {
            // Logit 0.5 at ids 0..3000 and 1.0 at ids 3000..3040, k = 64:
            // the threshold from the invocations' largest keys is 0.5, which
            // all 3040 keys reach, more than the 2048 the threshold path
            // holds, so the radix select must take over. The answer mixes
            // the last ids (the 40 at 1.0) with the first 24 at 0.5.
            let (vocab, hs, ntok) = (3040, 16, 2);
            let mut case = Case::from_params(&params(Topk, vocab, hs, ntok, 64, 27));
            for (v, row) in case.head.chunks_exact_mut(hs).enumerate() {
                row.fill(0.0);
                row[0] = if v < 3000 { 0.5 } else { 1.0 };
            }
            for row in case.hidden.chunks_exact_mut(hs) {
                row.fill(0.0);
                row[0] = 1.0;
            }
            case.name = "topk/regression[3000 tied below 40, V 3040]".into();
            let mut r = plain(case);
            let row_ids: Vec<u32> = (3000..3040).chain(0..24).collect();
            r.exact_ids = Some((0..ntok).flat_map(|_| row_ids.clone()).collect());
            r
        }
        // f16 rows whose width needs no padding go up without packing: the
        // rows past ntok in the padded tile keep whatever the scratch held
        // (NaN on the reference backend), which must not reach the results.
        "hidden_f16_unpadded_width_head_kl" => from(CaseParams {
            hidden_as_f16: true,
            ..params(HeadKl, 300, 64, 5, 8, 29)
        }),
        "hidden_f16_unpadded_width_topk" => from(CaseParams {
            hidden_as_f16: true,
            max_rows_per_chunk: Some(16),
            ..params(Topk, 300, 64, 37, 8, 30)
        }),
        // The threshold path at its largest k (one workgroup's invocations).
        "k256_v3000_topk" => from(CaseParams {
            ties: true,
            ..params(Topk, 3000, 32, 5, 256, 28)
        }),
        // Split-K dx GEMMs against the f64 reference: 5 slices (4 of 256
        // vocabulary rows in parts of 128, then 76 padded to 80 in parts of
        // 64 and 16) summed as 10 blocks, over 3 chunks.
        "dx_split2_five_slices_chunks_head_kl" => {
            let mut r = from(CaseParams {
                max_rows_per_slice: Some(256),
                max_rows_per_chunk: Some(16),
                masked: true,
                ..params(HeadKl, 1100, 72, 40, 12, 31)
            });
            r.min_slices = 5;
            r.min_chunks = 3;
            r.dx_split = Some((DxSplit::Parts(2), vec![2; 5]));
            r
        }
        // One slice of 1504 in parts of 512, 512 and 480.
        "dx_split3_one_slice_head_kl" => Regression {
            dx_split: Some((DxSplit::Parts(3), vec![3])),
            ..from(params(HeadKl, 1500, 80, 33, 16, 32))
        },
        // V 130 (144 padded, parts of 64, 64 and 16) and hs 320: the 3
        // partial blocks (960 f32 a row) outgrow the logits (144) they
        // live in, so the scratch grows for them.
        "dx_split3_partials_outgrow_logits_head_kl" => Regression {
            dx_split: Some((DxSplit::Parts(3), vec![3])),
            ..from(params(HeadKl, 130, 320, 20, 8, 33))
        },
        "terms_softcap_tau2_head_kl" => {
            let case = Case::from_params(&CaseParams {
                large: true,
                temperature: 2.0,
                masked: true,
                ..params(HeadKl, 300, 40, 20, 8, 34)
            });
            let terms = LossTerms {
                softcap: Some(3.0),
                ..LossTerms::default()
            };
            plain(with_terms(case, TeacherForm::Probs, TailMode::Renormalize, terms))
        }
        "terms_bucket_logprobs_head_kl" => {
            let case = Case::from_params(&params(HeadKl, 500, 48, 24, 16, 35));
            plain(with_terms(
                case,
                TeacherForm::Logprobs,
                TailMode::Bucket,
                LossTerms::default(),
            ))
        }
        "terms_tail_none_head_kl" => {
            let case = Case::from_params(&params(HeadKl, 257, 33, 19, 5, 36));
            plain(with_terms(
                case,
                TeacherForm::Probs,
                TailMode::Unnormalized,
                LossTerms::default(),
            ))
        }
        "terms_hard_smoothing_head_kl" => {
            let case = Case::from_params(&CaseParams {
                masked: true,
                ..params(HeadKl, 400, 40, 25, 8, 37)
            });
            let terms = LossTerms {
                hard_weight: 0.5,
                label_smoothing: 0.1,
                ..LossTerms::default()
            };
            plain(with_terms(case, TeacherForm::Probs, TailMode::Renormalize, terms))
        }
        "terms_z_loss_head_kl" => {
            let case = Case::from_params(&params(HeadKl, 350, 24, 17, 6, 38));
            let terms = LossTerms {
                z_loss: 1e-2,
                ..LossTerms::default()
            };
            plain(with_terms(case, TeacherForm::Probs, TailMode::Renormalize, terms))
        }
        // τ 1 and no cap: the KL rows take the logits GEMM's row
        // statistics, made on the scaled logits.
        "terms_logit_scale_head_kl" => {
            let case = Case::from_params(&CaseParams {
                masked: true,
                ..params(HeadKl, 330, 40, 21, 7, 47)
            });
            let terms = LossTerms {
                logit_scale: 1.75,
                ..LossTerms::default()
            };
            plain(with_terms(case, TeacherForm::Probs, TailMode::Renormalize, terms))
        }
        // PyTorch's reductions set the total: 1 for the sum (and none),
        // ntok for batchmean, whatever the weights.
        "reduction_sum_masked_head_kl" => {
            let mut case = Case::from_params(&CaseParams {
                masked: true,
                ..params(HeadKl, 300, 32, 19, 6, 48)
            });
            case.reduction = headkl_core::Reduction::Sum;
            plain(case)
        }
        "reduction_batchmean_chunks_head_kl" => {
            let mut case = Case::from_params(&CaseParams {
                masked: true,
                temperature: 2.0,
                max_rows_per_chunk: Some(16),
                ..params(HeadKl, 420, 24, 37, 5, 49)
            });
            case.reduction = headkl_core::Reduction::BatchMean;
            let mut r = plain(case);
            r.min_chunks = 2;
            r
        }
        // A teacher whose logits are scaled: top-k at S·z/τ.
        "logit_scale_chunks_topk" => {
            let mut case = Case::from_params(&CaseParams {
                temperature: 1.25,
                max_rows_per_chunk: Some(16),
                ..params(Topk, 520, 32, 35, 9, 50)
            });
            case.terms.logit_scale = 1.6;
            plain(case)
        }
        "terms_everything_slices_chunks_head_kl" => {
            let case = Case::from_params(&CaseParams {
                masked: true,
                temperature: 1.5,
                max_rows_per_slice: Some(256),
                max_rows_per_chunk: Some(16),
                ..params(HeadKl, 700, 56, 40, 12, 39)
            });
            let terms = every_term(Divergence::Forward);
            let mut r = plain(with_terms(case, TeacherForm::Logprobs, TailMode::Bucket, terms));
            r.min_slices = 3;
            r.min_chunks = 3;
            r
        }
        // The reverse KL and the JSD (DESIGN §1) in each tail mode.
        "divergence_reverse_renormalize_head_kl" => {
            let case = Case::from_params(&CaseParams {
                masked: true,
                ..params(HeadKl, 310, 40, 23, 9, 51)
            });
            let terms = LossTerms {
                divergence: Divergence::Reverse,
                ..LossTerms::default()
            };
            plain(with_terms(case, TeacherForm::Probs, TailMode::Renormalize, terms))
        }
        "divergence_reverse_bucket_logprobs_chunks_head_kl" => {
            let case = Case::from_params(&CaseParams {
                temperature: 1.5,
                max_rows_per_chunk: Some(16),
                ..params(HeadKl, 420, 32, 37, 7, 52)
            });
            let terms = LossTerms {
                divergence: Divergence::Reverse,
                ..LossTerms::default()
            };
            let mut r = plain(with_terms(case, TeacherForm::Logprobs, TailMode::Bucket, terms));
            r.min_chunks = 2;
            r
        }
        "divergence_reverse_tail_none_head_kl" => {
            let case = Case::from_params(&params(HeadKl, 257, 33, 19, 5, 53));
            let terms = LossTerms {
                divergence: Divergence::Reverse,
                ..LossTerms::default()
            };
            plain(with_terms(case, TeacherForm::Probs, TailMode::Unnormalized, terms))
        }
        "divergence_jsd_renormalize_tau2_head_kl" => {
            let case = Case::from_params(&CaseParams {
                temperature: 2.0,
                masked: true,
                ..params(HeadKl, 300, 40, 20, 8, 54)
            });
            let terms = LossTerms {
                divergence: Divergence::Jsd { beta: 0.5 },
                ..LossTerms::default()
            };
            plain(with_terms(case, TeacherForm::Probs, TailMode::Renormalize, terms))
        }
        "divergence_jsd_bucket_everything_slices_head_kl" => {
            let case = Case::from_params(&CaseParams {
                masked: true,
                temperature: 1.5,
                max_rows_per_slice: Some(256),
                ..params(HeadKl, 700, 56, 40, 12, 55)
            });
            let terms = every_term(Divergence::Jsd { beta: 0.3 });
            let mut r = plain(with_terms(case, TeacherForm::Logprobs, TailMode::Bucket, terms));
            r.min_slices = 3;
            r
        }
        "divergence_jsd_tail_none_head_kl" => {
            let case = Case::from_params(&params(HeadKl, 350, 24, 17, 6, 56));
            let terms = LossTerms {
                divergence: Divergence::Jsd { beta: 0.8 },
                ..LossTerms::default()
            };
            plain(with_terms(case, TeacherForm::Probs, TailMode::Unnormalized, terms))
        }
        // The KL rows' own first pass, with the statistics turned off (the
        // other plain-loss cases take it from the logits GEMM's).
        "no_row_stats_slices_chunks_head_kl" => {
            let mut r = from(CaseParams {
                masked: true,
                max_rows_per_slice: Some(256),
                max_rows_per_chunk: Some(16),
                ..params(HeadKl, 700, 56, 40, 12, 42)
            });
            r.row_stats = false;
            r.min_slices = 3;
            r.min_chunks = 3;
            r
        }
        // Chunks of 1024 rows: the host path halves the first and the last
        // (`ChunkPlan::tapered_ranges`: 512, 1024, 252, 512 rows here).
        "tapered_chunks_head_kl" => {
            let mut r = from(CaseParams {
                masked: true,
                max_rows_per_chunk: Some(1024),
                ..params(HeadKl, 130, 24, 2300, 5, 43)
            });
            r.min_chunks = 4;
            r
        }
        "tapered_chunks_topk" => from(CaseParams {
            max_rows_per_chunk: Some(1024),
            ..params(Topk, 130, 24, 2300, 5, 44)
        }),
        // The exact full-vocabulary divergence from the teacher's hidden
        // rows (another hidden size), each also in the top-k mode at k = V.
        "full_vocab_forward_masked_head_kl" => full_vocab(
            CaseParams {
                masked: true,
                ..params(HeadKl, 300, 24, 20, 1, 45)
            },
            Divergence::Forward,
            40,
        ),
        "full_vocab_reverse_tau2_slices_chunks_head_kl" => {
            let mut r = full_vocab(
                CaseParams {
                    temperature: 2.0,
                    max_rows_per_slice: Some(256),
                    max_rows_per_chunk: Some(16),
                    ..params(HeadKl, 700, 56, 40, 1, 46)
                },
                Divergence::Reverse,
                16,
            );
            r.min_slices = 3;
            r.min_chunks = 3;
            r
        }
        "full_vocab_jsd_logit_scale_slices_chunks_head_kl" => {
            let mut r = full_vocab(
                CaseParams {
                    temperature: 1.5,
                    masked: true,
                    max_rows_per_slice: Some(512),
                    max_rows_per_chunk: Some(16),
                    ..params(HeadKl, 1500, 56, 36, 1, 47)
                },
                Divergence::Jsd { beta: 0.3 },
                72,
            );
            r.case.terms.soft_weight = 0.7;
            r.case.terms.logit_scale = 0.8;
            r.min_slices = 3;
            r.min_chunks = 3;
            r
        }
        "full_vocab_jsd_f16_unpadded_head_kl" => full_vocab(
            CaseParams {
                hidden_as_f16: true,
                ..params(HeadKl, 130, 20, 9, 1, 48)
            },
            Divergence::Jsd { beta: 0.5 },
            36,
        ),
        other => return Err(format!("no regression case named {other}")),
    };
    Ok(r)
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
    let want = direct::head_kl_full_vocab_f64(&head, &hidden, &t_head, &t_hidden, &resolved);
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
    if engine.slices().len() < r.min_slices {
        return Err(format!(
            "the head was cut into {} slice(s); this case needs at least {}",
            engine.slices().len(),
            r.min_slices
        ));
    }
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
        let chunks = plan.tapered_ranges(case.ntok).len();
        if chunks < r.min_chunks {
            return Err(format!("{chunks} chunk(s); this case needs at least {}", r.min_chunks));
        }
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
        "filter_eps_zero_bit_identical",
        "the lm-like data, plain and with τ = 2, the hard term and the z-loss: with ε = 0 loss and dx are \
         bit-identical to the unfiltered call's; at ε = 2^-15 the loss is, and dx matches the reference",
    ),
];

/// lm-like data ([`crate::lm`]) small enough for the f64 reference, with
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
fn lm_case_and_prior(
    ntok: usize,
    max_rows_per_slice: Option<usize>,
    max_rows_per_chunk: Option<usize>,
) -> Result<(Case, Vec<f32>), String> {
    let spec = crate::lm::LmSpec {
        zipf: 3.0,
        zipf_offset: 5.0,
        order_noise: 0.3,
        peaks: 3,
        peak_flatness: 1.0,
        background: 0.5,
        entropy: Some(1.0),
        teacher_noise: 1.5,
        ..crate::lm::LmSpec::new(4096, 32, ntok, 16, 0x1F17)
    };
    let d = crate::lm::generate(&spec)?;
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

/// Runs error case `name`.
pub(crate) fn check_error_case<B: Backend + ?Sized>(
    backend: &B,
    name: &str,
    tol: &Tolerance,
) -> Result<CaseErrors, String> {
    match name {
        "nan_row_head_kl" => {
            let mut case = error_base(CaseKind::HeadKl, 40);
            case.hidden[21 * case.hs + 7] = f32::NAN;
            let mut engine = engine_for(backend, &case)?;
            let hidden = case.hidden_rows(&[]).map_err(|e| e.to_string())?;
            let teacher = case.teacher().map_err(|e| e.to_string())?;
            expect_non_finite("head_kl", engine.head_kl(&hidden, &teacher, &case.loss_options()), 21)?;
            Ok(CaseErrors::default())
        }
        "inf_then_nan_topk" => {
            let mut case = error_base(CaseKind::Topk, 40);
            case.hidden[3 * case.hs] = f32::INFINITY;
            case.hidden[30 * case.hs + 39] = f32::NAN;
            let mut engine = engine_for(backend, &case)?;
            let hidden = case.hidden_rows(&[]).map_err(|e| e.to_string())?;
            expect_non_finite("topk", engine.topk(&hidden, &case.topk_options()), 3)?;
            Ok(CaseErrors::default())
        }
        "past_f16_range_head_kl" => {
            let mut case = error_base(CaseKind::HeadKl, 40);
            case.hidden[33 * case.hs + 11] = 1e5;
            both_fail(backend, &case, 33)?;
            Ok(CaseErrors::default())
        }
        "f16_rows_nan" => {
            let mut case = error_base(CaseKind::HeadKl, 20);
            case.hidden_as_f16 = true;
            case.hidden[5 * case.hs + 2] = f32::NAN;
            let f16_rows = case.hidden_f16();
            let hidden = case.hidden_rows(&f16_rows).map_err(|e| e.to_string())?;
            if !matches!(hidden.data(), HiddenData::F16(_)) {
                return Err("the case must pass f16 rows".into());
            }
            both_fail(backend, &case, 5)?;
            Ok(CaseErrors::default())
        }
        "recovers_after_error" => {
            let clean = error_base(CaseKind::HeadKl, 40);
            let mut poisoned = clean.clone();
            poisoned.hidden[17 * clean.hs] = f32::NAN;
            let mut engine = engine_for(backend, &clean)?;
            let hidden = poisoned.hidden_rows(&[]).map_err(|e| e.to_string())?;
            let teacher = clean.teacher().map_err(|e| e.to_string())?;
            expect_non_finite("head_kl", engine.head_kl(&hidden, &teacher, &clean.loss_options()), 17)?;
            expect_non_finite("topk", engine.topk(&hidden, &clean.topk_options()), 17)?;
            let kl = compare(&mut engine, &clean, &clean.loss_options(), tol)
                .map_err(|e| format!("after the error: {e}"))?;
            let topk_case = Case {
                kind: CaseKind::Topk,
                ..clean.clone()
            };
            let top = compare(&mut engine, &topk_case, &clean.loss_options(), tol)
                .map_err(|e| format!("after the error: {e}"))?;
            Ok(CaseErrors { prob: top.prob, ..kl })
        }
        "two_chunks_in_flight" => {
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
        "multi_slice_multi_chunk" => {
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
        "memory_released" => {
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
        "filter_lm_dx_within_tolerance" => {
            let case = lm_case(80, Some(1536), Some(48))?;
            let mut engine = engine_for(backend, &case)?;
            if engine.slices().len() < 3 {
                return Err(format!("{} slice(s), want >= 3", engine.slices().len()));
            }
            let eps = headkl_core::filter::AUTO_EPS;
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
            let opts = LossOptions {
                config: LossConfig {
                    filter_eps: Some(eps),
                    ..case.loss_options().config
                },
                ..case.loss_options()
            };
            let m = compare(&mut engine, &case, &opts, tol)?;
            log::info!(
                "filter_lm_dx_within_tolerance: skipped {:.1}% of {} blocks, dx err {:.2e} (tolerance {:.0e})",
                100.0 * stats.skipped_fraction(),
                stats.blocks,
                m.dx.unwrap_or(f64::NAN),
                tol.dx_rel
            );
            Ok(m)
        }
        "vocab_order_prior" => {
            let (case, prior) = lm_case_and_prior(80, Some(1536), Some(48))?;
            let order = headkl_core::VocabOrder::by_score(&prior).map_err(|e| e.to_string())?;
            let head = case.head_weights().map_err(|e| format!("case head: {e}"))?;
            let mut ordered = Engine::with_vocab_order(backend, &head, case.slice_options(), Some(order))
                .map_err(|e| format!("Engine::with_vocab_order: {e}"))?;
            let mut natural = engine_for(backend, &case)?;
            let eps = headkl_core::filter::AUTO_EPS;
            let filtered = LossOptions {
                config: LossConfig {
                    filter_eps: Some(eps),
                    ..case.loss_options().config
                },
                ..case.loss_options()
            };
            let mut measured = compare(&mut ordered, &case, &case.loss_options(), tol)?;
            let m = compare(&mut ordered, &case, &filtered, tol)?;
            measured.dx = measured.dx.into_iter().chain(m.dx).reduce(f64::max);
            let top = Case {
                kind: CaseKind::Topk,
                ..case.clone()
            };
            measured.prob = compare(&mut ordered, &top, &top.loss_options(), tol)?.prob;
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
        "filter_eps_zero_bit_identical" => {
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
                let (zero, plain) = filtered_and_not(&mut engine, c, &c.loss_options(), 0.0)?;
                same_bits(&zero, &plain, true)?;
                let (auto, _) = filtered_and_not(&mut engine, c, &c.loss_options(), headkl_core::filter::AUTO_EPS)?;
                same_bits(&auto, &plain, false)?;
                let opts = LossOptions {
                    config: LossConfig {
                        filter_eps: Some(headkl_core::filter::AUTO_EPS),
                        ..c.loss_options().config
                    },
                    ..c.loss_options()
                };
                let m = compare(&mut engine, c, &opts, tol)?;
                let worst = |a: Option<f64>, b: Option<f64>| a.into_iter().chain(b).reduce(f64::max);
                measured.loss = worst(measured.loss, m.loss);
                measured.dx = worst(measured.dx, m.dx);
            }
            Ok(measured)
        }
        other => Err(format!("no error case named {other}")),
    }
}
