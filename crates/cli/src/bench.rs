//! `headkl bench`: the cross-backend comparison of `head_kl` and `topk`.
//!
//! For each backend: random f16 data of the shape, the head uploaded once
//! (outside the timing), then per job a warm-up and `iters` timed calls.
//! Reports wall time (median, min–max), GPU time from kernel timestamps
//! where the backend has them, effective TFLOP/s, and peak device memory
//! beyond the head.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use headkl_core::{
    Backend, DeviceInfo, Divergence, Engine, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, LossTerms,
    ResidentBackend, SliceOptions, TopkOptions, ALIGN,
};

use crate::environment::Settings;
use crate::error::{is_validation, CliError};
use crate::io::write_atomic;
use crate::options::BudgetArg;
use crate::progress::Progress;
use crate::select::{
    enumerate_backend, no_device_buffers, open_and_run, required, resolve_announced, target_for, BackendArgs,
    BackendKind, Job, RunError, Target,
};
use crate::text::fmt_bytes;

mod data;
mod preflight;
mod resident;
mod shape;
mod sharded;
mod stats;
mod table;

use data::{random_labels, teacher_data};
pub(crate) use data::{BenchData, DataKind, VocabOrderArg};
use resident::time_resident;
pub use shape::{JobKind, Shape, ShapeCost};
use sharded::{time_sharded, time_sharded_on_devices};
use stats::announce_estimate;
pub(crate) use stats::{median, sorted};
pub use table::{render, BenchReport, BenchRun, FilterReport, JobResult, KernelStat};

/// Rows of the probe call that estimates a run's length: a few whole
/// GEMM row tiles (16 rows over-estimated lavapipe's run 4.5x, its tiles
/// being wider).
const PROBE_ROWS: usize = 64;

/// Seed of the benchmark data (fixed, so runs compare).
const DATA_SEED: u64 = 0x5EED_4EAD;

/// Flops above which `--all` leaves out the CPU reference (it would take
/// minutes); naming `--backend reference` still runs it.
const REFERENCE_MAX_FLOPS: f64 = 2e11;

