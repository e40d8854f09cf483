//! Vocabulary-parallel: a head cut into 2 or 3 shards, one engine each, the
//! partials merged between the two phases; the result must equal the f64
//! reference (and so the unsharded engine) within the suite's tolerances.
//! Written once here; [`shard_tests!`] runs it with one thread per shard
//! (a rank each, the merge between them as a collective would be), and
//! [`run_shard_cases`] (what `headkl check` adds) drives the shards in turn.

use headkl_core::shard::{
    merge_loss, merge_loss_outputs, merge_topk, two_phases_on_threads, HeadShard, LossPartials, ShardEngine,
};
use headkl_core::{
    Backend, Error, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, LossOutput, SliceOptions, TailMode,
    Teacher, TeacherForm, TopK, TopkOptions,
};

use super::{run_one, CaseErrors, CaseOutcome, Recorder, SuiteReport};
use crate::generator::Rng;
use headkl_reference::direct::{head_kl_f64, topk_f64};
use headkl_reference::tolerance::Tolerance;

pub(super) const VOCAB: usize = 1000;
pub(super) const HS: usize = 48;
pub(super) const NTOK: usize = 40;
/// Tokens of the case whose host chunks taper: 2300 tokens in chunks of at
/// most 1024 rows run as 512, 1024, 252 and 512 (`ChunkPlan::chunk_rows`).
const TAPERED_NTOK: usize = 2300;

/// A sharded loss call's inputs: the hidden rows, the teacher and the
/// options.
pub type LossInputs<'a> = (&'a Hidden<'a>, &'a Teacher, &'a LossOptions);

