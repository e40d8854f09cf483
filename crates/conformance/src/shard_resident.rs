//! The device-resident two-phase loss of vocabulary shards
//! ([`ShardEngine::loss_partials_device`], [`merge_loss_device`],
//! [`ShardEngine::loss_finish_device`]): 2 and 3 shards, their partials,
//! merged statistics and outputs in device buffers, held to the f64
//! reference (and so to the unsharded result) within the suite's
//! tolerances, and the typed errors of bad buffers and calls. Written once
//! here over a [`ResidentBackend`]; [`resident_shard_tests!`] runs it with
//! one thread per shard on the GPU backends ([`Threads`]: each rank moves
//! its partials buffer to the "collective" and gets a statistics buffer
//! back) and the shards in turn on the CPU reference ([`Serial`]);
//! `headkl check` runs it serially.

use headkl_core::shard::{merge_loss_device, two_phases_on_threads, HeadShard, ShardEngine, STATS_PER_TOKEN};
use headkl_core::{
    DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Error, HeadData, HeadWeights, Hidden,
    HiddenDtype, LossConfig, LossOptions, LossTerms, ResidentBackend, SliceOptions, TeacherForm,
};

use super::resident::{device_buffer, download_f32};
use super::shard::{
    engines, even_thirds, expect_err, none_in_the_middle, one_token_short, run_named_cases, teacher, teacher_values,
    weights_with_a_masked_token, Inputs, Serial, Threads, HS, NTOK, VOCAB,
};
use super::{CaseErrors, CaseOutcome, SuiteReport};
use crate::generator::Rng;
use headkl_reference::direct::head_kl_f64;
use headkl_reference::tolerance::Tolerance;

/// The cases: name and what each checks.
pub const RESIDENT_SHARD_CASES: &[(&str, &str)] = &[
    (
        "resident/2-uneven",
        "2 shards [0,208) [208,1000) on device buffers, k = 8, token 0's ids all in shard 0, τ = 1, logits kept",
    ),
    (
        "resident/3-none-in-one",
        "3 shards, no teacher id in the middle one, τ = 2, logit scale 0.6, weights with a masked token, chunks of 16, logits recomputed",
    ),
    (
        "resident/3-even-logprobs",
        "3 even shards, log-probability teacher, τ = 0.7, several slices and chunks, dx accumulated, terms out",
    ),
    (
        "resident/errors",
        "typed errors: shard range, phase order, partials and statistics buffers of another token count, k above a shard, unsupported terms, a bad id named against the whole head; that row through both phases: NaN loss and terms, a zero dx part on every rank, the other rows as with a good id, bit for bit",
    ),
];

/// Cases [`run_resident_shard_cases`] runs.
pub fn resident_shard_case_count() -> usize {
    RESIDENT_SHARD_CASES.len()
}

/// One call's inputs in device buffers.
pub struct DeviceInputs<Buf> {
    x: Buf,
    ids: Buf,
    probs: Buf,
    weights: Option<Buf>,
    k: usize,
    form: TeacherForm,
    temperature: f32,
    logit_scale: f32,
    max_rows: Option<usize>,
    accumulate: bool,
}

impl<Buf> DeviceInputs<Buf> {
    fn hidden(&self) -> DeviceHidden<'_, Buf> {
        DeviceHidden {
            buffer: &self.x,
            dtype: HiddenDtype::F32,
        }
    }

    fn teacher(&self) -> DeviceTeacher<'_, Buf> {
        DeviceTeacher {
            form: self.form,
            ..DeviceTeacher::new(&self.ids, &self.probs, self.k)
        }
    }

    fn options<'a>(&'a self, terms_out: Option<&'a Buf>) -> DeviceLossOptions<'a, Buf> {
        DeviceLossOptions {
            config: LossConfig {
                temperature: self.temperature,
                terms: LossTerms {
                    logit_scale: self.logit_scale,
                    ..LossTerms::default()
                },
                max_rows_per_chunk: self.max_rows,
                ..LossConfig::default()
            },
            weights: self.weights.as_ref(),
            accumulate_dx: self.accumulate,
            terms_out,
            ..DeviceLossOptions::default()
        }
    }
}

/// What one rank reads back after phase two: loss, dx and terms.
pub struct RankOut {
    loss: Vec<f32>,
    dx: Vec<f32>,
    terms: Vec<f32>,
}

