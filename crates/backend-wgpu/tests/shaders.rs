//! Every WGSL file in `shaders/` parses, validates with every capability
//! (f16, subgroups, cooperative matrices) and translates to SPIR-V with its
//! `override` constants resolved, as the Vulkan backend will build it. This
//! is the only CI check that `gemm_coop.wgsl` compiles: lavapipe has no
//! matrix units to run it.

use std::path::PathBuf;

use naga::back::spv;
use naga::valid::{Capabilities, ValidationFlags, Validator};

fn shader_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shaders")
}

/// Override values to try per file (the defaults first).
fn override_sets(file: &str) -> Vec<Vec<(&'static str, f64)>> {
    match file {
        "gemm_coop.wgsl" => vec![
            vec![],
            vec![("SG_SIZE", 32.0), ("BK", 16.0)],
            vec![("SG_SIZE", 64.0), ("BK", 32.0)],
            vec![("SG_SIZE", 32.0), ("BK", 16.0), ("SG_ROWS", 4.0)],
        ],
        "gemm_coop_direct.wgsl" => vec![vec![], vec![("SG_SIZE", 64.0)]],
        _ => vec![vec![]],
    }
}

fn compile(file: &str, source: &str, overrides: &[(&str, f64)]) -> Result<usize, String> {
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    let mut validator = Validator::new(ValidationFlags::all(), Capabilities::all());
    let info = validator.validate(&module).map_err(|e| e.emit_to_string(source))?;
    let mut constants = naga::back::PipelineConstants::default();
    for &(name, value) in overrides {
        constants.insert(name.to_string(), value);
    }
    let mut words = 0;
    for ep in &module.entry_points {
        let (resolved, resolved_info) =
            naga::back::pipeline_constants::process_overrides(&module, &info, Some((ep.stage, &ep.name)), &constants)
                .map_err(|e| format!("{file}:{}: overrides {overrides:?}: {e}", ep.name))?;
        let options = spv::Options {
            lang_version: (1, 3),
            ..spv::Options::default()
        };
        let pipeline = spv::PipelineOptions {
            shader_stage: ep.stage,
            entry_point: ep.name.clone(),
        };
        let spirv = spv::write_vec(&resolved, &resolved_info, &options, Some(&pipeline))
            .map_err(|e| format!("{file}:{}: SPIR-V: {e}", ep.name))?;
        assert!(spirv.len() > 5, "{file}:{}: empty SPIR-V", ep.name);
        assert_eq!(spirv[0], 0x0723_0203, "{file}:{}: not SPIR-V", ep.name);
        words += spirv.len();
    }
    Ok(words)
}

#[test]
fn every_shader_validates_and_translates_to_spirv() {
    let mut files: Vec<_> = std::fs::read_dir(shader_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "wgsl"))
        .collect();
    files.sort();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for needed in [
        "convert.wgsl",
        "kl_rows.wgsl",
        "topk_rows.wgsl",
        "gemm_tiled.wgsl",
        "gemm_coop.wgsl",
    ] {
        assert!(names.iter().any(|n| n == needed), "shaders/{needed} is missing");
    }
    let mut failures = Vec::new();
    let common = std::fs::read_to_string(shader_dir().join("resident_common.wgsl")).unwrap();
    for (path, name) in files.iter().zip(&names) {
        let mut source = std::fs::read_to_string(path).unwrap();
        // The resident kernels are built after their shared header.
        if name.starts_with("resident_") && name != "resident_common.wgsl" {
            source = format!("{common}{source}");
        }
        for set in override_sets(name) {
            match compile(name, &source, &set) {
                Ok(words) => println!("{name} {set:?}: {words} SPIR-V words"),
                Err(e) => failures.push(format!("{name} {set:?}:\n{e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn entry_points_match_the_contract() {
    let expect = [
        ("convert.wgsl", &["convert_f16"][..]),
        ("kl_rows.wgsl", &["kl_rows"][..]),
        ("topk_rows.wgsl", &["topk_rows"][..]),
        ("gemm_tiled.wgsl", &["gemm_nt", "gemm_nn"][..]),
        ("gemm_coop.wgsl", &["gemm_nt", "gemm_nn"][..]),
        ("gemm_coop_direct.wgsl", &["gemm_nt", "gemm_nn"][..]),
    ];
    for (file, entries) in expect {
        let source = std::fs::read_to_string(shader_dir().join(file)).unwrap();
        let module = naga::front::wgsl::parse_str(&source)
            .map_err(|e| e.emit_to_string(&source))
            .unwrap();
        for entry in entries {
            assert!(
                module.entry_points.iter().any(|ep| ep.name == *entry),
                "{file} lacks entry point {entry}"
            );
        }
    }
}

/// Each device-resident kernel, built as the backends build it
/// (`resident_common.wgsl` first), has the entry point, workgroup size and
/// storage bindings (count and access) `headkl_core::ResidentKernel` lists.
#[test]
fn resident_kernels_match_the_catalogue() {
    use headkl_core::resident::Access;
    use headkl_core::ResidentKernel;
    let common = std::fs::read_to_string(shader_dir().join("resident_common.wgsl")).unwrap();
    for kernel in ResidentKernel::ALL {
        let body = std::fs::read_to_string(shader_dir().join(kernel.file())).unwrap();
        let source = format!("{common}{body}");
        let module = naga::front::wgsl::parse_str(&source)
            .map_err(|e| e.emit_to_string(&source))
            .unwrap();
        let ep = module
            .entry_points
            .iter()
            .find(|ep| ep.name == kernel.entry())
            .unwrap_or_else(|| panic!("{} lacks entry point {}", kernel.file(), kernel.entry()));
        assert_eq!(ep.workgroup_size, [kernel.workgroup_size(), 1, 1], "{}", kernel.file());
        let mut storage: Vec<(u32, bool)> = module
            .global_variables
            .iter()
            .filter_map(|(_, g)| match (g.space, &g.binding) {
                (naga::AddressSpace::Storage { access }, Some(b)) => {
                    Some((b.binding, access.contains(naga::StorageAccess::STORE)))
                }
                _ => None,
            })
            .collect();
        storage.sort_unstable();
        let want: Vec<(u32, bool)> = kernel
            .bindings()
            .iter()
            .enumerate()
            .map(|(i, a)| (i as u32 + 1, *a == Access::ReadWrite))
            .collect();
        assert_eq!(
            storage,
            want,
            "{}: storage bindings (binding, read_write)",
            kernel.file()
        );
    }
}
