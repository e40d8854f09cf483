//! Compiles `shaders/gemm_khr.comp` (GLSL, KHR cooperative matrices) to
//! SPIR-V once per variant with the `glslang` crate, and writes
//! `glsl_kernels.rs` into OUT_DIR: one `GlslKernel` per variant, its SPIR-V
//! beside it. No compiled shader is committed; a GLSL error fails the build.
//!
//! The tiles are core's `GLSL_TILES` (`crates/core/src/glsl_tile.rs`,
//! compiled in here): each as the GEMM (mode 0) for both layouts, and the
//! ceiling report's diagnostics (modes 2, 3, 4) for each distinct plain
//! configuration, plus one multiply-adds-from-registers kernel (mode 1) and
//! the pre-tiled and f16-accumulator timings of the two production tiles,
//! the timings of operands read straight into fragments, and exact variants
//! of how the GEMM loads (coherent, copied) and multiplies (16 x 8 x 16).

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
    /// Ceiling-report variants (`PRETILED` in the shader). Timings only:
    /// bit 0 A, bit 1 B read as if pre-tiled; bits 2 and 3: A and B read
    /// straight into fragments; bit 4: the tall 256 x 64 tile; bit 5: no
    /// barriers in the main loop. Still the GEMM: bit 6 coherent operand
    /// buffers; bit 7 words stored to workgroup memory as soon as loaded;
    /// bit 8 16 x 8 x 16 tiles.
    pretiled: u32,
    /// f16 accumulators (ceiling report timing only).
    acc16: bool,
    tile: GlslTile,
}

/// The tiles the ceiling report also times with pre-tiled operands (the
/// GEMM (e), its loads (c) and its staging (d)) and with f16 accumulators.
const PRETILED: [&str; 2] = ["bm128.bk64.s1", "bm128.bk32.s2"];

fn variants() -> Vec<Variant> {
    let mut v = Vec::new();
    let plain = |mode, nn, tile| Variant {
        mode,
        nn,
        pretiled: 0,
        acc16: false,
        tile,
    };
    for nn in [false, true] {
        // Multiply-adds from registers: one configuration is enough.
        let regs = GlslTile {
            bm: 128,
            bk: 32,
            stages: 1,
            interleave: false,
            ws: false,
            sg_cols: 2,
        };
        v.push(plain(1, nn, regs));
        let mut diagnosed = Vec::new();
        for t in GLSL_TILES {
            v.push(plain(0, nn, t));
            let base = t.plain();
            if !diagnosed.contains(&base) {
                diagnosed.push(base);
                for mode in [2, 3, 4] {
                    v.push(plain(mode, nn, base));
                }
            }
        }
        for name in PRETILED {
            let t = GlslTile::from_name(name).unwrap_or_else(|| panic!("{name} is not in GLSL_TILES"));
            for (mode, pretiled) in [(0, 1), (0, 2), (0, 3), (3, 3), (4, 3)] {
                v.push(Variant {
                    pretiled,
                    ..plain(mode, nn, t)
                });
            }
            // What halving the accumulator registers buys, with and without
            // pre-tiled operands.
            for pretiled in [0, 3] {
                v.push(Variant {
                    pretiled,
                    acc16: true,
                    ..plain(0, nn, t)
                });
            }
        }
        // Fragments read straight from memory, one 16-byte load per
        // invocation and fragment (docs/PERFORMANCE.md, row 37): A only (B
        // staged), both (nothing staged), and A only on the tall 256 x 64
        // tile (bit 4), where no two subgroups read the same A rows; and
        // the main loop without its barriers (bit 5). Timing only.
        for (bm, bk, stages, direct, acc16) in [
            (128, 32, 2, 4, false),
            (128, 64, 1, 4, false),
            (128, 16, 1, 12, false),
            (128, 32, 2, 20, false),
            // With f16 accumulators too: whether freeing 64 registers for a
            // third workgroup an SM pays once the A stage is gone.
            (128, 32, 2, 20, true),
            (128, 16, 2, 20, true),
            // Without the main loop's barriers (a race: what they cost).
            (128, 64, 1, 32, false),
            (128, 32, 2, 32, false),
            (128, 32, 2, 52, false),
            // Exact GEMMs (row 39): coherent operand loads (bit 6: L1 not
            // allocated) on the default tile, and words stored to
            // workgroup memory as soon as they are loaded (bit 7: a copy the
            // driver could make asynchronous) through two stages.
            (128, 64, 1, 64, false),
            (128, 32, 2, 128, false),
            // 16 x 8 x 16 tiles (bit 8), the last untried lever:
            // exact GEMMs of the two production tiles.
            (128, 64, 1, 256, false),
            (128, 32, 2, 256, false),
        ] {
            let t = GlslTile {
                bm,
                bk,
                stages,
                interleave: false,
                ws: false,
                sg_cols: 2,
            };
            v.push(Variant {
                pretiled: direct,
                acc16,
                ..plain(0, nn, t)
            });
        }
    }
    v
}

fn name(v: Variant) -> String {
    let pt = ["", "_pta", "_ptb", "_pt"][v.pretiled as usize & 3];
    let direct = ["", "_fa", "_fb", "_fab"][(v.pretiled as usize >> 2) & 3];
    let tall = if v.pretiled & 16 != 0 { "_tall" } else { "" };
    let tall = if v.pretiled & 32 != 0 {
        format!("{tall}_nobar")
    } else {
        tall.to_string()
    };
    let coherent = if v.pretiled & 64 != 0 { "_coh" } else { "" };
    let copied = if v.pretiled & 128 != 0 { "_cp" } else { "" };
    let narrow = if v.pretiled & 256 != 0 { "_n8" } else { "" };
    let h = if v.acc16 { "_h" } else { "" };
    format!(
        "{}{pt}{direct}{tall}{coherent}{copied}{narrow}{h}",
        v.tile.kernel_name(v.mode, v.nn)
    )
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
    for v in variants() {
        let Variant {
            mode,
            nn,
            pretiled,
            acc16,
            tile: t,
        } = v;
        let name = name(v);
        let mut defines: Vec<(&str, String)> = t.defines(mode, nn).iter().map(|(k, v)| (*k, v.to_string())).collect();
        defines.push(("PRETILED", pretiled.to_string()));
        defines.push(("ACC16", u32::from(acc16).to_string()));
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
            "    GlslKernel {{ name: {name:?}, mode: {mode}, nn: {nn}, pretiled: {pretiled}, acc16: {acc16}, \
             tile: GlslTile {{ bm: {}, bk: {}, stages: {}, interleave: {}, ws: {}, sg_cols: {} }}, \
             spirv: include_bytes!({path:?}) }},",
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