/// A rank's phase-two outputs on the device: loss and terms NaN-poisoned,
/// dx at [`dx_start`].
struct RankBuffers<Buf> {
    loss: Buf,
    dx: Buf,
    terms: Buf,
}

impl<Buf> RankBuffers<Buf> {
    fn new<B: ResidentBackend<Buffer = Buf>>(b: &B, inp: &DeviceInputs<Buf>) -> Result<Self, String> {
        Ok(Self {
            loss: device_buffer(b, bytemuck::cast_slice(&[f32::NAN; NTOK]), "loss")?,
            dx: device_buffer(b, bytemuck::cast_slice(&vec![dx_start(inp); NTOK * HS]), "dx")?,
            terms: device_buffer(b, bytemuck::cast_slice(&vec![f32::NAN; NTOK * 3]), "terms")?,
        })
    }

    fn output(&self) -> DeviceLossOutput<'_, Buf> {
        DeviceLossOutput {
            loss: &self.loss,
            dx: &self.dx,
        }
    }

    fn read_back<B: ResidentBackend<Buffer = Buf>>(&self, b: &B) -> Result<RankOut, String> {
        Ok(RankOut {
            loss: download_f32(b, &self.loss, NTOK)?,
            dx: download_f32(b, &self.dx, NTOK * HS)?,
            terms: download_f32(b, &self.terms, NTOK * 3)?,
        })
    }
}

/// The value dx starts at (NaN where overwritten, 0.5 where accumulated).
fn dx_start(inp: &DeviceInputs<impl Sized>) -> f32 {
    if inp.accumulate {
        0.5
    } else {
        f32::NAN
    }
}

/// Phase two on one rank and its outputs read back.
fn finish_rank<B: ResidentBackend>(
    b: &B,
    e: &mut ShardEngine<&B>,
    inp: &DeviceInputs<B::Buffer>,
    stats: &B::Buffer,
) -> Result<RankOut, String> {
    let err = |e: Error| e.to_string();
    let out = RankBuffers::new(b, inp)?;
    e.loss_finish_device(
        NTOK,
        &inp.hidden(),
        &inp.teacher(),
        stats,
        &out.output(),
        &inp.options(Some(&out.terms)),
    )
    .map_err(err)?;
    e.wait_device().map_err(err)?;
    out.read_back(b)
}

/// Phase one on one rank: its partials in a fresh device buffer.
fn partials_rank<B: ResidentBackend>(
    b: &B,
    e: &mut ShardEngine<&B>,
    inp: &DeviceInputs<B::Buffer>,
) -> Result<B::Buffer, String> {
    let err = |e: Error| e.to_string();
    let partials = b.alloc((NTOK * STATS_PER_TOKEN * 4) as u64, "partials").map_err(err)?;
    e.loss_partials_device(NTOK, &inp.hidden(), &inp.teacher(), &partials, &inp.options(None))
        .map_err(err)?;
    e.wait_device().map_err(err)?;
    Ok(partials)
}

/// The "collective": the partials merged into one statistics buffer per rank.
fn collective<B: ResidentBackend>(b: &B, parts: &[(HeadShard, B::Buffer)]) -> Result<Vec<B::Buffer>, String> {
    let views: Vec<(HeadShard, &B::Buffer)> = parts.iter().map(|(s, p)| (*s, p)).collect();
    parts
        .iter()
        .map(|_| {
            let stats = b
                .alloc((NTOK * STATS_PER_TOKEN * 4) as u64, "stats")
                .map_err(|e| e.to_string())?;
            merge_loss_device(b, NTOK, &views, &stats).map_err(|e| e.to_string())?;
            Ok(stats)
        })
        .collect()
}

/// How the shards run: in turn, or one thread each.
pub trait DeviceDrive<B: ResidentBackend> {
    /// Both phases on every shard with the merge between; each rank's
    /// outputs.
    fn two_phase(
        &self,
        b: &B,
        engines: Vec<ShardEngine<&B>>,
        inp: &DeviceInputs<B::Buffer>,
    ) -> Result<Vec<RankOut>, String>;
}

