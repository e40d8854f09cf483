//! The sharded rows of `bench --shards`: both host jobs with the head in even vocabulary shards.

use headkl_core::shard::{HeadShard, ShardEngine};
use headkl_core::{
    Backend, Engine, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, LossOutput, SliceOptions, Teacher,
    TopkOptions, ALIGN,
};

use super::data::BenchData;
use super::{BenchConfig, BenchJob, JobKind, JobResult};
use crate::error::CliError;
use crate::select::ShardsJob;
use crate::select::Target;
use crate::shard::{engine_on, open_and_run_shards, ShardArgs, ShardPlan};
use crate::text::fmt_bytes;
use headkl_runtime::{RuntimeBackend, Settings};

/// `--shards N`: both host jobs with the head cut into N even shards, one
/// engine each on this backend, called in turn on one thread (phase one on
/// each, the merge on the host, phase two on each, `dx` summed): the
/// shards' work, the second phase and the merge against the unsharded
/// call on the same device.
pub(super) fn time_sharded<B: Backend>(
    d: &BenchData,
    cfg: &BenchConfig,
    settings: &Settings,
    backend: &B,
    n: usize,
) -> Result<Vec<JobResult>, CliError> {
    let shards = HeadShard::even(d.shape.vocab, n).map_err(|e| CliError::from_core_in_option(e, "--shards"))?;
    let on_this_device: Vec<_> = shards.into_iter().map(|shard| (shard, 0)).collect();
    let calls = ShardCalls::in_turn(on_this_device.len());
    time_shards(d, cfg, std::slice::from_ref(backend), &on_this_device, settings, &calls)
}

/// `--shards N --devices I,J,...`: both host jobs with the shards on
/// `target`'s backend opened on those devices (shard i on device i mod
/// their number), each shard on its own thread with its engine kept across
/// calls, the merge on this thread, as ranks would run.
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
    let devices = plan.devices.clone();
    open_and_run_shards(target, &devices, DeviceShards { d, cfg, plan }).map_err(CliError::from)
}

/// The sharded rows' timing on the opened devices.
struct DeviceShards<'a> {
    d: &'a BenchData,
    cfg: &'a BenchConfig,
    plan: ShardPlan,
}

impl ShardsJob for DeviceShards<'_> {
    type Output = Result<Vec<JobResult>, CliError>;

    fn run<B: RuntimeBackend>(self, backends: &[B]) -> Self::Output {
        let plan = &self.plan;
        let placed: Vec<_> = plan.shards.iter().copied().zip(plan.assign.iter().copied()).collect();
        let calls = ShardCalls::threads(placed.len(), backends.len());
        time_shards(self.d, self.cfg, backends, &placed, &plan.target.settings, &calls)
    }
}

/// One sharded loss call (`crate::shard::loss_serial`'s arguments).
type LossCall<B> = fn(
    &mut [ShardEngine<&B>],
    (&Hidden<'_>, &Teacher, &LossOptions),
    &mut [LossOutput],
    &mut LossOutput,
) -> headkl_core::Result<()>;

/// One sharded top-k call.
type TopkCall<B> = fn(&mut [ShardEngine<&B>], &Hidden<'_>, &TopkOptions) -> headkl_core::Result<()>;

/// How each timed call runs the shards' engines: in turn on this thread
/// ([`ShardCalls::in_turn`]) or one thread a shard
/// ([`ShardCalls::threads`]).
struct ShardCalls<B> {
    shards: usize,
    /// `Some(devices)`: one thread a shard, on that many devices.
    devices: Option<usize>,
    loss: LossCall<B>,
    topk: TopkCall<B>,
}

impl<B: Backend> ShardCalls<B> {
    /// `shards` engines called in turn on this thread.
    fn in_turn(shards: usize) -> Self {
        let loss: LossCall<B> =
            |engines, inputs, outs, merged| crate::shard::loss_serial(engines, inputs, outs, merged);
        let topk: TopkCall<B> = |engines, hidden, opts| crate::shard::topk_serial(engines, hidden, opts).map(|_| ());
        ShardCalls {
            shards,
            devices: None,
            loss,
            topk,
        }
    }

    /// The rows' path label.
    fn path(&self) -> &'static str {
        match self.devices {
            None => "sharded",
            Some(_) => "sharded, threads",
        }
    }

    /// What a device error's message starts with.
    fn context(&self) -> &'static str {
        match self.devices {
            None => "bench --shards",
            Some(_) => "bench --shards --devices",
        }
    }

    /// The log line that says how the engines run.
    fn describe(&self) -> String {
        match self.devices {
            None => format!(
                "bench: {} shards of the head, one engine each, called in turn",
                self.shards
            ),
            Some(devices) => format!(
                "bench: {} shards of the head on {devices} device(s), one thread each",
                self.shards
            ),
        }
    }
}

