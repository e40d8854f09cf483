//! `headkl soak`: one engine called many times on one backend, through the
//! host path (`head_kl_into`, outputs kept from call to call) and then the
//! device-resident path (`head_kl_device` on device buffers, a wait per
//! call), with every call's loss and dx bit-identical to the first call's
//! and the device memory the backend holds and the process's host memory
//! flat after warm-up; then engines on threads, each of whose answers must
//! equal one engine's bit for bit.

use std::sync::Arc;
use std::time::Instant;

use headkl_core::{
    Backend, DeviceLossOptions, Engine, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, LossOutput,
    ResidentBackend, SliceOptions,
};

use crate::bench::{BenchData, DataKind, Shape, ShapeCost};
use crate::environment::Settings;
use crate::error::{join_in_order, CliError};
use crate::progress::Progress;
use crate::select::{self, no_device_buffers, BackendArgs, BackendKind, Job};
use crate::text::fmt_bytes;

/// Host memory a soak may gain after warm-up: allocator noise, where a
/// leak of one call's outputs would be megabytes a call.
const HOST_SLACK_BYTES: u64 = 16 << 20;

/// What `headkl soak` runs: its command-line options.
#[derive(clap::Args, Clone, Debug)]
pub struct SoakConfig {
    /// A, B, S, M or NTOK:V:HS:K (default: the backend's bench default)
    #[arg(long, value_parser = crate::parse_shape)]
    pub shape: Option<Shape>,
    /// Calls per path
    #[arg(long, default_value_t = 1000)]
    pub calls: usize,
    /// Calls before memory is first read (the scratch is sized by then)
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Engines on threads after the two paths (0: none)
    #[arg(long, default_value_t = 3)]
    pub threads: usize,
    /// Calls each thread's engine makes
    #[arg(long, default_value_t = 20)]
    pub thread_calls: usize,
    #[command(flatten)]
    pub budget: crate::options::BudgetArg,
}

/// One path's figures.
#[derive(Clone, Debug)]
struct PathReport {
    path: &'static str,
    calls: usize,
    secs: f64,
    /// Device bytes the backend held after warm-up, at the end, and at most
    /// at any read in between.
    device: (u64, u64, u64),
    /// The process's resident host bytes, likewise.
    host: (u64, u64, u64),
    /// The first call whose results differed from the first call's.
    differed: Option<(usize, &'static str)>,
}

impl PathReport {
    fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some((call, what)) = self.differed {
            out.push(format!(
                "{}: call {call}: {what} differs from the first call's",
                self.path
            ));
        }
        if self.device.2 != self.device.0 {
            out.push(format!(
                "{}: device memory grew after warm-up: {} → at most {}",
                self.path,
                fmt_bytes(self.device.0),
                fmt_bytes(self.device.2)
            ));
        }
        if self.host.2 > self.host.0 + HOST_SLACK_BYTES {
            out.push(format!(
                "{}: host memory grew after warm-up by more than {}: {} → at most {}",
                self.path,
                fmt_bytes(HOST_SLACK_BYTES),
                fmt_bytes(self.host.0),
                fmt_bytes(self.host.2)
            ));
        }
        out
    }

    fn line(&self) -> String {
        format!(
            "soak: {:<9} {:>6} calls in {:>7.1} s ({:.1} ms a call): device {} → {} (max {}), host RSS {} → {} (max {}), results {}",
            self.path,
            self.calls,
            self.secs,
            1e3 * self.secs / self.calls.max(1) as f64,
            fmt_bytes(self.device.0),
            fmt_bytes(self.device.1),
            fmt_bytes(self.device.2),
            fmt_bytes(self.host.0),
            fmt_bytes(self.host.1),
            fmt_bytes(self.host.2),
            if self.differed.is_none() { "bit-identical" } else { "DIFFER" }
        )
    }
}

/// Resident host memory of this process, from `/proc/self/statm` (0 where
/// there is none).
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4096)
}

fn bits(v: &[f32]) -> &[u32] {
    bytemuck::cast_slice(v)
}

