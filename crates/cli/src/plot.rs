//! `headkl bench --plot`: a hand-written SVG bar chart, one bar per backend
//! per job, its height the effective TFLOP/s, labelled with ms and TFLOP/s.

use std::fmt::Write;

use crate::bench::BenchRun;
use crate::text::fmt_stepped;

const HEIGHT: f64 = 420.0;
const TOP: f64 = 60.0;
const BOTTOM: f64 = 90.0;
const LEFT: f64 = 70.0;
const BAR: f64 = 64.0;
const GAP: f64 = 18.0;
const GROUP_GAP: f64 = 48.0;

/// Escapes text for an SVG text node or attribute.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn colour(backend: &str) -> &'static str {
    match backend {
        "vulkan" => "#b03a2e",
        "wgpu" => "#2874a6",
        "reference" => "#7f8c8d",
        _ => "#7d3c98",
    }
}

/// A round axis maximum at or above `v`.
fn nice_max(v: f64) -> f64 {
    if !(v > 0.0 && v.is_finite()) {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * mag >= v {
            return m * mag;
        }
    }
    10.0 * mag
}

fn fmt_num(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else {
        fmt_stepped(v, &[(100.0, 0), (1.0, 1), (0.01, 3)])
    }
}

/// The chart for `runs`, grouped by job.
pub fn svg(runs: &[BenchRun]) -> String {
    let jobs = ["head_kl", "topk"];
    let bars_per_group = runs.len().max(1) as f64;
    let group_w = bars_per_group * BAR + (bars_per_group - 1.0) * GAP;
    let width = LEFT + jobs.len() as f64 * (group_w + GROUP_GAP) + 20.0;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let max_tf = runs
        .iter()
        .flat_map(|r| r.jobs.iter().map(|j| j.tflops))
        .fold(0.0, f64::max);
    // Below 1 TFLOP/s (software devices, the CPU reference) GFLOP/s reads better.
    let (unit, unit_short, scale) = if max_tf >= 1.0 {
        ("TFLOP/s", "TF/s", 1.0)
    } else {
        ("GFLOP/s", "GF/s", 1e3)
    };
    let y_max = nice_max(max_tf * scale);
    let y = |v: f64| TOP + plot_h * (1.0 - (v / y_max).clamp(0.0, 1.0));

    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{HEIGHT:.0}" viewBox="0 0 {width:.0} {HEIGHT:.0}" font-family="sans-serif">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{:.0}" y="24" font-size="16" text-anchor="middle">headkl bench: effective {unit} (higher is better)</text>"#,
        width / 2.0
    );
    let shapes: Vec<String> = runs.iter().map(|r| r.shape.to_string()).collect::<Vec<_>>();
    let mut uniq = shapes.clone();
    uniq.dedup();
    let _ = writeln!(
        s,
        r##"<text x="{:.0}" y="42" font-size="11" text-anchor="middle" fill="#555">shape ntok:V:hs:k {}</text>"##,
        width / 2.0,
        esc(&uniq.join(", "))
    );
    // Axis and grid.
    for i in 0..=4 {
        let v = y_max * f64::from(i) / 4.0;
        let yy = y(v);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.0}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.0}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            width - 10.0,
            LEFT - 6.0,
            yy + 4.0,
            fmt_num(v)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="16" y="{:.0}" font-size="12" transform="rotate(-90 16 {:.0})" text-anchor="middle">{unit}</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    for (g, job) in jobs.iter().enumerate() {
        let gx = LEFT + GROUP_GAP / 2.0 + g as f64 * (group_w + GROUP_GAP);
        for (i, run) in runs.iter().enumerate() {
            let Some(j) = run.jobs.iter().find(|j| j.job.name() == *job && j.path == "host") else {
                continue;
            };
            let x = gx + i as f64 * (BAR + GAP);
            let value = j.tflops * scale;
            let top = y(value);
            let base = TOP + plot_h;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{top:.1}" width="{BAR}" height="{:.1}" fill="{}"><title>{} {} {} at {}: {} ms ({} time), {} {unit}</title></rect>"#,
                (base - top).max(0.5),
                colour(run.info.backend),
                esc(run.info.backend),
                esc(&run.info.device_name),
                job,
                run.shape,
                fmt_num(j.gpu_ms.unwrap_or(j.median_ms)),
                j.tflops_from,
                fmt_num(value)
            );
            let cx = x + BAR / 2.0;
            let _ = writeln!(
                s,
                r#"<text x="{cx:.1}" y="{:.1}" font-size="10" text-anchor="middle">{} ms</text><text x="{cx:.1}" y="{:.1}" font-size="10" text-anchor="middle">{} {unit_short}</text>"#,
                top - 16.0,
                fmt_num(j.gpu_ms.unwrap_or(j.median_ms)),
                top - 4.0,
                fmt_num(value)
            );
            let _ = writeln!(
                s,
                r#"<text x="{cx:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
                base + 14.0,
                esc(run.info.backend)
            );
            let mut device = run.info.device_name.clone();
            if device.chars().count() > 14 {
                device = device.chars().take(13).collect::<String>() + "…";
            }
            let _ = writeln!(
                s,
                r##"<text x="{cx:.1}" y="{:.1}" font-size="9" text-anchor="middle" fill="#555">{}</text>"##,
                base + 26.0,
                esc(&device)
            );
            // Which shape this bar ran, and what its time is.
            let _ = writeln!(
                s,
                r##"<text x="{cx:.1}" y="{:.1}" font-size="9" text-anchor="middle" fill="#555">{} ({} time)</text>"##,
                base + 38.0,
                esc(&run.shape.to_string()),
                j.tflops_from
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="13" font-weight="bold" text-anchor="middle">{job}</text>"#,
            gx + group_w / 2.0,
            TOP + plot_h + 56.0
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="{:.0}" font-size="10" fill="#555">ms: median GPU time where the backend times kernels, else median wall time (CPU time for the reference); under each bar its shape ntok:V:hs:k</text>"##,
        HEIGHT - 10.0
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{JobKind, JobResult, Shape};
    use headkl_core::{Backend, DeviceInfo};

    #[test]
    fn one_bar_per_backend_per_job() {
        let job = |job, tflops| JobResult {
            job,
            path: "host",
            iters: 3,
            median_ms: 12.5,
            min_ms: 12.0,
            max_ms: 13.0,
            gpu_ms: None,
            tflops,
            tflops_from: "wall",
            wall_tflops: tflops,
            peak_extra_bytes: 0,
            kernels: vec![],
            filter: None,
        };
        let cpu = headkl_reference::CpuBackend::new().info().clone();
        let run = |backend: &'static str, device: &str| BenchRun {
            info: DeviceInfo {
                backend,
                device_name: device.into(),
                ..cpu.clone()
            },
            shape: Shape::A,
            head_bytes: 1,
            slices: 1,
            upload_ms: 1.0,
            jobs: vec![job(JobKind::HeadKl, 3.0), job(JobKind::Topk, 1.5)],
        };
        let svg_of_slow = || {
            let mut r = run("reference", "cpu");
            r.jobs[0].tflops = 0.002;
            r.jobs[1].tflops = 0.001;
            svg(&[r])
        };
        let svg = svg(&[run("vulkan", "A<B>&C"), run("reference", "cpu")]);
        assert_eq!(svg.matches("<rect x=").count(), 4);
        assert!(svg.contains("A&lt;B&gt;&amp;C"));
        assert!(svg.contains("12.5 ms") && svg.contains("3.0 TF/s"), "{svg}");
        let slow = svg_of_slow();
        assert!(slow.contains("GFLOP/s") && slow.contains("2.0 GF/s"), "{slow}");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(nice_max(3.0), 5.0);
        assert_eq!(nice_max(0.0), 1.0);
    }
}