/// How the shards' engines are driven: [`Serial`] or [`Threads`].
pub trait Drive<B: Backend> {
    /// The sharded loss: phase one on every shard, the merge, phase two,
    /// the outputs summed.
    fn loss(&self, engines: Vec<ShardEngine<&B>>, inputs: LossInputs<'_>, keep: bool) -> Result<LossOutput, String>;
    /// The sharded top-k: each shard's candidates, then the merge.
    fn topk(&self, engines: Vec<ShardEngine<&B>>, hidden: &Hidden<'_>, opts: &TopkOptions) -> Result<TopK, String>;
}

/// The shards one after another on this thread (any backend).
pub struct Serial;

/// One thread per shard, exchanging partials and merged statistics over
/// channels as ranks would through a collective.
pub struct Threads;

impl<B: Backend> Drive<B> for Serial {
    fn loss(
        &self,
        mut engines: Vec<ShardEngine<&B>>,
        inputs: LossInputs<'_>,
        keep: bool,
    ) -> Result<LossOutput, String> {
        let (hidden, teacher, opts) = inputs;
        let err = |e: Error| e.to_string();
        let parts = engines
            .iter_mut()
            .map(|e| e.loss_partials(hidden, teacher, opts))
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        let stats = merge_loss(&parts).map_err(err)?;
        let mut outs = vec![LossOutput::default(); engines.len()];
        for (e, out) in engines.iter_mut().zip(&mut outs) {
            check_kept(e, keep)?;
            e.loss_finish(hidden, &stats, out).map_err(err)?;
        }
        merge_loss_outputs(&outs).map_err(err)
    }

    fn topk(&self, mut engines: Vec<ShardEngine<&B>>, hidden: &Hidden<'_>, opts: &TopkOptions) -> Result<TopK, String> {
        let err = |e: Error| e.to_string();
        let parts = engines
            .iter_mut()
            .map(|e| e.topk_partials(hidden, opts))
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        merge_topk(&parts, opts).map_err(err)
    }
}

/// The sharded cases: name and what each checks.
pub const SHARD_CASES: &[(&str, &str)] = &[
    (
        "loss/2-uneven",
        "2 shards [0,208) [208,1000), k = 8 across both, token 0's ids all in shard 0, τ = 1",
    ),
    (
        "loss/3-none-in-one",
        "3 shards, no teacher id in the middle one, τ = 2, weights with a masked token, logits recomputed",
    ),
    (
        "loss/2-tapered-chunks",
        "2 shards, 2300 tokens in chunks of at most 1024 rows: the host phases halve the first and last chunk, logits kept per chunk, τ = 1.5",
    ),
    (
        "loss/3-even-logprobs",
        "3 even shards, log-probability teacher, τ = 0.7, logit scale 1.3, several slices and chunks, logits kept",
    ),
    (
        "topk/2-uneven",
        "2 shards, k = 8, τ = 1, log-probabilities against the reference",
    ),
    ("topk/3-k-split", "3 shards, the first narrower than k = 16, τ = 2"),
    (
        "topk/ties-across-shards",
        "equal head rows in different shards: the lowest id wins, as unsharded",
    ),
    (
        "gather/3-k-split",
        "3 shards, the first narrower than k = 12 (its ids in column blocks), ids across all three, repeats and none, τ = 1.5",
    ),
    (
        "errors",
        "typed errors: range, token count, overlap, gap, phase order, unsupported terms",
    ),
];

/// Cases [`run_shard_cases`] runs.
pub fn shard_case_count() -> usize {
    SHARD_CASES.len()
}

/// Seeded head, hidden rows and a teacher whose ids the caller places.
pub(super) struct Inputs {
    pub(super) head: Vec<f32>,
    pub(super) x: Vec<f32>,
}

impl Inputs {
    pub(super) fn new(seed: u64) -> Self {
        Self::with_tokens(seed, NTOK)
    }

    fn with_tokens(seed: u64, ntok: usize) -> Self {
        let mut rng = Rng::new(seed);
        let mut fill = |n: usize, scale: f64| (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * scale) as f32).collect();
        Self {
            head: fill(VOCAB * HS, 0.5),
            x: fill(ntok * HS, 1.0),
        }
    }
}

/// A teacher of `k` distinct ids per token drawn by `pick(token, rng)`, with
/// random positive values (probabilities, or log-probabilities).
pub(super) fn teacher(
    seed: u64,
    k: usize,
    form: TeacherForm,
    pick: impl Fn(usize, &mut Rng) -> usize,
) -> Result<Teacher, String> {
    teacher_of(seed, NTOK, k, form, pick)
}

/// [`teacher`] for `ntok` tokens.
fn teacher_of(
    seed: u64,
    ntok: usize,
    k: usize,
    form: TeacherForm,
    pick: impl Fn(usize, &mut Rng) -> usize,
) -> Result<Teacher, String> {
    let (ids, vals) = teacher_values_of(seed, ntok, k, form, pick);
    Teacher::with_form(&ids, &vals, ntok, k, VOCAB, form, TailMode::Renormalize).map_err(|e| e.to_string())
}

/// A teacher id outside the middle shard of the cuts `[96, 700]` (none in
/// `96..700`); token 1's ids all in the last shard.
pub(super) fn none_in_the_middle(t: usize, rng: &mut Rng) -> usize {
    let id = if t == 1 {
        700 + rng.below(300)
    } else {
        rng.below(VOCAB - 604)
    };
    if (96..700).contains(&id) {
        id + 604
    } else {
        id
    }
}

/// Varied token weights, token 3's 0 (masked).
pub(super) fn weights_with_a_masked_token() -> Vec<f32> {
    let mut w: Vec<f32> = (0..NTOK).map(|t| 0.25 + (t % 5) as f32 * 0.5).collect();
    w[3] = 0.0;
    w
}

/// The cuts between three even shards of the head.
pub(super) fn even_thirds() -> Result<Vec<usize>, String> {
    Ok(HeadShard::even(VOCAB, 3)
        .map_err(|e| e.to_string())?
        .iter()
        .skip(1)
        .map(|s| s.v0())
        .collect())
}

/// [`teacher`]'s ids and values as drawn (what a device buffer holds).
pub(super) fn teacher_values(
    seed: u64,
    k: usize,
    form: TeacherForm,
    pick: impl Fn(usize, &mut Rng) -> usize,
) -> (Vec<i64>, Vec<f32>) {
    teacher_values_of(seed, NTOK, k, form, pick)
}

/// [`teacher_values`] for `ntok` tokens.
fn teacher_values_of(
    seed: u64,
    ntok: usize,
    k: usize,
    form: TeacherForm,
    pick: impl Fn(usize, &mut Rng) -> usize,
) -> (Vec<i64>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let mut ids = Vec::with_capacity(ntok * k);
    let mut vals = Vec::with_capacity(ntok * k);
    for t in 0..ntok {
        let mut row: Vec<i64> = Vec::new();
        while row.len() < k {
            let id = pick(t, &mut rng) as i64;
            if !row.contains(&id) {
                row.push(id);
            }
        }
        ids.extend(row);
        for _ in 0..k {
            let p = 0.02 + rng.uniform();
            vals.push(match form {
                TeacherForm::Probs => p as f32,
                TeacherForm::Logprobs => (p / (k as f64 * 1.1)).ln() as f32,
            });
        }
    }
    (ids, vals)
}

pub(super) fn engines<'b, B: Backend>(
    backend: &'b B,
    head: &HeadWeights<'_>,
    shards: &[HeadShard],
    slicing: SliceOptions,
    keep: bool,
) -> Result<Vec<ShardEngine<&'b B>>, String> {
    shards
        .iter()
        .map(|&s| {
            let rows = head.rows(s.v0(), s.v1()).map_err(|e| e.to_string())?;
            let mut e = ShardEngine::new(backend, &rows, s, slicing).map_err(|e| e.to_string())?;
            e.set_keep_logits(keep);
            Ok(e)
        })
        .collect()
}