/// Memory readings after warm-up: first, last, largest.
struct Meter {
    device: (u64, u64, u64),
    host: (u64, u64, u64),
    started: bool,
}

impl Meter {
    fn new() -> Self {
        Self {
            device: (0, 0, 0),
            host: (0, 0, 0),
            started: false,
        }
    }

    fn read<B: Backend>(&mut self, backend: &B) {
        let (d, h) = (backend.memory().current, resident_bytes());
        if !self.started {
            self.device = (d, d, d);
            self.host = (h, h, h);
            self.started = true;
            return;
        }
        self.device = (self.device.0, d, self.device.2.max(d));
        self.host = (self.host.0, h, self.host.2.max(h));
    }
}

/// One path's bookkeeping over its calls: the first call's results, the
/// first call that differed from them, and the memory readings.
struct Tracker {
    warmup: usize,
    first: Option<(Vec<f32>, Vec<f32>)>,
    differed: Option<(usize, &'static str)>,
    meter: Meter,
}

impl Tracker {
    fn new(warmup: usize) -> Self {
        Self {
            warmup,
            first: None,
            differed: None,
            meter: Meter::new(),
        }
    }

    /// Call `call`'s loss and dx (`None`: dx not read this call) against
    /// the first call's; the memory read after warm-up and every
    /// [`READ_EVERY`] calls.
    fn after_call<B: Backend>(&mut self, call: usize, loss: &[f32], dx: Option<&[f32]>, backend: &B) {
        match &self.first {
            None => self.first = Some((loss.to_vec(), dx.unwrap_or_default().to_vec())),
            Some((l, g)) if self.differed.is_none() => {
                if bits(loss) != bits(l) {
                    self.differed = Some((call, "the loss"));
                } else if dx.is_some_and(|dx| bits(dx) != bits(g)) {
                    self.differed = Some((call, "dx"));
                }
            }
            Some(_) => {}
        }
        if call + 1 == self.warmup || (call >= self.warmup && call.is_multiple_of(READ_EVERY)) {
            self.meter.read(backend);
        }
    }

    /// The path's report, with the memory read once more at its end.
    fn report<B: Backend>(mut self, path: &'static str, calls: usize, secs: f64, backend: &B) -> PathReport {
        self.meter.read(backend);
        PathReport {
            path,
            calls,
            secs,
            device: self.meter.device,
            host: self.meter.host,
            differed: self.differed,
        }
    }
}

struct SoakJob<'a> {
    cfg: &'a SoakConfig,
    kind: BackendKind,
}

/// Memory is read every this many calls (and after the last).
const READ_EVERY: usize = 100;

/// A soak with its data made.
struct Soak<'a> {
    cfg: &'a SoakConfig,
    data: &'a BenchData,
}

