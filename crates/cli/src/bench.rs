//! `headkl bench`: the cross-backend comparison of `head_kl` and `topk`.
//!
//! For each backend: random f16 data of the shape, the head uploaded once
//! (outside the timing), then per job a warm-up and `iters` timed calls.
//! Reports wall time (median, min–max), GPU time from kernel timestamps
//! where the backend has them, effective TFLOP/s, and peak device memory
//! beyond the head.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use half::f16;
use headkl_core::{
    check_k, Backend, DeviceHidden, DeviceInfo, DeviceLossOptions, DeviceLossOutput, DeviceTeacher, Engine, HeadData,
    HeadWeights, Hidden, HiddenDtype, LossOptions, ResidentBackend, SliceOptions, Teacher, TopkOptions,
};
use serde::Serialize;

use crate::error::CliError;
use crate::io::write_atomic;
use crate::progress::Progress;
use crate::rng::{fill_parallel, XorShift64};
use crate::select::{
    open_and_run, open_and_run_resident, resolve_announced, target_for, BackendArgs, BackendJob, BackendKind,
    ResidentJob, RunError, Target,
};
use crate::text::{fmt_bytes, table};

/// Seed of the benchmark data (fixed, so runs compare).
const DATA_SEED: u64 = 0x5EED_4EAD;

/// Flops above which `--all` leaves out the CPU reference (it would take
/// minutes); naming `--backend reference` still runs it.
const REFERENCE_MAX_FLOPS: f64 = 2e11;

/// A benchmark shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shape {
    /// Tokens.
    pub ntok: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub hs: usize,
    /// Teacher entries per token (and top-k's k).
    pub k: usize,
}

impl Shape {
    /// Shape A of DESIGN §7.
    pub const A: Shape = Shape {
        ntok: 4096,
        vocab: 248_320,
        hs: 5120,
        k: 64,
    };
    /// Shape B of DESIGN §7.
    pub const B: Shape = Shape {
        ntok: 8192,
        vocab: 151_936,
        hs: 4096,
        k: 64,
    };

    /// A size the backend finishes in seconds: the CPU reference and
    /// software Vulkan (a `cpu` device such as lavapipe) get a small one.
    pub fn default_for(info: &DeviceInfo, kind: BackendKind) -> Shape {
        let software = info.device_type.to_ascii_lowercase().contains("cpu");
        let (ntok, vocab, hs, k) = match kind {
            BackendKind::Reference => (64, 4096, 256, 16),
            _ if info.matrix_units => (1024, 65_536, 4096, 64),
            _ if software => (64, 8192, 256, 64),
            _ => (256, 32_768, 1024, 64),
        };
        Shape { ntok, vocab, hs, k }
    }

    /// `4·ntok·V·hs` for head_kl (two GEMMs), half that for topk.
    pub fn flops(&self, job: JobKind) -> f64 {
        let one = 2.0 * self.ntok as f64 * self.vocab as f64 * self.hs as f64;
        match job {
            JobKind::HeadKl => 2.0 * one,
            JobKind::Topk => one,
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}:{}", self.ntok, self.vocab, self.hs, self.k)
    }
}

impl FromStr for Shape {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let shape = match s.trim() {
            "A" | "a" => Shape::A,
            "B" | "b" => Shape::B,
            other => {
                let parts: Vec<&str> = other.split(':').collect();
                let nums: Result<Vec<usize>, _> = parts.iter().map(|p| p.trim().parse::<usize>()).collect();
                match nums.as_deref() {
                    Ok(&[ntok, vocab, hs, k]) => Shape { ntok, vocab, hs, k },
                    _ => return Err(format!("`{s}`: expected A, B or NTOK:V:HS:K (e.g. 256:32768:1024:64)")),
                }
            }
        };
        shape.validate()?;
        Ok(shape)
    }
}

impl Shape {
    fn validate(&self) -> Result<(), String> {
        if self.ntok == 0 || self.vocab == 0 || self.hs == 0 {
            return Err(format!("{self}: ntok, V and hs must be at least 1"));
        }
        check_k(self.k, self.vocab).map_err(|e| format!("{self}: {e}"))
    }
}

