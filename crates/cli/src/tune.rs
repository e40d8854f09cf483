//! `headkl tune`: times every matrix-unit GEMM kernel (the WGSL kernels and
//! the GLSL tiles, `CoopGemm::candidates`) on one device at the
//! GEMM shapes head_kl runs (the logits `x·Wᵀ` and the input gradient
//! `g·W`), checks each against the reference on the conformance suite's
//! kernel cases, and records the fastest correct one per layout in the tune
//! cache, keyed by backend, device and driver.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use half::f16;
use headkl_conformance::{Part, SuiteConfig};
use headkl_core::toolkit::gemm_choice::GEMM_ENV;
use headkl_core::toolkit::tune_cache::TuneCache;
use headkl_core::toolkit::{
    CoopGemm, GemmDesc, GemmRowStats, HeadLayout, KernelId, Kernels, RowStats, STATS_GROUP_COLS,
};
use headkl_core::{Backend, GemmChoice};

use crate::environment::Settings;
use crate::error::CliError;
use crate::progress::Progress;
use crate::select::{self, BackendArgs, BackendKind, Job, RunError, Target};
use crate::text::table;
use headkl_reference::rng::fill_parallel;

/// The GEMM shape tuned at: `m` token rows, `n` vocabulary rows, `k` hidden
/// size. The logits GEMM is `[m][k] · [n][k]ᵀ`; the dx GEMM `[m][n] · [n][k]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    /// Token rows.
    pub m: usize,
    /// Vocabulary rows of the head.
    pub n: usize,
    /// Hidden size.
    pub k: usize,
}

impl GemmShape {
    /// The "GEMM alone" shape: shape A's hidden size, half its
    /// vocabulary, 4096 tokens (4.4 GB of device memory).
    pub const LARGE: GemmShape = GemmShape {
        m: 4096,
        n: 124_160,
        k: 5120,
    };
    /// For devices with less than 16 GiB (0.6 GB).
    pub const SMALL: GemmShape = GemmShape {
        m: 1024,
        n: 32_768,
        k: 4096,
    };

    fn flops(self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    fn device_bytes(self) -> u64 {
        let (m, n, k) = (self.m as u64, self.n as u64, self.k as u64);
        // x and dx, the head, the logits (f32) and the f16 gradient.
        m * k * 2 + m * k * 4 + n * k * 2 + m * n * 4 + m * n * 2
    }
}

impl fmt::Display for GemmShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.m, self.n, self.k)
    }
}

impl FromStr for GemmShape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let [m, n, k] = parts.as_slice() else {
            return Err(format!("`{s}`: expected M:N:K (tokens:vocab:hidden)"));
        };
        let num = |name: &str, v: &str| -> Result<usize, String> {
            match v.trim().parse::<usize>() {
                Ok(x) if x > 0 && x % headkl_core::ALIGN == 0 => Ok(x),
                Ok(x) => Err(format!("`{s}`: {name} = {x} must be a positive multiple of 16")),
                Err(e) => Err(format!("`{s}`: {name}: {e}")),
            }
        };
        Ok(GemmShape {
            m: num("M", m)?,
            n: num("N", n)?,
            k: num("K", k)?,
        })
    }
}

/// What `headkl tune` was asked: its command-line options.
#[derive(clap::Args, Clone, Debug)]
pub struct TuneConfig {
    /// M:N:K = tokens:vocab:hidden (default: by device memory, see above)
    #[arg(long)]
    pub shape: Option<GemmShape>,
    /// Timed GEMMs per kernel and layout
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Only these kernels, comma-separated (e.g. direct,staged:bk32:r2:s2,glsl:bm128.bk64.s1)
    #[arg(long, value_delimiter = ',', value_parser = crate::parse_kernel)]
    pub kernels: Option<Vec<CoopGemm>>,
    /// Print the result without writing the tune cache
    #[arg(long)]
    pub no_save: bool,
    /// Instead of tuning: the ceiling report (Vulkan): the matrix-unit
    /// GEMM taken apart, each part as TFLOP/s and % of multiply-adds
    /// from registers, plus timings of operand layouts headkl does not
    /// use (marked "timing only"). Needs a build with the report's
    /// kernels: `cargo build --release -p headkl-cli --features ceiling`
    #[arg(long)]
    pub ceiling: bool,
}

