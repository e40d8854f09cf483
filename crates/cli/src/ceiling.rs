//! `headkl tune --ceiling`: how close the matrix-unit GEMM comes to what the
//! device's matrix units deliver, part by part. On the Vulkan backend it
//! times the GLSL variants of `shaders/gemm_khr.comp` at the tune shape,
//! both layouts:
//! (a) multiply-adds from registers, (b) fragments + multiply-adds from
//! workgroup memory staged once, (c) the global loads only, (d) the staging
//! only, pipelined as the GEMM does it, (e) the GEMMs: each GLSL tile
//! (checked on the conformance suite's kernel cases and on sampled elements
//! at this shape) and the GEMM headkl runs now (the backend's choice, by
//! default the GLSL `bm128.bk64.s1` tile), labelled with its kernel. Two tiles also get
//! (c), (d) and (e) with operands read as if pre-tiled (each K step's tile
//! one contiguous run), and their GEMMs with f16 accumulators (half the
//! accumulator registers); a few tiles also read A (or A and B) straight
//! into fragments as if stored in fragment order (docs/PERFORMANCE.md, row
//! 37): timings of what those levers would buy, never checked, since their
//! results are not the GEMM headkl computes.
//! Each is printed as
//! TFLOP/s (the rate of a GEMM that moves the same bytes, for (c) and (d))
//! and as a percentage of (a).

use half::f16;
use headkl_conformance::{Part, SuiteConfig};
use headkl_core::toolkit::{CoopGemm, GemmDesc, HeadLayout, Kernels};
use headkl_core::{Backend, GemmChoice};
use headkl_vulkan::{CeilingKernel, CeilingPart, GlslTile, VulkanBackend, VulkanBuffer};

use crate::error::CliError;
use crate::select::Target;
use crate::text::table;
use crate::tune::{GemmShape, TuneData};

/// Sampled elements must agree with the f64 dot product within this
/// fraction of `Σ|a·b|` (f32 accumulation over k terms stays far below).
const SAMPLE_REL: f64 = 2e-4;

/// One timed kernel.
struct Timed {
    layout: HeadLayout,
    part: CeilingPart,
    kernel: String,
    ms: f64,
    /// For GEMMs: kernel cases and sampled elements, in words.
    check: String,
}

/// The three buffers and the description of one layout's GEMM.
struct Operands<'a> {
    a: &'a VulkanBuffer,
    b: &'a VulkanBuffer,
    c: &'a VulkanBuffer,
    desc: GemmDesc,
}

