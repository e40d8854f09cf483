//! `headkl devices`: every backend × device, what it offers, and which one
//! `auto` picks and why.

use crate::environment::Settings;
use serde::Serialize;

use crate::select::{
    auto_pick, enumerate_all, AutoPick, BackendArg, BackendArgs, BackendKind, Enumeration, SOFTWARE_REASON,
};

use crate::text::{fmt_bytes, table};

/// One row of the listing (JSON form).
#[derive(Debug, Serialize)]
pub struct DeviceRow {
    /// Backend name.
    pub backend: BackendKind,
    /// Device index within the backend; `None` on a row saying why the
    /// backend has no devices.
    pub index: Option<usize>,
    /// Device name.
    pub name: Option<String>,
    /// Driver name and version.
    pub driver: Option<String>,
    /// Device type.
    pub device_type: Option<String>,
    /// Whether the GEMM runs on matrix units.
    pub matrix_units: bool,
    /// Matrix-unit shapes `(m, n, k)`.
    pub matrix_shapes: Vec<(u32, u32, u32)>,
    /// f16 arithmetic and 16-bit storage.
    pub shader_f16: bool,
    /// Subgroup size.
    pub subgroup_size: Option<u32>,
    /// Largest storage binding in bytes.
    pub max_binding_bytes: Option<u64>,
    /// Largest buffer in bytes.
    pub max_buffer_bytes: Option<u64>,
    /// Device memory in bytes.
    pub memory_bytes: Option<u64>,
    /// Whether headkl can run on it.
    pub runnable: bool,
    /// Why not, when it cannot (a missing feature, or the backend's
    /// enumeration error).
    pub why_not: Option<String>,
    /// Whether `auto` picks this row.
    pub auto: bool,
    /// The GEMM kernels the backend runs there by default, and whether the
    /// PTX tiles can run (or why not), where it says.
    pub gemm: Option<String>,
}

/// The whole listing (JSON form).
#[derive(Debug, Serialize)]
pub struct DeviceListing {
    /// One row per backend × device.
    pub devices: Vec<DeviceRow>,
    /// `auto`'s pick.
    pub auto: AutoJson,
}

/// `auto`'s pick (JSON form).
#[derive(Debug, Serialize)]
pub struct AutoJson {
    /// Backend.
    pub backend: BackendKind,
    /// Device index.
    pub index: usize,
    /// Why.
    pub reason: String,
}

