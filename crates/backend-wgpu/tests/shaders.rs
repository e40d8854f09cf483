//! The kernel catalogue (`headkl_core::toolkit::kernels`) against the shaders it
//! names, without a device: every build of every kernel (each GEMM family,
//! every matrix-unit tile at subgroups 32 and 64) parses, validates with
//! every capability, resolves its overrides and translates to SPIR-V as the
//! Vulkan backend builds it; and its parameter struct, storage bindings,
//! workgroup size and workgroup memory are the catalogue's (the parameter
//! struct is generated from `core::params`: this checks the generation). This is the only
//! CI check that `gemm_coop.wgsl` compiles: lavapipe has no matrix units.
//! The GLSL tiles' builds (at subgroup 32, the only size they are written
//! for) are held to the SPIR-V headkl-glsl built for them, which wgpu
//! passes through: present, with the catalogue's bindings, workgroup and
//! workgroup memory (`headkl_glsl::check_build`).

use headkl_core::toolkit::kernels::{Access, SHADERS};
use headkl_core::toolkit::{CoopGemm, GemmKernel, KernelBuild, KernelId, KernelSource};
use naga::back::spv;
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// Every build the backends can ask for.
fn builds() -> Vec<KernelBuild> {
    let mut gemms = vec![GemmKernel::Tiled];
    for subgroup in [32, 64] {
        gemms.extend(
            CoopGemm::candidates()
                .into_iter()
                .filter(|kernel| subgroup == 32 || !matches!(kernel, CoopGemm::Glsl(_) | CoopGemm::Wgmma(_)))
                .map(|kernel| GemmKernel::Coop { kernel, subgroup }),
        );
    }
    let mut all = Vec::new();
    for kernel in KernelId::ALL {
        if kernel.gemm_layout().is_some() {
            all.extend(gemms.iter().map(|&g| kernel.build(g)));
        } else {
            all.push(kernel.build(GemmKernel::Tiled));
        }
    }
    all
}

fn parse(file: &str, text: &str) -> (naga::Module, naga::valid::ModuleInfo) {
    let module = naga::front::wgsl::parse_str(text).unwrap_or_else(|e| panic!("{file}:\n{}", e.emit_to_string(text)));
    let info = Validator::new(ValidationFlags::all(), Capabilities::all())
        .validate(&module)
        .unwrap_or_else(|e| panic!("{file}:\n{}", e.emit_to_string(text)));
    (module, info)
}

/// Checks one build; returns what is wrong with it, if anything.
fn check(build: &KernelBuild) -> Result<usize, String> {
    let shader = match build.source {
        KernelSource::Wgsl(shader) => shader,
        KernelSource::Glsl { .. } => return headkl_glsl::check_build(build).map(|k| k.words().len()),
        // The PTX entry point, its parameter block and shared memory
        // (headkl_core's tests check the text is the source's).
        KernelSource::Ptx { .. } => return headkl_ptx::check_build(build).map(|_| headkl_ptx::PTX.len()),
    };
    let (file, entry) = (shader.file, build.entry);
    let (module, info) = parse(file, &shader.source());
    let mut constants = naga::back::PipelineConstants::default();
    for &(name, value) in &build.overrides {
        constants.insert(name.to_string(), f64::from(value));
    }
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, entry)),
        &constants,
    )
    .map_err(|e| format!("overrides {:?}: {e}", build.overrides))?;
    let ep = module
        .entry_points
        .iter()
        .find(|ep| ep.name == entry)
        .ok_or_else(|| format!("no entry point {entry}"))?;

    let invocations: u32 = ep.workgroup_size.iter().product();
    if invocations != build.invocations {
        return Err(format!(
            "workgroup of {invocations} invocations, catalogue says {}",
            build.invocations
        ));
    }
    let gctx = module.to_ctx();
    let mut workgroup_bytes = 0;
    let mut storage = Vec::new();
    for (_, var) in module.global_variables.iter() {
        let ty = &module.types[var.ty];
        match (var.space, &var.binding) {
            (naga::AddressSpace::WorkGroup, _) => workgroup_bytes += ty.inner.size(gctx),
            (naga::AddressSpace::Uniform, Some(b)) if (b.group, b.binding) == (0, 0) => {
                check_params(build.id, &module, ty)?;
            }
            (naga::AddressSpace::Storage { access }, Some(b)) if b.group == 0 => {
                let writes = access.contains(naga::StorageAccess::STORE);
                storage.push((b.binding, if writes { Access::ReadWrite } else { Access::Read }));
            }
            (space, binding) => return Err(format!("unexpected global {:?} in {space:?} at {binding:?}", var.name)),
        }
    }
    if workgroup_bytes != build.workgroup_bytes {
        return Err(format!(
            "{workgroup_bytes} bytes of workgroup memory, catalogue says {}",
            build.workgroup_bytes
        ));
    }
    storage.sort_by_key(|&(binding, _)| binding);
    let expected: Vec<(u32, Access)> = (1..).zip(build.id.bindings().iter().copied()).collect();
    if storage != expected {
        return Err(format!("storage bindings {storage:?}, catalogue says {expected:?}"));
    }

    let options = spv::Options {
        lang_version: (1, 3),
        ..spv::Options::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: entry.to_string(),
    };
    let words = spv::write_vec(&module, &info, &options, Some(&pipeline)).map_err(|e| format!("SPIR-V: {e}"))?;
    if words.first() != Some(&0x0723_0203) {
        return Err("not SPIR-V".into());
    }
    Ok(words.len())
}

