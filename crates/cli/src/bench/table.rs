//! What bench measured, per kernel, job and backend (the `--json` report),
//! and the results table.

use serde::Serialize;

use super::shape::{JobKind, Shape};
use crate::text::{fmt_bytes, table};

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
    /// Which time the TFLOP/s come from: `gpu` (kernel timestamps), `wall`, or `cpu` (the reference, whose times are CPU time).
    pub tflops_from: &'static str,
    /// Effective TFLOP/s from the median wall time.
    pub wall_tflops: f64,
    /// Peak device bytes beyond the head during the job.
    pub peak_extra_bytes: u64,
    /// Per-kernel breakdown (empty without kernel timing).
    pub kernels: Vec<KernelStat>,
    /// head_kl on the host path: the data and the dx block filter.
    pub filter: Option<FilterReport>,
}

/// head_kl's data and what the dx GEMM's block filter did.
#[derive(Clone, Debug, Serialize)]
pub struct FilterReport {
    /// The data (`random` skips nothing).
    pub data: super::DataKind,
    /// ε, or `None` with the filter off.
    pub eps: Option<f32>,
    /// Fraction of the dx GEMM's blocks skipped.
    pub skipped: f64,
    /// `‖dx − dx_unfiltered‖ / ‖dx_unfiltered‖`.
    pub dx_rel_err: f64,
    /// The filter's bound on that error, relative to the same norm.
    pub bound_rel: f64,
    /// Whether the per-token loss came out bit-identical to the unfiltered
    /// call's (it must: the filter changes dx only).
    pub loss_identical: bool,
}

impl FilterReport {
    /// The filter off.
    pub fn off(data: super::DataKind) -> Self {
        Self {
            data,
            eps: None,
            skipped: 0.0,
            dx_rel_err: 0.0,
            bound_rel: 0.0,
            loss_identical: true,
        }
    }
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
    /// The queue family the backend submitted to.
    pub queue: Option<String>,
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
    /// head_kl's divergence (`forward`, `reverse`, `jsd`).
    pub divergence: String,
    /// β of the JSD.
    pub beta: Option<f32>,
    /// head_kl's soft-term weight.
    pub soft_weight: f32,
    /// head_kl's hard-label weight (random labels when above 0).
    pub hard_weight: f32,
    /// The teacher's hidden size of the `head_kl_full_vocab` job
    /// (`--teacher-hs`).
    pub teacher_hs: Option<u32>,
    /// Scratch budget in bytes.
    pub budget_bytes: u64,
    /// One entry per backend.
    pub runs: Vec<BenchRun>,
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
                match (j.gpu_ms, j.tflops_from == "cpu") {
                    (Some(ms), true) => format!("{} (CPU)", fmt_ms(ms)),
                    (Some(ms), false) => fmt_ms(ms),
                    (None, _) => "-".into(),
                },
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
            "GPU ms (kernels)",
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