impl<B: ResidentBackend> DeviceDrive<B> for Serial {
    fn two_phase(
        &self,
        b: &B,
        mut engines: Vec<ShardEngine<&B>>,
        inp: &DeviceInputs<B::Buffer>,
    ) -> Result<Vec<RankOut>, String> {
        let parts = engines
            .iter_mut()
            .map(|e| Ok((e.shard(), partials_rank(b, e, inp)?)))
            .collect::<Result<Vec<_>, String>>()?;
        let stats = collective(b, &parts)?;
        engines
            .iter_mut()
            .zip(&stats)
            .map(|(e, s)| finish_rank(b, e, inp, s))
            .collect()
    }
}

impl<B: ResidentBackend + Sync> DeviceDrive<B> for Threads
where
    B::Buffer: Send + Sync,
{
    fn two_phase(
        &self,
        b: &B,
        engines: Vec<ShardEngine<&B>>,
        inp: &DeviceInputs<B::Buffer>,
    ) -> Result<Vec<RankOut>, String> {
        two_phases_on_threads(
            engines,
            |_, mut e| {
                let p = partials_rank(b, &mut e, inp)?;
                let shard = e.shard();
                Ok((e, (shard, p)))
            },
            |parts: Vec<(HeadShard, B::Buffer)>| collective(b, &parts),
            |mut e, stats| finish_rank(b, &mut e, inp, &stats),
            |rank, message| format!("shard {rank}'s thread panicked: {message}"),
            || "phase one failed".to_string(),
        )
    }
}

fn loss_case<B: ResidentBackend, D: DeviceDrive<B>>(b: &B, name: &str, drive: &D) -> Result<CaseErrors, String> {
    let x = Inputs::new(0x7368_6172_6404);
    let head = HeadWeights::new(HeadData::F32(&x.head), VOCAB, HS).map_err(|e| e.to_string())?;
    let hidden = Hidden::f32(&x.x, NTOK, HS).map_err(|e| e.to_string())?;
    let mut weights = None;
    let (cuts, seed, k, form, tau, max_rows, keep, slicing, accumulate) = match name {
        "resident/2-uneven" => (
            vec![208],
            5,
            8,
            TeacherForm::Probs,
            1.0,
            None,
            true,
            SliceOptions::default(),
            false,
        ),
        "resident/3-none-in-one" => {
            weights = Some(weights_with_a_masked_token());
            (
                vec![96, 700],
                6,
                6,
                TeacherForm::Probs,
                2.0,
                Some(16),
                false,
                SliceOptions::default(),
                false,
            )
        }
        _ => {
            let cuts = even_thirds()?;
            let slicing = SliceOptions {
                max_rows_per_slice: Some(128),
            };
            (cuts, 7, 12, TeacherForm::Logprobs, 0.7, Some(16), true, slicing, true)
        }
    };
    let pick = |t: usize, rng: &mut Rng| match name {
        "resident/2-uneven" if t == 0 => rng.below(208),
        "resident/3-none-in-one" => none_in_the_middle(t, rng),
        _ => rng.below(VOCAB),
    };
    let host_teacher = teacher(seed, k, form, pick)?;
    // The logits GEMM's scale S (z = S·x·Wᵀ) on one case.
    let logit_scale = if name == "resident/3-none-in-one" { 0.6 } else { 1.0 };
    let (ids, vals) = teacher_values(seed, k, form, pick);
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    let inp = DeviceInputs {
        x: device_buffer(b, bytemuck::cast_slice(&x.x), "x")?,
        ids: device_buffer(b, bytemuck::cast_slice(&ids), "ids")?,
        probs: device_buffer(b, bytemuck::cast_slice(&vals), "probs")?,
        weights: match &weights {
            Some(w) => Some(device_buffer(b, bytemuck::cast_slice(w), "weights")?),
            None => None,
        },
        k,
        form,
        temperature: tau,
        logit_scale,
        max_rows,
        accumulate,
    };
    let shards = HeadShard::split_at(VOCAB, &cuts).map_err(|e| e.to_string())?;
    let outs = drive.two_phase(b, engines(b, &head, &shards, slicing, keep)?, &inp)?;
    // Every rank has the same loss (from the same merged statistics); dx
    // is the sum of the ranks' parts (the trainer's all-reduce).
    for (r, o) in outs.iter().enumerate().skip(1) {
        if o.loss != outs[0].loss || o.terms != outs[0].terms {
            return Err(format!("rank {r}'s loss differs from rank 0's"));
        }
    }
    let mut dx = vec![0f32; NTOK * HS];
    for o in &outs {
        for (d, &v) in dx.iter_mut().zip(&o.dx) {
            *d += v - if accumulate { 0.5 } else { 0.0 };
        }
    }
    let opts = LossOptions {
        config: LossConfig {
            temperature: tau,
            terms: LossTerms {
                logit_scale,
                ..LossTerms::default()
            },
            ..LossConfig::default()
        },
        weights,
        ..LossOptions::default()
    };
    let resolved = opts.resolve(NTOK).map_err(|e| e.to_string())?;
    let want = head_kl_f64(&head, &hidden, &host_teacher, &resolved);
    let got = &outs[0].loss;
    let mean = resolved.mean_of(got);
    let tol = Tolerance::default();
    let loss = tol.check_loss(got, mean, &want).map_err(|m| m.to_string())?;
    let dx = tol.check_dx_rows(&dx, &want.dx, Some(HS)).map_err(|m| m.to_string())?;
    // terms: [lse at τ = 1, soft = loss, hard = 0], as the host path's.
    for (t, row) in outs[0].terms.chunks_exact(3).enumerate() {
        let w = want.lse[t];
        if (f64::from(row[0]) - w).abs() > 1e-5 * (w.abs() + 1.0) || row[1] != got[t] || row[2] != 0.0 {
            return Err(format!("terms[{t}] = {row:?}, reference lse {w}, loss {}", got[t]));
        }
    }
    Ok(CaseErrors {
        loss: Some(loss),
        dx: Some(dx),
        ..CaseErrors::default()
    })
}

