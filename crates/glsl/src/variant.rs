//! What one compiled variant of the GLSL GEMM is: the typed description
//! that both `build.rs` (which compiles each variant's SPIR-V) and the
//! library (which looks the SPIR-V up by name) use, so the defines, names
//! and labels are written once.
//!
//! The production build compiles [`production`] only: each tile of
//! `GLSL_TILES` as the GEMM, for both layouts. The ceiling report's
//! diagnostic variants ([`ceiling`]) are compiled only with the crate's
//! `ceiling` feature.
//!
//! This file uses nothing outside `std` and `GlslTile` (reached as
//! `crate::GlslTile`, which the build script and the library both bring
//! into their crate root).

use crate::GlslTile;

/// Which source a variant is compiled from (each after
/// `shaders/gemm_khr_body.glsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// `shaders/gemm_khr.comp`: the GEMM.
    Gemm,
    /// `shaders/gemm_ceiling.comp`: the ceiling report's diagnostic parts.
    Ceiling,
}

impl Source {
    /// The file under `shaders/`.
    pub const fn file(self) -> &'static str {
        match self {
            Source::Gemm => "gemm_khr.comp",
            Source::Ceiling => "gemm_ceiling.comp",
        }
    }
}

/// The shared body every variant's source follows.
pub const BODY_FILE: &str = "gemm_khr_body.glsl";

/// What a variant runs (the `MODE` define).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CeilingPart {
    /// The GEMM: staging and multiply-adds, with its result.
    Gemm,
    /// (a) Multiply-adds on fragments held in registers.
    Registers,
    /// (b) Fragment loads from workgroup memory staged once, and multiply-adds.
    SharedMath,
    /// (c) The GEMM's global loads only.
    Loads,
    /// (d) The GEMM's staging loop (loads a step ahead, workgroup stores,
    /// barriers) without the multiply-adds.
    Staging,
}

impl CeilingPart {
    /// The `MODE` define.
    pub const fn mode(self) -> u32 {
        match self {
            CeilingPart::Gemm => 0,
            CeilingPart::Registers => 1,
            CeilingPart::SharedMath => 2,
            CeilingPart::Loads => 3,
            CeilingPart::Staging => 4,
        }
    }

    /// The first word of a variant's name.
    pub const fn name(self) -> &'static str {
        match self {
            CeilingPart::Gemm => "gemm",
            CeilingPart::Registers => "regs",
            CeilingPart::SharedMath => "smem",
            CeilingPart::Loads => "loads",
            CeilingPart::Staging => "staging",
        }
    }

    /// The report's letter: a–d, and e for a GEMM.
    pub const fn letter(self) -> char {
        match self {
            CeilingPart::Registers => 'a',
            CeilingPart::SharedMath => 'b',
            CeilingPart::Loads => 'c',
            CeilingPart::Staging => 'd',
            CeilingPart::Gemm => 'e',
        }
    }

    /// What the variant runs, in words.
    pub const fn describe(self) -> &'static str {
        match self {
            CeilingPart::Registers => "multiply-adds from registers",
            CeilingPart::SharedMath => "fragments + multiply-adds from workgroup memory, staged once",
            CeilingPart::Loads => "global loads only",
            CeilingPart::Staging => "staging only, pipelined as the GEMM does it",
            CeilingPart::Gemm => "the GEMM",
        }
    }
}

/// How an operand reaches the multiply-adds (`A_READ`, `B_READ`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OperandRead {
    /// Row-major from memory, staged through workgroup memory: the GEMM.
    Staged,
    /// Staged, but read as if each K step's tile were one contiguous run (a
    /// timing of a pre-tiled layout: the result is not the GEMM).
    Pretiled,
    /// Straight into fragment registers as if stored in fragment order, one
    /// 16-byte load per invocation and fragment, nothing staged (timing).
    Fragments,
}

impl OperandRead {
    const fn define(self) -> u32 {
        match self {
            OperandRead::Staged => 0,
            OperandRead::Pretiled => 1,
            OperandRead::Fragments => 2,
        }
    }
}

/// How the staging loads its words (`LOAD_KIND`); each still computes
/// the GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoadKind {
    /// Loads into registers a step ahead, stored after the math.
    Plain,
    /// As `Plain`, with the operand buffers `coherent` (the driver may not
    /// keep their lines in the SM's L1).
    Coherent,
    /// Each word stored to workgroup memory as soon as it is loaded,
    /// `STAGES − 1` steps ahead (a copy a driver could make asynchronous;
    /// needs two stages or more).
    Copied,
}