impl<B: Backend + Sync> Drive<B> for Threads
where
    B::Buffer: Send,
{
    fn loss(&self, engines: Vec<ShardEngine<&B>>, inputs: LossInputs<'_>, keep: bool) -> Result<LossOutput, String> {
        let (hidden, teacher, opts) = inputs;
        let err = |e: Error| e.to_string();
        let outs = two_phases_on_threads(
            engines,
            |_, mut e| {
                let p = e.loss_partials(hidden, teacher, opts).map_err(err)?;
                Ok((e, p))
            },
            |parts: Vec<LossPartials>| {
                // The "all-reduce": the merged statistics go back to each.
                let stats = merge_loss(&parts).map_err(err)?;
                Ok(vec![stats; parts.len()])
            },
            |mut e, stats| {
                check_kept(&e, keep)?;
                let mut out = LossOutput::default();
                e.loss_finish(hidden, &stats, &mut out).map_err(err)?;
                Ok(out)
            },
            |rank, message| format!("shard {rank}'s thread panicked: {message}"),
            || "phase one failed".to_string(),
        )?;
        merge_loss_outputs(&outs).map_err(err)
    }

    fn topk(&self, engines: Vec<ShardEngine<&B>>, hidden: &Hidden<'_>, opts: &TopkOptions) -> Result<TopK, String> {
        let err = |e: Error| e.to_string();
        let parts = std::thread::scope(|s| {
            let ranks: Vec<_> = engines
                .into_iter()
                .map(|mut e| s.spawn(move || e.topk_partials(hidden, opts).map_err(err)))
                .collect();
            ranks
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a shard's thread panicked".into())))
                .collect::<Result<Vec<_>, String>>()
        })?;
        merge_topk(&parts, opts).map_err(err)
    }
}

fn check_kept<B: Backend>(e: &ShardEngine<B>, keep: bool) -> Result<(), String> {
    if e.kept_logits() != keep {
        return Err(format!(
            "shard {:?}: logits kept = {}, expected {keep}",
            e.shard(),
            e.kept_logits()
        ));
    }
    Ok(())
}

