//! What bench measured, per kernel, job and backend (the `--json` report),
//! and the results table.

use headkl_core::DeviceInfo;
use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

use super::shape::{JobKind, Shape};
use crate::text::{fmt_bytes, fmt_stepped, table};

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
    /// The device it ran on, written as the keys `backend`, `device`,
    /// `driver`, `device_type`, `matrix_units`, `gemm` and `queue`.
    #[serde(flatten, serialize_with = "device_keys")]
    pub info: DeviceInfo,
    /// The shape.
    #[serde(serialize_with = "super::shape::shape_json")]
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

/// The report's keys for the device a run was on (`scripts/h200.sh` reads
/// `backend` and `matrix_units`).
fn device_keys<S: Serializer>(info: &DeviceInfo, serializer: S) -> Result<S::Ok, S::Error> {
    let mut keys = serializer.serialize_struct("DeviceInfo", 7)?;
    keys.serialize_field("backend", info.backend)?;
    keys.serialize_field("device", &info.device_name)?;
    keys.serialize_field("driver", &info.driver)?;
    keys.serialize_field("device_type", &info.device_type)?;
    keys.serialize_field("matrix_units", &info.matrix_units)?;
    keys.serialize_field("gemm", &info.gemm)?;
    keys.serialize_field("queue", &info.queue)?;
    keys.end()
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
    fmt_stepped(v, &[(10.0, 1), (0.01, 3)])
}

fn fmt_ms(ms: f64) -> String {
    fmt_stepped(ms, &[(100.0, 0), (10.0, 1), (f64::NEG_INFINITY, 2)])
}

/// The results table.
pub fn render(runs: &[BenchRun]) -> String {
    let mut rows = Vec::new();
    for r in runs {
        for j in &r.jobs {
            rows.push(vec![
                r.info.backend.to_string(),
                r.info.device_name.clone(),
                if r.info.matrix_units { "on" } else { "off" }.into(),
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
                r.info.backend,
                j.job.name(),
                j.path,
                parts.join(", ")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use headkl_core::Backend;

    #[test]
    fn a_run_writes_the_device_keys_first_in_order() {
        let info = DeviceInfo {
            device_name: "cpu".into(),
            driver: "d".into(),
            gemm: Some("tiled".into()),
            ..headkl_reference::CpuBackend::new().info().clone()
        };
        let run = BenchRun {
            info,
            shape: Shape::A,
            head_bytes: 1,
            slices: 1,
            upload_ms: 1.0,
            jobs: vec![],
        };
        let json = serde_json::to_string(&run).unwrap();
        assert!(
            json.starts_with(
                r#"{"backend":"reference","device":"cpu","driver":"d","device_type":"cpu","matrix_units":false,"gemm":"tiled","queue":null,"shape":{"#
            ),
            "{json}"
        );
    }
}