impl LoadKind {
    const fn define(self) -> u32 {
        match self {
            LoadKind::Plain => 0,
            LoadKind::Coherent => 1,
            LoadKind::Copied => 2,
        }
    }
}

/// The cooperative-matrix shape the variant multiplies with (`FN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatrixShape {
    /// 16 × 16 × 16: every production tile.
    M16N16K16,
    /// 16 × 8 × 16: B fragments and accumulators 8 columns wide.
    M16N8K16,
}

impl MatrixShape {
    /// `(m, n, k)`: the device must list it.
    pub const fn mnk(self) -> (u32, u32, u32) {
        match self {
            MatrixShape::M16N16K16 => (16, 16, 16),
            MatrixShape::M16N8K16 => (16, 8, 16),
        }
    }
}

/// The accumulators' type (`ACC16`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Accumulator {
    /// f32: the GEMM.
    F32,
    /// f16: half the accumulator registers, a timing only (its sums lose
    /// precision).
    F16,
}

/// One variant of the GLSL GEMM source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GlslVariant {
    /// What it runs.
    pub part: CeilingPart,
    /// `C = A·B` with B stored `[k][n]` (the dx layout, `NN`), else
    /// `C = A·Bᵀ` with B stored `[n][k]` (the logits layout).
    pub nn: bool,
    /// Its tile configuration.
    pub tile: GlslTile,
    /// How A is read.
    pub a: OperandRead,
    /// How B is read.
    pub b: OperandRead,
    /// A 256 × 64 C tile of four 64 × 64 subgroups in one column (no two
    /// subgroups read the same A rows) in place of BM × 128 (timing).
    pub tall: bool,
    /// The main loop's barriers; without them it races (timing: what the
    /// barriers cost).
    pub barriers: bool,
    /// How the staging loads.
    pub load: LoadKind,
    /// The matrix shape.
    pub matrix: MatrixShape,
    /// The accumulators.
    pub acc: Accumulator,
    /// The dx GEMM's block filter (`FILTER`; `gemm_dx_filtered`, `nn`
    /// GEMMs only): skips the K steps whose block the mask clears.
    pub filter: bool,
}

impl GlslVariant {
    /// The GEMM headkl runs for `tile` in one layout.
    pub const fn gemm(tile: GlslTile, nn: bool) -> Self {
        GlslVariant {
            part: CeilingPart::Gemm,
            nn,
            tile,
            a: OperandRead::Staged,
            b: OperandRead::Staged,
            tall: false,
            barriers: true,
            load: LoadKind::Plain,
            matrix: MatrixShape::M16N16K16,
            acc: Accumulator::F32,
            filter: false,
        }
    }

    /// The filtered dx GEMM headkl runs for `tile` (`gemm_dx_filtered`).
    pub const fn gemm_filtered(tile: GlslTile) -> Self {
        GlslVariant {
            filter: true,
            ..GlslVariant::gemm(tile, true)
        }
    }

    /// Diagnostic part `part` of `tile`'s plain configuration.
    pub const fn part_of(part: CeilingPart, tile: GlslTile, nn: bool) -> Self {
        GlslVariant {
            part,
            ..GlslVariant::gemm(tile.plain(), nn)
        }
    }

    /// The source it is compiled from.
    pub const fn source(&self) -> Source {
        match self.part {
            CeilingPart::Gemm => Source::Gemm,
            _ => Source::Ceiling,
        }
    }

    /// Whether it is the GEMM headkl runs for its tile.
    pub fn is_tile_gemm(&self) -> bool {
        *self == GlslVariant::gemm(self.tile, self.nn) || *self == GlslVariant::gemm_filtered(self.tile)
    }

    /// Whether it reads its operands in a timing layout (pre-tiled or
    /// fragment-order operands, the tall tile, no barriers): its result is
    /// not the GEMM, and its reads stay inside the operands only when the
    /// tiles divide them.
    pub fn timing_layout(&self) -> bool {
        self.a != OperandRead::Staged || self.b != OperandRead::Staged || self.tall || !self.barriers
    }

    /// Whether its result is the GEMM of the row-major operands in f32, so
    /// the ceiling report checks it: the production GEMMs and the variants
    /// that change only how they load or multiply.
    pub fn exact(&self) -> bool {
        self.part == CeilingPart::Gemm && !self.timing_layout() && self.acc == Accumulator::F32
    }

