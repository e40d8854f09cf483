//! `--shards N` and `--devices I,J,...` of `headkl topk`, `headkl gather`,
//! `headkl loss` and `headkl bench`: the head cut into N vocabulary shards, one engine each on
//! its own thread, the partials merged between the two phases
//! (`headkl_core::shard`). The outputs are the unsharded commands'.

use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use headkl_core::shard::{
    merge_gather, merge_loss, merge_loss_outputs, merge_loss_outputs_into, merge_topk, two_phases_on_threads,
    HeadShard, LossPartials, LossStats, ShardEngine,
};
use headkl_core::{
    Backend, Error as CoreError, Gathered, HeadWeights, Hidden, LossOptions, LossOutput, SliceOptions, Teacher, TopK,
    TopkOptions,
};

use crate::environment::Settings;
use crate::error::{join_in_order, CliError};
use crate::gather::GatherJob;
use crate::jobs::{JobInputs, LossJob, TopkJob};
use crate::select::{open_and_run, resolve_announced, BackendArgs, Job, RunError, ShardsJob, Target};
use headkl_runtime::RuntimeBackend;

/// `--shards` and `--devices`.
#[derive(Args, Clone, Debug, Default)]
pub struct ShardArgs {
    /// Split the head into N vocabulary shards, one engine (and thread) each, their partials merged
    /// between two phases (vocabulary-parallel); each shard but the last gets round_up(ceil(V/N), 16)
    /// rows, the last the rest. The output is the unsharded command's
    #[arg(long, value_name = "N", value_parser = crate::options::parse_shard_count)]
    pub shards: Option<usize>,
    /// With --shards: spread the shards over these devices of the backend (indices as `headkl
    /// devices` lists them), shard i on device i mod (the number given) [default: --device]
    #[arg(long, value_name = "I,J,...", value_delimiter = ',', requires = "shards")]
    pub devices: Option<Vec<usize>>,
}

/// What the sharded run does: which rows each shard holds, on which device.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    /// The shards, in order.
    pub shards: Vec<HeadShard>,
    /// The devices opened (`None`: the backend's default).
    pub devices: Vec<Option<usize>>,
    /// Shard i runs on `devices[assign[i]]`.
    pub assign: Vec<usize>,
    /// The target the shards run on (its kind and settings; its device is
    /// replaced by each entry of `devices`).
    pub target: Target,
}

impl ShardArgs {
    /// The plan for a head of `vocab` rows on `target`, or `None` without
    /// `--shards` (or with `--shards 1` and no `--devices`).
    pub fn plan(&self, vocab: usize, target: &Target) -> Result<Option<ShardPlan>, CliError> {
        // The parser made n 1 to MAX_SHARDS.
        let Some(n) = self.shards else { return Ok(None) };
        if n == 1 && self.devices.is_none() {
            return Ok(None);
        }
        let shards = HeadShard::even(vocab, n).map_err(|e| CliError::from_core_in_option(e, "--shards"))?;
        let devices: Vec<Option<usize>> = match &self.devices {
            Some(d) if d.is_empty() => return Err(CliError::option("--devices", "names no device")),
            Some(d) => d.iter().map(|&i| Some(i)).collect(),
            None => vec![target.device],
        };
        let assign = (0..n).map(|i| i % devices.len()).collect();
        Ok(Some(ShardPlan {
            shards,
            devices,
            assign,
            target: target.clone(),
        }))
    }

    /// Runs a command's job (`topk`, `gather`, `loss`) on the backend
    /// `backend` resolves to: on the shards of the plan [`Self::plan`]
    /// gives ([`Sharded`], once `check_sharded` passes), or without shards
    /// on one engine.
    /// Returns the result and when the run started (the backend resolved).
    pub(crate) fn run_job<T, J>(
        &self,
        backend: &BackendArgs,
        settings: &Arc<Settings>,
        vocab: usize,
        check_sharded: impl FnOnce() -> Result<(), CliError>,
        job: J,
    ) -> Result<(T, Instant), CliError>
    where
        J: Job<Output = Result<T, CliError>>,
        Sharded<J>: ShardsJob<Output = Result<T, CliError>>,
    {
        let target = resolve_announced(backend, "headkl", settings)?;
        let start = Instant::now();
        let result = match self.plan(vocab, &target)? {
            Some(plan) => {
                check_sharded()?;
                open_and_run_shards(&target, &plan.devices.clone(), Sharded { plan, job })?
            }
            None => open_and_run(&target, job)?,
        };
        Ok((result, start))
    }
}

/// A command's one-engine job ([`TopkJob`], [`GatherJob`], [`LossJob`])
/// run on the shards of `plan` instead: the same inputs and options, the
/// same output.
pub(crate) struct Sharded<J> {
    /// The shards and where they run.
    plan: ShardPlan,
    /// The job as it runs on the whole head.
    job: J,
}