impl Soak<'_> {
    fn fail(what: &'static str) -> impl Fn(headkl_core::Error) -> CliError {
        move |e| CliError::device(format!("soak: {what}"), e)
    }

    /// The host path: `head_kl_into` with one kept output.
    fn host_path<B: Backend>(&self, engine: &mut Engine<B>, progress: &mut Progress) -> Result<PathReport, CliError> {
        let d = self.data;
        let shape = d.shape;
        let hidden = Hidden::f16(&d.hidden, shape.ntok, shape.hs).map_err(Self::fail("hidden rows"))?;
        let opts = LossOptions::from(LossConfig {
            budget_bytes: self.cfg.budget.bytes,
            ..LossConfig::default()
        });
        let mut out = LossOutput::default();
        let mut tracker = Tracker::new(self.cfg.warmup);
        let start = Instant::now();
        for call in 0..self.cfg.calls {
            engine
                .head_kl_into(&hidden, &d.teacher, &opts, &mut out)
                .map_err(Self::fail("host-path call"))?;
            tracker.after_call(call, &out.loss, Some(&out.dx), engine.backend());
            progress.inc_by(1);
        }
        let secs = start.elapsed().as_secs_f64();
        Ok(tracker.report("host", self.cfg.calls, secs, engine.backend()))
    }

    /// The device-resident path: inputs in device buffers, a wait a call;
    /// the loss read back every call, dx every [`READ_EVERY`] calls and
    /// after the last.
    fn resident_path<B: ResidentBackend>(
        &self,
        engine: &mut Engine<B>,
        progress: &mut Progress,
    ) -> Result<PathReport, CliError> {
        let d = self.data;
        let shape = d.shape;
        let (ntok, hs, k) = (shape.ntok, shape.hs, shape.k);
        let buffers = d
            .upload_loss_buffers(
                engine.backend(),
                ["soak x", "soak ids", "soak probs", "soak loss", "soak dx"],
            )
            .map_err(Self::fail("device buffers"))?;
        let (hidden, teacher, out) = buffers.views(k);
        let opts = DeviceLossOptions::from(LossConfig {
            budget_bytes: self.cfg.budget.bytes,
            ..LossConfig::default()
        });
        let (mut got_loss, mut got_dx) = (vec![0f32; ntok], vec![0f32; ntok * hs]);
        let mut tracker = Tracker::new(self.cfg.warmup);
        let start = Instant::now();
        let calls = self.cfg.calls;
        for call in 0..calls {
            engine
                .head_kl_device(ntok, &hidden, &teacher, &out, &opts)
                .map_err(Self::fail("resident call"))?;
            engine.wait_device().map_err(Self::fail("resident call's wait"))?;
            let backend = engine.backend();
            backend
                .download(&buffers.loss, 0, bytemuck::cast_slice_mut(&mut got_loss))
                .map_err(Self::fail("reading the loss"))?;
            let read_dx = call.is_multiple_of(READ_EVERY) || call + 1 == calls;
            if read_dx {
                backend
                    .download(&buffers.dx, 0, bytemuck::cast_slice_mut(&mut got_dx))
                    .map_err(Self::fail("reading dx"))?;
            }
            tracker.after_call(call, &got_loss, read_dx.then_some(got_dx.as_slice()), backend);
            progress.inc_by(1);
        }
        let secs = start.elapsed().as_secs_f64();
        Ok(tracker.report("resident", calls, secs, engine.backend()))
    }

    /// `threads` engines on threads, each making `thread_calls` calls at
    /// once with the others: each answer against `alone` (one engine's).
    fn threads<B: Backend + Sync>(&self, backend: &B, alone: &LossOutput) -> Result<Vec<String>, CliError> {
        let d = self.data;
        let shape = d.shape;
        let head = HeadWeights::new(HeadData::F16(&d.head), shape.vocab, shape.hs).map_err(Self::fail("the head"))?;
        let hidden = Hidden::f16(&d.hidden, shape.ntok, shape.hs).map_err(Self::fail("hidden rows"))?;
        let opts = LossOptions::from(LossConfig {
            budget_bytes: self.cfg.budget.bytes,
            ..LossConfig::default()
        });
        let results: Vec<Result<Vec<String>, CliError>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..self.cfg.threads)
                .map(|t| {
                    let (head, hidden, opts) = (&head, &hidden, &opts);
                    s.spawn(move || -> Result<Vec<String>, CliError> {
                        let mut engine = Engine::new(backend, head, SliceOptions::default())
                            .map_err(Self::fail("a thread's engine"))?;
                        let mut out = LossOutput::default();
                        let mut problems = Vec::new();
                        for call in 0..self.cfg.thread_calls {
                            engine
                                .head_kl_into(hidden, &d.teacher, opts, &mut out)
                                .map_err(Self::fail("a thread's call"))?;
                            if bits(&out.loss) != bits(&alone.loss) || bits(&out.dx) != bits(&alone.dx) {
                                problems.push(format!("thread {t} call {call}: differs from one engine's answer"));
                                break;
                            }
                        }
                        Ok(problems)
                    })
                })
                .collect();
            join_in_order(workers, |t| format!("soak thread {t}"))
        });
        let mut problems = Vec::new();
        for r in results {
            problems.extend(r?);
        }
        Ok(problems)
    }
}