/// Rows a timed GEMM takes at a time: the host path's chunk at shape A
/// under the default budget, so a kernel's per-GEMM cost (the bulk PTX
/// tiles pack the head each GEMM) counts as often as in a call.
const TUNE_CHUNK_ROWS: usize = 1024;

/// One kernel's measurements.
#[derive(Clone, Debug)]
struct Trial {
    kernel: CoopGemm,
    /// Kernel cases passed / run, or why the kernel could not run.
    outcome: Result<(usize, usize), String>,
    /// Mean GPU ms a round of the logits and dx GEMMs.
    logits_ms: Option<f64>,
    dx_ms: Option<f64>,
}

impl Trial {
    fn correct(&self) -> bool {
        matches!(self.outcome, Ok((passed, run)) if passed == run)
    }
}

/// The host data every trial uploads.
pub(crate) struct TuneData {
    shape: GemmShape,
    /// x `[m][k]`.
    pub(crate) hidden: Vec<f16>,
    /// The head `[n][k]`; its first `m·n` elements also serve as the f16
    /// gradient `[m][n]`.
    pub(crate) head: Vec<f16>,
}

impl TuneData {
    pub(crate) fn new(shape: GemmShape) -> Self {
        let mut hidden = vec![f16::ZERO; shape.m * shape.k];
        let mut head = vec![f16::ZERO; (shape.n * shape.k).max(shape.m * shape.n)];
        fill_parallel(&mut hidden, 0x7475_6e65_0001, |r| f16::from_f32(r.symmetric(1.0)));
        fill_parallel(&mut head, 0x7475_6e65_0002, |r| f16::from_f32(r.symmetric(1.0)));
        Self { shape, hidden, head }
    }

    /// Uploads x, the head and the gradient into `backend`'s buffers of
    /// their sizes.
    pub(crate) fn upload<B: Backend>(
        &self,
        backend: &B,
        x: &B::Buffer,
        head: &B::Buffer,
        grad: &B::Buffer,
    ) -> headkl_core::Result<()> {
        let GemmShape { m, n, k } = self.shape;
        backend.upload(x, 0, bytemuck::cast_slice(&self.hidden))?;
        backend.upload(head, 0, bytemuck::cast_slice(&self.head[..n * k]))?;
        backend.upload(grad, 0, bytemuck::cast_slice(&self.head[..m * n]))
    }
}

/// Times one kernel (both layouts) on an opened backend.
struct TrialJob<'a> {
    data: &'a TuneData,
    iters: usize,
}

