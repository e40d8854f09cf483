//! The device-resident rows of `bench --resident`: head_kl and topk on device buffers, and with `--shards` head_kl's two phases on device buffers.

use headkl_core::shard::{merge_loss_device, HeadShard, ShardEngine, STATS_PER_TOKEN};
use headkl_core::{
    DeviceHidden, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, HeadData, HeadWeights, ResidentBackend,
    SliceOptions, TopkOptions, ALIGN,
};

use super::data::{random_labels, upload_buffer, BenchData};
use super::{BenchConfig, BenchJob, JobKind, JobResult};
use crate::error::CliError;

/// The device-resident jobs: the bench data uploaded to device buffers once
/// (outside the timing), then `head_kl_device` and `topk_device`, each call
/// timed with the trainer's `wait_device`.
pub(super) fn time_resident<B: ResidentBackend>(
    d: &BenchData,
    cfg: &BenchConfig,
    engine: &mut Engine<B>,
    head_bytes: u64,
    topk_call: Option<f64>,
) -> Result<Vec<JobResult>, CliError> {
    let shape = d.shape;
    let (ntok, k) = (shape.ntok, shape.k);
    let fail = |e| CliError::device("bench --resident: device buffers", e);
    let buffer = |engine: &Engine<B>, data: &[u8], label| upload_buffer(engine.backend(), data, label).map_err(fail);
    let buffers = d
        .upload_loss_buffers(
            engine.backend(),
            ["bench x", "bench ids", "bench probs", "bench loss", "bench dx"],
        )
        .map_err(fail)?;
    let top_ids = buffer(engine, &vec![0u8; ntok * k * 4], "bench topk ids")?;
    let top_probs = buffer(engine, &vec![0u8; ntok * k * 4], "bench topk probs")?;
    // The head and these buffers (the trainer's, in a real run) are not
    // counted in the jobs' peak extra memory.
    let held = engine.backend().memory().current.max(head_bytes);
    let (hidden, teacher, out) = buffers.views(k);
    let labels = match cfg.labels {
        Some(_) => {
            let labels: Vec<u32> = random_labels(shape).into_iter().map(|l| l as u32).collect();
            Some(buffer(engine, bytemuck::cast_slice(&labels), "bench labels")?)
        }
        None => None,
    };
    let loss_opts = DeviceLossOptions {
        config: cfg.loss_config()?,
        labels: labels.as_ref(),
        ..DeviceLossOptions::default()
    };
    let topk_opts = TopkOptions {
        budget_bytes: cfg.budget.bytes,
        ..TopkOptions::new(k)
    };
    let head_kl = BenchJob::time_calls(
        cfg,
        engine,
        JobKind::HeadKl,
        "resident",
        held,
        shape,
        topk_call,
        |engine| {
            engine.head_kl_device(ntok, &hidden, &teacher, &out, &loss_opts)?;
            engine.wait_device()
        },
    )?;
    let topk = BenchJob::time_calls(
        cfg,
        engine,
        JobKind::Topk,
        "resident",
        held,
        shape,
        topk_call,
        |engine| {
            engine.topk_device(ntok, &hidden, &top_ids, &top_probs, &topk_opts)?;
            engine.wait_device()
        },
    )?;
    let mut jobs = vec![head_kl, topk];
    if cfg.head_grad {
        jobs.extend(time_resident_head_grad(
            d,
            cfg,
            engine,
            (&hidden, &teacher, &out, &loss_opts),
            topk_call,
        )?);
    }
    if let Some(n) = cfg.shards {
        let inputs = (&hidden, &teacher, &out, &loss_opts);
        jobs.push(time_sharded_resident(d, cfg, engine, n, inputs)?);
    }
    Ok(jobs)
}