/// Opens `devices` of `target`'s backend and runs `job` on them (shard i
/// of the job's plan on `backends[plan.assign[i]]`).
pub fn open_and_run_shards<T, J: ShardsJob<Output = Result<T, CliError>>>(
    target: &Target,
    devices: &[Option<usize>],
    job: J,
) -> Result<T, RunError> {
    headkl_runtime::open_and_run_shards(target, devices, job)?.map_err(RunError::Job)
}

/// Maps a core error to the input or option that caused it (the unsharded
/// command's mapping), with a context for device errors.
pub type MapError<'a> = &'a (dyn Fn(CoreError, &str) -> CliError + Sync);

/// Each shard's engine on its own thread, built there (its head upload in
/// parallel with the others').
pub(crate) fn engine_on<'b, B: Backend>(
    backend: &'b B,
    head: &HeadWeights<'_>,
    shard: HeadShard,
    settings: &headkl_runtime::Settings,
    map: MapError<'_>,
) -> Result<ShardEngine<&'b B>, CliError> {
    let rows = head.rows(shard.v0(), shard.v1()).map_err(|e| map(e, "shard rows"))?;
    let mut e =
        ShardEngine::new(backend, &rows, shard, SliceOptions::default()).map_err(|e| map(e, "uploading the head"))?;
    e.engine_mut().set_trace(settings.trace);
    e.engine_mut().set_dx_split(settings.dx_split);
    Ok(e)
}

/// Says how many shards run on how many devices of which backend.
fn announce<B: Backend>(backends: &[B], plan: &ShardPlan) {
    log::info!(
        "headkl: {} shards on {} device(s) of {}",
        plan.shards.len(),
        backends.len(),
        crate::select::describe(backends[0].info())
    );
}

/// The one-phase sharded jobs (top-k, the gather): each shard's engine
/// built on its own thread and `partials` run on it (its error mapped
/// under `what`), then the partials, in shard order, merged on this
/// thread (a panicking thread is an error).
fn merged_over_shards<B, P, T>(
    backends: &[B],
    plan: &ShardPlan,
    inputs: &JobInputs<'_>,
    what: &str,
    partials: impl Fn(&mut ShardEngine<&B>) -> headkl_core::Result<P> + Sync,
    merge: impl FnOnce(&[P]) -> headkl_core::Result<T>,
) -> Result<T, CliError>
where
    B: Backend + Sync,
    P: Send,
{
    let map = &|e, c: &str| CliError::from(inputs.sources.map(e, c));
    announce(backends, plan);
    let partials = &partials;
    let parts: Result<Vec<P>, _> = std::thread::scope(|s| {
        let ranks: Vec<_> = plan
            .shards
            .iter()
            .zip(&plan.assign)
            .map(|(&shard, &d)| {
                let backend = &backends[d];
                s.spawn(move || {
                    let mut e = engine_on(backend, &inputs.head, shard, &plan.target.settings, map)?;
                    partials(&mut e).map_err(|e| map(e, what))
                })
            })
            .collect();
        join_in_order(ranks, |rank| format!("shard {rank}'s thread"))
    });
    merge(&parts?).map_err(|e| map(e, "merging the shards"))
}

/// The sharded loss: N engines on N threads, phase one, the merge on this
/// thread (where a trainer's all-reduce goes), phase two, `dx` summed.
impl ShardsJob for Sharded<LossJob<'_>> {
    type Output = Result<LossOutput, CliError>;

    fn run<B: RuntimeBackend>(self, backends: &[B]) -> Self::Output {
        let Sharded {
            plan,
            job: LossJob {
                inputs, teacher, opts, ..
            },
        } = self;
        let plan = &plan;
        let map = &|e, c: &str| CliError::from(inputs.sources.map(e, c));
        announce(backends, plan);
        let ranks: Vec<_> = plan.shards.iter().copied().zip(plan.assign.iter().copied()).collect();
        let outs = two_phases_on_threads(
            ranks,
            |_, (shard, d)| {
                let mut e = engine_on(&backends[d], &inputs.head, shard, &plan.target.settings, map)?;
                let p = e
                    .loss_partials(&inputs.hidden, teacher, opts)
                    .map_err(|e| map(e, "head_kl"))?;
                Ok((e, p))
            },
            |parts: Vec<LossPartials>| {
                let stats = merge_loss(&parts).map_err(|e| map(e, "merging the shards"))?;
                Ok(vec![stats; parts.len()])
            },
            |mut engine: ShardEngine<&B>, stats: LossStats| {
                let mut out = LossOutput::default();
                engine
                    .loss_finish(&inputs.hidden, &stats, &mut out)
                    .map_err(|e| map(e, "head_kl"))?;
                Ok(out)
            },
            |rank, message| CliError::Panicked {
                what: format!("shard {rank}'s thread"),
                message,
            },
            || CliError::option("--shards", "another shard failed"),
        )?;
        merge_loss_outputs(&outs).map_err(|e| map(e, "merging the shards"))
    }
}

