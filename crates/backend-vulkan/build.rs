//! Compiles `shaders/gemm_khr.comp` (GLSL, KHR cooperative matrices) to
//! SPIR-V once per variant with the `glslang` crate, and writes
//! `glsl_kernels.rs` into OUT_DIR: one `GlslKernel` per variant, its SPIR-V
//! beside it. No compiled shader is committed; a GLSL error fails the build.

use std::fmt::Write as _;
use std::path::PathBuf;

use glslang::{
    Compiler, CompilerOptions, ShaderInput, ShaderSource, ShaderStage, SourceLanguage, SpirvVersion, Target,
    VulkanVersion,
};

/// One variant of `gemm_khr.comp`.
#[derive(Clone, Copy, PartialEq)]
struct Variant {
    mode: u32,
    nn: bool,
    /// Operands read as if pre-tiled (ceiling report timing only): bit 0
    /// A, bit 1 B.
    pretiled: u32,
    /// f16 accumulators (ceiling report timing only).
    acc16: bool,
    tile: Tile,
}

/// A tile configuration (the defines other than MODE and NN).
#[derive(Clone, Copy, PartialEq)]
struct Tile {
    bm: u32,
    bk: u32,
    stages: u32,
    interleave: bool,
    ws: bool,
    sg_cols: u32,
}

const fn tile(bm: u32, bk: u32, stages: u32, interleave: bool, ws: bool, sg_cols: u32) -> Tile {
    Tile {
        bm,
        bk,
        stages,
        interleave,
        ws,
        sg_cols,
    }
}

/// The GEMM tiles. Each gets the GEMM, and each (bm, bk, stages, sg_cols)
/// the diagnostics (modes 2, 3, 4), for both layouts.
const TILES: [Tile; 13] = [
    tile(64, 32, 2, false, false, 2),
    tile(64, 32, 1, false, false, 2),
    tile(64, 16, 2, false, false, 2),
    tile(128, 32, 2, false, false, 2),
    tile(128, 32, 2, true, false, 2),
    tile(128, 32, 2, false, true, 2),
    tile(128, 16, 4, false, true, 2),
    tile(128, 64, 1, false, false, 2),
    tile(256, 32, 1, false, false, 2),
    tile(256, 16, 2, false, false, 2),
    tile(128, 32, 2, false, false, 4),
    tile(128, 32, 2, false, true, 4),
    tile(128, 64, 1, false, false, 4),
];

/// The tiles the ceiling report also times with pre-tiled operands: the
/// GEMM (e), its loads (c) and its staging (d).
const PRETILED: [Tile; 2] = [tile(128, 64, 1, false, false, 2), tile(128, 32, 2, false, false, 2)];

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
        v.push(plain(1, nn, tile(128, 32, 1, false, false, 2)));
        let mut diagnosed = Vec::new();
        for t in TILES {
            v.push(plain(0, nn, t));
            let base = tile(t.bm, t.bk, t.stages, false, false, t.sg_cols);
            if !diagnosed.contains(&base) {
                diagnosed.push(base);
                for mode in [2, 3, 4] {
                    v.push(plain(mode, nn, base));
                }
            }
        }
        for t in PRETILED {
            for (mode, pretiled) in [(0, 1), (0, 2), (0, 3), (3, 3), (4, 3)] {
                v.push(Variant {
                    mode,
                    nn,
                    pretiled,
                    acc16: false,
                    tile: t,
                });
            }
            // What halving the accumulator registers buys, with and without
            // pre-tiled operands.
            for pretiled in [0, 3] {
                v.push(Variant {
                    mode: 0,
                    nn,
                    pretiled,
                    acc16: true,
                    tile: t,
                });
            }
        }
    }
    v
}

fn name(v: Variant) -> String {
    let mode = ["gemm", "regs", "smem", "loads", "staging"][v.mode as usize];
    let layout = if v.nn { "nn" } else { "nt" };
    let t = v.tile;
    let i = if t.interleave { "_i" } else { "" };
    let w = if t.ws { "_ws" } else { "" };
    let c = if t.sg_cols != 2 {
        format!("_c{}", t.sg_cols)
    } else {
        String::new()
    };
    let pt = ["", "_pta", "_ptb", "_pt"][v.pretiled as usize];
    let h = if v.acc16 { "_h" } else { "" };
    format!("{mode}_{layout}_bm{}_bk{}_s{}{i}{w}{c}{pt}{h}", t.bm, t.bk, t.stages)
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
        let Variant {
            mode,
            nn,
            pretiled,
            acc16,
            tile: t,
        } = v;
        let name = name(v);
        let defines = [
            ("MODE", mode.to_string()),
            ("NN", u32::from(nn).to_string()),
            ("BM", t.bm.to_string()),
            ("BK", t.bk.to_string()),
            ("STAGES", t.stages.to_string()),
            ("INTERLEAVE", u32::from(t.interleave).to_string()),
            ("WS", u32::from(t.ws).to_string()),
            ("SG_COLS", t.sg_cols.to_string()),
            ("PRETILED", pretiled.to_string()),
            ("ACC16", u32::from(acc16).to_string()),
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
        // BM / 64 x SG_COLS math subgroups of 32, and 4 copying ones with WS.
        let threads = t.bm / 64 * t.sg_cols * 32 + if t.ws { 128 } else { 0 };
        let kw = t.bk / 8;
        let sa = t.bm * (kw + 1);
        let sb = if nn { t.bk * (128 / 8 + 1) } else { 128 * (kw + 1) };
        let shared = t.stages * (sa + sb) * 16;
        writeln!(
            table,
            "    GlslKernel {{ name: {name:?}, mode: {mode}, nn: {nn}, bm: {}, bk: {}, stages: {}, \
             interleave: {}, ws: {}, sg_cols: {}, pretiled: {pretiled}, acc16: {acc16}, threads: {threads}, shared_bytes: {shared}, \
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