/// Settings of one `headkl bench` run: its command-line options.
#[derive(clap::Args, Clone, Debug)]
pub struct BenchConfig {
    /// A, B, S, M or NTOK:V:HS:K (default: per backend, see above)
    #[arg(long, value_parser = crate::parse_shape)]
    pub shape: Option<Shape>,
    /// Teacher entries / top-k k (overrides the shape's K)
    #[arg(long)]
    pub k: Option<usize>,
    /// Timed calls per job
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Untimed calls per job before the timed ones
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    #[command(flatten)]
    pub budget: BudgetArg,
    /// Write every number as JSON to FILE
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write an SVG bar chart to FILE.svg
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Run every backend this machine can start
    #[arg(long)]
    pub all: bool,
    /// Also time the device-resident entry points (inputs already in device buffers, the
    /// trainer's wait included), beside the host path
    #[arg(long)]
    pub resident: bool,
    /// Run even when bench estimates more than 5 minutes or more memory than the machine has
    /// (without it bench asks on a terminal, and refuses with exit 2 elsewhere)
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Also time both jobs with the head in N even vocabulary shards (one engine each on this
    /// device, called in turn: phase one, the merge, phase two), beside the unsharded rows; with
    /// --resident also head_kl's two phases on device buffers (row "sharded resident")
    #[arg(long, value_name = "N", value_parser = crate::options::parse_shard_count)]
    pub shards: Option<usize>,
    /// With --shards: time the sharded host rows with the shards spread over these devices of the
    /// backend (indices as `headkl devices` lists them; shard i on device i mod the number given),
    /// one thread each as ranks would run (row "sharded, threads"), instead of in turn on this
    /// device; the sharded resident row stays on this device
    #[arg(long, value_name = "I,J,...", value_delimiter = ',', requires = "shards")]
    pub devices: Option<Vec<usize>>,
    /// The data: `random` (uniform head and hidden rows, random teacher: the filter skips
    /// nothing) or `lm` (logits like a trained LM's: a Zipf prior, contextual peaks, a teacher
    /// consistent with them; its statistics are printed beside the published ones)
    #[arg(long, value_enum, default_value_t = DataKind::Random)]
    pub data: DataKind,
    /// The dx GEMM's block filter: skip blocks whose |∂L/∂s| entries are all at most ε
    /// (`auto` = 2^-15); prints the skipped fraction, a bound on what it dropped and dx's error
    /// against an unfiltered call (the sharded rows run without it) [default: off]
    #[arg(long, value_parser = crate::parse_filter_eps, value_name = "auto|E")]
    pub filter_eps: Option<f32>,
    /// The order the head's rows are stored in, fixed at upload: `natural`, `prior` (the `lm`
    /// data's unigram prior, likely tokens first, so the dx block filter finds them in fewer
    /// blocks; needs --data lm) or a file of token ids, whitespace-separated, one per position
    #[arg(long, value_parser = VocabOrderArg::parse, value_name = "natural|prior|FILE",
          default_value = "natural")]
    pub vocab_order: VocabOrderArg,
    /// head_kl's divergence, as `loss --divergence`: `forward`, `reverse` or `jsd` (the sharded
    /// rows compute the forward KL alone)
    #[arg(long, value_name = "D", default_value = "forward", value_parser = crate::terms::parse_divergence)]
    pub divergence: Divergence,
    /// β of --divergence jsd, in [0, 1] [default: 0.5]
    #[arg(long, value_name = "B", allow_negative_numbers = true)]
    pub beta: Option<f32>,
    /// head_kl's soft-term weight α_soft, as `loss --soft-weight` (0 with --hard-weight 1
    /// --labels random: the cross-entropy alone)
    #[arg(long, value_name = "W", default_value_t = 1.0, allow_negative_numbers = true)]
    pub soft_weight: f32,
    /// head_kl's hard-label weight α_hard, as `loss --hard-weight` (needs --labels)
    #[arg(long, value_name = "W", default_value_t = 0.0, allow_negative_numbers = true)]
    pub hard_weight: f32,
    /// Labels of the hard term: `random` (uniform over the vocabulary, seeded)
    #[arg(long, value_enum, value_name = "random")]
    pub labels: Option<BenchLabels>,
    /// Also time `gather` (the log-probabilities at the teacher's k ids a token,
    /// `Engine::logprobs_at`) on the host path
    #[arg(long)]
    pub gather: bool,
    /// Also time the exact full-vocabulary head_kl from teacher hidden rows of hidden size N
    /// (`loss --teacher-hidden`; a random teacher head [V][N], uploaded outside the timing), with
    /// --divergence, --beta and --soft-weight (not --hard-weight; without --filter-eps)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub teacher_hs: Option<u32>,
    /// Also time head_kl with the head's gradient (`loss --head-grad`: a third GEMM a chunk,
    /// read back once a call) on the host path, row `head_kl_head_grad`
    #[arg(long)]
    pub head_grad: bool,
}

/// `bench --labels`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchLabels {
    /// One label a token, uniform over the vocabulary (seeded).
    Random,
}

impl BenchConfig {
    /// head_kl's terms: the divergence (and β) asked for, checked, the
    /// rest the defaults.
    fn loss_terms(&self) -> Result<LossTerms, CliError> {
        let divergence = crate::terms::with_beta(self.divergence, self.beta)?;
        let terms = LossTerms {
            divergence,
            soft_weight: self.soft_weight,
            hard_weight: self.hard_weight,
            ..LossTerms::default()
        };
        terms.check().map_err(|e| match &e {
            headkl_core::Error::InvalidLossOption { field, .. } => {
                CliError::from_core_in_option(e.clone(), headkl_files::sources::option_of(field))
            }
            _ => CliError::from_core_in_option(e, "--divergence"),
        })?;
        if terms.hard_on() && self.teacher_hs.is_some() {
            return Err(CliError::option(
                "--teacher-hs",
                "the full-vocabulary loss computes the soft term alone: leave out --hard-weight",
            ));
        }
        if terms.hard_on() && self.labels.is_none() {
            return Err(CliError::option(
                "--hard-weight",
                format!("--hard-weight {} needs --labels random", self.hard_weight),
            ));
        }
        if self.shards.is_some() && (terms != LossTerms::default() || self.labels.is_some()) {
            return Err(CliError::option(
                "--shards",
                "the sharded rows time the default loss: leave out --divergence, --soft-weight, --hard-weight and --labels",
            ));
        }
        Ok(terms)
    }

    /// head_kl's config on the host and resident paths: `loss_terms`, the
    /// budget and the dx block filter.
    fn loss_config(&self) -> Result<LossConfig, CliError> {
        Ok(LossConfig {
            budget_bytes: self.budget.bytes,
            filter_eps: self.filter_eps,
            terms: self.loss_terms()?,
            ..LossConfig::default()
        })
    }
}