/// The rows for an enumeration and the pick, in policy order (a failed
/// backend's row where its devices would be).
pub fn rows(e: &Enumeration, pick: &AutoPick) -> Vec<DeviceRow> {
    let mut out = Vec::new();
    for kind in BackendKind::ALL {
        if let Some(why) = e.failure(kind) {
            out.push(DeviceRow {
                backend: kind,
                index: None,
                name: None,
                driver: None,
                device_type: None,
                matrix_units: false,
                matrix_shapes: Vec::new(),
                shader_f16: false,
                subgroup_size: None,
                max_binding_bytes: None,
                max_buffer_bytes: None,
                memory_bytes: None,
                runnable: false,
                why_not: Some(why.to_string()),
                auto: false,
                gemm: None,
            });
        }
        for c in e.candidates.iter().filter(|c| c.kind == kind) {
            let i = &c.info;
            out.push(DeviceRow {
                backend: kind,
                index: Some(c.index),
                name: Some(i.device_name.clone()),
                driver: Some(i.driver.clone()),
                device_type: Some(i.device_type.clone()),
                matrix_units: i.matrix_units,
                matrix_shapes: i.matrix_shapes.clone(),
                shader_f16: i.shader_f16,
                subgroup_size: i.subgroup_size,
                // The CPU reference has no binding limit: its 2 GiB is only
                // where it cuts the head into slices, not a device's limit.
                max_binding_bytes: (kind != BackendKind::Reference).then_some(i.max_binding_bytes),
                max_buffer_bytes: (kind != BackendKind::Reference).then_some(i.max_buffer_bytes),
                memory_bytes: i.memory_bytes,
                runnable: i.unusable.is_none(),
                why_not: i.unusable.clone(),
                auto: kind == pick.kind && c.index == pick.index,
                gemm: i.gemm.clone(),
            });
        }
    }
    out
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// The listing as a text table.
pub fn render(rows: &[DeviceRow], pick: &AutoPick) -> String {
    let header = [
        "",
        "backend",
        "dev",
        "name",
        "driver",
        "type",
        "matrix units",
        "f16",
        "subgroup",
        "max binding",
        "memory",
        "runnable",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let dash = || "-".to_string();
            if r.index.is_none() {
                // Blank, backend, nine dashes, then why: one cell per column.
                let mut v = vec![String::new(), r.backend.to_string()];
                v.extend((0..header.len() - 3).map(|_| dash()));
                v.push(format!("no: {}", r.why_not.as_deref().unwrap_or("unknown")));
                return v;
            }
            let mu = if r.matrix_units {
                let shapes: Vec<String> = r.matrix_shapes.iter().map(|(m, n, k)| format!("{m}x{n}x{k}")).collect();
                format!("yes {}", shapes.join(","))
            } else {
                "no".to_string()
            };
            vec![
                if r.auto { "*".into() } else { String::new() },
                r.backend.to_string(),
                r.index.map(|i| i.to_string()).unwrap_or_else(dash),
                r.name.clone().unwrap_or_else(dash),
                r.driver.clone().unwrap_or_else(dash),
                r.device_type.clone().unwrap_or_else(dash),
                mu,
                yes_no(r.shader_f16).into(),
                r.subgroup_size.map(|s| s.to_string()).unwrap_or_else(dash),
                r.max_binding_bytes.map(fmt_bytes).unwrap_or_else(dash),
                r.memory_bytes.map(fmt_bytes).unwrap_or_else(dash),
                match &r.why_not {
                    None => "yes".into(),
                    Some(why) => format!("no: {why}"),
                },
            ]
        })
        .collect();
    let mut out = table(&header, &cells);
    out.push_str(&format!(
        "\n* auto picks {} device {}: {}\n",
        pick.kind, pick.index, pick.reason
    ));
    for r in rows.iter().filter(|r| r.runnable) {
        if let (Some(gemm), Some(index)) = (&r.gemm, r.index) {
            out.push_str(&format!("  {} device {index}: {gemm}\n", r.backend));
        }
    }
    for r in rows.iter().filter(|r| {
        r.backend != BackendKind::Reference
            && r.runnable
            && r.device_type
                .as_deref()
                .is_some_and(|t| t.to_ascii_lowercase().contains("cpu"))
    }) {
        out.push_str(&format!(
            "  {} device {} ({}) is {SOFTWARE_REASON}; auto passes over it (--backend {} runs there anyway)\n",
            r.backend,
            r.index.unwrap_or(0),
            r.name.as_deref().unwrap_or("?"),
            r.backend
        ));
    }
    out
}

/// Runs `headkl devices`: every backend, or only the one `--backend` names.
pub fn run(args: &BackendArgs, json: bool, settings: &Settings) -> Result<(), crate::error::CliError> {
    let args = &args.with_settings(settings);
    let e = enumerate_all(&settings.runtime);
    let pick = auto_pick(&e.candidates, args.device);
    let mut rows = rows(&e, &pick);
    if let Some(BackendArg::Named(kind)) = args.backend {
        rows.retain(|r| r.backend == kind);
    }
    if json {
        let listing = DeviceListing {
            devices: rows,
            auto: AutoJson {
                backend: pick.kind,
                index: pick.index,
                reason: pick.reason,
            },
        };
        let text = serde_json::to_string_pretty(&listing).map_err(|e| crate::error::CliError::Output {
            file: "<stdout>".into(),
            problem: e.to_string(),
        })?;
        println!("{text}");
    } else {
        print!("{}", render(&rows, &pick));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use headkl_core::DeviceInfo;
    use headkl_runtime::Candidate;

    #[test]
    fn failed_backend_gets_one_row_and_one_auto_mark() {
        let info = DeviceInfo {
            backend: "reference",
            device_name: "cpu".into(),
            driver: "f64".into(),
            device_type: "cpu".into(),
            matrix_units: false,
            gemm: None,
            queue: None,
            matrix_shapes: vec![],
            shader_f16: false,
            subgroup_size: None,
            max_binding_bytes: 1 << 40,
            max_buffer_bytes: 1 << 40,
            memory_bytes: None,
            unusable: None,
        };
        let e = Enumeration {
            candidates: vec![Candidate {
                kind: BackendKind::Reference,
                index: 0,
                info,
            }],
            failures: vec![(BackendKind::Vulkan, "no Vulkan loader".into())],
        };
        let pick = auto_pick(&e.candidates, None);
        let r = rows(&e, &pick);
        assert_eq!(r.len(), 2);
        assert_eq!(r.iter().filter(|r| r.auto).count(), 1);
        let text = render(&r, &pick);
        assert!(text.contains("no Vulkan loader"), "{text}");
        assert!(text.contains("* auto picks reference"), "{text}");
    }
}