impl Job for TrialJob<'_> {
    type Output = Result<(Result<(usize, usize), String>, Option<f64>, Option<f64>), CliError>;

    fn run<B: Backend>(self, backend: B) -> Self::Output {
        if !backend.info().matrix_units {
            return Err(CliError::option(
                "--backend",
                format!(
                    "{} runs the tiled GEMM here: nothing to tune",
                    backend.info().device_name
                ),
            ));
        }
        let cfg = SuiteConfig { cases: 0, seed: 0 };
        let report = headkl_conformance::run_part(&backend, Part::Kernels, &cfg, &mut |_| {});
        let outcome = match report.failures.first() {
            None => Ok((report.passed, report.cases)),
            Some(f) => Err(format!(
                "{}/{} kernel cases passed; first failure {}: {}",
                report.passed, report.cases, f.name, f.message
            )),
        };
        if outcome.is_err() {
            return Ok((outcome, None, None));
        }
        let timed = backend.set_profiling(true);
        if !timed {
            return Err(CliError::option(
                "--backend",
                "this backend has no kernel timestamps: nothing to tune by",
            ));
        }
        let dev = |e| CliError::device("tune", e);
        let GemmShape { m, n, k } = self.data.shape;
        let x = backend.alloc((m * k * 2) as u64, "tune x").map_err(dev)?;
        let head = backend.alloc((n * k * 2) as u64, "tune head").map_err(dev)?;
        let grad = backend.alloc((m * n * 2) as u64, "tune grad").map_err(dev)?;
        // The logits GEMM as head_kl runs it: with the row statistics
        // (after C), whose epilogue is part of its cost.
        let groups = n.div_ceil(STATS_GROUP_COLS);
        let row_stats = GemmRowStats {
            at: RowStats {
                offset: m * n,
                ld: groups.div_ceil(2) * 2,
                groups,
            },
            first_group: 0,
            cols: n,
        };
        let stats_floats = m * row_stats.at.ld * 2;
        let logits = backend
            .alloc(((m * n + stats_floats) * 4) as u64, "tune logits")
            .map_err(dev)?;
        let dx = backend.alloc((m * k * 4) as u64, "tune dx").map_err(dev)?;
        let data = self.data;
        data.upload(&backend, &x, &head, &grad).map_err(dev)?;
        // Each GEMM as the calls run it: in chunks of rows against the one
        // head (a kernel that prepares the head per GEMM pays it per chunk).
        let chunks: Vec<(GemmDesc, GemmDesc)> = (0..m)
            .step_by(TUNE_CHUNK_ROWS)
            .map(|start| {
                let rows = TUNE_CHUNK_ROWS.min(m - start);
                let logits = GemmDesc {
                    a_offset: start * k,
                    c_offset: start * n,
                    row_stats: Some(GemmRowStats {
                        at: RowStats {
                            offset: m * n + start * row_stats.at.ld * 2,
                            ..row_stats.at
                        },
                        ..row_stats
                    }),
                    ..GemmDesc::dense(rows, n, k, HeadLayout::Logits)
                };
                let dx = GemmDesc {
                    a_offset: start * n,
                    c_offset: start * k,
                    ..GemmDesc::dense(rows, k, n, HeadLayout::Dx)
                };
                (logits, dx)
            })
            .collect();
        // One untimed call each builds the pipelines and warms the clocks.
        for timed_round in [false, true] {
            let rounds = if timed_round { self.iters } else { 1 };
            for _ in 0..rounds {
                for (logits_desc, dx_desc) in &chunks {
                    backend.gemm(&x, &head, &logits, logits_desc).map_err(dev)?;
                    backend.gemm(&grad, &head, &dx, dx_desc).map_err(dev)?;
                }
            }
            backend.finish().map_err(dev)?;
            if !timed_round {
                backend.take_kernel_times().map_err(dev)?;
            }
        }
        let times = backend.take_kernel_times().map_err(dev)?;
        backend.set_profiling(false);
        // A GEMM's time a round: its launches' and, for the bulk PTX
        // tiles, their packs' (several of each a GEMM), over the rounds.
        let per_round = |kernel: KernelId| {
            let v: Vec<f64> = times
                .iter()
                .filter(|t| t.kernel == kernel.name() || t.kernel == kernel.pack_label())
                .map(|t| t.ms)
                .collect();
            (!v.is_empty()).then(|| v.iter().sum::<f64>() / self.iters as f64)
        };
        Ok((outcome, per_round(KernelId::GemmLogits), per_round(KernelId::GemmDx)))
    }
}

/// Reads the device's name, driver and memory.
struct InfoJob;

impl Job for InfoJob {
    type Output = Result<headkl_core::DeviceInfo, CliError>;
    fn run<B: Backend>(self, backend: B) -> Self::Output {
        Ok(backend.info().clone())
    }
}

/// Runs `headkl tune`.
pub fn run(args: &BackendArgs, settings: &Arc<Settings>, cfg: &TuneConfig) -> Result<(), CliError> {
    let target = select::resolve_announced(args, "tune", settings)?;
    check_target(&target, cfg)?;
    let info = select::open_and_run_gemm(&target, None, InfoJob)?;
    let shape = tune_shape(&target, &info, cfg)?;
    if cfg.ceiling {
        return crate::ceiling::run(&target, shape, cfg.iters);
    }
    let kernels = cfg.kernels.clone().unwrap_or_else(CoopGemm::candidates);
    eprintln!(
        "tune: {} on {} (driver {}): {} kernels at m:n:k = {shape} ({:.1} GFLOP per GEMM, in chunks of {TUNE_CHUNK_ROWS} rows, the logits with its row statistics), mean of {}",
        target.kind,
        info.device_name,
        info.driver,
        kernels.len(),
        shape.flops() / 1e9,
        cfg.iters
    );
    let start = Instant::now();
    let data = TuneData::new(shape);
    log::info!("tune: data ready in {:.1} s", start.elapsed().as_secs_f64());

    let trials = time_kernels(&target, &data, &kernels, cfg.iters);
    print_trials(&target, &info, shape, cfg.iters, &trials);
    let choice = best_choice(&target, shape, &trials)?;
    if !cfg.no_save {
        save(&target, &info, choice)?;
    }
    Ok(())
}

