//! Compiles the GLSL GEMM to SPIR-V once per variant with the `glslang`
//! crate, and writes `glsl_spirv.rs` into OUT_DIR: each variant's name and
//! its SPIR-V. No compiled shader is committed; a GLSL error fails the build.
//!
//! Which variants, and each one's defines and name, come from the typed
//! description in `src/variant.rs` (compiled in here and in the library):
//! the GEMM of every tile of core's `GLSL_TILES` (`crates/core/src/toolkit/glsl_tile.rs`,
//! compiled in too) for both layouts, and with the `ceiling` feature the
//! ceiling report's diagnostic variants. Each variant's source is
//! `shaders/gemm_khr_body.glsl` followed by its own file (`gemm_khr.comp`
//! or `gemm_ceiling.comp`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use glslang::{
    Compiler, CompilerOptions, ShaderInput, ShaderSource, ShaderStage, SourceLanguage, SpirvVersion, Target,
    VulkanVersion,
};

#[allow(
    dead_code,
    reason = "the build uses the tile table, not every helper of core's module"
)]
#[path = "../core/src/toolkit/glsl_tile.rs"]
mod glsl_tile;

#[allow(
    dead_code,
    reason = "the build uses the variants' defines and names, not every helper"
)]
#[path = "src/variant.rs"]
mod variant;

use glsl_tile::{GlslTile, GLSL_TILES};
use variant::{Source, BODY_FILE};

fn read(path: &Path) -> String {
    println!("cargo:rerun-if-changed={}", path.display());
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let shaders = manifest.join("../../shaders");
    println!(
        "cargo:rerun-if-changed={}",
        manifest.join("../core/src/toolkit/glsl_tile.rs").display()
    );
    println!("cargo:rerun-if-changed={}", manifest.join("src/variant.rs").display());
    println!("cargo:rerun-if-changed=build.rs");
    let ceiling = std::env::var_os("CARGO_FEATURE_CEILING").is_some();
    let body = read(&shaders.join(BODY_FILE));
    let source_of = |source: Source| ShaderSource::from(format!("{body}{}", read(&shaders.join(source.file()))));
    let (gemm_source, ceiling_source) = (source_of(Source::Gemm), source_of(Source::Ceiling));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let compiler = Compiler::acquire().expect("glslang did not initialise");
    let options = CompilerOptions {
        source_language: SourceLanguage::GLSL,
        target: Target::Vulkan {
            version: VulkanVersion::Vulkan1_3,
            spirv_version: SpirvVersion::SPIRV1_6,
        },
        ..Default::default()
    };
    let mut table = String::from("&[\n");
    for v in variant::all(&GLSL_TILES, ceiling) {
        let name = v.name();
        let file = v.source().file();
        let defines: Vec<(&str, String)> = v.defines().iter().map(|(k, v)| (*k, v.to_string())).collect();
        let defines: Vec<(&str, Option<&str>)> = defines.iter().map(|(k, v)| (*k, Some(v.as_str()))).collect();
        let source = match v.source() {
            Source::Gemm => &gemm_source,
            Source::Ceiling => &ceiling_source,
        };
        let input = ShaderInput::new(source, ShaderStage::Compute, &options, Some(&defines[..]), None)
            .unwrap_or_else(|e| panic!("{file} {name}: {e}"));
        let shader = compiler
            .create_shader(input)
            .unwrap_or_else(|e| panic!("{file} {name}: {e}"));
        let words = shader.compile().unwrap_or_else(|e| panic!("{file} {name}: {e}"));
        let spv = out.join(format!("{name}.spv"));
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(&spv, bytes).unwrap_or_else(|e| panic!("{}: {e}", spv.display()));
        writeln!(
            table,
            "    ({name:?}, include_bytes!({:?})),",
            spv.display().to_string()
        )
        .expect("write to a String");
    }
    table.push(']');
    let generated = out.join("glsl_spirv.rs");
    std::fs::write(&generated, table).unwrap_or_else(|e| panic!("{}: {e}", generated.display()));
}
