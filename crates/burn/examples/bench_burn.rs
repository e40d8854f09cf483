//! The peer benchmark: burn's unfused loss (matmul, log_softmax, gather,
//! autodiff) against headkl-burn, forward and backward, on the same device
//! in one run, with the device memory each adds.
//!
//! ```sh
//! cargo run --release --manifest-path crates/burn/Cargo.toml --example bench_burn -- --shape A
//! cargo run --release --manifest-path crates/burn/Cargo.toml --example bench_burn -- --shape B --reps 5
//! cargo run --release --manifest-path crates/burn/Cargo.toml --example bench_burn -- --shape 2048:248320:5120:64
//! ```
//!
//! Each rep: the loss of `hidden` `[ntok][hs]` (tracked) against a teacher's
//! top-k, `backward()`, the hidden rows' gradient, then `Device::sync`
//! (headkl's `wait` too): wall time per rep, median over `--reps` after
//! `--warmup` reps. Memory is the growth of burn's pool over the timed reps
//! (from a cleaned pool; burn keeps its pages, so the growth is the high
//! mark of what the step allocated), plus, for headkl-burn, the peak of
//! headkl's own allocations beyond its head planes (its scratch, made by
//! the first call and kept); neither counts the head itself.

use std::error::Error;
use std::time::Instant;

use burn::prelude::{Int, Tensor};
use burn::tensor::{DType, Device, FloatDType, TensorData};
use headkl_burn::prelude::LossConfig;
use headkl_burn::{unfused, DeviceOptions, HeadKl, SharedDevice, Teacher};
use headkl_core::{Backend, HeadData, HeadWeights, Shape};

#[path = "../../backend-wgpu/examples/common/mod.rs"]
mod common;

use common::{each_flag, parsed, uniform};

/// `A`, `B`, `S`, `M`, `NTOK:V:HS:K` (core's [`Shape`]), or `tiny`.
pub fn parse_shape(s: &str) -> Result<Shape, String> {
    match s {
        "tiny" => Ok(Shape::new(64, 512, 64, 8)),
        _ => s.parse().map_err(|e| format!("--shape {e}")),
    }
}

/// Flags.
#[derive(Clone, Debug)]
pub struct Config {
    /// The shape.
    pub shape: Shape,
    /// Timed reps (median).
    pub reps: usize,
    /// Untimed reps first (pipelines, burn's autotune).
    pub warmup: usize,
    /// The dtype of the hidden rows and of burn's copy of the head.
    pub dtype: FloatDType,
    /// Run burn's unfused loss (off: headkl-burn alone, for shapes burn
    /// cannot fit).
    pub unfused: bool,
}

