//! The sharded rows of `bench --shards`: both host jobs with the head in even vocabulary shards.

use headkl_core::shard::ShardEngine;
use headkl_core::{
    Backend, Engine, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, SliceOptions, TopkOptions, ALIGN,
};

use super::data::BenchData;
use super::{BenchConfig, BenchJob, JobKind, JobResult};
use crate::environment::Settings;
use crate::error::CliError;
use crate::select::Target;
use crate::shard::{engine_on, open_and_run_shards, ShardArgs, ShardJob, ShardPlan};
use crate::text::fmt_bytes;

/// `--shards N`: both host jobs with the head cut into N even shards, one
/// engine each on this backend, called in turn on one thread (phase one on
/// each, the merge on the host, phase two on each, `dx` summed): the
/// shards' work, the second phase and the merge against the unsharded
/// call on the same device. The timing loop is [`BenchJob::time_calls`] on
/// an anchor engine of 16 rows that only carries the backend; its head and
/// the shards' heads are not counted in the peak.
pub(super) fn time_sharded<B: Backend>(
    d: &BenchData,
    cfg: &BenchConfig,
    settings: &Settings,
    backend: &B,
    n: usize,
) -> Result<Vec<JobResult>, CliError> {
    let shape = d.shape;
    let fail = |e| CliError::device("bench --shards", e);
    let head = HeadWeights::new(HeadData::F16(&d.head), shape.vocab, shape.hs).map_err(fail)?;
    let before = backend.memory().current;
    let mut shards = crate::shard::serial_engines(backend, &head, n, settings)?;
    let mut anchor = Engine::new(
        backend,
        &head.rows(0, shape.vocab.min(ALIGN)).map_err(fail)?,
        SliceOptions::default(),
    )
    .map_err(fail)?;
    let held = backend.memory().current.saturating_sub(before);
    eprintln!("bench: {n} shards of the head, one engine each, called in turn");
    let hidden = Hidden::f16(&d.hidden, shape.ntok, shape.hs).map_err(fail)?;
    let (loss_opts, topk_opts) = sharded_options(cfg, shape.k);
    let mut outs = vec![headkl_core::LossOutput::default(); n];
    let mut merged = headkl_core::LossOutput::default();
    let head_kl = BenchJob::time_calls(cfg, &mut anchor, JobKind::HeadKl, "sharded", held, shape, None, |_| {
        let inputs = (&hidden, &d.teacher, &loss_opts);
        crate::shard::loss_serial(&mut shards, inputs, &mut outs, &mut merged)
    })?;
    eprintln!(
        "bench: the shards {} their logits between the phases (kept where the chunk scratch and \
         the logits fit --budget {}; else phase two recomputes them)",
        if shards.iter().all(|s| s.kept_logits()) {
            "kept"
        } else {
            "recomputed"
        },
        fmt_bytes(cfg.budget.bytes)
    );
    let topk = BenchJob::time_calls(cfg, &mut anchor, JobKind::Topk, "sharded", held, shape, None, |_| {
        crate::shard::topk_serial(&mut shards, &hidden, &topk_opts).map(|_| ())
    })?;
    Ok(vec![head_kl, topk])
}

/// The sharded rows' options: the default loss (what the shards take) and
/// top-k `k`, within `--budget`.
fn sharded_options(cfg: &BenchConfig, k: usize) -> (LossOptions, TopkOptions) {
    let loss = LossOptions::from(LossConfig {
        budget_bytes: cfg.budget.bytes,
        ..LossConfig::default()
    });
    let topk = TopkOptions {
        budget_bytes: cfg.budget.bytes,
        ..TopkOptions::new(k)
    };
    (loss, topk)
}

/// `--shards N --devices I,J,...`: both host jobs with the shards on
/// `target`'s backend opened on those devices (shard i on device i mod
/// their number), each shard on its own thread with its engine kept across
/// calls, the merge on this thread, as ranks would run. The timing loop
/// runs on an anchor engine of 16 rows on the first device; the memory
/// figure is every device's.
pub(super) fn time_sharded_on_devices(
    d: &BenchData,
    cfg: &BenchConfig,
    target: &Target,
    n: usize,
    devices: &[usize],
) -> Result<Vec<JobResult>, CliError> {
    let args = ShardArgs {
        shards: Some(n),
        devices: Some(devices.to_vec()),
    };
    let Some(plan) = args.plan(d.shape.vocab, target)? else {
        return Ok(Vec::new());
    };
    open_and_run_shards(target, &plan, DeviceShards { d, cfg }).map_err(CliError::from)
}

/// The sharded rows' timing on the opened devices.
struct DeviceShards<'a> {
    d: &'a BenchData,
    cfg: &'a BenchConfig,
}

impl ShardJob for DeviceShards<'_> {
    type Output = Vec<JobResult>;

    fn run<B: Backend + Sync>(self, backends: &[B], plan: &ShardPlan) -> Result<Vec<JobResult>, CliError>
    where
        B::Buffer: Send,
    {
        let DeviceShards { d, cfg } = self;
        let shape = d.shape;
        let fail = |e| CliError::device("bench --shards --devices", e);
        let map = |e, what: &str| CliError::device(format!("bench --shards --devices: {what}"), e);
        let head = HeadWeights::new(HeadData::F16(&d.head), shape.vocab, shape.hs).map_err(fail)?;
        let in_use = |backends: &[B]| backends.iter().map(|b| b.memory().current).sum::<u64>();
        let before = in_use(backends);
        let mut engines: Vec<ShardEngine<&B>> = plan
            .shards
            .iter()
            .zip(&plan.assign)
            .map(|(&shard, &device)| engine_on(&backends[device], &head, shard, &plan.target.settings, &map))
            .collect::<Result<_, _>>()?;
        let mut anchor = Engine::new(
            &backends[0],
            &head.rows(0, shape.vocab.min(ALIGN)).map_err(fail)?,
            SliceOptions::default(),
        )
        .map_err(fail)?;
        let held = in_use(backends).saturating_sub(before);
        eprintln!(
            "bench: {n} shards of the head on {} device(s), one thread each",
            backends.len(),
            n = plan.shards.len()
        );
        let hidden = Hidden::f16(&d.hidden, shape.ntok, shape.hs).map_err(fail)?;
        let (loss_opts, topk_opts) = sharded_options(cfg, shape.k);
        let mut outs = vec![headkl_core::LossOutput::default(); engines.len()];
        let mut merged = headkl_core::LossOutput::default();
        let path = "sharded, threads";
        let head_kl = BenchJob::time_calls(cfg, &mut anchor, JobKind::HeadKl, path, held, shape, None, |_| {
            let inputs = (&hidden, &d.teacher, &loss_opts);
            crate::shard::loss_on_threads(&mut engines, inputs, &mut outs, &mut merged)
        })?;
        let topk = BenchJob::time_calls(cfg, &mut anchor, JobKind::Topk, path, held, shape, None, |_| {
            crate::shard::topk_on_threads(&mut engines, &hidden, &topk_opts).map(|_| ())
        })?;
        Ok(vec![head_kl, topk])
    }
}