/// Runs the ceiling report on `target` (already checked to be Vulkan with
/// matrix units by the caller's device info) at `shape`.
pub fn run(target: &Target, shape: GemmShape, iters: usize) -> Result<(), CliError> {
    let dev = |e| CliError::device("tune --ceiling", e);
    let mut backend =
        <VulkanBackend as headkl_runtime::RuntimeBackend>::open(target, None).map_err(crate::select::RunError::from)?;
    if let Some(why) = backend.glsl_unavailable() {
        return Err(CliError::option(
            "--ceiling",
            format!("{why}: no matrix-unit ceiling to report"),
        ));
    }
    let kernels = backend.ceiling_kernels();
    let current = backend.gemm_kernel();
    eprintln!(
        "ceiling: {} variants at m:n:k = {shape}, median of {iters}; current GEMM {current}",
        kernels.len()
    );

    // The correctness gate: each GLSL GEMM tile on the suite's kernel cases.
    let mut tiles: Vec<GlslTile> = Vec::new();
    for k in kernels.iter().filter(|k| k.is_tile_gemm()) {
        if !tiles.contains(&k.tile()) {
            tiles.push(k.tile());
        }
    }
    let mut gate = Vec::new();
    let current_choice = backend.gemm_choice();
    for &tile in &tiles {
        let glsl = CoopGemm::Glsl(tile);
        backend.use_gemm(GemmChoice { logits: glsl, dx: glsl }).map_err(dev)?;
        let report =
            headkl_conformance::run_part(&backend, Part::Kernels, &SuiteConfig { cases: 0, seed: 0 }, &mut |_| {});
        let verdict = match report.failures.first() {
            None => format!("{}/{} cases", report.passed, report.cases),
            Some(f) => format!(
                "FAILED {}/{} cases ({}: {})",
                report.passed, report.cases, f.name, f.message
            ),
        };
        eprintln!("ceiling: GLSL GEMM {tile}: {verdict}");
        gate.push((tile, verdict));
    }
    if let Some(choice) = current_choice {
        backend.use_gemm(choice).map_err(dev)?;
    }

    let data = TuneData::new(shape);
    let GemmShape { m, n, k } = shape;
    let x = backend.alloc((m * k * 2) as u64, "ceiling x").map_err(dev)?;
    let head = backend.alloc((n * k * 2) as u64, "ceiling head").map_err(dev)?;
    let grad = backend.alloc((m * n * 2) as u64, "ceiling grad").map_err(dev)?;
    let logits = backend.alloc((m * n * 4) as u64, "ceiling logits").map_err(dev)?;
    let dx = backend.alloc((m * k * 4) as u64, "ceiling dx").map_err(dev)?;
    data.upload(&backend, &x, &head, &grad).map_err(dev)?;
    if !backend.set_profiling(true) {
        return Err(CliError::option("--ceiling", "this device has no kernel timestamps"));
    }

    let mut timed = Vec::new();
    for layout in [HeadLayout::Logits, HeadLayout::Dx] {
        let ops = match layout {
            HeadLayout::Logits => Operands {
                a: &x,
                b: &head,
                c: &logits,
                desc: GemmDesc::dense(m, n, k, layout),
            },
            HeadLayout::Dx => Operands {
                a: &grad,
                b: &head,
                c: &dx,
                desc: GemmDesc::dense(m, k, n, layout),
            },
        };
        let mine: Vec<&CeilingKernel> = kernels.iter().filter(|k| k.layout() == layout).collect();
        let medians = time_layout(&backend, &ops, &mine, iters).map_err(dev)?;
        for (kernel, ms) in mine.iter().zip(&medians) {
            let check = if !kernel.exact() {
                "timing only".to_string()
            } else if kernel.part() == CeilingPart::Gemm {
                let gate = gate
                    .iter()
                    .find(|(t, _)| *t == kernel.tile())
                    .map_or("-".to_string(), |(_, v)| v.clone());
                backend
                    .dispatch_glsl(kernel.name, ops.a, ops.b, ops.c, &ops.desc, kernel.name)
                    .map_err(dev)?;
                format!("{gate}; {}", sample_check(&backend, &ops, &data).map_err(dev)?)
            } else {
                String::new()
            };
            timed.push(Timed {
                layout,
                part: kernel.part(),
                kernel: kernel.label(),
                ms: *ms,
                check,
            });
        }
        let current_ms = medians.last().copied().unwrap_or(f64::NAN);
        backend.gemm(ops.a, ops.b, ops.c, &ops.desc).map_err(dev)?;
        let check = sample_check(&backend, &ops, &data).map_err(dev)?;
        timed.push(Timed {
            layout,
            part: CeilingPart::Gemm,
            kernel: current_label(current_choice, layout),
            ms: current_ms,
            check,
        });
    }
    backend.set_profiling(false);
    println!("current: {current}");
    print_report(shape, &timed);
    Ok(())
}

/// Times every kernel of `mine` and then the current GEMM on one layout
/// (the backend's choice as opened: the caller restored it after the gate),
/// `iters` rounds after an untimed one; returns their medians in ms, the
/// current GEMM's last.
fn time_layout(
    backend: &VulkanBackend,
    ops: &Operands,
    mine: &[&CeilingKernel],
    iters: usize,
) -> headkl_core::Result<Vec<f64>> {
    for timed_round in [false, true] {
        let rounds = if timed_round { iters } else { 1 };
        for _ in 0..rounds {
            for kernel in mine {
                backend.dispatch_glsl(kernel.name, ops.a, ops.b, ops.c, &ops.desc, kernel.name)?;
            }
            backend.gemm(ops.a, ops.b, ops.c, &ops.desc)?;
            backend.finish()?;
        }
        if !timed_round {
            backend.take_kernel_times()?;
        }
    }
    let times = backend.take_kernel_times()?;
    let median_of = |label: &str| {
        let v: Vec<f64> = times.iter().filter(|t| t.kernel == label).map(|t| t.ms).collect();
        if v.is_empty() {
            f64::NAN
        } else {
            crate::bench::median(&crate::bench::sorted(v))
        }
    };
    let mut out: Vec<f64> = mine.iter().map(|k| median_of(k.name)).collect();
    // The current GEMM is timed under its kernel's name.
    out.push(median_of(ops.desc.kernel().name()));
    Ok(out)
}