/// Refuses what `tune` cannot do on `target` before anything opens: the
/// reference backend, no iterations, the ceiling report off Vulkan or
/// without its kernels.
fn check_target(target: &Target, cfg: &TuneConfig) -> Result<(), CliError> {
    if target.kind == BackendKind::Reference {
        return Err(CliError::option(
            "--backend",
            "the reference backend has no matrix units to tune (name vulkan or wgpu, or run where auto finds a GPU)",
        ));
    }
    if target.kind == BackendKind::Cuda {
        return Err(CliError::option(
            "--backend",
            "the CUDA backend's GEMMs are cuBLASLt's, and it times them itself on each shape's first call \
             (the fastest of cuBLASLt's candidates, kept in cublaslt-picks.tsv beside the tune cache; \
             delete that file to time them afresh): nothing to tune (name vulkan or wgpu)",
        ));
    }
    if cfg.iters == 0 {
        return Err(CliError::option("--iters", "must be at least 1"));
    }
    if cfg.ceiling && target.kind != BackendKind::Vulkan {
        return Err(CliError::option(
            "--ceiling",
            format!(
                "the ceiling report runs the Vulkan backend's GLSL kernels: name --backend vulkan, not {}",
                target.kind
            ),
        ));
    }
    if cfg.ceiling && !headkl_vulkan::CEILING_BUILT {
        return Err(CliError::option(
            "--ceiling",
            "this headkl was built without the ceiling report's kernels; build it with \
             `cargo build --release -p headkl-cli --features ceiling`",
        ));
    }
    Ok(())
}

/// The shape to tune at: `--shape`, else by the device's memory; refused
/// where the device has no matrix units or too little memory.
fn tune_shape(target: &Target, info: &headkl_core::DeviceInfo, cfg: &TuneConfig) -> Result<GemmShape, CliError> {
    if cfg.ceiling && !info.matrix_units {
        return Err(CliError::option(
            "--ceiling",
            format!(
                "{} on {} has no usable matrix units (or HEADKL_NO_COOPMAT is set): no matrix-unit ceiling to report",
                target.kind, info.device_name
            ),
        ));
    }
    if !info.matrix_units {
        return Err(CliError::option(
            "--backend",
            format!(
                "{} on {} runs the tiled GEMM (no usable matrix units, or HEADKL_NO_COOPMAT): nothing to tune",
                target.kind, info.device_name
            ),
        ));
    }
    // wgpu does not report memory: a discrete GPU is taken to have 16 GiB.
    let large = match info.memory_bytes {
        Some(b) => b >= 16 << 30,
        None => info.device_type == "discrete",
    };
    let shape = cfg
        .shape
        .unwrap_or(if large { GemmShape::LARGE } else { GemmShape::SMALL });
    if let Some(mem) = info.memory_bytes {
        if shape.device_bytes() > mem {
            return Err(CliError::option(
                "--shape",
                format!(
                    "{shape} needs {} of device memory, {} has {}",
                    crate::text::fmt_bytes(shape.device_bytes()),
                    info.device_name,
                    crate::text::fmt_bytes(mem)
                ),
            ));
        }
    }
    Ok(shape)
}