/// Which job is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum JobKind {
    /// The loss and its gradient.
    #[serde(rename = "head_kl")]
    HeadKl,
    /// The teacher's top-k.
    #[serde(rename = "topk")]
    Topk,
}

impl JobKind {
    /// The job's name.
    pub fn name(self) -> &'static str {
        match self {
            JobKind::HeadKl => "head_kl",
            JobKind::Topk => "topk",
        }
    }
}

/// Settings of one `headkl bench` run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Shape from `--shape` (with `--k` applied), or `None` for each
    /// backend's default.
    pub shape: Option<Shape>,
    /// `--k`, applied to default shapes too.
    pub k: Option<usize>,
    /// Timed calls per job.
    pub iters: usize,
    /// Untimed calls before them.
    pub warmup: usize,
    /// Scratch budget in bytes.
    pub budget: u64,
    /// `--json` file.
    pub json: Option<PathBuf>,
    /// `--plot` file.
    pub plot: Option<PathBuf>,
    /// `--all`.
    pub all: bool,
    /// `--resident`: also time the device-resident entry points.
    pub resident: bool,
}

/// One kernel's share of a call.
#[derive(Clone, Debug, Serialize)]
pub struct KernelStat {
    /// Kernel name.
    pub kernel: String,
    /// Median over calls of its summed GPU ms per call.
    pub ms: f64,
    /// Dispatches per call.
    pub dispatches: usize,
}

/// One timed job.
#[derive(Clone, Debug, Serialize)]
pub struct JobResult {
    /// Which job.
    pub job: JobKind,
    /// `host` (host slices in and out, the transfers timed) or `resident`
    /// (inputs and outputs already in device buffers; the call and the
    /// trainer's `wait_device` timed).
    pub path: &'static str,
    /// Timed calls.
    pub iters: usize,
    /// Median wall time per call in ms.
    pub median_ms: f64,
    /// Fastest call in ms.
    pub min_ms: f64,
    /// Slowest call in ms.
    pub max_ms: f64,
    /// Median GPU time per call (sum of kernel times) in ms, when the
    /// backend times kernels.
    pub gpu_ms: Option<f64>,
    /// Effective TFLOP/s, from the GPU time when there is one, else wall.
    pub tflops: f64,
    /// What `tflops` was computed from: `gpu` or `wall`.
    pub tflops_from: &'static str,
    /// Effective TFLOP/s from the median wall time.
    pub wall_tflops: f64,
    /// Peak device bytes beyond the head during the job.
    pub peak_extra_bytes: u64,
    /// Per-kernel breakdown (empty without kernel timing).
    pub kernels: Vec<KernelStat>,
}

/// One backend's results.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRun {
    /// Backend.
    pub backend: String,
    /// Device name.
    pub device: String,
    /// Driver.
    pub driver: String,
    /// Device type.
    pub device_type: String,
    /// Whether the GEMM ran on matrix units.
    pub matrix_units: bool,
    /// Which GEMM kernels ran and where the choice came from.
    pub gemm: Option<String>,
    /// The shape.
    pub shape: Shape,
    /// Device bytes the f16 head occupies.
    pub head_bytes: u64,
    /// Vocabulary slices the head was cut into.
    pub slices: usize,
    /// Wall time of the head upload in ms.
    pub upload_ms: f64,
    /// The timed jobs.
    pub jobs: Vec<JobResult>,
}

/// The whole report (`--json`).
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Timed calls per job.
    pub iters: usize,
    /// Untimed calls per job.
    pub warmup: usize,
    /// Scratch budget in bytes.
    pub budget_bytes: u64,
    /// One entry per backend.
    pub runs: Vec<BenchRun>,
}

/// Random data of one shape: f16 head and hidden rows, and a teacher.
struct BenchData {
    shape: Shape,
    head: Vec<f16>,
    hidden: Vec<f16>,
    teacher: Teacher,
}