fn errors_case<B: ResidentBackend>(b: &B) -> Result<CaseErrors, String> {
    let err = |e: Error| e.to_string();
    let x = Inputs::new(0x7368_6172_6405);
    let head = HeadWeights::new(HeadData::F32(&x.head), VOCAB, HS).map_err(err)?;
    expect_err("shard past the head", HeadShard::new(900, 1100, VOCAB), |e| {
        matches!(e, Error::ShardRange { v1: 1100, .. })
    })?;
    let k = 4;
    let (ids, vals) = teacher_values(8, k, TeacherForm::Probs, |_, rng| rng.below(VOCAB));
    let mut ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    let inp = DeviceInputs {
        x: device_buffer(b, bytemuck::cast_slice(&x.x), "x")?,
        ids: device_buffer(b, bytemuck::cast_slice(&ids), "ids")?,
        probs: device_buffer(b, bytemuck::cast_slice(&vals), "probs")?,
        weights: None,
        k,
        form: TeacherForm::Probs,
        temperature: 1.0,
        logit_scale: 1.0,
        max_rows: None,
        accumulate: false,
    };
    let shards = HeadShard::split_at(VOCAB, &[16]).map_err(err)?;
    let mut es = engines(b, &head, &shards, SliceOptions::default(), true)?;
    let tokens = |n: usize, what| b.alloc((n * STATS_PER_TOKEN * 4) as u64, what).map_err(err);
    let (partials, short) = (tokens(NTOK, "partials")?, tokens(NTOK - 1, "short")?);
    let (loss, dx) = (tokens(NTOK, "loss")?, tokens(NTOK * HS, "dx")?);
    let out = DeviceLossOutput { loss: &loss, dx: &dx };
    let (hidden, teacher, opts) = (inp.hidden(), inp.teacher(), inp.options(None));
    expect_err(
        "phase two first",
        es[1].loss_finish_device(NTOK, &hidden, &teacher, &partials, &out, &opts),
        |e| matches!(e, Error::ShardPhaseOrder { .. }),
    )?;
    expect_err(
        "a partials buffer of fewer tokens",
        es[1].loss_partials_device(NTOK, &hidden, &teacher, &short, &opts),
        |e| matches!(e, Error::DeviceBuffer { field: "partials", .. }),
    )?;
    let wide = DeviceTeacher { k: 20, ..inp.teacher() };
    expect_err(
        "k above the shard's rows",
        es[0].loss_partials_device(NTOK, &hidden, &wide, &partials, &opts),
        |e| matches!(e, Error::ShardUnsupported { option: "k", .. }),
    )?;
    let z = DeviceLossOptions {
        config: LossConfig {
            terms: LossTerms {
                z_loss: 1e-4,
                ..LossTerms::default()
            },
            ..inp.options(None).config
        },
        ..inp.options(None)
    };
    expect_err(
        "z-loss",
        es[1].loss_partials_device(NTOK, &hidden, &teacher, &partials, &z),
        |e| matches!(e, Error::ShardUnsupported { option: "z-loss", .. }),
    )?;
    // Both phases one, then the merge's and phase two's token checks.
    let mut parts = Vec::new();
    for e in es.iter_mut() {
        parts.push((e.shard(), partials_rank(b, e, &inp)?));
    }
    let views: Vec<_> = parts.iter().map(|(s, p)| (*s, p)).collect();
    let stats = tokens(NTOK, "stats")?;
    expect_err(
        "merged into a buffer of fewer tokens",
        merge_loss_device(b, NTOK, &views, &short),
        one_token_short,
    )?;
    expect_err(
        "a missing shard",
        merge_loss_device(b, NTOK, &views[..1], &stats),
        |e| matches!(e, Error::ShardGap { from: 16, .. }),
    )?;
    merge_loss_device(b, NTOK, &views, &stats).map_err(err)?;
    expect_err(
        "phase two of another token count",
        es[0].loss_finish_device(NTOK - 1, &hidden, &teacher, &stats, &out, &opts),
        |e| matches!(e, Error::ShardMismatch { what: "tokens", .. }),
    )?;
    expect_err(
        "a statistics buffer of fewer tokens",
        es[0].loss_finish_device(NTOK, &hidden, &teacher, &short, &out, &opts),
        |e| matches!(e, Error::DeviceBuffer { field: "stats", .. }),
    )?;
    // Phase one stays pending after those refusals.
    es[0]
        .loss_finish_device(NTOK, &hidden, &teacher, &stats, &out, &opts)
        .map_err(err)?;
    es[0].wait_device().map_err(err)?;
    // An id past the whole head on the device: the host path's error,
    // naming V (not the shard's width), at the wait.
    ids[5 * k + 2] = VOCAB as u32;
    let bad_ids = device_buffer(b, bytemuck::cast_slice(&ids), "bad ids")?;
    let bad = DeviceTeacher {
        ids: &bad_ids,
        ..inp.teacher()
    };
    es[1]
        .loss_partials_device(NTOK, &hidden, &bad, &partials, &opts)
        .map_err(err)?;
    let id_past_the_head = |e: &Error| {
        matches!(
            e,
            Error::IdOutOfRange {
                row: 5,
                col: 2,
                vocab: VOCAB,
                ..
            }
        )
    };
    expect_err("an id past the head", es[1].wait_device(), id_past_the_head)?;
    // The engine is usable after it.
    partials_rank(b, &mut es[1], &inp)?;
    // The bad row through both phases on every shard (DESIGN §8): its loss
    // and terms NaN and its part of dx 0 on every rank before any wait,
    // each wait naming it; every other row as with the good teacher, bit
    // for bit.
    let bad_run = two_phase_waiting(b, &mut es, &inp, &bad, Some(&id_past_the_head))?;
    let good_run = two_phase_waiting(b, &mut es, &inp, &inp.teacher(), None)?;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for (r, (o, g)) in bad_run.iter().zip(&good_run).enumerate() {
        for t in 0..NTOK {
            let (row3, row) = (t * 3..t * 3 + 3, t * HS..(t + 1) * HS);
            if t == 5 {
                if !o.loss[t].is_nan() || !o.terms[row3.clone()].iter().all(|v| v.is_nan()) {
                    return Err(format!(
                        "rank {r}: flagged row 5: loss {}, terms {:?}, want NaN",
                        o.loss[t], &o.terms[row3]
                    ));
                }
                if let Some(v) = o.dx[row].iter().find(|&&v| v != 0.0) {
                    return Err(format!("rank {r}: flagged row 5: dx part holds {v}, want 0"));
                }
            } else if o.loss[t].to_bits() != g.loss[t].to_bits()
                || bits(&o.terms[row3.clone()]) != bits(&g.terms[row3])
                || bits(&o.dx[row.clone()]) != bits(&g.dx[row])
            {
                return Err(format!(
                    "rank {r}: row {t} (not flagged) differs from the run with a good id (loss {} against {})",
                    o.loss[t], g.loss[t]
                ));
            }
        }
    }
    Ok(CaseErrors::default())
}