/// Both rounds: every kernel once, then the contenders again (the faster
/// of their two means kept).
fn time_kernels(target: &Target, data: &TuneData, kernels: &[CoopGemm], iters: usize) -> Vec<Trial> {
    let shape = data.shape;
    let tflops = |ms: Option<f64>| ms.map_or("-".to_string(), |ms| format!("{:.1}", shape.flops() / ms / 1e9));
    let ms = |ms: Option<f64>| ms.map_or("-".to_string(), |ms| format!("{ms:.2}"));
    let run_trial = |kernel: CoopGemm| -> Trial {
        let choice = GemmChoice {
            logits: kernel,
            dx: kernel,
        };
        let job = TrialJob { data, iters };
        let (outcome, logits_ms, dx_ms) = match select::open_and_run_gemm(target, Some(choice), job) {
            Ok(measured) => measured,
            Err(RunError::Start(_, why)) => (Err(format!("does not start: {why}")), None, None),
            Err(RunError::Job(e)) => (Err(e.to_string()), None, None),
        };
        Trial {
            kernel,
            outcome,
            logits_ms,
            dx_ms,
        }
    };
    let report = |round: &str, i: usize, n: usize, t: &Trial| {
        format!(
            "tune: {round} [{}/{n}] {}: logits {} ms ({} TFLOP/s), dx {} ms ({} TFLOP/s){}",
            i + 1,
            t.kernel,
            ms(t.logits_ms),
            tflops(t.logits_ms),
            ms(t.dx_ms),
            tflops(t.dx_ms),
            match &t.outcome {
                Ok(_) => String::new(),
                Err(why) => format!(": {why}"),
            }
        )
    };
    let mut trials = Vec::new();
    let mut progress = Progress::new("tune round 1", kernels.len() as u64);
    for (i, &kernel) in kernels.iter().enumerate() {
        progress.message(kernel.to_string());
        let trial = run_trial(kernel);
        progress.println(report("round 1", i, kernels.len(), &trial));
        progress.inc_by(1);
        trials.push(trial);
    }
    progress.finish();
    // One slow measurement must not decide: every correct kernel within
    // CONFIRM of the round's best for either GEMM runs again, in reverse
    // order, and keeps the faster of its two medians.
    let contenders = contenders(&trials);
    let mut progress = Progress::new("tune round 2", contenders.len() as u64);
    for (i, &index) in contenders.iter().rev().enumerate() {
        let again = run_trial(trials[index].kernel);
        progress.println(report("round 2", i, contenders.len(), &again));
        progress.inc_by(1);
        let t = &mut trials[index];
        if again.correct() {
            t.logits_ms = min_ms(t.logits_ms, again.logits_ms);
            t.dx_ms = min_ms(t.dx_ms, again.dx_ms);
        } else {
            // A kernel that fails the second time is not picked.
            t.outcome = again.outcome;
        }
    }

    trials
}

/// The table of every kernel's cases and times.
fn print_trials(target: &Target, info: &headkl_core::DeviceInfo, shape: GemmShape, iters: usize, trials: &[Trial]) {
    let tflops = |ms: Option<f64>| ms.map_or("-".to_string(), |ms| format!("{:.1}", shape.flops() / ms / 1e9));
    let ms = |ms: Option<f64>| ms.map_or("-".to_string(), |ms| format!("{ms:.2}"));
    let rows: Vec<Vec<String>> = trials
        .iter()
        .map(|t| {
            vec![
                t.kernel.to_string(),
                match &t.outcome {
                    Ok((p, r)) => format!("{p}/{r}"),
                    Err(why) if why.starts_with("does not start") => "does not start".to_string(),
                    Err(_) => "FAIL".to_string(),
                },
                ms(t.logits_ms),
                tflops(t.logits_ms),
                ms(t.dx_ms),
                tflops(t.dx_ms),
            ]
        })
        .collect();
    println!(
        "{} {} (driver {}), m:n:k = {shape} in chunks of {TUNE_CHUNK_ROWS} rows, GPU ms: mean of {}, the faster of two rounds for contenders",
        target.kind, info.device_name, info.driver, iters
    );
    print!(
        "{}",
        table(
            &["kernel", "kernel cases", "logits ms", "TFLOP/s", "dx ms", "TFLOP/s"],
            &rows
        )
    );
}

