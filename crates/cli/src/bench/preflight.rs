//! Before a bench commits to a long run: how long it will take and how much
//! memory it needs, said up front, and refused past a few minutes or past
//! the machine's memory unless `--yes`.
//!
//! The time comes from a warm calibration call (a second call, so pipeline
//! builds are not counted) on a small head with the shape's hidden size:
//! its rate, scaled to every call of the run. On a GPU such a call is
//! mostly fixed costs and its rate says little, so a calibration call
//! shorter than [`TRUST_SECS`] decides nothing; the run's own warm probe on
//! the full head ([`super::BenchJob`]) decides then.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

use half::f16;
use headkl_core::{Backend, DeviceInfo, Engine, HeadData, HeadWeights, Hidden, SliceOptions, TopkOptions};

use super::shape::{JobKind, Shape, ShapeCost};
use super::stats::fmt_secs;
use super::BenchConfig;
use crate::error::CliError;
use crate::text::fmt_bytes;

/// Estimated seconds past which bench asks for `--yes`.
pub(super) const CONFIRM_SECS: f64 = 300.0;

/// A calibration call at least this long is compute, not fixed costs: its
/// rate is trusted.
const TRUST_SECS: f64 = 0.02;

/// Rows and vocabulary of the calibration call.
const CALIBRATION_ROWS: usize = 16;
const CALIBRATION_VOCAB: usize = 2048;

/// What a run will need.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Needs {
    /// Estimated seconds of the timed jobs, where known.
    pub secs: Option<f64>,
    /// How the seconds were estimated, for the message.
    pub from: &'static str,
    /// Host memory: the bench data, and for a CPU device its "device"
    /// memory too.
    pub host_bytes: u64,
    /// Device memory: the head's planes and the scratch budget (0 for a
    /// CPU device, counted in `host_bytes`).
    pub device_bytes: u64,
}

/// Whether the backend's memory is the host's (the CPU reference, or a
/// software rasterizer such as lavapipe).
fn memory_is_host(info: &DeviceInfo) -> bool {
    info.backend == "reference" || info.device_type == "cpu"
}

/// The flops of every timed call of the run (warm-ups included).
pub(super) fn run_flops(shape: Shape, cfg: &BenchConfig) -> f64 {
    let calls = (cfg.warmup + cfg.iters) as f64;
    let paths = if cfg.resident { 2.0 } else { 1.0 };
    paths * calls * (shape.flops(JobKind::HeadKl) + shape.flops(JobKind::Topk))
}

/// Memory the run needs: host (the f16 head and hidden rows, the teacher,
/// head_kl's dx) and device (the head's f16 planes, the scratch budget and,
/// with `--resident`, the device-side inputs and outputs).
pub(super) fn memory_needs(shape: Shape, cfg: &BenchConfig, info: &DeviceInfo) -> (u64, u64) {
    let (ntok, vocab, hs, k) = (shape.ntok as u64, shape.vocab as u64, shape.hs as u64, shape.k as u64);
    let pad = |x: u64| x.div_ceil(headkl_core::ALIGN as u64) * headkl_core::ALIGN as u64;
    let host = vocab * hs * 2 + ntok * hs * (2 + 4) + ntok * k * 16;
    // Scratch grows to the budget, or to what the whole shape needs in one
    // chunk (its f32 logits dominate) when that is less.
    let scratch = cfg
        .budget
        .bytes
        .min(pad(ntok) * pad(vocab) * 4 + pad(ntok) * pad(hs) * 8);
    let mut device = pad(vocab) * pad(hs) * 2 + scratch;
    if cfg.resident {
        device += ntok * hs * (2 + 4) + ntok * k * 16 + ntok * 4;
    }
    if memory_is_host(info) {
        (host + device, 0)
    } else {
        (host, device)
    }
}

/// Seconds per flop of a warm top-k call on a small head with the shape's
/// hidden size, or `None` when the call is too short to be compute.
pub(super) fn calibrate<B: Backend>(backend: &B, shape: Shape, budget: u64) -> Result<Option<f64>, CliError> {
    let (rows, vocab, hs) = (CALIBRATION_ROWS, CALIBRATION_VOCAB.min(shape.vocab), shape.hs);
    let fail = |e| CliError::device("bench calibration", e);
    // Any finite values do: only the time is used.
    let pattern = |n: usize, step: usize| -> Vec<f16> {
        (0..n)
            .map(|i| f16::from_f32(((i * step) % 251) as f32 / 251.0 - 0.5))
            .collect()
    };
    let head = pattern(vocab * hs, 7919);
    let x = pattern(rows * hs, 104_729);
    let head = HeadWeights::new(HeadData::F16(&head), vocab, hs).map_err(fail)?;
    let hidden = Hidden::f16(&x, rows, hs).map_err(fail)?;
    let mut engine = Engine::new(backend, &head, SliceOptions::default()).map_err(fail)?;
    let opts = TopkOptions {
        budget_bytes: budget,
        ..TopkOptions::new(shape.k.min(vocab))
    };
    let call = |engine: &mut Engine<&B>| -> Result<f64, CliError> {
        let start = Instant::now();
        engine.topk(&hidden, &opts).map_err(fail)?;
        engine.backend().finish().map_err(fail)?;
        Ok(start.elapsed().as_secs_f64())
    };
    call(&mut engine)?; // builds the pipelines
    let secs = call(&mut engine)?;
    let _ = engine.backend().take_kernel_times();
    let flops = 2.0 * rows as f64 * vocab as f64 * hs as f64;
    Ok((secs >= TRUST_SECS).then(|| secs / flops))
}