impl BenchData {
    /// Generates the data on every core. Head values have standard
    /// deviation 0.02 and hidden values 1 (the anchors' scales), so logits
    /// are O(1) as in a real model.
    fn generate(shape: Shape) -> Result<Self, CliError> {
        let start = Instant::now();
        eprintln!(
            "bench: generating {shape} data (head {})",
            fmt_bytes((shape.vocab * shape.hs * 2) as u64)
        );
        let head_a = 0.02 * 3f32.sqrt();
        let mut head = vec![f16::ZERO; shape.vocab * shape.hs];
        fill_parallel(&mut head, DATA_SEED, |r| f16::from_f32(r.symmetric(head_a)));
        let mut hidden = vec![f16::ZERO; shape.ntok * shape.hs];
        fill_parallel(&mut hidden, DATA_SEED + 1, |r| f16::from_f32(r.symmetric(3f32.sqrt())));
        let (ntok, k, vocab) = (shape.ntok, shape.k, shape.vocab);
        let mut ids = vec![0u32; ntok * k];
        let mut probs = vec![0f32; ntok * k];
        let mut rng = XorShift64::new(DATA_SEED + 2);
        for t in 0..ntok {
            let row = &mut ids[t * k..(t + 1) * k];
            let mut q = 0;
            while q < k {
                let id = rng.below(vocab as u64) as u32;
                // k ≤ 2048 and ≤ V: a linear scan is cheap next to the GEMMs.
                if !row[..q].contains(&id) {
                    row[q] = id;
                    q += 1;
                }
            }
            for p in &mut probs[t * k..(t + 1) * k] {
                *p = (3.0 * rng.unit()).exp();
            }
        }
        let teacher = Teacher::new(&ids, &probs, ntok, k, vocab)
            .map_err(|e| CliError::device("generating the benchmark teacher", e))?;
        eprintln!("bench: data ready in {:.1} s", start.elapsed().as_secs_f64());
        Ok(Self {
            shape,
            head,
            hidden,
            teacher,
        })
    }
}

/// The median of sorted values (NaN for none).
pub(crate) fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    }
}

/// `v` in ascending order.
pub(crate) fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Runs both jobs on one backend; the data of the last shape is kept for
/// the next backend.
struct BenchJob<'a> {
    kind: BackendKind,
    cfg: &'a BenchConfig,
    cache: &'a mut Option<BenchData>,
}

impl BenchJob<'_> {
    fn time_job<B: Backend>(
        d: &BenchData,
        cfg: &BenchConfig,
        engine: &mut Engine<B>,
        job: JobKind,
        head_bytes: u64,
    ) -> Result<JobResult, CliError> {
        let shape = d.shape;
        let hidden = Hidden::f16(&d.hidden, shape.ntok, shape.hs).map_err(|e| CliError::device("bench data", e))?;
        let loss_opts = LossOptions {
            budget_bytes: cfg.budget,
            ..LossOptions::default()
        };
        let topk_opts = TopkOptions {
            budget_bytes: cfg.budget,
            ..TopkOptions::new(shape.k)
        };
        // Kept across calls, as a training loop keeps its gradient buffer.
        let mut loss_out = headkl_core::LossOutput::default();
        Self::time_calls(cfg, engine, job, "host", head_bytes, shape, |engine| match job {
            JobKind::HeadKl => engine.head_kl_into(&hidden, &d.teacher, &loss_opts, &mut loss_out),
            JobKind::Topk => engine.topk(&hidden, &topk_opts).map(|_| ()),
        })
    }

    /// Times `cfg.iters` calls of `call` (after `cfg.warmup`), each
    /// followed by the backend's `finish`.
    fn time_calls<B: Backend>(
        cfg: &BenchConfig,
        engine: &mut Engine<B>,
        job: JobKind,
        path: &'static str,
        head_bytes: u64,
        shape: Shape,
        mut call: impl FnMut(&mut Engine<B>) -> headkl_core::Result<()>,
    ) -> Result<JobResult, CliError> {
        // Scratch of the previous job is freed, so the peak is this job's.
        engine.release_scratch();
        engine.backend().reset_peak_memory();
        let label = format!("bench {} {} {path}", engine.backend().info().backend, job.name());
        let mut progress = Progress::new(label, (cfg.warmup + cfg.iters) as u64);
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
            progress.message(what.clone());
            let start = Instant::now();
            let result = call(engine);
            let b = engine.backend();
            result
                .and_then(|()| b.finish())
                .map_err(|e| CliError::device(format!("bench {} {}", b.info().backend, job.name()), e))?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
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
            tflops_from: if gpu_ms.is_some() { "gpu" } else { "wall" },
            wall_tflops: tf(median_ms),
            peak_extra_bytes: peak.saturating_sub(head_bytes),
            kernels,
        })
    }
}