impl Job for SoakJob<'_> {
    type Output = Result<Vec<String>, CliError>;

    fn run<B: Backend>(self, _: B) -> Self::Output {
        Err(no_device_buffers("--backend"))
    }

    fn run_resident<B: ResidentBackend + Sync>(self, backend: B) -> Result<Vec<String>, CliError> {
        let info = backend.info().clone();
        let shape = self.cfg.shape.unwrap_or_else(|| Shape::default_for(&info, self.kind));
        let data = BenchData::generate(shape, DataKind::Random)?;
        Soak {
            cfg: self.cfg,
            data: &data,
        }
        .run(&backend)
    }
}

impl Soak<'_> {
    fn run<B: ResidentBackend + Sync>(&self, backend: &B) -> Result<Vec<String>, CliError> {
        let d = self.data;
        let shape = d.shape;
        let info = backend.info().clone();
        eprintln!(
            "soak: {} on {}, shape {shape}, {} calls a path (memory read after {} and every {READ_EVERY}), {} threads × {} calls",
            info.backend, info.device_name, self.cfg.calls, self.cfg.warmup, self.cfg.threads, self.cfg.thread_calls
        );
        let head = HeadWeights::new(HeadData::F16(&d.head), shape.vocab, shape.hs).map_err(Self::fail("the head"))?;
        let mut problems = Vec::new();
        let alone = {
            let mut engine = Engine::new(backend, &head, SliceOptions::default()).map_err(Self::fail("the engine"))?;
            let total = 2 * self.cfg.calls as u64;
            let mut progress = Progress::new(format!("soak {}", info.backend), total);
            let host = self.host_path(&mut engine, &mut progress)?;
            progress.println(host.line());
            problems.extend(host.problems());
            let resident = self.resident_path(&mut engine, &mut progress)?;
            progress.println(resident.line());
            problems.extend(resident.problems());
            progress.finish();
            let mut out = LossOutput::default();
            let opts = LossOptions::from(LossConfig {
                budget_bytes: self.cfg.budget.bytes,
                ..LossConfig::default()
            });
            let hidden = Hidden::f16(&d.hidden, shape.ntok, shape.hs).map_err(Self::fail("hidden rows"))?;
            engine
                .head_kl_into(&hidden, &d.teacher, &opts, &mut out)
                .map_err(Self::fail("one engine's answer"))?;
            out
        };
        if self.cfg.threads > 0 {
            let start = Instant::now();
            let found = self.threads(backend, &alone)?;
            eprintln!(
                "soak: threads   {} engines × {} calls in {:.1} s: {}",
                self.cfg.threads,
                self.cfg.thread_calls,
                start.elapsed().as_secs_f64(),
                if found.is_empty() {
                    "every answer bit-identical to one engine's"
                } else {
                    "DIFFER"
                }
            );
            problems.extend(found);
        }
        Ok(problems)
    }
}

/// `headkl soak` on the backend `args` names (auto: the best GPU).
pub fn run(args: &BackendArgs, settings: &Arc<Settings>, cfg: &SoakConfig) -> Result<(), CliError> {
    if cfg.calls == 0 {
        return Err(CliError::option("--calls", "must be at least 1"));
    }
    if cfg.warmup == 0 || cfg.warmup >= cfg.calls {
        return Err(CliError::option(
            "--warmup",
            format!(
                "must be at least 1 and below --calls ({}), not {}",
                cfg.calls, cfg.warmup
            ),
        ));
    }
    if cfg.threads > 0 && cfg.thread_calls == 0 {
        return Err(CliError::option("--thread-calls", "must be at least 1 with --threads"));
    }
    let target = select::resolve_announced(args, "soak", settings)?;
    if target.kind == BackendKind::Reference {
        return Err(CliError::option(
            "--backend",
            "soak runs the device-resident path, which the reference backend has not (name vulkan or wgpu)",
        ));
    }
    let problems = select::open_and_run(&target, SoakJob { cfg, kind: target.kind })?;
    if problems.is_empty() {
        println!("soak: passed");
        return Ok(());
    }
    for p in &problems {
        eprintln!("soak: {p}");
    }
    Err(CliError::CheckFailed(format!(
        "soak failed: {} problem(s)",
        problems.len()
    )))
}