/// Both phases on every engine in turn with `teacher` (and `inp`'s other
/// inputs), the merge between, and each rank's outputs; each wait must
/// report an error `want` accepts (`None`: none).
fn two_phase_waiting<B: ResidentBackend>(
    b: &B,
    es: &mut [ShardEngine<&B>],
    inp: &DeviceInputs<B::Buffer>,
    teacher: &DeviceTeacher<'_, B::Buffer>,
    want: Option<&dyn Fn(&Error) -> bool>,
) -> Result<Vec<RankOut>, String> {
    let err = |e: Error| e.to_string();
    let waited = |r: Result<(), Error>, phase: &str| -> Result<(), String> {
        match (r, want) {
            (Ok(()), None) => Ok(()),
            (Err(e), Some(accepts)) if accepts(&e) => Ok(()),
            (other, _) => Err(format!("{phase}: the wait gave {other:?}")),
        }
    };
    let hidden = inp.hidden();
    let mut parts = Vec::new();
    for e in es.iter_mut() {
        let partials = b.alloc((NTOK * STATS_PER_TOKEN * 4) as u64, "partials").map_err(err)?;
        e.loss_partials_device(NTOK, &hidden, teacher, &partials, &inp.options(None))
            .map_err(err)?;
        waited(e.wait_device(), "phase one")?;
        parts.push((e.shard(), partials));
    }
    let views: Vec<(HeadShard, &B::Buffer)> = parts.iter().map(|(s, p)| (*s, p)).collect();
    let stats = b.alloc((NTOK * STATS_PER_TOKEN * 4) as u64, "stats").map_err(err)?;
    merge_loss_device(b, NTOK, &views, &stats).map_err(err)?;
    let mut outs = Vec::new();
    for e in es.iter_mut() {
        let out = RankBuffers::new(b, inp)?;
        e.loss_finish_device(
            NTOK,
            &hidden,
            teacher,
            &stats,
            &out.output(),
            &inp.options(Some(&out.terms)),
        )
        .map_err(err)?;
        waited(e.wait_device(), "phase two")?;
        outs.push(out.read_back(b)?);
    }
    Ok(outs)
}