/// Runs both jobs on one backend; the data of the last shape is kept for
/// the next backend.
struct BenchJob<'a> {
    kind: BackendKind,
    /// The backend and device it runs on (`--devices` opens more of it).
    target: &'a Target,
    /// `HEADKL_TRACE`, `HEADKL_DX_SPLIT` and `HEADKL_NO_ROW_STATS` for the engine.
    settings: &'a headkl_runtime::Settings,
    cfg: &'a BenchConfig,
    /// Whether the device-resident jobs run too (on a backend with device
    /// buffers).
    resident: bool,
    cache: &'a mut Option<BenchData>,
}

impl BenchJob<'_> {
    /// Before committing to the whole run: a warm top-k call on a few rows
    /// (the second of two: pipeline builds are not counted), scaled to the
    /// shape's rows and every call of both jobs (head_kl counted as two
    /// top-k GEMMs), and said when it comes to
    /// [`stats::ESTIMATE_NOTE_SECS`] or more; past
    /// [`preflight::CONFIRM_SECS`] it asks for `--yes` unless that was
    /// asked already (`confirmed`). The cost is linear in the rows at a
    /// fixed head, so this errs long (fixed costs scale too). Returns the
    /// estimated seconds of one top-k call on the whole shape.
    fn probe<B: Backend>(
        d: &BenchData,
        cfg: &BenchConfig,
        engine: &mut Engine<B>,
        confirmed: bool,
    ) -> Result<Option<f64>, CliError> {
        let shape = d.shape;
        let rows = PROBE_ROWS;
        if shape.ntok < 4 * rows {
            return Ok(None); // a probe would cost a good part of the first call
        }
        let hidden =
            Hidden::f16(&d.hidden[..rows * shape.hs], rows, shape.hs).map_err(|e| CliError::device("bench data", e))?;
        let opts = TopkOptions {
            budget_bytes: cfg.budget.bytes,
            ..TopkOptions::new(shape.k)
        };
        let mut probe_s = 0.0;
        for _ in 0..2 {
            let start = Instant::now();
            engine
                .topk(&hidden, &opts)
                .and_then(|_| engine.backend().finish())
                .map_err(|e| CliError::device("bench probe", e))?;
            probe_s = start.elapsed().as_secs_f64();
        }
        let _ = engine.backend().take_kernel_times();
        let topk_call = probe_s * (shape.ntok as f64 / rows as f64);
        let calls = (cfg.warmup + cfg.iters) as f64;
        let paths = if cfg.resident { 2.0 } else { 1.0 };
        let total = topk_call * calls * 3.0 * paths;
        if !confirmed && total > preflight::CONFIRM_SECS {
            let info = engine.backend().info().clone();
            let (host_bytes, device_bytes) = preflight::memory_needs(shape, cfg, &info);
            let needs = preflight::Needs {
                secs: Some(total),
                from: "from a warm 64-row probe on the whole head",
                host_bytes,
                device_bytes,
            };
            preflight::confirm(&format!("bench {} at {shape}", info.backend), &needs, cfg, &info)?;
            return Ok(Some(topk_call));
        }
        if total >= stats::ESTIMATE_NOTE_SECS {
            log::info!(
                "bench: {} calls per job at {shape} will take about {} here (from a {rows}-row probe; \
                 fewer --iters/--warmup or a smaller --shape to shorten; Ctrl-C stops)",
                cfg.warmup + cfg.iters,
                stats::fmt_secs(total)
            );
        }
        Ok(Some(topk_call))
    }

    fn time_job<B: Backend>(
        d: &BenchData,
        cfg: &BenchConfig,
        engine: &mut Engine<B>,
        job: JobKind,
        head_bytes: u64,
        topk_call: Option<f64>,
    ) -> Result<JobResult, CliError> {
        let shape = d.shape;
        let hidden = Hidden::f16(&d.hidden, shape.ntok, shape.hs).map_err(|e| CliError::device("bench data", e))?;
        let loss_opts = LossOptions {
            config: cfg.loss_config()?,
            labels: cfg.labels.map(|_| random_labels(shape)),
            ..LossOptions::default()
        };
        let topk_opts = TopkOptions {
            budget_bytes: cfg.budget.bytes,
            ..TopkOptions::new(shape.k)
        };
        // The gather scores the teacher's own ids.
        let gather_ids: Vec<i64> = match job {
            JobKind::Gather => d.teacher.ids().iter().map(|&i| i64::from(i)).collect(),
            _ => Vec::new(),
        };
        // The full-vocabulary loss's teacher: its head goes up outside the
        // timing, as a trainer uploads it once.
        let teacher_hidden = match job {
            JobKind::FullVocab { teacher_hs } => {
                let (head, hidden) = teacher_data(shape, teacher_hs);
                let teacher_head = HeadWeights::new(HeadData::F16(&head), shape.vocab, teacher_hs)
                    .map_err(|e| CliError::device("bench teacher head", e))?;
                engine
                    .set_teacher_head(&teacher_head, SliceOptions::default())
                    .map_err(|e| CliError::device("bench: uploading the teacher's head", e))?;
                hidden
            }
            _ => Vec::new(),
        };
        let teacher_rows = match job {
            JobKind::FullVocab { teacher_hs } => Some(
                Hidden::f16(&teacher_hidden, shape.ntok, teacher_hs).map_err(|e| CliError::device("bench data", e))?,
            ),
            _ => None,
        };
        // The full-vocabulary loss has no dx filter (refused there).
        let full_vocab_opts = LossOptions {
            config: LossConfig {
                filter_eps: None,
                ..loss_opts.config
            },
            ..loss_opts.clone()
        };
        // The head's gradient has no dx filter to skip blocks with.
        let head_grad_opts = LossOptions {
            config: LossConfig {
                head_grad: true,
                ..loss_opts.config
            },
            ..loss_opts.clone()
        };
        // Kept across calls, as a training loop keeps its gradient buffer.
        let mut loss_out = headkl_core::LossOutput::default();
        let mut result = Self::time_calls(
            cfg,
            engine,
            job,
            "host",
            head_bytes,
            shape,
            topk_call,
            |engine| match job {
                JobKind::HeadKl => engine.head_kl_into(&hidden, &d.teacher, &loss_opts, &mut loss_out),
                JobKind::HeadGrad => engine.head_kl_into(&hidden, &d.teacher, &head_grad_opts, &mut loss_out),
                JobKind::Topk => engine.topk(&hidden, &topk_opts).map(|_| ()),
                JobKind::Gather => engine.logprobs_at(&hidden, &gather_ids, &topk_opts).map(|_| ()),
                JobKind::FullVocab { .. } => match &teacher_rows {
                    Some(t) => engine.head_kl_full_vocab_into(&hidden, t, &full_vocab_opts, &mut loss_out),
                    None => Err(headkl_core::Error::NoTeacherHead),
                },
            },
        )?;
        if job == JobKind::HeadKl {
            result.filter = Some(Self::filter_report(d, engine, &hidden, &loss_opts, &loss_out)?);
        }
        engine.remove_teacher_head();
        Ok(result)
    }
    /// What the block filter did in the last timed call, and dx's error
    /// against one unfiltered call (untimed) on the same engine.
    fn filter_report<B: Backend>(
        d: &BenchData,
        engine: &mut Engine<B>,
        hidden: &Hidden<'_>,
        opts: &LossOptions,
        filtered: &headkl_core::LossOutput,
    ) -> Result<FilterReport, CliError> {
        let Some(st) = filtered.filter else {
            eprintln!("bench: dx block filter off ({} data)", d.kind.name());
            return Ok(FilterReport::off(d.kind));
        };
        let exact = engine
            .head_kl(
                hidden,
                &d.teacher,
                &LossOptions {
                    config: LossConfig {
                        filter_eps: None,
                        ..opts.config
                    },
                    ..opts.clone()
                },
            )
            .map_err(|e| CliError::device("bench: the unfiltered call", e))?;
        let _ = engine.backend().take_kernel_times();
        let norm = exact.dx.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        let diff = exact
            .dx
            .iter()
            .zip(&filtered.dx)
            .map(|(&a, &b)| f64::from(a - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let rel = |v: f64| v / norm.max(f64::MIN_POSITIVE);
        let report = FilterReport {
            data: d.kind,
            eps: Some(st.eps),
            skipped: st.skipped_fraction(),
            dx_rel_err: rel(diff),
            bound_rel: rel(st.dropped_bound),
            loss_identical: exact.loss == filtered.loss,
        };
        eprintln!(
            "bench: dx block filter ε = {:e} ({} data): skipped {:.1}% of the dx GEMM's blocks; dx vs unfiltered: \
             relative L2 error {:.2e} (bound {:.2e}); loss {}",
            st.eps,
            d.kind.name(),
            100.0 * report.skipped,
            report.dx_rel_err,
            report.bound_rel,
            if report.loss_identical {
                "bit-identical"
            } else {
                "DIFFERS"
            },
        );
        Ok(report)
    }

    /// Times `cfg.iters` calls of `call` (after `cfg.warmup`), each
    /// followed by the backend's `finish`. The bar's time left comes from
    /// the probe's estimate of a top-k call (`topk_call`, seconds; head_kl
    /// counted as two) until two calls are done, then from the last call,
    /// so the bar and the probe's estimate agree.
    #[allow(clippy::too_many_arguments, reason = "one private helper of two call sites")]
    fn time_calls<B: Backend>(
        cfg: &BenchConfig,
        engine: &mut Engine<B>,
        job: JobKind,
        path: &'static str,
        head_bytes: u64,
        shape: Shape,
        topk_call: Option<f64>,
        mut call: impl FnMut(&mut Engine<B>) -> headkl_core::Result<()>,
    ) -> Result<JobResult, CliError> {
        // Scratch of the previous job is freed, so the peak is this job's.
        engine.release_scratch();
        engine.backend().reset_peak_memory();
        let label = format!("bench {} {} {path}", engine.backend().info().backend, job.name());
        let mut progress = Progress::new_estimated(label, (cfg.warmup + cfg.iters) as u64);
        let estimate = topk_call.map(|s| s * shape.flops(job) / shape.flops(JobKind::Topk));
        let mut last_call: Option<f64> = None;
        let mut wall = Vec::with_capacity(cfg.iters);
        let mut gpu = Vec::with_capacity(cfg.iters);
        let mut per_kernel: BTreeMap<&'static str, (Vec<f64>, usize)> = BTreeMap::new();
        for i in 0..cfg.warmup + cfg.iters {
            let timed = i >= cfg.warmup;
            let what = if timed {
                format!("iteration {}/{}", i + 1 - cfg.warmup, cfg.iters)
            } else {
                format!("warm-up {}/{}", i + 1, cfg.warmup)
            };
            // The first call builds pipelines: not a measure of the others.
            let per_call = if i >= 2 { last_call } else { estimate.or(last_call) };
            let left = per_call.map(|s| s * (cfg.warmup + cfg.iters - i) as f64);
            progress.message(match left {
                Some(left) => format!("{what}, about {} left", stats::fmt_secs(left)),
                None => what.clone(),
            });
            let start = Instant::now();
            let result = call(engine);
            let b = engine.backend();
            result
                .and_then(|()| b.finish())
                .map_err(|e| CliError::device(format!("bench {} {}", b.info().backend, job.name()), e))?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
            last_call = Some(ms * 1e-3);
            // Without the probe's estimate: said after the second call, the
            // first one's pipeline builds left out.
            if i == 1 && topk_call.is_none() {
                announce_estimate(b.info().backend, job, ms, cfg.warmup + cfg.iters - 1);
            }
            let times = b
                .take_kernel_times()
                .map_err(|e| CliError::device("reading kernel times", e))?;
            if timed {
                wall.push(ms);
                if !times.is_empty() {
                    gpu.push(times.iter().map(|t| t.ms).sum());
                    let mut this_call: BTreeMap<&'static str, (f64, usize)> = BTreeMap::new();
                    for t in &times {
                        let e = this_call.entry(t.kernel).or_default();
                        e.0 += t.ms;
                        e.1 += 1;
                    }
                    for (kernel, (ms, n)) in this_call {
                        let e = per_kernel.entry(kernel).or_default();
                        e.0.push(ms);
                        e.1 = n;
                    }
                }
            }
            progress.inc(&what);
        }
        progress.finish();
        let peak = engine.backend().memory().peak;
        let on_cpu = engine.backend().info().backend == "reference";
        let wall = sorted(wall);
        let median_ms = median(&wall);
        let gpu_ms = (!gpu.is_empty()).then(|| median(&sorted(gpu)));
        let flops = shape.flops(job);
        let tf = |ms: f64| flops / (ms * 1e-3) / 1e12;
        let kernels = per_kernel
            .into_iter()
            .map(|(kernel, (ms, dispatches))| KernelStat {
                kernel: kernel.to_string(),
                ms: median(&sorted(ms)),
                dispatches,
            })
            .collect();
        Ok(JobResult {
            job,
            path,
            iters: cfg.iters,
            median_ms,
            min_ms: wall.first().copied().unwrap_or(f64::NAN),
            max_ms: wall.last().copied().unwrap_or(f64::NAN),
            gpu_ms,
            tflops: tf(gpu_ms.unwrap_or(median_ms)),
            // The reference's times (its kernel timings too) are CPU time:
            // say so, not "gpu" or "wall".
            tflops_from: match (on_cpu, gpu_ms.is_some()) {
                (true, _) => "cpu",
                (false, true) => "gpu",
                (false, false) => "wall",
            },
            wall_tflops: tf(median_ms),
            peak_extra_bytes: peak.saturating_sub(head_bytes),
            kernels,
            filter: None,
        })
    }
}

impl Job for BenchJob<'_> {
    type Output = Result<Option<BenchRun>, CliError>;

    fn run<B: Backend>(self, backend: B) -> Self::Output {
        self.run_with(backend, |_, _, _, _, _| Ok(Vec::new()))
    }

    fn run_resident<B: ResidentBackend<Buffer: Send> + Sync>(self, backend: B) -> Self::Output {
        if self.resident {
            self.run_with(backend, time_resident)
        } else {
            self.run(backend)
        }
    }
}