/// The shader's uniform struct against `core::params`: same size, and each
/// field the catalogue lists at the same offset (padding fields aside).
fn check_params(kernel: KernelId, module: &naga::Module, ty: &naga::Type) -> Result<(), String> {
    let naga::TypeInner::Struct { members, span } = &ty.inner else {
        return Err("the uniform at binding 0 is not a struct".into());
    };
    if u64::from(*span) != kernel.params_bytes() {
        return Err(format!(
            "{span}-byte parameter struct, core's is {}",
            kernel.params_bytes()
        ));
    }
    let shader: Vec<(&str, usize)> = members
        .iter()
        .filter_map(|m| Some((m.name.as_deref()?, m.offset as usize)))
        .filter(|(name, _)| !name.starts_with("pad"))
        .collect();
    let core: Vec<(&str, usize)> = kernel.params().fields.iter().map(|&(n, o, _)| (n, o)).collect();
    if shader != core {
        return Err(format!("parameter fields {shader:?}, core's are {core:?}"));
    }
    for m in members {
        let inner = &module.types[m.ty].inner;
        if inner.size(module.to_ctx()) != 4 {
            return Err(format!("parameter field {:?} is not 4 bytes", m.name));
        }
    }
    Ok(())
}

#[test]
fn every_build_in_the_catalogue_matches_its_shader_and_compiles() {
    let builds = builds();
    let mut failures = Vec::new();
    let (mut words, mut glsl) = (0, 0);
    for build in &builds {
        match check(build) {
            Ok(n) => words += n,
            Err(e) => failures.push(format!(
                "{}:{} {:?}: {e}",
                build.source.name(),
                build.entry,
                build.overrides
            )),
        }
        glsl += usize::from(matches!(build.source, KernelSource::Glsl { .. }));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // 4 fixed kernels (kl_rows, topk_rows, sum_parts, transpose), the 11
    // device-resident ones, and per GEMM (logits, dx, dx filtered) the
    // tiled kernel, 19 WGSL tiles at 2 subgroup sizes and the GLSL and PTX
    // tiles at one (the filtered dx GEMM of a PTX tile is the GLSL filter
    // tile's).
    let tiles = headkl_core::toolkit::glsl_tile::GLSL_TILES.len();
    // The PTX tiles `tune` tries (not the bulk ones).
    let ptx = headkl_core::toolkit::CoopGemm::candidates()
        .into_iter()
        .filter(|k| matches!(k, headkl_core::toolkit::CoopGemm::Wgmma(_)))
        .count();
    assert_eq!(builds.len(), 4 + 11 + 3 * (1 + 2 * 19 + tiles + ptx));
    assert_eq!(glsl, 3 * tiles + ptx);
    assert!(words > 0);
}

#[test]
fn every_shader_file_belongs_to_a_kernel() {
    let files: Vec<String> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shaders"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".wgsl"))
        .collect();
    // A file is a shader of its own, or a part the catalogue assembles
    // into one or more (the resident kernels' header and reduction, the
    // GEMMs' shared tails, the KL rows' parts): its text is in theirs.
    for file in &files {
        let path = format!("{}/../../shaders/{file}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            SHADERS.iter().any(|s| s.file == file || s.text.contains(text.as_str())),
            "shaders/{file} is not in the catalogue"
        );
    }
    for shader in SHADERS {
        assert!(
            KernelId::ALL.iter().any(|k| k.shaders().contains(&shader)),
            "{} implements no kernel",
            shader.file
        );
    }
    // The parts: the resident kernels' header and reduction, the GEMMs'
    // two shared tails and the KL rows' five beside `kl_rows.wgsl`.
    assert_eq!(files.len(), SHADERS.len() + 4 + 5);
}
