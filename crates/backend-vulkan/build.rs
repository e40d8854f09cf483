//! Compiles `shaders/gemm_khr.comp` (GLSL, KHR cooperative matrices) to
//! SPIR-V once per variant with the `glslang` crate, and writes
//! `glsl_kernels.rs` into OUT_DIR: one `GlslKernel` per variant, its SPIR-V
//! beside it. No compiled shader is committed; a GLSL error fails the build.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use glslang::{
    Compiler, CompilerOptions, ShaderInput, ShaderSource, ShaderStage, SourceLanguage, SpirvVersion, Target,
    VulkanVersion,
};

/// One variant: (mode, nn, bm, bk, stages, interleave).
type Variant = (u32, bool, u32, u32, u32, bool);

/// The tile configurations: (bm, bk, stages, interleave). Each gets the
/// GEMM and the per-configuration diagnostics (modes 2, 3, 4) for both
/// layouts.
const TILES: [(u32, u32, u32, bool); 5] = [
    (128, 32, 2, false),
    (128, 32, 2, true),
    (128, 64, 1, false),
    (256, 32, 1, false),
    (256, 16, 2, false),
];

fn variants() -> Vec<Variant> {
    let mut v = Vec::new();
    for nn in [false, true] {
        // Multiply-adds from registers: one configuration is enough.
        v.push((1, nn, 128, 32, 1, false));
        for (bm, bk, stages, interleave) in TILES {
            // The diagnostics ignore INTERLEAVE: one set per (bm, bk, stages).
            let modes: &[u32] = if interleave { &[0] } else { &[0, 2, 3, 4] };
            for &mode in modes {
                v.push((mode, nn, bm, bk, stages, interleave));
            }
        }
    }
    v
}

fn name((mode, nn, bm, bk, stages, interleave): Variant) -> String {
    let mode = ["gemm", "regs", "smem", "loads", "staging"][mode as usize];
    let layout = if nn { "nn" } else { "nt" };
    let i = if interleave { "_i" } else { "" };
    format!("{mode}_{layout}_bm{bm}_bk{bk}_s{stages}{i}")
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let file = manifest.join("../../shaders/gemm_khr.comp");
    println!("cargo:rerun-if-changed={}", file.display());
    println!("cargo:rerun-if-changed=build.rs");
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let compiler = Compiler::acquire().expect("glslang did not initialise");
    let source = ShaderSource::from(text);
    let options = CompilerOptions {
        source_language: SourceLanguage::GLSL,
        target: Target::Vulkan {
            version: VulkanVersion::Vulkan1_3,
            spirv_version: SpirvVersion::SPIRV1_6,
        },
        ..Default::default()
    };
    let mut table = String::from("&[\n");
    for v in variants() {
        let (mode, nn, bm, bk, stages, interleave) = v;
        let name = name(v);
        let defines = [
            ("MODE", mode.to_string()),
            ("NN", u32::from(nn).to_string()),
            ("BM", bm.to_string()),
            ("BK", bk.to_string()),
            ("STAGES", stages.to_string()),
            ("INTERLEAVE", u32::from(interleave).to_string()),
        ];
        let defines: Vec<(&str, Option<&str>)> = defines.iter().map(|(k, v)| (*k, Some(v.as_str()))).collect();
        let input = ShaderInput::new(&source, ShaderStage::Compute, &options, Some(&defines[..]), None)
            .unwrap_or_else(|e| panic!("gemm_khr.comp {name}: {e}"));
        let shader = compiler
            .create_shader(input)
            .unwrap_or_else(|e| panic!("gemm_khr.comp {name}: {e}"));
        let words = shader.compile().unwrap_or_else(|e| panic!("gemm_khr.comp {name}: {e}"));
        let spv = out.join(format!("{name}.spv"));
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(&spv, bytes).unwrap_or_else(|e| panic!("{}: {e}", spv.display()));
        let threads = bm; // BM / 64 x 2 subgroups of 32
        let kw = bk / 8;
        let sa = bm * (kw + 1);
        let sb = if nn { bk * (128 / 8 + 1) } else { 128 * (kw + 1) };
        let shared = stages * (sa + sb) * 16;
        writeln!(
            table,
            "    GlslKernel {{ name: {name:?}, mode: {mode}, nn: {nn}, bm: {bm}, bk: {bk}, stages: {stages}, \
             interleave: {interleave}, threads: {threads}, shared_bytes: {shared}, spirv: include_bytes!({path:?}) }},",
            path = Path::new(&spv).display().to_string()
        )
        .expect("write to a String");
    }
    table.push(']');
    let generated = out.join("glsl_kernels.rs");
    std::fs::write(&generated, table).unwrap_or_else(|e| panic!("{}: {e}", generated.display()));
}