impl BenchJob<'_> {
    /// Opens the engine and times the host jobs, then whatever `extra`
    /// times on the same engine.
    fn run_with<B: Backend>(
        self,
        backend: B,
        extra: impl FnOnce(&BenchData, &BenchConfig, &mut Engine<B>, u64, Option<f64>) -> Result<Vec<JobResult>, CliError>,
    ) -> Result<Option<BenchRun>, CliError> {
        let info = backend.info().clone();
        let shape = shape_for(self.cfg, &info, self.kind)?;
        if self.cfg.all && self.kind == BackendKind::Reference && shape.flops(JobKind::HeadKl) > REFERENCE_MAX_FLOPS {
            log::info!(
                "bench: reference: shape {shape} is too large for the CPU backend \
                 (skipped; run it alone with --backend reference)"
            );
            return Ok(None);
        }
        // Before the data is made: a run of hours, or one past the memory
        // there is, is said and refused here unless --yes.
        let (host_bytes, device_bytes) = preflight::memory_needs(shape, self.cfg, &info);
        let secs = preflight::calibrate(&backend, shape, self.cfg.budget.bytes)?
            .map(|secs_per_flop| secs_per_flop * preflight::run_flops(shape, self.cfg));
        let needs = preflight::Needs {
            secs,
            from: "at the rate of a warm 16-row call",
            host_bytes,
            device_bytes,
        };
        let confirmed = preflight::confirm(&format!("bench {} at {shape}", info.backend), &needs, self.cfg, &info)?;
        if self
            .cache
            .as_ref()
            .is_none_or(|d| d.shape != shape || d.kind != self.cfg.data)
        {
            *self.cache = None; // free the old data before making the new
            *self.cache = Some(BenchData::generate(shape, self.cfg.data)?);
        }
        let Some(data) = self.cache.as_ref() else {
            return Ok(None);
        };
        let profiling = backend.set_profiling(true);
        eprintln!(
            "bench: {} on {} ({}), matrix units {}, kernel timing {}, shape {shape}",
            info.backend,
            info.device_name,
            info.device_type,
            if info.matrix_units { "on" } else { "off" },
            if profiling { "on" } else { "off (wall time only)" }
        );
        if let Some(gemm) = &info.gemm {
            eprintln!("bench: GEMM {gemm}");
        }
        if let Some(queue) = &info.queue {
            eprintln!("bench: queue {queue}");
        }
        // The sharded jobs first, their engines dropped before the head goes up whole.
        let sharded = match (self.cfg.shards, &self.cfg.devices) {
            (Some(n), Some(devices)) => time_sharded_on_devices(data, self.cfg, self.target, n, devices)?,
            (Some(n), None) => time_sharded(data, self.cfg, self.settings, &backend, n)?,
            (None, _) => Vec::new(),
        };
        let before = backend.memory().current;
        let head = HeadWeights::new(HeadData::F16(&data.head), shape.vocab, shape.hs)
            .map_err(|e| CliError::device("bench head", e))?;
        let order = self.cfg.vocab_order.resolve(data)?;
        let start = Instant::now();
        let mut engine = Engine::with_vocab_order(backend, &head, SliceOptions::default(), order)
            .map_err(|e| CliError::device(format!("uploading the head to {}", info.backend), e))?;
        let upload_ms = start.elapsed().as_secs_f64() * 1e3;
        self.settings.apply(&mut engine);
        let head_bytes = engine.backend().memory().current.saturating_sub(before);
        // Upload kernels (if any were timed) are not part of a job.
        let _ = engine.backend().take_kernel_times();
        // Where the time went: the host's scan, the packing thread, the
        // backend's copies.
        let split = engine.head_upload_times().map_or(String::new(), |t| {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            format!(
                "; check {:.0} ms, alloc {:.0}, waiting for packing {:.0}, copies {:.0}, finish {:.0}",
                ms(t.check),
                ms(t.alloc),
                ms(t.packing_wait),
                ms(t.copies),
                ms(t.finish)
            )
        });
        eprintln!(
            "bench: head uploaded in {upload_ms:.0} ms ({}, {} slice(s), vocabulary order {}{split})",
            fmt_bytes(head_bytes),
            engine.slices().len(),
            if engine.vocab_order().is_some() {
                "given"
            } else {
                "natural"
            }
        );
        let plan = engine
            .loss_plan(
                shape.ntok,
                shape.k,
                false,
                &LossOptions::from(LossConfig {
                    budget_bytes: self.cfg.budget.bytes,
                    ..LossConfig::default()
                }),
            )
            .map_err(|e| CliError::device("bench chunk plan", e))?;
        eprintln!(
            "bench: dx GEMM split {} ({:?} part(s) per slice at {} rows per chunk)",
            engine.dx_split(),
            engine.dx_parts(headkl_core::round_up(plan.rows_per_chunk.min(shape.ntok), ALIGN)),
            plan.rows_per_chunk
        );
        let topk_call = Self::probe(data, self.cfg, &mut engine, confirmed)?;
        let mut jobs = Vec::new();
        let gather = self.cfg.gather.then_some(JobKind::Gather);
        let head_grad = self.cfg.head_grad.then_some(JobKind::HeadGrad);
        let full_vocab = self
            .cfg
            .teacher_hs
            .map(|n| JobKind::FullVocab { teacher_hs: n as usize });
        for job in [JobKind::HeadKl, JobKind::Topk]
            .into_iter()
            .chain(head_grad)
            .chain(gather)
            .chain(full_vocab)
        {
            jobs.push(Self::time_job(data, self.cfg, &mut engine, job, head_bytes, topk_call)?);
        }
        if self.cfg.resident && engine.vocab_order().is_some() {
            eprintln!("bench: --resident left out: the device-resident entry points take no vocabulary order");
        } else {
            jobs.extend(extra(data, self.cfg, &mut engine, head_bytes, topk_call)?);
        }
        jobs.extend(sharded);
        engine.backend().set_profiling(false);
        Ok(Some(BenchRun {
            info,
            shape,
            head_bytes,
            slices: engine.slices().len(),
            upload_ms,
            jobs,
        }))
    }
}