impl Config {
    /// `--shape S --reps N --warmup N --dtype f32|f16 --headkl-only`.
    pub fn from_args(args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut cfg = Config {
            shape: Shape::A,
            reps: 5,
            warmup: 2,
            dtype: FloatDType::F16,
            unfused: true,
        };
        let flags = "--shape --reps --warmup --dtype --headkl-only";
        each_flag(args, Some("--headkl-only"), flags, |flag, value| {
            match flag {
                "--headkl-only" => cfg.unfused = false,
                "--shape" => cfg.shape = parse_shape(value)?,
                "--reps" => cfg.reps = parsed(flag, value)?,
                "--warmup" => cfg.warmup = parsed(flag, value)?,
                "--dtype" => {
                    cfg.dtype = match value {
                        "f32" => FloatDType::F32,
                        "f16" => FloatDType::F16,
                        _ => return Err(format!("--dtype {value}: f32 or f16")),
                    }
                }
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        if cfg.reps == 0 {
            return Err("--reps must be at least 1".into());
        }
        Ok(cfg)
    }
}

/// One method's result.
#[derive(Clone, Debug)]
pub struct Row {
    /// `burn unfused` or `headkl-burn`.
    pub method: &'static str,
    /// Median wall time of forward + backward + sync, ms.
    pub ms: f64,
    /// Every timed rep, ms.
    pub all_ms: Vec<f64>,
    /// Device memory the step added, bytes.
    pub extra_bytes: u64,
    /// The mean loss.
    pub loss: f32,
}

/// Cheap deterministic values: a 64 Ki block of xorshift64* uniforms in
/// [-scale, scale), tiled (a V × hs head is too large to draw one by one).
fn tiled(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let values = uniform((1 << 16).min(n).max(1), seed, scale);
    // A stride prime to the block, so rows do not repeat each other.
    (0..n).map(|i| values[(i * 7919) % values.len()]).collect()
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn pool_reserved(device: &Device) -> u64 {
    device.memory_pool_usage().map_or(0, |u| u.bytes_reserved)
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Runs the benchmark on `shared`; the rows (headkl-burn first).
pub fn run_on(shared: &SharedDevice, cfg: &Config) -> Result<Vec<Row>, Box<dyn Error>> {
    let Shape { ntok, vocab, hs, k } = cfg.shape;
    let plain = shared.device();
    let device = plain.clone().autodiff();
    let w = tiled(vocab * hs, 1, 2.0 / (hs as f32).sqrt());
    let mut head = HeadKl::new(
        shared,
        &HeadWeights::new(HeadData::F32(&w), vocab, hs)?,
        &Default::default(),
    )?;
    // What headkl holds before its first call: the head's f16 planes. Its
    // scratch, made by the first call and kept, is extra memory of the step.
    let headkl_head_bytes = head.engine().backend().memory().current;
    head.engine().backend().reset_peak_memory();
    // Converted on the host: a V × hs f32 tensor can be past the device's
    // largest binding.
    let dtype = DType::from(cfg.dtype);
    let hidden = Tensor::<2>::from_data(TensorData::new(tiled(ntok * hs, 2, 1.0), [ntok, hs]), (&device, dtype));
    // Distinct ids per row: 104729 is prime to every V here.
    let ids: Vec<i32> = (0..ntok * k)
        .map(|i| (((i / k) * 7919 + (i % k) * 104_729) % vocab) as i32)
        .collect();
    let probs: Vec<f32> = (0..ntok * k).map(|i| 1.0 / (1.0 + (i % k) as f32)).collect();
    let teacher = Teacher {
        ids: Tensor::<2, Int>::from_data(TensorData::new(ids, [ntok, k]), &plain),
        probs: Tensor::from_data(TensorData::new(probs, [ntok, k]), &plain),
    };
    let mut rows = Vec::new();

    // headkl-burn.
    let step_headkl = |head: &mut HeadKl| -> Result<f32, Box<dyn Error>> {
        let h = hidden.clone().require_grad();
        let out = head.loss(&h, &teacher, None, &LossConfig::default())?;
        let grads = out.loss.clone().backward();
        let _grad = h.grad(&grads);
        device.sync()?;
        head.wait()?;
        Ok(out.loss.into_scalar::<f32>())
    };
    let mut row = timed("headkl-burn", cfg, &plain, || step_headkl(&mut head))?;
    row.extra_bytes += head.engine().backend().memory().peak.saturating_sub(headkl_head_bytes);
    rows.push(row);
    // headkl's scratch and head planes go before burn's run.
    drop(head);

    if cfg.unfused {
        // burn reports a tensor past the device's largest binding (B's f32
        // logits on most devices) by panicking: say so and keep headkl's row.
        let burn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_unfused(cfg, &w, &hidden, &teacher, &device)
        }));
        match burn {
            Ok(Ok(row)) => rows.push(row),
            Ok(Err(e)) => eprintln!("burn unfused: did not run: {e}"),
            Err(panic) => {
                let why = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("a panic");
                eprintln!("burn unfused: did not run: {why}");
            }
        }
    }
    log::info!("headkl head planes: {:.2} GiB", gib(headkl_head_bytes));
    Ok(rows)
}

/// burn's unfused loss, forward and backward: the timed row.
fn run_unfused(
    cfg: &Config,
    w: &[f32],
    hidden: &Tensor<2>,
    teacher: &Teacher,
    device: &Device,
) -> Result<Row, Box<dyn Error>> {
    let Shape { vocab, hs, .. } = cfg.shape;
    let plain = device.clone().inner();
    let head_t = Tensor::<2>::from_data(
        TensorData::new(w.to_vec(), [vocab, hs]),
        (device, DType::from(cfg.dtype)),
    );
    let unfused_teacher = unfused::UnfusedTeacher {
        ids: teacher.ids.clone(),
        probs: teacher.probs.clone(),
    };
    let step_burn = || -> Result<f32, Box<dyn Error>> {
        let h = hidden.clone().require_grad();
        let (mean, _) = unfused::loss(h.clone(), &head_t, &unfused_teacher, None, None, 1.0);
        let grads = mean.clone().backward();
        let _grad = h.grad(&grads);
        device.sync()?;
        Ok(mean.into_scalar::<f32>())
    };
    timed("burn unfused", cfg, &plain, step_burn)
}

/// `step` run `cfg.warmup` times, then timed `cfg.reps` times from a
/// cleaned pool: the row, with the pool's growth as its extra memory.
fn timed(
    method: &'static str,
    cfg: &Config,
    plain: &Device,
    mut step: impl FnMut() -> Result<f32, Box<dyn Error>>,
) -> Result<Row, Box<dyn Error>> {
    for _ in 0..cfg.warmup {
        step()?;
    }
    plain.memory_cleanup();
    let pool0 = pool_reserved(plain);
    let mut all_ms = Vec::new();
    let mut loss = 0.0;
    for _ in 0..cfg.reps {
        let t = Instant::now();
        loss = step()?;
        all_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(Row {
        method,
        ms: median(&all_ms),
        all_ms,
        extra_bytes: pool_reserved(plain).saturating_sub(pool0),
        loss,
    })
}

#[allow(
    dead_code,
    reason = "the bench test includes this file for `run_on` and never calls `main`"
)]
fn main() {
    let help = "bench_burn: burn's unfused loss against headkl-burn, forward and backward, same device, one run\n\n\
         Flags:\n  \
         --shape S       A, B, S, M (DESIGN §7), tiny, or NTOK:V:HS:K (default A)\n  \
         --reps N        timed reps, median reported (default 5)\n  \
         --warmup N      untimed reps first (default 2)\n  \
         --dtype f16|f32 hidden rows and burn's head (default f16: A's f32 head, 5.1 GB, is past wgpu's 4 GiB binding)\n  \
         --headkl-only   skip burn's unfused loss (a shape it cannot fit)";
    common::example_main("bench_burn", help, Config::from_args, open_and_run, print_rows);
}

/// The device opened, the run's header line, then [`run_on`].
fn open_and_run(cfg: &Config) -> Result<Vec<Row>, Box<dyn Error>> {
    let shared = SharedDevice::open(&DeviceOptions::default())?;
    let info = shared.adapter().get_info();
    println!(
        "shape {} (ntok:V:hs:k), {} ({:?}, driver {} {}), {:?} rows, median of {} reps after {} warm-up",
        cfg.shape, info.name, info.backend, info.driver, info.driver_info, cfg.dtype, cfg.reps, cfg.warmup
    );
    run_on(&shared, cfg)
}

fn print_rows(rows: Vec<Row>) {
    println!(
        "{:<14} {:>14} {:>18} {:>12}",
        "method", "fwd+bwd ms", "extra memory GiB", "loss"
    );
    for r in &rows {
        println!(
            "{:<14} {:>14.2} {:>18.3} {:>12.6}",
            r.method,
            r.ms,
            gib(r.extra_bytes),
            r.loss
        );
    }
    if let [ours, theirs] = &rows[..] {
        println!(
            "burn unfused / headkl-burn: {:.2}x time, {:.2}x memory",
            theirs.ms / ours.ms,
            theirs.extra_bytes as f64 / ours.extra_bytes.max(1) as f64
        );
    }
}