/// The sharded top-k: each shard's candidates on its own thread, merged.
impl ShardsJob for Sharded<TopkJob<'_>> {
    type Output = Result<TopK, CliError>;

    fn run<B: RuntimeBackend>(self, backends: &[B]) -> Self::Output {
        let TopkJob { inputs, opts } = self.job;
        merged_over_shards(
            backends,
            &self.plan,
            &inputs,
            "top-k",
            |e| e.topk_partials(&inputs.hidden, opts),
            |parts| merge_topk(parts, opts),
        )
    }
}

/// The sharded gather: each shard's log-probabilities and lse on its own
/// thread, merged.
impl ShardsJob for Sharded<GatherJob<'_>> {
    type Output = Result<Gathered, CliError>;

    fn run<B: RuntimeBackend>(self, backends: &[B]) -> Self::Output {
        let GatherJob { inputs, ids, opts } = self.job;
        merged_over_shards(
            backends,
            &self.plan,
            &inputs,
            "gather",
            |e| e.gather_partials(&inputs.hidden, ids, opts),
            merge_gather,
        )
    }
}

/// One sharded loss call with the shards in turn on this thread: phase
/// one on each, the merge, phase two on each (into `outs`), `dx` summed
/// into `merged` (all kept across calls).
pub fn loss_serial<B: Backend>(
    engines: &mut [ShardEngine<B>],
    (hidden, teacher, opts): (&Hidden<'_>, &Teacher, &LossOptions),
    outs: &mut [LossOutput],
    merged: &mut LossOutput,
) -> headkl_core::Result<()> {
    let parts = engines
        .iter_mut()
        .map(|e| e.loss_partials(hidden, teacher, opts))
        .collect::<headkl_core::Result<Vec<_>>>()?;
    let stats = merge_loss(&parts)?;
    for (e, out) in engines.iter_mut().zip(outs.iter_mut()) {
        e.loss_finish(hidden, &stats, out)?;
    }
    merge_loss_outputs_into(outs, merged)
}

/// One sharded top-k call with the shards in turn on this thread.
pub fn topk_serial<B: Backend>(
    engines: &mut [ShardEngine<B>],
    hidden: &Hidden<'_>,
    opts: &TopkOptions,
) -> headkl_core::Result<TopK> {
    let parts = engines
        .iter_mut()
        .map(|e| e.topk_partials(hidden, opts))
        .collect::<headkl_core::Result<Vec<_>>>()?;
    merge_topk(&parts, opts)
}

/// What a rank's thread that panicked, or stopped because another rank
/// failed, is as a core error (the timing loop's error type).
fn rank_panicked(rank: usize, message: String) -> CoreError {
    CoreError::Backend {
        backend: "shards",
        message: format!("shard {rank}'s thread panicked: {message}"),
    }
}

fn rank_stopped() -> CoreError {
    CoreError::Backend {
        backend: "shards",
        message: "stopped: another shard failed".into(),
    }
}

/// One sharded loss call with each shard on its own thread, its engine
/// kept across calls (`bench --shards --devices`): phase one on every
/// thread, the merge on this one, phase two, `dx` summed into `merged`.
pub fn loss_on_threads<B: Backend + Sync>(
    engines: &mut [ShardEngine<&B>],
    (hidden, teacher, opts): (&Hidden<'_>, &Teacher, &LossOptions),
    outs: &mut [LossOutput],
    merged: &mut LossOutput,
) -> headkl_core::Result<()>
where
    B::Buffer: Send,
{
    let ranks: Vec<_> = engines.iter_mut().zip(outs.iter_mut()).collect();
    two_phases_on_threads(
        ranks,
        |_, (engine, out)| {
            let partials = engine.loss_partials(hidden, teacher, opts)?;
            Ok(((engine, out), partials))
        },
        |parts: Vec<LossPartials>| {
            let stats = merge_loss(&parts)?;
            Ok(vec![stats; parts.len()])
        },
        |(engine, out), stats: LossStats| engine.loss_finish(hidden, &stats, out),
        rank_panicked,
        rank_stopped,
    )?;
    merge_loss_outputs_into(outs, merged)
}

/// One sharded top-k call with each shard on its own thread, its engine
/// kept across calls; the candidates merged on this thread.
pub fn topk_on_threads<B: Backend + Sync>(
    engines: &mut [ShardEngine<&B>],
    hidden: &Hidden<'_>,
    opts: &TopkOptions,
) -> headkl_core::Result<TopK>
where
    B::Buffer: Send,
{
    let mut merged = None;
    two_phases_on_threads(
        engines.iter_mut().collect(),
        |_, engine| Ok(((), engine.topk_partials(hidden, opts)?)),
        // One phase: the merge is the result, and the ranks get nothing back.
        |parts| {
            merged = Some(merge_topk(&parts, opts)?);
            Ok(vec![(); parts.len()])
        },
        |(), ()| Ok(()),
        rank_panicked,
        rank_stopped,
    )?;
    merged.ok_or_else(rank_stopped)
}