fn loss_case<B: Backend, D: Drive<B>>(backend: &B, name: &str, drive: &D) -> Result<CaseErrors, String> {
    let ntok = if name == "loss/2-tapered-chunks" {
        TAPERED_NTOK
    } else {
        NTOK
    };
    let x = Inputs::with_tokens(0x7368_6172_6401, ntok);
    let head = HeadWeights::new(HeadData::F32(&x.head), VOCAB, HS).map_err(|e| e.to_string())?;
    let hidden = Hidden::f32(&x.x, ntok, HS).map_err(|e| e.to_string())?;
    let (shards, teacher, opts, keep, slicing) = match name {
        "loss/2-uneven" => {
            let t = teacher(1, 8, TeacherForm::Probs, |t, rng| {
                if t == 0 {
                    rng.below(208)
                } else {
                    rng.below(VOCAB)
                }
            })?;
            let opts = LossOptions::default();
            (vec![208], t, opts, true, SliceOptions::default())
        }
        "loss/3-none-in-one" => {
            let t = teacher(2, 6, TeacherForm::Probs, none_in_the_middle)?;
            let opts = LossOptions {
                config: LossConfig {
                    temperature: 2.0,
                    max_rows_per_chunk: Some(16),
                    ..LossConfig::default()
                },
                weights: Some(weights_with_a_masked_token()),
                ..LossOptions::default()
            };
            (vec![96, 700], t, opts, false, SliceOptions::default())
        }
        "loss/2-tapered-chunks" => {
            let t = teacher_of(4, ntok, 8, TeacherForm::Probs, |_, rng| rng.below(VOCAB))?;
            let opts = LossOptions::from(LossConfig {
                temperature: 1.5,
                max_rows_per_chunk: Some(1024),
                ..LossConfig::default()
            });
            (vec![500], t, opts, true, SliceOptions::default())
        }
        _ => {
            let t = teacher(3, 12, TeacherForm::Logprobs, |_, rng| rng.below(VOCAB))?;
            let opts = LossOptions::from(LossConfig {
                temperature: 0.7,
                max_rows_per_chunk: Some(16),
                terms: headkl_core::LossTerms {
                    logit_scale: 1.3,
                    ..Default::default()
                },
                ..LossConfig::default()
            });
            let shards = even_thirds()?;
            let slicing = SliceOptions {
                max_rows_per_slice: Some(128),
            };
            (shards, t, opts, true, slicing)
        }
    };
    let shards = HeadShard::split_at(VOCAB, &shards).map_err(|e| e.to_string())?;
    let got = drive.loss(
        engines(backend, &head, &shards, slicing, keep)?,
        (&hidden, &teacher, &opts),
        keep,
    )?;
    let resolved = opts.resolve(ntok).map_err(|e| e.to_string())?;
    let want = head_kl_f64(&head, &hidden, &teacher, &resolved);
    let tol = Tolerance::default();
    let loss = tol.check_loss(&got.loss, got.mean, &want).map_err(|m| m.to_string())?;
    let dx = tol
        .check_dx_rows(&got.dx, &want.dx, Some(HS))
        .map_err(|m| m.to_string())?;
    // The lse output too (τ = 1), as the unsharded loss gives it.
    for (t, (&g, &w)) in got.lse.iter().zip(&want.lse).enumerate() {
        if (f64::from(g) - w).abs() > 1e-5 * (w.abs() + 1.0) {
            return Err(format!("lse[{t}] = {g}, reference {w}"));
        }
    }
    Ok(CaseErrors {
        loss: Some(loss),
        dx: Some(dx),
        ..CaseErrors::default()
    })
}

fn topk_case<B: Backend, D: Drive<B>>(backend: &B, name: &str, drive: &D) -> Result<CaseErrors, String> {
    let mut x = Inputs::new(0x7368_6172_6402);
    let (cuts, opts) = match name {
        "topk/2-uneven" => (
            vec![208],
            TopkOptions {
                logprobs: true,
                ..TopkOptions::new(8)
            },
        ),
        "topk/3-k-split" => (
            vec![8, 500],
            TopkOptions {
                temperature: 2.0,
                max_rows_per_chunk: Some(16),
                ..TopkOptions::new(16)
            },
        ),
        _ => {
            // Rows 100, 600 and 900 (three shards) equal and far above the
            // rest for every token: an exact three-way tie at the top.
            let lead: Vec<f32> = (0..HS).map(|c| if c % 2 == 0 { 0.5 } else { -0.5 }).collect();
            for id in [100, 600, 900] {
                x.head[id * HS..(id + 1) * HS].copy_from_slice(&lead);
            }
            for t in 0..NTOK {
                for (c, v) in x.x[t * HS..(t + 1) * HS].iter_mut().enumerate() {
                    *v = lead[c] * 2.0 + if c == t % HS { 0.25 } else { 0.0 };
                }
            }
            (
                vec![500, 800],
                TopkOptions {
                    logprobs: true,
                    ..TopkOptions::new(2)
                },
            )
        }
    };
    let head = HeadWeights::new(HeadData::F32(&x.head), VOCAB, HS).map_err(|e| e.to_string())?;
    let hidden = Hidden::f32(&x.x, NTOK, HS).map_err(|e| e.to_string())?;
    let shards = HeadShard::split_at(VOCAB, &cuts).map_err(|e| e.to_string())?;
    let got = drive.topk(
        engines(backend, &head, &shards, SliceOptions::default(), true)?,
        &hidden,
        &opts,
    )?;
    let want = topk_f64(&head, &hidden, opts.k, opts.temperature);
    let prob = Tolerance::default()
        .check_topk(&got.ids, &got.probs, &want)
        .map_err(|m| m.to_string())?;
    if name == "topk/ties-across-shards" {
        // The unsharded engine on the same backend, exactly.
        let mut one = headkl_core::Engine::new(backend, &head, SliceOptions::default()).map_err(|e| e.to_string())?;
        let alone = one.topk(&hidden, &opts).map_err(|e| e.to_string())?;
        if got.ids != alone.ids {
            return Err(format!("ids {:?}, unsharded {:?}", &got.ids[..4], &alone.ids[..4]));
        }
        if got.ids[..2] != [100, 600] {
            return Err(format!("tied ids {:?}, expected [100, 600]", &got.ids[..2]));
        }
    }
    if opts.logprobs {
        let k = opts.k;
        for t in 0..NTOK {
            let row = &want.logits[t * VOCAB..(t + 1) * VOCAB];
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            for q in 0..k {
                let (g, w) = (
                    f64::from(got.logprobs[t * k + q]),
                    row[got.ids[t * k + q] as usize] - lse,
                );
                if (g - w).abs() > 1e-4 * (w.abs() + 1.0) {
                    return Err(format!("logprobs[{t}][{q}] = {g}, reference {w}"));
                }
            }
        }
    }
    Ok(CaseErrors {
        prob: Some(prob),
        ..CaseErrors::default()
    })
}