    /// The shader's defines.
    pub fn defines(&self) -> Vec<(&'static str, u32)> {
        let t = self.tile;
        vec![
            ("MODE", self.part.mode()),
            ("NN", u32::from(self.nn)),
            ("BM", t.bm),
            ("BK", t.bk),
            ("STAGES", t.stages),
            ("INTERLEAVE", u32::from(t.interleave)),
            ("WS", u32::from(t.ws)),
            ("SG_COLS", t.sg_cols),
            ("A_READ", self.a.define()),
            ("B_READ", self.b.define()),
            ("TALL", u32::from(self.tall)),
            ("BARRIERS", u32::from(self.barriers)),
            ("LOAD_KIND", self.load.define()),
            ("FN", self.matrix.mnk().1),
            ("ACC16", u32::from(self.acc == Accumulator::F16)),
            ("FILTER", u32::from(self.filter)),
        ]
    }

    /// The switches this variant turns away from the production GEMM, as
    /// (name tag, label tag) pairs in the order both spell them.
    fn departures(&self) -> impl Iterator<Item = (&'static str, &'static str)> {
        [
            (self.tall, "_tall", " 256x64"),
            (!self.barriers, "_nobar", " no barriers"),
            (self.load == LoadKind::Coherent, "_coh", " coherent"),
            (self.load == LoadKind::Copied, "_cp", " copied"),
            (self.matrix == MatrixShape::M16N8K16, "_n8", " 16x8x16"),
            (self.acc == Accumulator::F16, "_h", " f16-acc"),
            (self.filter, "_filter", " filtered"),
        ]
        .into_iter()
        .filter(|&(on, _, _)| on)
        .map(|(_, name, label)| (name, label))
    }

    /// Its name: pipeline caches, timing labels, the SPIR-V's file
    /// (`gemm_nt_bm128_bk64_s1`, `loads_nn_bm128_bk32_s2_pt`).
    pub fn name(&self) -> String {
        use OperandRead::{Fragments, Pretiled};
        let mut name = self.tile.kernel_name(self.part.name(), self.nn);
        let pair =
            |r: OperandRead, a: &'static str, b: &'static str, both: &'static str| match (self.a == r, self.b == r) {
                (true, true) => both,
                (true, false) => a,
                (false, true) => b,
                (false, false) => "",
            };
        name.push_str(pair(Pretiled, "_pta", "_ptb", "_pt"));
        name.push_str(pair(Fragments, "_fa", "_fb", "_fab"));
        for (name_tag, _) in self.departures() {
            name.push_str(name_tag);
        }
        name
    }

    /// Its tile, and what it does differently from the GEMM headkl runs.
    pub fn label(&self) -> String {
        let mut label = self.tile.to_string();
        let read = |r: OperandRead, pretiled: &str, fragments: &str| match r {
            OperandRead::Staged => String::new(),
            OperandRead::Pretiled => pretiled.to_string(),
            OperandRead::Fragments => fragments.to_string(),
        };
        label.push_str(&read(self.a, " pre-tiled A", " A direct"));
        label.push_str(&read(self.b, " pre-tiled B", " B direct"));
        for (_, label_tag) in self.departures() {
            label.push_str(label_tag);
        }
        label
    }

    /// Workgroup memory in bytes, as the shader declares it: the tall tile
    /// stages 2·BM rows of A and 64 columns of B, and an operand read
    /// straight into fragments keeps one word.
    pub fn shared_bytes(&self) -> u32 {
        let t = self.tile;
        let (rows, cols) = if self.tall { (2 * t.bm, 64) } else { (t.bm, 128) };
        let (a, b) = t.stage_bytes(self.nn, rows, cols);
        let a = if self.a == OperandRead::Fragments {
            16
        } else {
            t.stages * a
        };
        let b = if self.b == OperandRead::Fragments {
            16
        } else {
            t.stages * b
        };
        a + b
    }
}

/// The GEMMs headkl runs: every tile of `tiles`, both layouts, and the
/// filtered dx GEMM of each.
pub fn production(tiles: &[GlslTile]) -> Vec<GlslVariant> {
    [false, true]
        .into_iter()
        .flat_map(|nn| tiles.iter().map(move |&t| GlslVariant::gemm(t, nn)))
        .chain(tiles.iter().map(|&t| GlslVariant::gemm_filtered(t)))
        .collect()
}

/// The tiles the ceiling report also times with pre-tiled operands and
/// f16 accumulators: the two production tiles.
pub const PRETILED_TILES: [&str; 2] = ["bm128.bk64.s1", "bm128.bk32.s2"];