/// Host memory the kernel says is available (`MemAvailable`), where known.
fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Says what the run needs and, past [`CONFIRM_SECS`] or the memory there
/// is, asks to go on: `--yes` goes on; on a terminal a `y` answer does;
/// otherwise the run is refused (exit 2) before any of it starts.
/// `Ok(true)`: it asked and was told to go on.
pub(super) fn confirm(what: &str, needs: &Needs, cfg: &BenchConfig, info: &DeviceInfo) -> Result<bool, CliError> {
    let mut reasons = Vec::new();
    if let Some(secs) = needs.secs.filter(|&s| s > CONFIRM_SECS) {
        reasons.push(format!("about {} of compute ({})", fmt_secs(secs), needs.from));
    }
    if let Some(avail) = host_available().filter(|&a| needs.host_bytes > a) {
        reasons.push(format!(
            "{} of host memory, {} available",
            fmt_bytes(needs.host_bytes),
            fmt_bytes(avail)
        ));
    }
    if let Some(mem) = info.memory_bytes.filter(|&m| needs.device_bytes > m) {
        reasons.push(format!(
            "{} of device memory, the device has {}",
            fmt_bytes(needs.device_bytes),
            fmt_bytes(mem)
        ));
    }
    if reasons.is_empty() {
        return Ok(false);
    }
    let problem = format!(
        "{what} needs {} (memory in all: {} host{})",
        reasons.join(" and "),
        fmt_bytes(needs.host_bytes),
        if needs.device_bytes > 0 {
            format!(", {} device", fmt_bytes(needs.device_bytes))
        } else {
            String::new()
        }
    );
    if cfg.yes {
        log::warn!("bench: {problem}; going on (--yes)");
        return Ok(true);
    }
    if crate::progress::shown() && std::io::stdin().is_terminal() {
        eprint!("bench: {problem}. Run it anyway? [y/N] ");
        let _ = std::io::stderr().flush();
        let mut answer = String::new();
        let _ = std::io::stdin().lock().read_line(&mut answer);
        if matches!(answer.trim(), "y" | "Y" | "yes") {
            return Ok(true);
        }
    }
    Err(CliError::option(
        "--shape",
        format!("{problem}; pass --yes to run it anyway, or a smaller --shape (or fewer --iters)"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(resident: bool) -> BenchConfig {
        BenchConfig {
            shape: None,
            k: None,
            iters: 10,
            warmup: 2,
            budget: crate::options::BudgetArg::default(),
            json: None,
            plot: None,
            all: false,
            resident,
            shards: None,
            devices: None,
            data: crate::bench::DataKind::Random,
            filter_eps: None,
            vocab_order: crate::bench::VocabOrderArg::Natural,
            yes: false,
            divergence: headkl_core::Divergence::Forward,
            beta: None,
            soft_weight: 1.0,
            hard_weight: 0.0,
            labels: None,
            gather: false,
            head_grad: false,
            teacher_hs: None,
        }
    }

    #[test]
    fn a_cpu_device_counts_its_memory_as_the_hosts() {
        let cpu = headkl_reference::CpuBackend::new().info().clone();
        let (host, device) = memory_needs(Shape::A, &cfg(false), &cpu);
        assert_eq!(device, 0);
        // The f16 head twice (the data and the backend's planes) and the
        // whole 2 GiB budget: shape A's logits exceed it.
        let head = 248_320u64 * 5120 * 2;
        assert!(host > 2 * head + (2 << 30) && host < 2 * head + (3 << 30), "{host}");
        let gpu = DeviceInfo {
            backend: "vulkan",
            device_type: "discrete".into(),
            ..cpu
        };
        let (host, device) = memory_needs(Shape::A, &cfg(true), &gpu);
        assert!(host > head && host < 2 * head, "{host}");
        assert!(device > head + (2 << 30), "{device}");
    }

    #[test]
    fn run_flops_count_every_call_of_every_path() {
        let one = Shape::A.flops(JobKind::HeadKl) + Shape::A.flops(JobKind::Topk);
        assert_eq!(run_flops(Shape::A, &cfg(false)), 12.0 * one);
        assert_eq!(run_flops(Shape::A, &cfg(true)), 24.0 * one);
    }

    #[test]
    fn a_fast_run_within_memory_goes_on_without_asking() {
        let cpu = headkl_reference::CpuBackend::new().info().clone();
        let needs = Needs {
            secs: Some(1.0),
            from: "test",
            host_bytes: 1 << 20,
            device_bytes: 0,
        };
        assert!(matches!(confirm("bench", &needs, &cfg(false), &cpu), Ok(false)));
        let mut yes = cfg(false);
        yes.yes = true;
        let slow = Needs {
            secs: Some(10.0 * CONFIRM_SECS),
            ..needs
        };
        assert!(matches!(confirm("bench", &slow, &yes, &cpu), Ok(true)));
    }
}