impl<B: Backend + Sync> ShardCalls<B>
where
    B::Buffer: Send,
{
    /// `shards` engines on `devices` device(s), one thread each.
    fn threads(shards: usize, devices: usize) -> Self {
        let loss: LossCall<B> =
            |engines, inputs, outs, merged| crate::shard::loss_on_threads(engines, inputs, outs, merged);
        let topk: TopkCall<B> =
            |engines, hidden, opts| crate::shard::topk_on_threads(engines, hidden, opts).map(|_| ());
        ShardCalls {
            shards,
            devices: Some(devices),
            loss,
            topk,
        }
    }
}

/// Both jobs timed with each of `shards` on `backends[device]`, called as
/// `calls` runs them. The timing loop is [`BenchJob::time_calls`] on an anchor
/// engine of 16 rows on the first backend that only carries it; its head
/// and the shards' heads are not counted in the peak, and the memory they
/// hold is every backend's.
fn time_shards<B: Backend>(
    d: &BenchData,
    cfg: &BenchConfig,
    backends: &[B],
    shards: &[(HeadShard, usize)],
    settings: &Settings,
    calls: &ShardCalls<B>,
) -> Result<Vec<JobResult>, CliError> {
    let shape = d.shape;
    let fail = |e| CliError::device(calls.context(), e);
    let map = |e, what: &str| CliError::device(format!("{}: {what}", calls.context()), e);
    let head = HeadWeights::new(HeadData::F16(&d.head), shape.vocab, shape.hs).map_err(fail)?;
    let in_use = || backends.iter().map(|b| b.memory().current).sum::<u64>();
    let before = in_use();
    let mut engines: Vec<ShardEngine<&B>> = shards
        .iter()
        .map(|&(shard, device)| engine_on(&backends[device], &head, shard, settings, &map))
        .collect::<Result<_, _>>()?;
    let mut anchor = Engine::new(
        &backends[0],
        &head.rows(0, shape.vocab.min(ALIGN)).map_err(fail)?,
        SliceOptions::default(),
    )
    .map_err(fail)?;
    let held = in_use().saturating_sub(before);
    eprintln!("{}", calls.describe());
    let hidden = Hidden::f16(&d.hidden, shape.ntok, shape.hs).map_err(fail)?;
    let loss_opts = LossOptions::from(LossConfig {
        budget_bytes: cfg.budget.bytes,
        ..LossConfig::default()
    });
    let topk_opts = TopkOptions {
        budget_bytes: cfg.budget.bytes,
        ..TopkOptions::new(shape.k)
    };
    let mut outs = vec![LossOutput::default(); engines.len()];
    let mut merged = LossOutput::default();
    let head_kl = BenchJob::time_calls(
        cfg,
        &mut anchor,
        JobKind::HeadKl,
        calls.path(),
        held,
        shape,
        None,
        |_| (calls.loss)(&mut engines, (&hidden, &d.teacher, &loss_opts), &mut outs, &mut merged),
    )?;
    eprintln!(
        "bench: the shards {} their logits between the phases (kept where the chunk scratch and \
         the logits fit --budget {}; else phase two recomputes them)",
        if engines.iter().all(|s| s.kept_logits()) {
            "kept"
        } else {
            "recomputed"
        },
        fmt_bytes(cfg.budget.bytes)
    );
    let topk = BenchJob::time_calls(cfg, &mut anchor, JobKind::Topk, calls.path(), held, shape, None, |_| {
        (calls.topk)(&mut engines, &hidden, &topk_opts)
    })?;
    Ok(vec![head_kl, topk])
}