impl BackendJob for BenchJob<'_> {
    type Output = Option<BenchRun>;

    fn run<B: Backend>(self, backend: B) -> Result<Option<BenchRun>, CliError> {
        self.run_with(backend, |_, _, _, _| Ok(Vec::new()))
    }
}

impl ResidentJob for BenchJob<'_> {
    type Output = Option<BenchRun>;

    fn run_resident<B: ResidentBackend>(self, backend: B) -> Result<Option<BenchRun>, CliError> {
        self.run_with(backend, time_resident)
    }
}

/// The device-resident jobs: the bench data uploaded to device buffers once
/// (outside the timing), then `head_kl_device` and `topk_device`, each call
/// timed with the trainer's `wait_device`.
fn time_resident<B: ResidentBackend>(
    d: &BenchData,
    cfg: &BenchConfig,
    engine: &mut Engine<B>,
    head_bytes: u64,
) -> Result<Vec<JobResult>, CliError> {
    let shape = d.shape;
    let (ntok, hs, k) = (shape.ntok, shape.hs, shape.k);
    let fail = |e| CliError::device("bench --resident: device buffers", e);
    let buffer = |engine: &Engine<B>, data: &[u8], label| -> Result<B::Buffer, CliError> {
        let b = engine.backend().alloc(data.len() as u64, label).map_err(fail)?;
        engine.backend().upload(&b, 0, data).map_err(fail)?;
        Ok(b)
    };
    let x = buffer(engine, bytemuck::cast_slice(&d.hidden), "bench x")?;
    let ids = buffer(engine, bytemuck::cast_slice(d.teacher.ids()), "bench ids")?;
    let probs = buffer(engine, bytemuck::cast_slice(d.teacher.probs()), "bench probs")?;
    let loss = buffer(engine, &vec![0u8; ntok * 4], "bench loss")?;
    let dx = buffer(engine, &vec![0u8; ntok * hs * 4], "bench dx")?;
    let top_ids = buffer(engine, &vec![0u8; ntok * k * 4], "bench topk ids")?;
    let top_probs = buffer(engine, &vec![0u8; ntok * k * 4], "bench topk probs")?;
    // The head and these buffers (the trainer's, in a real run) are not
    // counted in the jobs' peak extra memory.
    let held = engine.backend().memory().current.max(head_bytes);
    let hidden = DeviceHidden {
        buffer: &x,
        dtype: HiddenDtype::F16,
    };
    let teacher = DeviceTeacher {
        ids: &ids,
        probs: &probs,
        k,
    };
    let out = DeviceLossOutput { loss: &loss, dx: &dx };
    let loss_opts = DeviceLossOptions {
        budget_bytes: cfg.budget,
        ..DeviceLossOptions::default()
    };
    let topk_opts = TopkOptions {
        budget_bytes: cfg.budget,
        ..TopkOptions::new(k)
    };
    let head_kl = BenchJob::time_calls(cfg, engine, JobKind::HeadKl, "resident", held, shape, |engine| {
        engine.head_kl_device(ntok, &hidden, &teacher, &out, &loss_opts)?;
        engine.wait_device()
    })?;
    let topk = BenchJob::time_calls(cfg, engine, JobKind::Topk, "resident", held, shape, |engine| {
        engine.topk_device(ntok, &hidden, &top_ids, &top_probs, &topk_opts)?;
        engine.wait_device()
    })?;
    Ok(vec![head_kl, topk])
}

