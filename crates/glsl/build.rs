//! Compiles `shaders/gemm_khr.comp` (GLSL, KHR cooperative matrices) to
//! SPIR-V once per variant with the `glslang` crate, and writes
//! `glsl_kernels.rs` into OUT_DIR: one `GlslKernel` per variant, its SPIR-V
//! beside it. No compiled shader is committed; a GLSL error fails the build.
//!
//! The tiles are core's `GLSL_TILES` (`crates/core/src/glsl_tile.rs`,
//! compiled in here): each as the GEMM (mode 0) for both layouts, and the
//! ceiling report's diagnostics (modes 2, 3, 4) for each distinct plain
//! configuration, plus one multiply-adds-from-registers kernel (mode 1).

use std::fmt::Write as _;
use std::path::PathBuf;

use glslang::{
    Compiler, CompilerOptions, ShaderInput, ShaderSource, ShaderStage, SourceLanguage, SpirvVersion, Target,
    VulkanVersion,
};

#[allow(
    dead_code,
    reason = "the build uses the tile table, not every helper of core's module"
)]
#[path = "../core/src/glsl_tile.rs"]
mod glsl_tile;

use glsl_tile::{GlslTile, GLSL_TILES};

/// One variant of `gemm_khr.comp`.
#[derive(Clone, Copy, PartialEq)]
struct Variant {
    mode: u32,
    nn: bool,
    tile: GlslTile,
}

fn variants() -> Vec<Variant> {
    let mut v = Vec::new();
    for nn in [false, true] {
        // Multiply-adds from registers: one configuration is enough.
        v.push(Variant {
            mode: 1,
            nn,
            tile: GlslTile {
                bm: 128,
                bk: 32,
                stages: 1,
                interleave: false,
                ws: false,
                sg_cols: 2,
            },
        });
        let mut diagnosed = Vec::new();
        for t in GLSL_TILES {
            v.push(Variant { mode: 0, nn, tile: t });
            let plain = t.plain();
            if !diagnosed.contains(&plain) {
                diagnosed.push(plain);
                for mode in [2, 3, 4] {
                    v.push(Variant { mode, nn, tile: plain });
                }
            }
        }
    }
    v
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let file = manifest.join("../../shaders/gemm_khr.comp");
    let tiles = manifest.join("../core/src/glsl_tile.rs");
    println!("cargo:rerun-if-changed={}", file.display());
    println!("cargo:rerun-if-changed={}", tiles.display());
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
    for Variant { mode, nn, tile: t } in variants() {
        let name = t.kernel_name(mode, nn);
        let defines: Vec<(&str, String)> = t.defines(mode, nn).iter().map(|(k, v)| (*k, v.to_string())).collect();
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
        writeln!(
            table,
            "    GlslKernel {{ name: {name:?}, mode: {mode}, nn: {nn}, tile: GlslTile {{ bm: {}, bk: {}, \
             stages: {}, interleave: {}, ws: {}, sg_cols: {} }}, spirv: include_bytes!({path:?}) }},",
            t.bm,
            t.bk,
            t.stages,
            t.interleave,
            t.ws,
            t.sg_cols,
            path = spv.display().to_string()
        )
        .expect("write to a String");
    }
    table.push(']');
    let generated = out.join("glsl_kernels.rs");
    std::fs::write(&generated, table).unwrap_or_else(|e| panic!("{}: {e}", generated.display()));
}
