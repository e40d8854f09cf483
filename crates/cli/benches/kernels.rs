//! Criterion benches of the backend primitives, per backend: the logits and
//! dx GEMMs, the KL row kernel, the top-k row kernel, and the end-to-end
//! `head_kl`. Small sizes by default (a software Vulkan finishes in about a
//! minute); `HEADKL_BENCH_SHAPE=A` or `B` times DESIGN §7's shapes.
//!
//! Each measured call ends with `finish()`, so the time is the kernel's
//! completion as the host sees it. A backend that cannot start is skipped
//! with the reason, unless `HEADKL_REQUIRE` names it.

#![allow(clippy::unwrap_used, reason = "a bench fails loudly on any error")]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use half::f16;
use headkl_conformance::{harness_env, harness_suite};
use headkl_core::toolkit::settings::BENCH_SHAPE;
use headkl_core::toolkit::{GemmDesc, HeadLayout, Kernels, KlDesc, TopkDesc};
use headkl_core::{
    Backend, Engine, HeadData, HeadWeights, Hidden, LossOptions, LossTerms, SliceOptions, TailMode, Teacher,
};

/// Problem sizes of one bench run.
struct Sizes {
    label: &'static str,
    /// Logits GEMM: rows (tokens per chunk), vocabulary columns (one
    /// slice), hidden size.
    gemm: (usize, usize, usize),
    /// Row kernels: rows, vocabulary, k.
    rows: (usize, usize, usize),
    /// End-to-end head_kl: ntok, V, hs, k.
    e2e: (usize, usize, usize, usize),
    /// Measurement time per kernel bench (three times that end to end).
    measure: Duration,
}

fn sizes() -> Sizes {
    // HEADKL_BENCH_SHAPE is this bench's own setting.
    let shape = match harness_env().text(BENCH_SHAPE) {
        Ok(shape) => shape.map(|s| s.trim().to_ascii_uppercase()),
        Err(e) => panic!("bad setting: {e}"),
    };
    match shape.as_deref() {
        Some("A") => Sizes {
            label: "A",
            gemm: (1024, 65_536, 5120),
            rows: (1024, 248_320, 64),
            e2e: (4096, 248_320, 5120, 64),
            measure: Duration::from_secs(5),
        },
        Some("B") => Sizes {
            label: "B",
            gemm: (1024, 65_536, 4096),
            rows: (1024, 151_936, 64),
            e2e: (8192, 151_936, 4096, 64),
            measure: Duration::from_secs(5),
        },
        Some(other) if other != "SMALL" => panic!("bad setting: {BENCH_SHAPE}={other}: expected A, B or small"),
        _ => Sizes {
            label: "small",
            gemm: (64, 1024, 256),
            rows: (64, 4096, 64),
            e2e: (64, 4096, 256, 16),
            measure: Duration::from_secs(1),
        },
    }
}

/// Deterministic pseudo-random values in `[-a, a)` (xorshift64).
fn random(seed: u64, a: f32) -> impl Iterator<Item = f32> {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    })
}

fn values(n: usize, seed: u64, a: f32) -> Vec<f32> {
    random(seed, a).take(n).collect()
}

fn f16s(n: usize, seed: u64, a: f32) -> Vec<f16> {
    random(seed, a).take(n).map(f16::from_f32).collect()
}

/// Distinct ids per row: a stride coprime-ish to V walks without repeats.
fn teacher_ids(rows: usize, vocab: usize, k: usize) -> Vec<u32> {
    (0..rows)
        .flat_map(|t| (0..k).map(move |q| ((t * 7919 + q * 131) % vocab) as u32))
        .collect()
}

/// A buffer holding `bytes`, uploaded in 64 MiB pieces as the driver does.
fn upload<B: Backend>(b: &B, bytes: &[u8], label: &'static str) -> headkl_core::Result<B::Buffer> {
    const PIECE: usize = 64 << 20;
    let buf = b.alloc(bytes.len() as u64, label)?;
    for (i, piece) in bytes.chunks(PIECE).enumerate() {
        b.upload(&buf, (i * PIECE) as u64, piece)?;
    }
    Ok(buf)
}