/// The sharded gather: each shard's partials (in turn), merged, against
/// the f64 log-softmax at the ids; a shard given another shard's partials
/// twice is refused.
fn gather_case<B: Backend>(backend: &B) -> Result<CaseErrors, String> {
    let x = Inputs::new(0x7368_6172_6403);
    let head = HeadWeights::new(HeadData::F32(&x.head), VOCAB, HS).map_err(|e| e.to_string())?;
    let hidden = Hidden::f32(&x.x, NTOK, HS).map_err(|e| e.to_string())?;
    let shards = HeadShard::split_at(VOCAB, &[8, 500]).map_err(|e| e.to_string())?;
    let k = 12;
    // Ids in every shard (shard 0 gets four a token), a repeat, and none
    // in the last column.
    let ids: Vec<i64> = (0..NTOK * k)
        .map(|i| {
            let (t, q) = ((i / k) as i64, (i % k) as i64);
            match q {
                0..=3 => (t + q) % 8,
                4 => (t + 3) % 8,
                11 => -1,
                _ => (t * 97 + q * 131) % VOCAB as i64,
            }
        })
        .collect();
    let opts = TopkOptions {
        temperature: 1.5,
        max_rows_per_chunk: Some(16),
        ..TopkOptions::new(k)
    };
    let mut parts = Vec::new();
    for mut e in engines(backend, &head, &shards, SliceOptions::default(), false)? {
        parts.push(e.gather_partials(&hidden, &ids, &opts).map_err(|e| e.to_string())?);
    }
    let got = headkl_core::shard::merge_gather(&parts).map_err(|e| e.to_string())?;
    let (want, want_lse) = headkl_reference::direct::logprobs_at_f64(&head, &hidden, &ids, k, opts.temperature);
    let mut worst = 0f64;
    for (i, (&g, &w)) in got.logprobs.iter().zip(&want).enumerate() {
        if w == f64::NEG_INFINITY {
            if g != f32::NEG_INFINITY {
                return Err(format!("logprobs[{}][{}] = {g}, want -inf (none)", i / k, i % k));
            }
            continue;
        }
        let err = (f64::from(g) - w).abs() / (w.abs() + 1.0);
        worst = worst.max(err);
        if err > 1e-4 {
            return Err(format!("logprobs[{}][{}] = {g}, reference {w}", i / k, i % k));
        }
    }
    for (t, (&g, &w)) in got.lse.iter().zip(&want_lse).enumerate() {
        if (f64::from(g) - w).abs() > 1e-4 * (w.abs() + 1.0) {
            return Err(format!("lse[{t}] = {g}, reference {w}"));
        }
    }
    let twice = [parts[0].clone(), parts[0].clone(), parts[1].clone(), parts[2].clone()];
    expect_err(
        "the first shard's partials twice",
        headkl_core::shard::merge_gather(&twice),
        |e| matches!(e, Error::ShardOverlap { .. }),
    )?;
    Ok(CaseErrors {
        loss: Some(worst),
        ..CaseErrors::default()
    })
}