/// Compares sampled elements of the GEMM just recorded into `ops.c` with
/// the f64 dot product: rows 0, m/2 and m − 1, 16 columns each including
/// the last.
fn sample_check(backend: &VulkanBackend, ops: &Operands, data: &TuneData) -> headkl_core::Result<String> {
    backend.finish()?;
    let d = &ops.desc;
    let (m, n, k) = (d.m, d.n, d.k);
    let mut worst = 0.0f64;
    let mut bad = 0;
    let mut row = vec![0f32; n];
    let rows = [0, m / 2, m - 1];
    for &i in &rows {
        backend.download(ops.c, (i * d.ldc * 4) as u64, bytemuck::cast_slice_mut(&mut row))?;
        for s in 0..16 {
            let j = if s == 15 { n - 1 } else { (s * 7919 + i * 31) % n };
            let (mut want, mut scale) = (0.0f64, 0.0f64);
            for r in 0..k {
                let (av, bv) = match d.b_layout {
                    // x [m][k] · head [n][k]ᵀ
                    HeadLayout::Logits => (data.hidden[i * k + r], data.head[j * k + r]),
                    // grad [m][n_vocab] · head [n_vocab][hs]: here k is the vocabulary.
                    HeadLayout::Dx => (data.head[i * k + r], data.head[r * n + j]),
                };
                let p = f64::from(f16::to_f32(av)) * f64::from(f16::to_f32(bv));
                want += p;
                scale += p.abs();
            }
            let err = (f64::from(row[j]) - want).abs() / scale.max(f64::MIN_POSITIVE);
            worst = worst.max(err);
            if err > SAMPLE_REL || !err.is_finite() {
                bad += 1;
            }
        }
    }
    Ok(if bad == 0 {
        format!("48 sampled ok (worst {worst:.1e} of Σ|ab|)")
    } else {
        format!("FAILED {bad}/48 sampled (worst {worst:.1e} of Σ|ab|)")
    })
}

/// The (e) row label of the GEMM the backend runs now for `layout`: its
/// matrix-unit kernel (`glsl:…` or a WGSL tile), or the tiled fallback.
fn current_label(choice: Option<GemmChoice>, layout: HeadLayout) -> String {
    match choice {
        Some(choice) => format!("current: {}", choice.for_layout(layout)),
        None => "current: tiled".to_string(),
    }
}

fn layout_name(layout: HeadLayout) -> &'static str {
    match layout {
        HeadLayout::Logits => "logits (A·Bᵀ)",
        HeadLayout::Dx => "dx (A·B)",
    }
}

fn print_report(shape: GemmShape, timed: &[Timed]) {
    let flops = 2.0 * shape.m as f64 * shape.n as f64 * shape.k as f64;
    for layout in [HeadLayout::Logits, HeadLayout::Dx] {
        let rows: Vec<&Timed> = timed.iter().filter(|t| t.layout == layout).collect();
        let regs = rows
            .iter()
            .find(|t| t.part == CeilingPart::Registers)
            .map(|t| t.ms)
            .unwrap_or(f64::NAN);
        println!(
            "\nceiling {} at m:n:k = {shape} (TFLOP/s; for (c) and (d), of a GEMM moving the same bytes)",
            layout_name(layout)
        );
        let mut lines = Vec::new();
        for t in rows {
            lines.push(vec![
                format!("({}) {}", t.part.letter(), t.part.describe()),
                t.kernel.clone(),
                format!("{:.3}", t.ms),
                format!("{:.1}", flops / t.ms / 1e9),
                format!("{:.0}%", 100.0 * regs / t.ms),
                t.check.clone(),
            ]);
        }
        print!(
            "{}",
            table(&["part", "tile", "ms", "TFLOP/s", "% of (a)", "check"], &lines)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_row_names_the_kernel_the_backend_runs() {
        let glsl = GemmChoice::GLSL_DEFAULT;
        assert_eq!(
            current_label(Some(glsl), HeadLayout::Logits),
            "current: glsl:bm128.bk64.s1"
        );
        assert_eq!(current_label(Some(glsl), HeadLayout::Dx), "current: glsl:bm128.bk64.s1");
        let mixed = GemmChoice {
            logits: glsl.logits,
            dx: headkl_core::toolkit::CoopGemm::Direct,
        };
        assert_eq!(
            current_label(Some(mixed), HeadLayout::Logits),
            "current: glsl:bm128.bk64.s1"
        );
        assert_eq!(current_label(Some(mixed), HeadLayout::Dx), "current: direct");
        assert_eq!(current_label(None, HeadLayout::Dx), "current: tiled");
    }
}