fn bench_backend<B: Backend>(c: &mut Criterion, b: &B, s: &Sizes) -> headkl_core::Result<()> {
    let name = b.info().backend;
    let mut g = c.benchmark_group(format!("{name}/{}", s.label));
    // Flat sampling: kernels on a software device take tens of ms, and
    // criterion's linear ramp would run each one 55 times.
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(s.measure);

    // GEMMs: logits = x·Wᵀ ([m][k]·[n][k]ᵀ), dx = g·W ([m][n]·[n][k]).
    let (m, n, k) = s.gemm;
    let x = upload(b, bytemuck::cast_slice(&f16s(m * k, 1, 1.0)), "x16")?;
    let w = upload(b, bytemuck::cast_slice(&f16s(n * k, 2, 0.03)), "head slice")?;
    let logits = b.alloc((m * n * 4) as u64, "logits")?;
    let grad = upload(b, bytemuck::cast_slice(&f16s(m * n, 3, 1.0)), "grad")?;
    let dx = b.alloc((m * k * 4) as u64, "dx")?;
    let logits_desc = GemmDesc::dense(m, n, k, HeadLayout::Logits);
    let dx_desc = GemmDesc::dense(m, k, n, HeadLayout::Dx);
    g.throughput(Throughput::Elements((2 * m * n * k) as u64));
    g.bench_function(format!("gemm_logits {m}x{n}x{k}"), |bch| {
        bch.iter(|| {
            b.gemm(&x, &w, &logits, &logits_desc).unwrap();
            b.finish().unwrap();
        })
    });
    g.bench_function(format!("gemm_dx {m}x{k}x{n}"), |bch| {
        bch.iter(|| {
            b.gemm(&grad, &w, &dx, &dx_desc).unwrap();
            b.finish().unwrap();
        })
    });
    drop((x, w, logits, grad, dx));

    // Row kernels over a full vocabulary row.
    let (rows, vocab, kk) = s.rows;
    let logits = upload(b, bytemuck::cast_slice(&values(rows * vocab, 4, 4.0)), "logits")?;
    let ids = upload(b, bytemuck::cast_slice(&teacher_ids(rows, vocab, kk)), "ids")?;
    let probs = upload(b, bytemuck::cast_slice(&vec![1.0 / kk as f32; rows * kk]), "probs")?;
    // Per-row inputs: coefficient 1 and label t % vocab.
    let row_in: Vec<u32> = (0..rows)
        .flat_map(|t| [1f32.to_bits(), (t * 7 % vocab) as u32])
        .collect();
    let coef = upload(b, bytemuck::cast_slice(&row_in), "row_in")?;
    let loss = b.alloc((rows * 16) as u64, "loss")?;
    let grad = b.alloc((rows * vocab * 2) as u64, "grad")?;
    let out_ids = b.alloc((rows * kk * 4) as u64, "topk ids")?;
    let out_probs = b.alloc((rows * kk * 4) as u64, "topk probs")?;
    let kl = KlDesc::plain(rows, vocab, vocab, kk);
    // Every term on (τ 2): the cost of the options against the plain kernel.
    let kl_terms = KlDesc {
        temperature: 2.0,
        tail: TailMode::Bucket,
        terms: LossTerms {
            hard_weight: 0.5,
            label_smoothing: 0.1,
            z_loss: 1e-4,
            softcap: Some(30.0),
            ..LossTerms::default()
        },
        ..kl
    };
    // The same terms at τ = 1 (one softmax) and at a τ that is no integer
    // (two exponentials a logit; τ = 2 squares the first).
    let kl_terms_t1 = KlDesc {
        temperature: 1.0,
        ..kl_terms
    };
    let kl_terms_t15 = KlDesc {
        temperature: 1.5,
        ..kl_terms
    };
    let topk = TopkDesc::plain(rows, vocab, vocab, kk);
    g.throughput(Throughput::Elements((rows * vocab) as u64));
    g.bench_function(format!("kl_rows {rows}x{vocab} k{kk}"), |bch| {
        bch.iter(|| {
            b.kl_rows(&logits, &ids, &probs, &coef, &loss, &grad, &kl).unwrap();
            b.finish().unwrap();
        })
    });
    g.bench_function(format!("kl_rows+terms {rows}x{vocab} k{kk}"), |bch| {
        bch.iter(|| {
            b.kl_rows(&logits, &ids, &probs, &coef, &loss, &grad, &kl_terms)
                .unwrap();
            b.finish().unwrap();
        })
    });
    for (tau, desc) in [("1", &kl_terms_t1), ("1.5", &kl_terms_t15)] {
        g.bench_function(format!("kl_rows+terms t{tau} {rows}x{vocab} k{kk}"), |bch| {
            bch.iter(|| {
                b.kl_rows(&logits, &ids, &probs, &coef, &loss, &grad, desc).unwrap();
                b.finish().unwrap();
            })
        });
    }
    g.bench_function(format!("topk_rows {rows}x{vocab} k{kk}"), |bch| {
        bch.iter(|| {
            b.topk_rows(&logits, &out_ids, &out_probs, &topk).unwrap();
            b.finish().unwrap();
        })
    });
    drop((logits, ids, probs, coef, loss, grad, out_ids, out_probs));

    // End to end: the driver's head_kl (upload of the head outside).
    let (ntok, vocab, hs, kk) = s.e2e;
    let head_data = f16s(vocab * hs, 5, 0.03);
    let hidden_data = f16s(ntok * hs, 6, 1.0);
    let head = HeadWeights::new(HeadData::F16(&head_data), vocab, hs)?;
    let hidden = Hidden::f16(&hidden_data, ntok, hs)?;
    let teacher = Teacher::new(&teacher_ids(ntok, vocab, kk), &vec![1.0; ntok * kk], ntok, kk, vocab)?;
    let mut engine = Engine::new(b, &head, SliceOptions::default())?;
    let opts = LossOptions::default();
    g.measurement_time(s.measure * 3);
    g.throughput(Throughput::Elements((4 * ntok * vocab * hs) as u64));
    g.bench_function(format!("head_kl {ntok}:{vocab}:{hs}:{kk}"), |bch| {
        bch.iter(|| black_box(engine.head_kl(&hidden, &teacher, &opts).unwrap()))
    });
    g.finish();
    Ok(())
}