/// One case by name.
fn run_case<B: ResidentBackend, D: DeviceDrive<B>>(b: &B, name: &str, drive: &D) -> Result<CaseErrors, String> {
    match name {
        "resident/errors" => errors_case(b),
        n => loss_case(b, n, drive),
    }
}

/// Every resident sharded case on `backend`, as a report.
pub fn run_resident_shard_cases<B: ResidentBackend, D: DeviceDrive<B>>(
    backend: &B,
    drive: &D,
    progress: &mut dyn FnMut(&CaseOutcome),
) -> SuiteReport {
    run_named_cases(backend, RESIDENT_SHARD_CASES, progress, |name| {
        run_case(backend, name, drive)
    })
}

/// The body of the test [`resident_shard_tests!`] generates.
pub fn run_resident_shard_test<B: ResidentBackend, D: DeviceDrive<B>>(
    backend_name: &str,
    drive: &D,
    open: impl FnOnce() -> headkl_core::Result<B>,
) {
    let (label, part) = ("resident shard", "shard_resident");
    let Some(report) = super::harness::run_recorded(backend_name, open, label, part, |backend, progress| {
        run_resident_shard_cases(backend, drive, progress)
    }) else {
        return;
    };
    super::harness::assert_all_passed(&report, resident_shard_case_count(), "resident sharded");
}

/// Instantiates the resident sharded cases for a backend: `threads` (one
/// thread per shard; the backend's buffers must be `Send + Sync`) or
/// `serial`, and `$open` as for [`crate::resident_conformance_tests!`].
#[macro_export]
macro_rules! resident_shard_tests {
    (@drive threads) => {
        $crate::shard::Threads
    };
    (@drive serial) => {
        $crate::shard::Serial
    };
    ($drive:ident, $name:literal, $open:expr $(,)?) => {
        #[test]
        fn shards_resident_two_phase_equal_the_unsharded_result() {
            $crate::shard_resident::run_resident_shard_test(
                $name,
                &$crate::resident_shard_tests!(@drive $drive),
                || $open,
            );
        }
    };
}