impl BenchJob<'_> {
    /// Opens the engine and times the host jobs, then whatever `extra`
    /// times on the same engine.
    fn run_with<B: Backend>(
        self,
        backend: B,
        extra: impl FnOnce(&BenchData, &BenchConfig, &mut Engine<B>, u64) -> Result<Vec<JobResult>, CliError>,
    ) -> Result<Option<BenchRun>, CliError> {
        let info = backend.info().clone();
        let shape = shape_for(self.cfg, &info, self.kind)?;
        if self.cfg.all && self.kind == BackendKind::Reference && shape.flops(JobKind::HeadKl) > REFERENCE_MAX_FLOPS {
            eprintln!(
                "bench: reference: shape {shape} is too large for the CPU backend \
                 (skipped; run it alone with --backend reference)"
            );
            return Ok(None);
        }
        if self.cache.as_ref().is_none_or(|d| d.shape != shape) {
            *self.cache = None; // free the old data before making the new
            *self.cache = Some(BenchData::generate(shape)?);
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
        let before = backend.memory().current;
        let head = HeadWeights::new(HeadData::F16(&data.head), shape.vocab, shape.hs)
            .map_err(|e| CliError::device("bench head", e))?;
        let start = Instant::now();
        let mut engine = Engine::new(backend, &head, SliceOptions::default())
            .map_err(|e| CliError::device(format!("uploading the head to {}", info.backend), e))?;
        let upload_ms = start.elapsed().as_secs_f64() * 1e3;
        let head_bytes = engine.backend().memory().current.saturating_sub(before);
        // Upload kernels (if any were timed) are not part of a job.
        let _ = engine.backend().take_kernel_times();
        eprintln!(
            "bench: head uploaded in {upload_ms:.0} ms ({}, {} slice(s))",
            fmt_bytes(head_bytes),
            engine.slices().len()
        );
        let mut jobs = Vec::new();
        for job in [JobKind::HeadKl, JobKind::Topk] {
            jobs.push(Self::time_job(data, self.cfg, &mut engine, job, head_bytes)?);
        }
        jobs.extend(extra(data, self.cfg, &mut engine, head_bytes)?);
        engine.backend().set_profiling(false);
        Ok(Some(BenchRun {
            backend: info.backend.to_string(),
            device: info.device_name.clone(),
            driver: info.driver.clone(),
            device_type: info.device_type.clone(),
            matrix_units: info.matrix_units,
            gemm: info.gemm.clone(),
            shape,
            head_bytes,
            slices: engine.slices().len(),
            upload_ms,
            jobs,
        }))
    }
}

/// The backends to run: `--all` gives every startable one; otherwise the
/// named backend or auto's pick.
fn targets(args: &BackendArgs, all: bool) -> Vec<Result<Target, (BackendKind, String)>> {
    if all {
        return BackendKind::ALL
            .iter()
            .map(|&kind| target_for(kind, args.device).map_err(|why| (kind, why)))
            .collect();
    }
    vec![Ok(resolve_announced(args, "bench"))]
}

/// The shape one backend runs: `--shape`, or its default for the opened
/// device (whose matrix units reflect HEADKL_NO_COOPMAT); `--k` applied.
fn shape_for(cfg: &BenchConfig, info: &DeviceInfo, kind: BackendKind) -> Result<Shape, CliError> {
    let mut shape = cfg.shape.unwrap_or_else(|| Shape::default_for(info, kind));
    if let Some(k) = cfg.k {
        shape.k = k;
    }
    shape.validate().map_err(|e| CliError::option("--k", e))?;
    Ok(shape)
}

fn fmt_tflops(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.1}")
    } else if v >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

fn fmt_ms(ms: f64) -> String {
    if ms >= 100.0 {
        format!("{ms:.0}")
    } else if ms >= 10.0 {
        format!("{ms:.1}")
    } else {
        format!("{ms:.2}")
    }
}