/// The ceiling report's diagnostic variants (never run by headkl's GEMMs):
/// for each layout, (a) once, (b)–(d) for each distinct plain tile, and
/// the levers measured in `docs/PERFORMANCE.md` (rows 27–43).
pub fn ceiling(tiles: &[GlslTile]) -> Vec<GlslVariant> {
    use CeilingPart::{Gemm, Loads, Registers, SharedMath, Staging};
    use OperandRead::{Pretiled, Staged};
    let mut out = Vec::new();
    let named = |name: &str| tiles.iter().copied().find(|t| t.to_string() == name);
    for nn in [false, true] {
        // (a) Multiply-adds from registers: one configuration is enough.
        let regs = GlslTile {
            bm: 128,
            bk: 32,
            stages: 1,
            interleave: false,
            ws: false,
            sg_cols: 2,
        };
        out.push(GlslVariant::part_of(Registers, regs, nn));
        let mut diagnosed = Vec::new();
        for t in tiles.iter().map(|t| t.plain()) {
            if !diagnosed.contains(&t) {
                diagnosed.push(t);
                for part in [SharedMath, Loads, Staging] {
                    out.push(GlslVariant::part_of(part, t, nn));
                }
            }
        }
        for t in PRETILED_TILES.iter().filter_map(|name| named(name)) {
            // Pre-tiled A, B, both; the loads (c) and staging (d) of both.
            for (part, a, b) in [
                (Gemm, Pretiled, Staged),
                (Gemm, Staged, Pretiled),
                (Gemm, Pretiled, Pretiled),
                (Loads, Pretiled, Pretiled),
                (Staging, Pretiled, Pretiled),
            ] {
                out.push(GlslVariant {
                    a,
                    b,
                    ..GlslVariant::part_of(part, t, nn)
                });
            }
            // What halving the accumulator registers buys, with and
            // without pre-tiled operands.
            for read in [Staged, Pretiled] {
                out.push(GlslVariant {
                    a: read,
                    b: read,
                    acc: Accumulator::F16,
                    ..GlslVariant::gemm(t, nn)
                });
            }
        }
        out.extend(levers(nn));
    }
    out
}

/// Fragments read straight from memory (row 37), the loop without its
/// barriers, and the exact load and matrix-shape levers (rows 39 and 43),
/// on plain tiles.
fn levers(nn: bool) -> Vec<GlslVariant> {
    use OperandRead::Fragments;
    let plain = |bm, bk, stages| GlslTile {
        bm,
        bk,
        stages,
        interleave: false,
        ws: false,
        sg_cols: 2,
    };
    let (k64, k32, k16s1, k16s2) = (
        plain(128, 64, 1),
        plain(128, 32, 2),
        plain(128, 16, 1),
        plain(128, 16, 2),
    );
    let v = |tile| GlslVariant::gemm(tile, nn);
    let a_direct = |tile| GlslVariant {
        a: Fragments,
        ..v(tile)
    };
    let tall_a_direct = |tile| GlslVariant {
        tall: true,
        ..a_direct(tile)
    };
    vec![
        // A only (B staged), both, and A only on the tall tile, where no two
        // subgroups read the same A rows.
        a_direct(k32),
        a_direct(k64),
        GlslVariant {
            b: Fragments,
            ..a_direct(k16s1)
        },
        tall_a_direct(k32),
        // With f16 accumulators too: whether freeing 64 registers for a
        // third workgroup an SM pays once the A stage is gone.
        GlslVariant {
            acc: Accumulator::F16,
            ..tall_a_direct(k32)
        },
        GlslVariant {
            acc: Accumulator::F16,
            ..tall_a_direct(k16s2)
        },
        // Without the main loop's barriers (a race: what they cost).
        GlslVariant {
            barriers: false,
            ..v(k64)
        },
        GlslVariant {
            barriers: false,
            ..v(k32)
        },
        GlslVariant {
            barriers: false,
            ..tall_a_direct(k32)
        },
        // Exact: coherent operand loads on the default tile, words stored
        // as soon as loaded through two stages, 16 × 8 × 16 tiles.
        GlslVariant {
            load: LoadKind::Coherent,
            ..v(k64)
        },
        GlslVariant {
            load: LoadKind::Copied,
            ..v(k32)
        },
        GlslVariant {
            matrix: MatrixShape::M16N8K16,
            ..v(k64)
        },
        GlslVariant {
            matrix: MatrixShape::M16N8K16,
            ..v(k32)
        },
    ]
}

/// Every variant the build compiles: the production GEMMs, and with
/// `ceiling` the report's diagnostics.
pub fn all(tiles: &[GlslTile], ceiling: bool) -> Vec<GlslVariant> {
    let mut v = production(tiles);
    if ceiling {
        v.extend(self::ceiling(tiles));
    }
    v
}