pub(super) fn expect_err<T>(what: &str, r: Result<T, Error>, ok: impl Fn(&Error) -> bool) -> Result<(), String> {
    match r {
        Err(e) if ok(&e) => Ok(()),
        Err(e) => Err(format!("{what}: wrong error: {e}")),
        Ok(_) => Err(format!("{what}: accepted")),
    }
}

/// A merge's refusal of partials one token short of [`NTOK`].
pub(super) fn one_token_short(e: &Error) -> bool {
    matches!(
        e,
        Error::ShardMismatch {
            what: "tokens",
            expected: NTOK,
            got
        } if *got == NTOK - 1
    )
}

fn errors_case<B: Backend>(backend: &B) -> Result<CaseErrors, String> {
    let x = Inputs::new(0x7368_6172_6403);
    let head = HeadWeights::new(HeadData::F32(&x.head), VOCAB, HS).map_err(|e| e.to_string())?;
    let hidden = Hidden::f32(&x.x, NTOK, HS).map_err(|e| e.to_string())?;
    expect_err("shard past the head", HeadShard::new(900, 1100, VOCAB), |e| {
        matches!(e, Error::ShardRange { v1: 1100, .. })
    })?;
    expect_err("rows past the head", head.rows(900, 1100), |e| {
        matches!(e, Error::ShardRange { .. })
    })?;
    let shards = HeadShard::split_at(VOCAB, &[400]).map_err(|e| e.to_string())?;
    let wrong_rows = head.rows(0, 300).map_err(|e| e.to_string())?;
    expect_err(
        "rows of another width",
        ShardEngine::new(backend, &wrong_rows, shards[0], SliceOptions::default()),
        |e| matches!(e, Error::LengthMismatch { .. }),
    )?;
    let mut es = engines(backend, &head, &shards, SliceOptions::default(), true)?;
    let teacher = teacher(4, 4, TeacherForm::Probs, |_, rng| rng.below(VOCAB))?;
    let opts = LossOptions::default();
    let mut out = LossOutput::default();
    let no_stats = headkl_core::shard::LossStats {
        lse: vec![0.0; NTOK],
        lse1: vec![0.0; NTOK],
        soft_part: vec![0.0; NTOK],
    };
    expect_err(
        "phase two first",
        es[0].loss_finish(&hidden, &no_stats, &mut out),
        |e| matches!(e, Error::ShardPhaseOrder { .. }),
    )?;
    let p0 = es[0]
        .loss_partials(&hidden, &teacher, &opts)
        .map_err(|e| e.to_string())?;
    let p1 = es[1]
        .loss_partials(&hidden, &teacher, &opts)
        .map_err(|e| e.to_string())?;
    let short = LossPartials {
        lse: p1.lse[..NTOK - 1].to_vec(),
        ..p1.clone()
    };
    expect_err(
        "partials of another token count",
        merge_loss(&[p0.clone(), short]),
        one_token_short,
    )?;
    let overlap = LossPartials {
        shard: HeadShard::new(300, VOCAB, VOCAB).map_err(|e| e.to_string())?,
        ..p1.clone()
    };
    expect_err("overlapping shards", merge_loss(&[p0.clone(), overlap]), |e| {
        matches!(e, Error::ShardOverlap { second_v0: 300, .. })
    })?;
    expect_err("a missing shard", merge_loss(std::slice::from_ref(&p0)), |e| {
        matches!(
            e,
            Error::ShardGap {
                from: 400,
                to: VOCAB,
                ..
            }
        )
    })?;
    let stats = merge_loss(&[p0, p1]).map_err(|e| e.to_string())?;
    let short_stats = headkl_core::shard::LossStats {
        soft_part: stats.soft_part[..NTOK - 2].to_vec(),
        ..stats.clone()
    };
    expect_err(
        "statistics of another token count",
        es[0].loss_finish(&hidden, &short_stats, &mut out),
        |e| matches!(e, Error::ShardMismatch { what: "tokens", .. }),
    )?;
    // Phase one stays pending after that refusal: the right statistics work.
    es[0]
        .loss_finish(&hidden, &stats, &mut out)
        .map_err(|e| e.to_string())?;
    let ids: Vec<i64> = teacher.ids().iter().map(|&i| i64::from(i)).collect();
    let probs: Vec<f32> = teacher.probs().iter().map(|p| p * 0.5).collect();
    let bucket = Teacher::with_form(&ids, &probs, NTOK, 4, VOCAB, TeacherForm::Probs, TailMode::Bucket)
        .map_err(|e| e.to_string())?;
    expect_err("tail bucket", es[1].loss_partials(&hidden, &bucket, &opts), |e| {
        matches!(e, Error::ShardUnsupported { option: "tail", .. })
    })?;
    let z = LossOptions::from(LossConfig {
        terms: headkl_core::LossTerms {
            z_loss: 1e-4,
            ..Default::default()
        },
        ..LossConfig::default()
    });
    expect_err("z-loss", es[1].loss_partials(&hidden, &teacher, &z), |e| {
        matches!(e, Error::ShardUnsupported { option: "z-loss", .. })
    })?;
    let capped = TopkOptions {
        softcap: Some(30.0),
        ..TopkOptions::new(4)
    };
    expect_err("top-k softcap", es[1].topk_partials(&hidden, &capped), |e| {
        matches!(e, Error::ShardUnsupported { option: "softcap", .. })
    })?;
    let t0 = es[0]
        .topk_partials(&hidden, &TopkOptions::new(4))
        .map_err(|e| e.to_string())?;
    let t1 = es[1]
        .topk_partials(&hidden, &TopkOptions::new(4))
        .map_err(|e| e.to_string())?;
    let t1_short = headkl_core::shard::TopkPartials {
        ntok: NTOK - 1,
        ..t1.clone()
    };
    expect_err(
        "top-k of another token count",
        merge_topk(&[t0.clone(), t1_short], &TopkOptions::new(4)),
        |e| matches!(e, Error::ShardMismatch { what: "tokens", .. }),
    )?;
    expect_err(
        "top-k with more k than the partials",
        merge_topk(&[t0, t1], &TopkOptions::new(8)),
        |e| matches!(e, Error::ShardMismatch { what: "k", .. }),
    )?;
    Ok(CaseErrors::default())
}