/// The results table.
pub fn render(runs: &[BenchRun]) -> String {
    let mut rows = Vec::new();
    for r in runs {
        for j in &r.jobs {
            rows.push(vec![
                r.backend.clone(),
                r.device.clone(),
                if r.matrix_units { "on" } else { "off" }.into(),
                r.shape.to_string(),
                if j.path == "host" {
                    j.job.name().to_string()
                } else {
                    format!("{} ({})", j.job.name(), j.path)
                },
                fmt_ms(j.median_ms),
                format!("{}–{}", fmt_ms(j.min_ms), fmt_ms(j.max_ms)),
                j.gpu_ms.map(fmt_ms).unwrap_or_else(|| "-".into()),
                format!("{} ({})", fmt_tflops(j.tflops), j.tflops_from),
                fmt_bytes(j.peak_extra_bytes),
                fmt_bytes(r.head_bytes),
            ]);
        }
    }
    let mut out = table(
        &[
            "backend",
            "device",
            "matrix units",
            "shape ntok:V:hs:k",
            "job",
            "median ms",
            "min–max ms",
            "GPU ms",
            "TFLOP/s",
            "peak extra",
            "head",
        ],
        &rows,
    );
    for r in runs {
        for j in r.jobs.iter().filter(|j| !j.kernels.is_empty()) {
            let parts: Vec<String> = j
                .kernels
                .iter()
                .map(|k| format!("{} {} ms ×{}", k.kernel, fmt_ms(k.ms), k.dispatches))
                .collect();
            out.push_str(&format!(
                "{} {} {}: {}\n",
                r.backend,
                j.job.name(),
                j.path,
                parts.join(", ")
            ));
        }
    }
    out
}

/// Runs `headkl bench`.
pub fn run(args: &BackendArgs, cfg: &BenchConfig) -> Result<(), CliError> {
    if cfg.iters == 0 {
        return Err(CliError::option("--iters", "must be at least 1"));
    }
    let mut runs = Vec::new();
    let mut data: Option<BenchData> = None;
    for target in targets(args, cfg.all) {
        let target = match target {
            Ok(t) => t,
            Err((kind, why)) => {
                eprintln!("bench: {kind}: cannot start: {why} (skipped)");
                continue;
            }
        };
        let job = BenchJob {
            kind: target.kind,
            cfg,
            cache: &mut data,
        };
        let result = if cfg.resident {
            open_and_run_resident(&target, job)
        } else {
            open_and_run(&target, job)
        };
        match result {
            Ok(Some(run)) => runs.push(run),
            Ok(None) => {}
            Err(RunError::Start(kind, why)) if cfg.all => eprintln!("bench: {kind}: cannot start: {why} (skipped)"),
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
        budget_bytes: cfg.budget,
        runs,
    };
    if let Some(path) = &cfg.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| CliError::Output {
            file: path.clone(),
            problem: e.to_string(),
        })?;
        write_atomic(path, text.as_bytes())?;
        eprintln!("bench: wrote {}", path.display());
    }
    if let Some(path) = &cfg.plot {
        write_atomic(path, crate::plot::svg(&report.runs).as_bytes())?;
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse() {
        assert_eq!("A".parse::<Shape>(), Ok(Shape::A));
        assert_eq!("b".parse::<Shape>(), Ok(Shape::B));
        assert_eq!(
            "64:4096:256:16".parse::<Shape>(),
            Ok(Shape {
                ntok: 64,
                vocab: 4096,
                hs: 256,
                k: 16
            })
        );
        assert!("64:4096:256".parse::<Shape>().is_err());
        assert!("64:100:256:200".parse::<Shape>().is_err(), "k > V");
        assert!("0:100:256:2".parse::<Shape>().is_err());
        assert_eq!(Shape::A.flops(JobKind::HeadKl), 4.0 * 4096.0 * 248_320.0 * 5120.0);
        assert_eq!(Shape::A.flops(JobKind::Topk) * 2.0, Shape::A.flops(JobKind::HeadKl));
    }

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
    }

    #[test]
    fn generated_teacher_rows_are_distinct() {
        let shape = Shape {
            ntok: 5,
            vocab: 40,
            hs: 8,
            k: 30,
        };
        let d = BenchData::generate(shape).unwrap();
        assert_eq!(d.head.len(), 40 * 8);
        assert_eq!(d.teacher.ntok(), 5);
        assert!(d.head.iter().all(|v| v.to_f32().abs() < 0.035));
    }
}