/// The fastest correct kernel for each GEMM.
fn best_choice(target: &Target, shape: GemmShape, trials: &[Trial]) -> Result<GemmChoice, CliError> {
    let best = |f: fn(&Trial) -> Option<f64>| {
        trials
            .iter()
            .filter(|t| t.correct())
            .filter_map(|t| f(t).map(|ms| (t.kernel, ms)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    };
    let (Some((logits, logits_ms)), Some((dx, dx_ms))) = (best(|t| t.logits_ms), best(|t| t.dx_ms)) else {
        return Err(CliError::device(
            "tune",
            headkl_core::Error::Backend {
                backend: target.kind.name(),
                message: "no kernel both passed the kernel cases and ran".into(),
            },
        ));
    };
    let choice = GemmChoice { logits, dx };
    println!(
        "best: {choice} (logits {:.1}, dx {:.1} TFLOP/s)",
        shape.flops() / logits_ms / 1e9,
        shape.flops() / dx_ms / 1e9
    );
    Ok(choice)
}

/// How far behind the first round's best a kernel may be and still run a
/// second round.
const CONFIRM: f64 = 1.25;

/// Indices of the correct trials within [`CONFIRM`] of the best logits or
/// dx time.
fn contenders(trials: &[Trial]) -> Vec<usize> {
    let best = |f: fn(&Trial) -> Option<f64>| {
        trials
            .iter()
            .filter(|t| t.correct())
            .filter_map(f)
            .min_by(f64::total_cmp)
    };
    let (logits, dx) = (best(|t| t.logits_ms), best(|t| t.dx_ms));
    let near = |ms: Option<f64>, best: Option<f64>| matches!((ms, best), (Some(m), Some(b)) if m <= b * CONFIRM);
    trials
        .iter()
        .enumerate()
        .filter(|(_, t)| t.correct() && (near(t.logits_ms, logits) || near(t.dx_ms, dx)))
        .map(|(i, _)| i)
        .collect()
}

fn min_ms(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn save(target: &Target, info: &headkl_core::DeviceInfo, choice: GemmChoice) -> Result<(), CliError> {
    let Some(path) = target.settings.wgpu.common.gemm_sources.tune_cache.clone() else {
        return Err(CliError::option(
            "--no-save",
            "no cache folder: set HEADKL_CACHE_DIR, XDG_CACHE_HOME or HOME (or pass --no-save)",
        ));
    };
    let mut cache = TuneCache::load(&path);
    cache.insert(target.kind.name(), &info.device_name, &info.driver, choice);
    cache
        .save(&path)
        .map_err(|e| CliError::file(&path, format!("cannot write the tune cache: {e}")))?;
    println!(
        "saved to {} ({} uses it on this device unless {} is set)",
        path.display(),
        target.kind,
        GEMM_ENV
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trial(kernel: &str, ok: bool, logits: f64, dx: f64) -> Trial {
        Trial {
            kernel: CoopGemm::parse(kernel).unwrap(),
            outcome: if ok { Ok((26, 26)) } else { Err("wrong".into()) },
            logits_ms: Some(logits),
            dx_ms: Some(dx),
        }
    }

    #[test]
    fn contenders_are_the_correct_kernels_near_either_best() {
        let trials = [
            trial("direct", true, 88.0, 68.0),
            trial("staged:bk64:r2:s1", true, 31.0, 31.0),
            trial("staged:bk32:r4:s1:pf", true, 33.0, 19.0),
            trial("staged:bk32:r2:s2", true, 35.0, 34.0),
            trial("staged:bk16:r2:s1", false, 10.0, 10.0),
        ];
        // bk64 leads the logits (35 and 33 are within 1.25× of 31); the
        // failed kernel never counts, however fast.
        assert_eq!(contenders(&trials), vec![1, 2, 3]);
        assert_eq!(min_ms(Some(3.0), Some(2.0)), Some(2.0));
        assert_eq!(min_ms(None, Some(2.0)), Some(2.0));
    }

    #[test]
    fn shapes_parse_and_name_the_bad_field() {
        assert_eq!("4096:124160:5120".parse::<GemmShape>(), Ok(GemmShape::LARGE));
        assert!("4096:124160".parse::<GemmShape>().unwrap_err().contains("M:N:K"));
        assert!("4096:100:5120".parse::<GemmShape>().unwrap_err().contains("N = 100"));
        assert!("x:128:128".parse::<GemmShape>().unwrap_err().contains("M:"));
        assert_eq!(GemmShape::LARGE.to_string(), "4096:124160:5120");
        assert!(GemmShape::SMALL.device_bytes() < 1 << 30);
    }
}