/// One sharded case by name.
pub(crate) fn run_shard_case<B: Backend, D: Drive<B>>(
    backend: &B,
    name: &str,
    drive: &D,
) -> Result<CaseErrors, String> {
    match name {
        n if n.starts_with("loss/") => loss_case(backend, n, drive),
        n if n.starts_with("topk/") => topk_case(backend, n, drive),
        n if n.starts_with("gather/") => gather_case(backend),
        "errors" => errors_case(backend),
        other => Err(format!("no sharded case {other}")),
    }
}

/// Every sharded case on `backend`, as a report; `progress` sees each case.
pub fn run_shard_cases<B: Backend, D: Drive<B>>(
    backend: &B,
    drive: &D,
    progress: &mut dyn FnMut(&CaseOutcome),
) -> SuiteReport {
    run_named_cases(backend, SHARD_CASES, progress, |name| {
        run_shard_case(backend, name, drive)
    })
}

/// Each case of `cases` (name and what it checks) run by `run` under its
/// name, as `shard/<name>`, into one report.
pub(super) fn run_named_cases<B: Backend + ?Sized>(
    backend: &B,
    cases: &[(&str, &str)],
    progress: &mut dyn FnMut(&CaseOutcome),
    run: impl Fn(&str) -> Result<CaseErrors, String>,
) -> SuiteReport {
    let mut rec = Recorder::new(backend.info(), progress);
    for &(name, what) in cases {
        rec.push(run_one(backend, format!("shard/{name}"), what.to_string(), 0, || {
            run(name)
        }));
    }
    rec.report
}

/// The body of the test [`shard_tests!`] generates: opens the backend (or
/// skips), runs the sharded cases with one thread per shard, records the
/// run for `scripts/test.sh`'s summary, and panics listing every failure.
pub fn run_shard_test<B: Backend + Sync>(backend_name: &str, open: impl FnOnce() -> headkl_core::Result<B>)
where
    B::Buffer: Send,
{
    let Some(report) = super::harness::run_recorded(backend_name, open, "shard", "shard", |backend, progress| {
        run_shard_cases(backend, &Threads, progress)
    }) else {
        return;
    };
    super::harness::assert_all_passed(&report, shard_case_count(), "sharded");
}

/// Instantiates the sharded cases for a backend (one thread per shard):
/// `$open` as for [`crate::conformance_tests!`].
#[macro_export]
macro_rules! shard_tests {
    ($name:literal, $open:expr $(,)?) => {
        #[test]
        fn shards_on_threads_equal_the_unsharded_result() {
            $crate::shard::run_shard_test($name, || $open);
        }
    };
}