/// The backends to run: `--all` gives every startable one; otherwise the
/// named backend or auto's pick. A bad option or setting fails here.
fn targets(args: &BackendArgs, all: bool, settings: &Arc<Settings>) -> Result<Vec<Result<Target, RunError>>, CliError> {
    if all {
        let args = args.with_settings(settings);
        return BackendKind::ALL
            .iter()
            .map(|&kind| match target_for(kind, args.device, settings) {
                Err(RunError::Job(e)) => Err(e),
                other => Ok(other),
            })
            .collect();
    }
    Ok(vec![Ok(resolve_announced(args, "bench", settings)?)])
}

/// The one shape `--all` runs on every backend without `--shape`: the
/// smallest of their defaults, so the slowest finishes in seconds and every
/// bar compares the same work.
fn common_shape(targets: &[Result<Target, RunError>]) -> Option<Shape> {
    targets
        .iter()
        .filter_map(|t| t.as_ref().ok())
        .filter_map(|t| {
            let infos = enumerate_backend(t.kind, &t.settings).ok()?;
            let info = infos.get(t.device.unwrap_or(0))?;
            Some(Shape::default_for(info, t.kind))
        })
        .min_by(|a, b| a.flops(JobKind::HeadKl).total_cmp(&b.flops(JobKind::HeadKl)))
}