/// `--head-grad --resident`: head_kl with the head's gradient into a
/// device buffer (`DeviceLossOptions::head_grad_out`), nothing read back;
/// left out, with the reason, where the f32 `[V][hs]` is past one binding
/// and the backend cannot bind a window of it.
#[allow(clippy::type_complexity, reason = "the resident job's buffers")]
fn time_resident_head_grad<B: ResidentBackend>(
    d: &BenchData,
    cfg: &BenchConfig,
    engine: &mut Engine<B>,
    (hidden, teacher, out, opts): (
        &DeviceHidden<'_, B::Buffer>,
        &DeviceTeacher<'_, B::Buffer>,
        &DeviceLossOutput<'_, B::Buffer>,
        &DeviceLossOptions<'_, B::Buffer>,
    ),
    topk_call: Option<f64>,
) -> Result<Option<JobResult>, CliError> {
    let shape = d.shape;
    let bytes = (shape.vocab * shape.hs * 4) as u64;
    let fail = |e| CliError::device("bench --resident --head-grad", e);
    let info = engine.backend().info();
    let max_binding = info.max_binding_bytes.min(info.max_buffer_bytes);
    // Past one binding, the call goes a window of the buffer at a time
    // where the backend makes windows (all four do): asked of a
    // word before the gradient's gigabytes are allocated.
    let probe = engine.backend().alloc(4, "bench window probe").map_err(fail)?;
    let windows = engine.backend().window(&probe, 0, 4).is_some();
    if bytes > max_binding && !windows {
        eprintln!(
            "bench: --resident --head-grad left out: the f32 head gradient ({}) is past the device's largest binding ({}) \
             and {} makes no windows of a buffer; the host row times it",
            crate::text::fmt_bytes(bytes),
            crate::text::fmt_bytes(max_binding),
            info.backend
        );
        return Ok(None);
    }
    if bytes > info.max_buffer_bytes {
        // The gradient is one buffer of the caller's (as a trainer's
        // parameter is): past the device's largest, no call can take it.
        eprintln!(
            "bench: --resident --head-grad left out: the f32 head gradient ({}) is past the largest buffer {} can \
             make on this device ({}); the host row times it",
            crate::text::fmt_bytes(bytes),
            info.backend,
            crate::text::fmt_bytes(info.max_buffer_bytes)
        );
        return Ok(None);
    }
    let dw = engine.backend().alloc(bytes, "bench head_grad").map_err(fail)?;
    let held = engine.backend().memory().current;
    let with_grad = DeviceLossOptions {
        head_grad_out: Some(&dw),
        ..*opts
    };
    let result = BenchJob::time_calls(
        cfg,
        engine,
        JobKind::HeadGrad,
        "resident",
        held,
        shape,
        topk_call,
        |engine| {
            engine.head_kl_device(shape.ntok, hidden, teacher, out, &with_grad)?;
            engine.wait_device()
        },
    )?;
    Ok(Some(result))
}

/// `--shards N --resident`: head_kl's two phases on device buffers, the
/// head in N even shards (engines on the same device, called in turn):
/// phase one on each into its partials buffer, the merge
/// (`merge_loss_device`), phase two on each (the first overwrites the
/// call's dx, the others add to it: the sum a trainer's all-reduce makes).
#[allow(clippy::type_complexity, reason = "the resident job's buffers")]
fn time_sharded_resident<B: ResidentBackend>(
    d: &BenchData,
    cfg: &BenchConfig,
    engine: &Engine<B>,
    n: usize,
    (hidden, teacher, out, opts): (
        &DeviceHidden<'_, B::Buffer>,
        &DeviceTeacher<'_, B::Buffer>,
        &DeviceLossOutput<'_, B::Buffer>,
        &DeviceLossOptions<'_, B::Buffer>,
    ),
) -> Result<JobResult, CliError> {
    let shape = d.shape;
    let backend = engine.backend();
    let fail = |e| CliError::device("bench --shards --resident", e);
    let head = HeadWeights::new(HeadData::F16(&d.head), shape.vocab, shape.hs).map_err(fail)?;
    let mut shards = HeadShard::even(shape.vocab, n)
        .map_err(|e| CliError::from_core_in_option(e, "--shards"))?
        .into_iter()
        .map(|s| {
            let mut e = ShardEngine::new(backend, &head.rows(s.v0(), s.v1())?, s, SliceOptions::default())?;
            e.engine_mut().set_dx_split(engine.dx_split());
            Ok(e)
        })
        .collect::<headkl_core::Result<Vec<_>>>()
        .map_err(fail)?;
    let partials = shards
        .iter()
        .map(|_| backend.alloc((shape.ntok * STATS_PER_TOKEN * 4) as u64, "bench partials"))
        .collect::<headkl_core::Result<Vec<_>>>()
        .map_err(fail)?;
    let stats = backend
        .alloc((shape.ntok * STATS_PER_TOKEN * 4) as u64, "bench merged statistics")
        .map_err(fail)?;
    let mut anchor = Engine::new(
        backend,
        &head.rows(0, shape.vocab.min(ALIGN)).map_err(fail)?,
        SliceOptions::default(),
    )
    .map_err(fail)?;
    let held = backend.memory().current;
    eprintln!("bench: {n} shards of the head on device buffers, one engine each, called in turn");
    let adding = DeviceLossOptions {
        accumulate_dx: true,
        ..*opts
    };
    BenchJob::time_calls(
        cfg,
        &mut anchor,
        JobKind::HeadKl,
        "sharded resident",
        held,
        shape,
        None,
        |_| {
            for (e, p) in shards.iter_mut().zip(&partials) {
                e.loss_partials_device(shape.ntok, hidden, teacher, p, opts)?;
            }
            for e in shards.iter_mut() {
                e.wait_device()?;
            }
            let views: Vec<_> = shards.iter().map(|e| e.shard()).zip(&partials).collect();
            merge_loss_device(backend, shape.ntok, &views, &stats)?;
            for (i, e) in shards.iter_mut().enumerate() {
                let o = if i == 0 { opts } else { &adding };
                e.loss_finish_device(shape.ntok, hidden, teacher, &stats, out, o)?;
            }
            for e in shards.iter_mut() {
                e.wait_device()?;
            }
            Ok(())
        },
    )
}