/// Runs the benches on a backend, or says why it cannot.
fn run_or_skip<B: Backend>(c: &mut Criterion, name: &str, opened: headkl_core::Result<B>, s: &Sizes) {
    let must = harness_suite().requires(name);
    match opened {
        Ok(b) => {
            let info = b.info();
            eprintln!(
                "{name}: {} ({}), matrix units {}",
                info.device_name,
                info.device_type,
                if info.matrix_units { "on" } else { "off" }
            );
            if let Err(e) = bench_backend(c, &b, s) {
                panic!("{name}: bench failed: {e}");
            }
        }
        Err(e) if must => panic!("{name} cannot start and HEADKL_REQUIRE names it: {e}"),
        Err(e) => eprintln!("{name}: skipped, cannot start: {e}"),
    }
}

fn kernels(c: &mut Criterion) {
    let s = sizes();
    if s.label == "small" {
        run_or_skip(c, "reference", Ok(headkl_reference::CpuBackend::new()), &s);
    } else {
        eprintln!("reference: skipped for shape {} (the CPU would take hours)", s.label);
    }
    let env = harness_env();
    let wgpu = headkl_wgpu::OpenOptions::from_env(&env);
    run_or_skip(
        c,
        "wgpu",
        wgpu.and_then(|o| headkl_wgpu::WgpuBackend::open_with(&o)),
        &s,
    );
    let vulkan = headkl_vulkan::VulkanOptions::from_env(&env);
    run_or_skip(
        c,
        "vulkan",
        vulkan.and_then(|o| headkl_vulkan::VulkanBackend::open_with(&o)),
        &s,
    );
}

criterion_group!(benches, kernels);
criterion_main!(benches);