/// The shape one backend runs: `--shape` (or `--all`'s common shape), or
/// its default for the opened device (whose matrix units reflect
/// HEADKL_NO_COOPMAT); `--k` applied.
fn shape_for(cfg: &BenchConfig, info: &DeviceInfo, kind: BackendKind) -> Result<Shape, CliError> {
    let mut shape = cfg.shape.unwrap_or_else(|| Shape::default_for(info, kind));
    if let Some(k) = cfg.k {
        shape.k = k;
    }
    shape.validate().map_err(|e| CliError::option("--k", e))?;
    Ok(shape)
}

/// A backend `--all` cannot start: skipped with why, unless the cause is a
/// bad setting (exit 2) or `HEADKL_REQUIRE` names it.
fn skip_or_fail(kind: BackendKind, why: headkl_core::Error, settings: &Settings) -> Result<(), CliError> {
    if is_validation(&why) || required(kind, settings) {
        return Err(CliError::start(kind.name(), why));
    }
    log::warn!("bench: {kind}: cannot start: {why} (skipped)");
    Ok(())
}

/// Runs `headkl bench`.
pub fn run(args: &BackendArgs, settings: &Arc<Settings>, cfg: &BenchConfig) -> Result<(), CliError> {
    if cfg.iters == 0 {
        return Err(CliError::option("--iters", "must be at least 1"));
    }
    let terms = cfg.loss_terms()?;
    if terms != LossTerms::default() {
        log::info!(
            "bench: head_kl with α_soft {}, α_hard {}{}",
            terms.soft_weight,
            terms.hard_weight,
            if cfg.labels.is_some() { " (random labels)" } else { "" }
        );
    }
    if terms.divergence != Divergence::Forward {
        log::info!(
            "bench: head_kl computes the {} divergence{}",
            terms.divergence.name(),
            match terms.divergence {
                Divergence::Jsd { beta } => format!(" (β {beta})"),
                _ => String::new(),
            }
        );
    }
    let mut runs = Vec::new();
    let mut data: Option<BenchData> = None;
    let targets = targets(args, cfg.all, settings)?;
    let common;
    let cfg = if cfg.all && cfg.shape.is_none() {
        common = BenchConfig {
            shape: common_shape(&targets),
            ..cfg.clone()
        };
        if let Some(shape) = common.shape {
            log::info!(
                "bench: --all runs one shape on every backend: {shape} (the smallest default; --shape picks another)"
            );
        }
        &common
    } else {
        cfg
    };
    for target in targets {
        let target = match target {
            Ok(t) => t,
            Err(RunError::Start(kind, why)) => {
                skip_or_fail(kind, why, settings)?;
                continue;
            }
            Err(RunError::Job(e)) => return Err(e),
        };
        // `--all --resident`: the CPU reference has no device buffers, so it
        // runs its host jobs only (naming `--backend reference` with
        // `--resident` stays an error).
        if cfg.resident && !target.kind.has_device_buffers() {
            if !cfg.all {
                return Err(no_device_buffers("--resident"));
            }
            eprintln!("bench: reference: no device buffers, so its --resident jobs are left out (host jobs only)");
        }
        let job = BenchJob {
            kind: target.kind,
            target: &target,
            settings: &settings.runtime,
            cfg,
            resident: cfg.resident,
            cache: &mut data,
        };
        let result = open_and_run(&target, job);
        match result {
            Ok(Some(run)) => runs.push(run),
            Ok(None) => {}
            Err(RunError::Start(kind, why)) if cfg.all => skip_or_fail(kind, why, settings)?,
            Err(e) => return Err(e.into()),
        }
    }
    if runs.is_empty() {
        return Err(CliError::device(
            "bench",
            headkl_core::Error::NoDevice {
                backend: "bench",
                reason: "no backend could start".into(),
            },
        ));
    }
    print!("{}", render(&runs));
    let report = BenchReport {
        iters: cfg.iters,
        warmup: cfg.warmup,
        divergence: terms.divergence.name().to_string(),
        soft_weight: terms.soft_weight,
        hard_weight: terms.hard_weight,
        teacher_hs: cfg.teacher_hs,
        beta: match terms.divergence {
            Divergence::Jsd { beta } => Some(beta),
            _ => None,
        },
        budget_bytes: cfg.budget.bytes,
        runs,
    };
    if let Some(path) = &cfg.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| CliError::Output {
            file: path.clone(),
            problem: e.to_string(),
        })?;
        write_atomic(path, text.as_bytes())?;
        log::info!("bench: wrote {}", path.display());
    }
    if let Some(path) = &cfg.plot {
        write_atomic(path, crate::plot::svg(&report.runs).as_bytes())?;
        log::info!("bench: wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_teacher_rows_are_distinct() {
        let shape = Shape {
            ntok: 5,
            vocab: 40,
            hs: 8,
            k: 30,
        };
        let d = BenchData::generate(shape, DataKind::Random).unwrap();
        assert_eq!(d.head.len(), 40 * 8);
        assert_eq!(d.teacher.ntok(), 5);
        assert!(d.head.iter().all(|v| v.to_f32().abs() < 0.035));
    }
}
