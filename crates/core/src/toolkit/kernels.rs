//! The kernel catalogue: for every kernel, its shader file and entry point,
//! its bindings and parameter block, its workgroup shape, workgroup memory
//! and override values, and its workgroup count for a descriptor. Both GPU
//! backends build their pipelines and dispatches from these entries alone,
//! so a new kernel is one [`KernelId`] variant and its rows in the `match`es
//! below (and a row in ARCHITECTURE.md's Kernels table).
//!
//! The device-resident entry points' kernels (`crate::resident`) are
//! rows of the same catalogue: each is `shaders/resident_common.wgsl`
//! followed by its own file, with its own parameter block and the status
//! buffer's names generated in ([`RESIDENT_MARKER`]).
//!
//! The sources are the WGSL files of `shaders/` ([`Shader`]) and, for the
//! GEMM, the GLSL tiles of `gemm_khr.comp` ([`KernelSource::Glsl`]), whose
//! SPIR-V the `headkl-glsl` crate compiles at build time.

use std::fmt;

use crate::error::{Error, Result};
use crate::toolkit::backend::{GemmDesc, HeadLayout, KlDesc, SumPartsDesc, TopkDesc, TransposeDesc};
use crate::toolkit::gemm_choice::{CoopGemm, KernelLimits};
use crate::toolkit::glsl_tile::GlslTile;
use crate::toolkit::params::{
    GatherRowsParams, GemmParams, HeadGradOutParams, HiddenInParams, LabelsInParams, LossOutParams, ParamBlock,
    RowParams, ShardRowsParams, StatusDetailParams, SumPartsParams, TeacherRowsParams, TopkOutParams, TransposeParams,
    WeightStatsParams,
};
use crate::toolkit::resident_kernels::{
    GatherRowsDesc, HeadGradOutDesc, HiddenInDesc, LabelsInDesc, LossOutDesc, ShardRowsDesc, StatusDetailDesc,
    TeacherRowsDesc, TopkOutDesc, WeightStatsDesc,
};
use crate::toolkit::wgmma_tile::WgmmaTile;

/// One WGSL file of `shaders/`: its name (errors, caches), its text, and
/// the parameter block its kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shader {
    /// File name within `shaders/`.
    pub file: &'static str,
    /// The file's WGSL, with [`PARAMS_MARKER`] where the parameter block goes.
    pub text: &'static str,
    /// The parameter block at binding 0.
    pub params: ParamBlock,
}

/// The line of every shader that [`Shader::source`] replaces with the
/// parameter block's declaration.
pub const PARAMS_MARKER: &str =
    "// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>";

/// The line of `shaders/resident_common.wgsl` that [`Shader::source`]
/// replaces with the status buffer's names and the codes the resident
/// kernels compare against ([`crate::toolkit::status::wgsl`]).
pub const RESIDENT_MARKER: &str =
    "// <resident constants: generated from crates/core/src/resident/status.rs (headkl_core::toolkit::kernels::Shader::source)>";

/// The line of `shaders/kl_rows.wgsl` that [`Shader::source`] replaces
/// with the coefficient word's marker of a row the device flagged
/// ([`crate::toolkit::status::row_wgsl`]).
pub const ROW_MARKER: &str =
    "// <row constants: generated from crates/core/src/resident/status.rs (headkl_core::toolkit::kernels::Shader::source)>";

/// The line of `shaders/kl_rows.wgsl` and `shaders/topk_rows.wgsl` that
/// [`Shader::source`] replaces with the row kernels' flag bits and codes
/// ([`crate::toolkit::params::row_flags::wgsl`]).
pub const FLAGS_MARKER: &str =
    "// <row flags: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>";

impl Shader {
    /// The WGSL to compile: the file with its parameter struct and binding
    /// generated from `core::params` in place of [`PARAMS_MARKER`] (and,
    /// in the resident kernels, their constants in place of
    /// [`RESIDENT_MARKER`]; in the KL kernel, the flagged row's marker in
    /// place of [`ROW_MARKER`]; in the row kernels, their flag bits and
    /// codes in place of [`FLAGS_MARKER`]).
    pub fn source(&self) -> String {
        let block = self.params.wgsl() + &shared_wgsl();
        let mut text = self.text.replacen(PARAMS_MARKER, &block, 1);
        if text.contains(RESIDENT_MARKER) {
            text = text.replacen(RESIDENT_MARKER, &crate::toolkit::status::wgsl(), 1);
        }
        if text.contains(ROW_MARKER) {
            text = text.replacen(ROW_MARKER, &crate::toolkit::status::row_wgsl(), 1);
        }
        if text.contains(FLAGS_MARKER) {
            text = text.replacen(FLAGS_MARKER, &crate::toolkit::params::row_flags::wgsl(), 1);
        }
        text
    }
}

macro_rules! shader {
    ($file:literal, $params:ty) => {
        Shader {
            file: $file,
            text: include_str!(concat!("../../../../shaders/", $file)),
            params: <$params>::BLOCK,
        }
    };
}

/// A GEMM shader: its file followed by `shaders/gemm_common.wgsl` (the
/// workgroup's tile and split-K part, shared by every WGSL GEMM) and, for
/// the matrix-unit ones, `shaders/gemm_coop_common.wgsl` (the C tile's
/// store).
macro_rules! gemm_shader {
    ($file:literal) => {
        Shader {
            file: $file,
            text: concat!(
                include_str!(concat!("../../../../shaders/", $file)),
                include_str!("../../../../shaders/gemm_common.wgsl")
            ),
            params: GemmParams::BLOCK,
        }
    };
    ($file:literal, coop) => {
        Shader {
            file: $file,
            text: concat!(
                include_str!(concat!("../../../../shaders/", $file)),
                include_str!("../../../../shaders/gemm_common.wgsl"),
                include_str!("../../../../shaders/gemm_coop_common.wgsl")
            ),
            params: GemmParams::BLOCK,
        }
    };
}

/// A device-resident kernel's shader: `resident_common.wgsl` (helpers and
/// the generated block and constants) followed by its own file (WGSL has
/// no include) and, for the kernels that reduce over their workgroup,
/// `resident_reduce.wgsl`.
macro_rules! resident_shader {
    ($file:literal, $params:ty) => {
        Shader {
            file: $file,
            text: concat!(
                include_str!("../../../../shaders/resident_common.wgsl"),
                include_str!(concat!("../../../../shaders/", $file))
            ),
            params: <$params>::BLOCK,
        }
    };
    ($file:literal, $params:ty, reduce) => {
        Shader {
            file: $file,
            text: concat!(
                include_str!("../../../../shaders/resident_common.wgsl"),
                include_str!(concat!("../../../../shaders/", $file)),
                include_str!("../../../../shaders/resident_reduce.wgsl")
            ),
            params: <$params>::BLOCK,
        }
    };
}

/// The KL row kernel, assembled from its parts in the order of the
/// `kl_rows_state.wgsl` header (bindings and state, the folds, the
/// gradient, the entry point `kl_rows.wgsl`, the block filter, the dense
/// teacher): the order in which naga emits its functions, so the SPIR-V is
/// that of the single file it was.
pub const KL_ROWS_WGSL: Shader = Shader {
    file: "kl_rows.wgsl",
    text: concat!(
        include_str!("../../../../shaders/kl_rows_state.wgsl"),
        include_str!("../../../../shaders/kl_rows_fold.wgsl"),
        include_str!("../../../../shaders/kl_rows_grad.wgsl"),
        include_str!("../../../../shaders/kl_rows.wgsl"),
        include_str!("../../../../shaders/kl_rows_filter.wgsl"),
        include_str!("../../../../shaders/kl_rows_dense.wgsl")
    ),
    params: RowParams::BLOCK,
};
/// `topk_rows.wgsl`: the exact top-k row kernel.
pub const TOPK_ROWS_WGSL: Shader = shader!("topk_rows.wgsl", RowParams);
/// `gemm_tiled.wgsl`: the portable GEMM (no matrix units).
pub const GEMM_TILED_WGSL: Shader = gemm_shader!("gemm_tiled.wgsl");
/// `gemm_coop.wgsl`: the matrix-unit GEMM staged through workgroup memory.
pub const GEMM_COOP_WGSL: Shader = gemm_shader!("gemm_coop.wgsl", coop);
/// `gemm_coop_direct.wgsl`: the matrix-unit GEMM without workgroup memory.
pub const GEMM_COOP_DIRECT_WGSL: Shader = gemm_shader!("gemm_coop_direct.wgsl", coop);
/// `sum_parts.wgsl`: a split-K GEMM's partial blocks summed.
pub const SUM_PARTS_WGSL: Shader = shader!("sum_parts.wgsl", SumPartsParams);
/// `transpose.wgsl`: f16 rows into columns, for the head's gradient.
pub const TRANSPOSE_WGSL: Shader = shader!("transpose.wgsl", TransposeParams);

/// `resident_stats.wgsl`: the weights' total and gradient scale.
pub const WEIGHT_STATS_WGSL: Shader = resident_shader!("resident_stats.wgsl", WeightStatsParams, reduce);
/// `resident_teacher.wgsl`: the caller's teacher rows checked into scratch.
pub const TEACHER_ROWS_WGSL: Shader = resident_shader!("resident_teacher.wgsl", TeacherRowsParams, reduce);
/// `resident_labels.wgsl`: the caller's labels checked into scratch.
pub const LABELS_IN_WGSL: Shader = resident_shader!("resident_labels.wgsl", LabelsInParams);
/// `resident_hidden.wgsl`: hidden rows (the caller's on the device, the
/// host path's f32 rows once uploaded) into the f16 operand.
pub const HIDDEN_IN_WGSL: Shader = resident_shader!("resident_hidden.wgsl", HiddenInParams);
/// `resident_loss_out.wgsl`: a chunk's loss and dx into the caller's buffers.
pub const LOSS_OUT_WGSL: Shader = resident_shader!("resident_loss_out.wgsl", LossOutParams);
/// `resident_head_grad_out.wgsl`: the head's gradient into the caller's buffer.
pub const HEAD_GRAD_OUT_WGSL: Shader = resident_shader!("resident_head_grad_out.wgsl", HeadGradOutParams);
/// `resident_topk_out.wgsl`: a chunk's top-k into the caller's buffers.
pub const TOPK_OUT_WGSL: Shader = resident_shader!("resident_topk_out.wgsl", TopkOutParams);
/// `resident_gather.wgsl`: the caller's gather ids checked into scratch
/// (`gather_in`), and a chunk's gathered values into the caller's
/// log-probabilities and lse (`gather_out`).
pub const GATHER_WGSL: Shader = resident_shader!("resident_gather.wgsl", GatherRowsParams);
/// `resident_shard.wgsl`: a vocabulary shard's per-row steps of the
/// two-phase loss.
pub const SHARD_ROWS_WGSL: Shader = resident_shader!("resident_shard.wgsl", ShardRowsParams);
/// `resident_status.wgsl`: the first flagged row described.
pub const STATUS_DETAIL_WGSL: Shader = resident_shader!("resident_status.wgsl", StatusDetailParams);

/// Every shader file, in the order of [`KernelId::ALL`].
pub const SHADERS: [Shader; 17] = [
    KL_ROWS_WGSL,
    TOPK_ROWS_WGSL,
    GEMM_TILED_WGSL,
    GEMM_COOP_WGSL,
    GEMM_COOP_DIRECT_WGSL,
    SUM_PARTS_WGSL,
    TRANSPOSE_WGSL,
    WEIGHT_STATS_WGSL,
    TEACHER_ROWS_WGSL,
    LABELS_IN_WGSL,
    HIDDEN_IN_WGSL,
    LOSS_OUT_WGSL,
    TOPK_OUT_WGSL,
    STATUS_DETAIL_WGSL,
    SHARD_ROWS_WGSL,
    GATHER_WGSL,
    HEAD_GRAD_OUT_WGSL,
];

/// The GLSL tile whose filtered build the dx GEMM runs with the block
/// filter where the PTX tiles run the others (they have no filter):
/// `glsl:bm128.bk64.s1`, the GLSL default.
pub const GLSL_FILTER_TILE: GlslTile = crate::toolkit::glsl_tile::GLSL_BM128_BK64_S1;

/// The override of `kl_rows.wgsl` that specializes it to one term set
/// ([`crate::toolkit::params::row_flags`]; 0, its default, is the seed's loss):
/// [`crate::toolkit::Checked::build`] sets it from the launch.
pub const KL_FLAGS: &str = "KL_FLAGS";

/// Invocations per workgroup of the row kernels, the sum of parts, the
/// transpose and the resident kernels (`WG` in their shaders).
pub const ROW_WORKGROUP: u32 = 256;
/// Entries of `topk_rows`' radix histogram: 11-bit digits (`TOPK_HIST`).
pub const TOPK_HIST: u32 = 2048;
/// The block filter's mask words one `kl_rows` workgroup builds at a time
/// (`SEG_WORDS`).
pub const FILTER_SEG_WORDS: u32 = 64;

/// The constants every WGSL shader gets after its parameter block (in
/// place of [`PARAMS_MARKER`]), so no shader spells a host value by hand:
/// the workgroup size, `MAX_K`, the top-k histogram, the filter's segment,
/// the shard steps' codes and the floor on a shard's softmax share.
pub fn shared_wgsl() -> String {
    let mut s = String::from("// headkl_core's constants (kernels::shared_wgsl).\n");
    let max_k = crate::problem::MAX_K as u32;
    let stages = crate::toolkit::resident_kernels::ShardStage::ALL.map(|st| (st.name(), st.code()));
    for (name, value) in [
        ("WG", ROW_WORKGROUP),
        ("MAX_K", max_k),
        ("TOPK_HIST", TOPK_HIST),
        ("SEG_WORDS", FILTER_SEG_WORDS),
    ] {
        s.push_str(&format!("const {name}: u32 = {value}u;\n"));
    }
    for (name, code) in stages {
        s.push_str(&format!("const STAGE_{name}: u32 = {code}u;\n"));
    }
    // f32's shortest round-trip digits: the value the host's f32 holds.
    let floor = crate::toolkit::resident_kernels::ALPHA_FLOOR as f32;
    s.push_str(&format!("const ALPHA_FLOOR: f32 = {floor:e};\n"));
    s
}
/// Output tile `(rows, columns)` per workgroup of `gemm_tiled.wgsl`
/// (`TM`, `TN`), computed by 16 × 16 invocations.
pub const TILED_TILE: (u32, u32) = (64, 64);

/// The catalogue's table: one row per kernel, with its name, its storage
/// bindings (`R` read, `W` written) in the order the [`crate::toolkit::Backend`]
/// method takes the buffers, its parameter block, whether it is a
/// device-resident kernel and, for every kernel but the GEMMs, its WGSL
/// shader with its workgroup memory and invocations. It makes [`KernelId`]
/// and the facts [`KernelId::name`], [`KernelId::bindings`],
/// [`KernelId::params`], [`KernelId::is_resident`], [`KernelId::shaders`]
/// and (but for the GEMMs) [`KernelId::build`] read from it; a new kernel
/// is one row here plus its shader, its descriptor and its `Launch`.
macro_rules! catalogue {
    (@build) => {
        None
    };
    (@build $shader:ident, $bytes:expr, $invocations:expr) => {
        Some(WgslRow {
            shader: $shader,
            workgroup_bytes: $bytes,
            invocations: $invocations,
        })
    };
    ($(
        $(#[$doc:meta])*
        $id:ident => $name:literal, [$($access:ident),*], $params:ty, $resident:literal
            $(, $shader:ident: $bytes:expr, $invocations:expr)?;
    )*) => {
        /// A kernel the driver dispatches. Its [`name`](Self::name) is its
        /// entry point in every shader that implements it, its label in
        /// kernel timings, and (for the GEMMs, without the `gemm_` prefix)
        /// its key in `HEADKL_GEMM` and the tune cache.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum KernelId {
            $($(#[$doc])* $id,)*
        }

        impl KernelId {
            /// Every kernel.
            pub const ALL: [KernelId; [$(stringify!($id)),*].len()] = [$(KernelId::$id),*];

            /// Its one name: entry point, timing label and docs.
            pub const fn name(self) -> &'static str {
                match self {
                    $(KernelId::$id => $name,)*
                }
            }

            /// Its storage bindings, at bindings 1.. (binding 0 is the
            /// uniform parameter block), in the order the
            /// [`crate::toolkit::Backend`] method takes the buffers.
            pub const fn bindings(self) -> &'static [Access] {
                const R: Access = Access::Read;
                const W: Access = Access::ReadWrite;
                match self {
                    $(KernelId::$id => &[$($access),*],)*
                }
            }

            /// Its uniform parameter block (the descriptor's `check`
            /// returns one).
            pub const fn params(self) -> ParamBlock {
                match self {
                    $(KernelId::$id => <$params>::BLOCK,)*
                }
            }

            /// Whether it is one of the device-resident entry points'
            /// kernels, which read the caller's data and so are always
            /// built with runtime bounds checks.
            pub const fn is_resident(self) -> bool {
                match self {
                    $(KernelId::$id => $resident,)*
                }
            }

            /// Its one WGSL build, for every kernel but the GEMMs (whose
            /// build depends on the device's [`GemmKernel`]).
            const fn wgsl_row(self) -> Option<WgslRow> {
                match self {
                    $(KernelId::$id => catalogue!(@build $($shader, $bytes, $invocations)?),)*
                }
            }
        }
    };
}

/// [`crate::problem::MAX_K`] as the shaders' `u32`.
const MAX_K_U32: u32 = crate::problem::MAX_K as u32;

/// A kernel's one WGSL build, as its catalogue row gives it.
#[derive(Clone, Copy)]
struct WgslRow {
    shader: Shader,
    /// Workgroup memory as the shader declares it (checked against naga's
    /// layout by the shader tests).
    workgroup_bytes: u32,
    invocations: u32,
}

catalogue! {
    /// The logits GEMM, `x · W_sliceᵀ` ([`HeadLayout::Logits`]).
    GemmLogits => "gemm_logits", [R, R, W], GemmParams, false;
    /// The input-gradient GEMM, `g_slice · W_slice` ([`HeadLayout::Dx`]).
    GemmDx => "gemm_dx", [R, R, W], GemmParams, false;
    /// [`KernelId::GemmDx`] with the block filter (`crate::problem::filter`;
    /// [`GemmDesc::mask_rows`] > 0): a build of its own in every GEMM
    /// family (a WGSL entry point, a GLSL variant with `FILTER 1`), so the
    /// unfiltered GEMM's code is unchanged.
    GemmDxFiltered => "gemm_dx_filtered", [R, R, W], GemmParams, false;
    /// The KL row kernel ([`KlDesc`]).
    KlRows => "kl_rows", [R, R, R, R, W, W], RowParams, false,
        // red_max, red_sum, red_bad, red_max1, red_sum1, red_aux [WG], three
        // scalars, two vec4s, the divergences' vec2, and the block filter's
        // seg_mask [SEG_WORDS] (declared in every pipeline, touched only
        // with the filter).
        KL_ROWS_WGSL: 6 * 4 * ROW_WORKGROUP + 3 * 4 + 2 * 16 + 8 + 4 * FILTER_SEG_WORDS, ROW_WORKGROUP;
    /// The exact top-k row kernel ([`TopkDesc`]).
    TopkRows => "topk_rows", [R, W, W], RowParams, false,
        // hist [TOPK_HIST], scan [WG], sel_key and sel_id [MAX_K], 9 scalars.
        TOPK_ROWS_WGSL: 4 * (TOPK_HIST + ROW_WORKGROUP + 2 * MAX_K_U32 + 9), ROW_WORKGROUP;
    /// A split-K GEMM's partial blocks summed ([`SumPartsDesc`]).
    SumParts => "sum_parts", [R, W], SumPartsParams, false, SUM_PARTS_WGSL: 0, ROW_WORKGROUP;
    /// f16 rows into columns for the head's gradient GEMM ([`TransposeDesc`]).
    Transpose => "transpose", [R, W], TransposeParams, false,
        // tile [32 × 33] f32.
        TRANSPOSE_WGSL: 4 * TRANSPOSE_TILE * (TRANSPOSE_TILE + 1), ROW_WORKGROUP;
    /// Resident: the weights' total and gradient scale ([`WeightStatsDesc`]).
    WeightStats => "weight_stats", [R, W], WeightStatsParams, true,
        // red_sum, red_max, red_bad [WG].
        WEIGHT_STATS_WGSL: 3 * 4 * ROW_WORKGROUP, ROW_WORKGROUP;
    /// Resident: the caller's teacher rows checked into scratch
    /// ([`TeacherRowsDesc`]).
    TeacherRows => "teacher_rows", [R, R, R, W, W, W, W], TeacherRowsParams, true,
        // row_ids [MAX_K]; red_sum, red_bad, red_range [WG].
        TEACHER_ROWS_WGSL: 4 * (MAX_K_U32 + 3 * ROW_WORKGROUP), ROW_WORKGROUP;
    /// Resident: the caller's labels checked into scratch ([`LabelsInDesc`]).
    LabelsIn => "labels_in", [R, W, W], LabelsInParams, true, LABELS_IN_WGSL: 0, ROW_WORKGROUP;
    /// Resident: the caller's hidden rows (f32, f16 or bf16) into the
    /// padded f16 operand ([`HiddenInDesc`]); the host path's f32 rows too,
    /// once uploaded.
    HiddenIn => "hidden_in", [R, W], HiddenInParams, true, HIDDEN_IN_WGSL: 0, ROW_WORKGROUP;
    /// Resident: a chunk's loss and dx into the caller's buffers
    /// ([`LossOutDesc`]).
    LossOut => "loss_out", [R, R, W, W, W, W], LossOutParams, true, LOSS_OUT_WGSL: 4, ROW_WORKGROUP;
    /// Resident: a chunk's top-k into the caller's buffers ([`TopkOutDesc`]).
    TopkOut => "topk_out", [R, R, W, W, W], TopkOutParams, true, TOPK_OUT_WGSL: 0, ROW_WORKGROUP;
    /// Resident: the first flagged row described ([`StatusDetailDesc`]).
    StatusDetail => "status_detail", [R, R, R, W, R], StatusDetailParams, true,
        // One invocation walks the flagged row.
        STATUS_DETAIL_WGSL: 0, 1;
    /// Resident: a vocabulary shard's per-row steps of the two-phase loss
    /// ([`ShardRowsDesc`]).
    ShardRows => "shard_rows", [W, R, W, W, W, W, W], ShardRowsParams, true, SHARD_ROWS_WGSL: 0, ROW_WORKGROUP;
    /// Resident: the caller's gather ids checked into scratch
    /// ([`GatherRowsDesc`]).
    GatherIn => "gather_in", [R, W, W], GatherRowsParams, true, GATHER_WGSL: 0, ROW_WORKGROUP;
    /// Resident: a chunk's gathered log-probabilities and lse into the
    /// caller's buffers ([`GatherRowsDesc`]).
    GatherOut => "gather_out", [R, W, W, W], GatherRowsParams, true, GATHER_WGSL: 0, ROW_WORKGROUP;
    /// Resident: a piece of the head's gradient into the caller's buffer
    /// ([`HeadGradOutDesc`]).
    HeadGradOut => "head_grad_out", [R, W, W], HeadGradOutParams, true, HEAD_GRAD_OUT_WGSL: 4, ROW_WORKGROUP;
}

/// How a kernel uses one storage binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read only.
    Read,
    /// Written (and possibly read).
    ReadWrite,
}

/// Which GEMM implementation runs on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmKernel {
    /// `gemm_tiled.wgsl`, on any device.
    Tiled,
    /// A matrix-unit kernel at a fixed subgroup size.
    Coop {
        /// The kernel and its tile.
        kernel: CoopGemm,
        /// The subgroup size it is built for (`SG_SIZE`).
        subgroup: u32,
    },
}

/// Where a kernel's code comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSource {
    /// A WGSL file of `shaders/`, compiled by naga (with overrides).
    Wgsl(Shader),
    /// The SPIR-V of `gemm_khr.comp` built for this tile and layout
    /// (`headkl_glsl::gemm`); entry point `main`, no overrides. Its
    /// bindings and parameter block are the GEMM's, as for the WGSL GEMMs.
    Glsl {
        /// The tile.
        tile: GlslTile,
        /// The layout it was built for (`NN` is [`HeadLayout::Dx`]).
        layout: HeadLayout,
        /// The dx GEMM's block filter compiled in (`FILTER 1`).
        filter: bool,
    },
    /// An entry point of `shaders/gemm_wgmma.ptx` (NVIDIA Hopper, launched
    /// through `VK_NVX_binary_import`): the GEMM's parameter block passed by
    /// value and its three buffers by device address, in that order.
    Ptx {
        /// The tile.
        tile: WgmmaTile,
        /// The layout its entry point computes.
        layout: HeadLayout,
    },
}

impl KernelSource {
    /// A name for it in pipeline caches and errors: the WGSL file, or the
    /// GLSL variant's name.
    pub fn name(&self) -> String {
        match self {
            KernelSource::Wgsl(shader) => shader.file.to_string(),
            KernelSource::Glsl { tile, layout, filter } => {
                let name = tile.kernel_name("gemm", *layout == HeadLayout::Dx);
                if *filter {
                    name + "_filter"
                } else {
                    name
                }
            }
            KernelSource::Ptx { tile, layout } => tile.entry(*layout).to_string(),
        }
    }
}

/// What a backend needs to build one kernel's pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelBuild {
    /// The kernel.
    pub id: KernelId,
    /// Its source.
    pub source: KernelSource,
    /// Its entry point in that source.
    pub entry: &'static str,
    /// `override` values, by name.
    pub overrides: Vec<(&'static str, u32)>,
    /// Workgroup memory in bytes.
    pub workgroup_bytes: u32,
    /// Invocations per workgroup.
    pub invocations: u32,
    /// Runs on matrix units: needs whole subgroups of the size it was built for.
    pub matrix_units: bool,
}

impl KernelId {
    /// The GEMM kernel for `layout`.
    pub const fn gemm(layout: HeadLayout) -> KernelId {
        match layout {
            HeadLayout::Logits => KernelId::GemmLogits,
            HeadLayout::Dx => KernelId::GemmDx,
        }
    }

    /// The kernel-time label of a bulk PTX tile's pack launches for this
    /// GEMM (`crate::toolkit::wgmma_tile::PackKind`): `gemm_logits_pack` or
    /// `gemm_dx_pack`; a GEMM's time is its own label's and this one's.
    pub const fn pack_label(self) -> &'static str {
        match self {
            KernelId::GemmLogits => "gemm_logits_pack",
            _ => "gemm_dx_pack",
        }
    }

    /// The head layout of a GEMM kernel (`None` for the others).
    pub const fn gemm_layout(self) -> Option<HeadLayout> {
        match self {
            KernelId::GemmLogits => Some(HeadLayout::Logits),
            KernelId::GemmDx | KernelId::GemmDxFiltered => Some(HeadLayout::Dx),
            _ => None,
        }
    }

    /// The largest parameter block of any kernel, in bytes: what a
    /// backend's ring of uniform slots must give each slot at least.
    pub const MAX_PARAMS_BYTES: u64 = 128;

    /// Size in bytes of its uniform parameter block.
    pub const fn params_bytes(self) -> u64 {
        self.params().bytes as u64
    }

    /// Every shader that implements it (the GEMMs have one per
    /// [`GemmKernel`] family).
    pub fn shaders(self) -> Vec<Shader> {
        match self.wgsl_row() {
            Some(row) => vec![row.shader],
            None => vec![GEMM_TILED_WGSL, GEMM_COOP_WGSL, GEMM_COOP_DIRECT_WGSL],
        }
    }

    /// How to build it where the GEMM runs as `gemm` (ignored by the
    /// other kernels).
    pub fn build(self, gemm: GemmKernel) -> KernelBuild {
        let fixed = |shader, workgroup_bytes| KernelBuild {
            id: self,
            source: KernelSource::Wgsl(shader),
            entry: self.name(),
            overrides: Vec::new(),
            workgroup_bytes,
            invocations: ROW_WORKGROUP,
            matrix_units: false,
        };
        if let Some(row) = self.wgsl_row() {
            return KernelBuild {
                invocations: row.invocations,
                ..fixed(row.shader, row.workgroup_bytes)
            };
        }
        match (self, gemm) {
            // as_ and bs_: [16][64] f32 each.
            (_, GemmKernel::Tiled) => fixed(GEMM_TILED_WGSL, 2 * 16 * 64 * 4),
            (_, GemmKernel::Coop { kernel, subgroup }) => {
                // Only the GEMMs reach this arm.
                let layout = self.gemm_layout().unwrap_or(HeadLayout::Logits);
                // The PTX tiles have no block filter: the filtered dx GEMM
                // runs the default GLSL tile's filtered build beside them.
                let kernel = match kernel {
                    CoopGemm::Wgmma(_) if self == KernelId::GemmDxFiltered => CoopGemm::Glsl(GLSL_FILTER_TILE),
                    other => other,
                };
                let (source, entry, workgroup_bytes) = match kernel {
                    CoopGemm::Staged(_) => (KernelSource::Wgsl(GEMM_COOP_WGSL), self.name(), kernel.shared_bytes()),
                    CoopGemm::Direct => (KernelSource::Wgsl(GEMM_COOP_DIRECT_WGSL), self.name(), 0),
                    CoopGemm::Glsl(tile) => (
                        KernelSource::Glsl {
                            tile,
                            layout,
                            filter: self == KernelId::GemmDxFiltered,
                        },
                        "main",
                        tile.layout_shared_bytes(layout == HeadLayout::Dx),
                    ),
                    CoopGemm::Wgmma(tile) => (
                        KernelSource::Ptx { tile, layout },
                        tile.entry(layout),
                        tile.shared_bytes(),
                    ),
                };
                KernelBuild {
                    id: self,
                    source,
                    entry,
                    overrides: kernel.overrides(subgroup),
                    workgroup_bytes,
                    invocations: kernel.invocations(subgroup),
                    matrix_units: true,
                }
            }
        }
    }

    /// Why a device with `limits` cannot run this kernel built as
    /// [`GemmKernel::Tiled`] (the build every device must run), or `None`.
    fn misfit(self, limits: &KernelLimits) -> Option<String> {
        let build = self.build(GemmKernel::Tiled);
        if build.workgroup_bytes > limits.shared_bytes {
            return Some(format!(
                "{} bytes of workgroup memory for {self} (has {})",
                build.workgroup_bytes, limits.shared_bytes
            ));
        }
        if build.invocations > limits.invocations {
            return Some(format!(
                "workgroups of {} invocations for {self} (allows {})",
                build.invocations, limits.invocations
            ));
        }
        None
    }
}

impl fmt::Display for KernelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a device with `limits` cannot run headkl's kernels without matrix
/// units (the row kernels, `hidden_in`, the tiled GEMM), or `None` when it
/// can. Both backends call it when they list a device.
pub fn device_misfit(limits: &KernelLimits) -> Option<String> {
    let why: Vec<String> = KernelId::ALL.iter().filter_map(|k| k.misfit(limits)).collect();
    (!why.is_empty()).then(|| why.join("; "))
}

impl GemmKernel {
    /// Output tile `(rows, columns)` per workgroup.
    pub const fn tile(self) -> (u32, u32) {
        match self {
            GemmKernel::Tiled => TILED_TILE,
            GemmKernel::Coop { kernel, .. } => kernel.tile(),
        }
    }
}

impl GemmDesc {
    /// Workgroups of its dispatch with `gemm`: one per output tile and part.
    pub fn workgroups(&self, gemm: GemmKernel) -> u64 {
        self.workgroups_for_tile(gemm.tile())
    }

    /// Workgroups of its dispatch with a kernel of output tile `(rows,
    /// columns)`: one per tile and part (the shaders take workgroup `l` as
    /// part `l / tiles` of tile `l % tiles`).
    pub fn workgroups_for_tile(&self, (rows, cols): (u32, u32)) -> u64 {
        self.tiles((rows, cols)) * self.k_parts as u64
    }

    /// Output tiles of one part with a kernel of tile `(rows, columns)`.
    pub fn tiles(&self, (rows, cols): (u32, u32)) -> u64 {
        (self.m as u64).div_ceil(u64::from(rows)) * (self.n as u64).div_ceil(u64::from(cols))
    }

    /// Its kernel: the filtered dx GEMM with a block mask to read.
    pub const fn kernel(&self) -> KernelId {
        match self.b_layout {
            HeadLayout::Dx if self.mask_rows > 0 => KernelId::GemmDxFiltered,
            layout => KernelId::gemm(layout),
        }
    }
}

impl SumPartsDesc {
    /// Workgroups of its dispatch: one invocation per 4 elements of `dst`.
    pub fn workgroups(&self) -> u64 {
        (self.len as u64 / 4).div_ceil(u64::from(ROW_WORKGROUP))
    }
}

/// Rows and columns of `transpose.wgsl`'s tile (its `TILE`).
pub const TRANSPOSE_TILE: u32 = 32;

impl TransposeDesc {
    /// Workgroups of its dispatch: one per 32 × 32 tile of `src`'s
    /// `rows_padded × cols`.
    pub fn workgroups(&self) -> u64 {
        let tile = TRANSPOSE_TILE as usize;
        (self.cols.div_ceil(tile) * self.rows_padded.div_ceil(tile)) as u64
    }
}

impl KlDesc {
    /// Workgroups of its dispatch: one per row.
    pub fn workgroups(&self) -> u64 {
        self.rows as u64
    }
}

impl TopkDesc {
    /// Workgroups of its dispatch: one per row.
    pub fn workgroups(&self) -> u64 {
        self.rows as u64
    }
}

/// Workgroups of [`ROW_WORKGROUP`] invocations for one invocation per each
/// of `n` elements.
fn per_element(n: usize) -> u64 {
    (n as u64).div_ceil(u64::from(ROW_WORKGROUP))
}

impl WeightStatsDesc {
    /// Workgroups of its dispatch: one, which strides over the tokens.
    pub fn workgroups(&self) -> u64 {
        1
    }
}

impl TeacherRowsDesc {
    /// Workgroups of its dispatch: one per row.
    pub fn workgroups(&self) -> u64 {
        self.rows as u64
    }
}

impl LabelsInDesc {
    /// Workgroups of its dispatch: one invocation per row.
    pub fn workgroups(&self) -> u64 {
        per_element(self.rows)
    }
}

impl HiddenInDesc {
    /// Workgroups of its dispatch: one invocation per element of the
    /// padded operand.
    pub fn workgroups(&self) -> u64 {
        per_element(self.rows_padded * self.ld)
    }
}

impl LossOutDesc {
    /// Workgroups of its dispatch: one invocation per element of the
    /// chunk's dx (the first `rows` also copy the loss).
    pub fn workgroups(&self) -> u64 {
        per_element(self.rows * self.hs.max(1))
    }
}

impl HeadGradOutDesc {
    /// Workgroups of its dispatch: one invocation per element copied.
    pub fn workgroups(&self) -> u64 {
        per_element(self.rows * self.hs)
    }
}

impl TopkOutDesc {
    /// Workgroups of its dispatch: one invocation per entry.
    pub fn workgroups(&self) -> u64 {
        per_element(self.rows * self.k)
    }
}

impl GatherRowsDesc {
    /// Workgroups of either kernel's dispatch: one invocation per column
    /// of the chunk's `[rows][k + 1]` gather rows.
    pub fn workgroups(&self) -> u64 {
        per_element(self.rows * (self.k + 1))
    }
}

impl ShardRowsDesc {
    /// Workgroups of its dispatch: one invocation per row.
    pub fn workgroups(&self) -> u64 {
        per_element(self.rows)
    }
}

impl StatusDetailDesc {
    /// Workgroups of its dispatch: one (of one invocation).
    pub fn workgroups(&self) -> u64 {
        1
    }
}

/// An error naming a kernel descriptor's field: the driver never builds
/// one, so this is a bug in a caller of [`crate::toolkit::Backend`].
pub(crate) fn bad_descriptor(kernel: KernelId, field: &'static str, value: u128, reason: String) -> Error {
    Error::BadDescriptor {
        kernel: kernel.name(),
        field,
        value,
        reason,
    }
}

/// `Ok(())`, or the error of [`bad_descriptor`] when `ok` is false.
pub(crate) fn require(
    ok: bool,
    kernel: KernelId,
    field: &'static str,
    value: u128,
    reason: impl FnOnce() -> String,
) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(bad_descriptor(kernel, field, value, reason()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row kernels take their flag bits and codes from
    /// `row_flags::wgsl` and declare none of their own.
    #[test]
    fn the_row_kernels_take_their_flags_from_params() {
        use crate::toolkit::params::row_flags;
        let generated = row_flags::wgsl();
        for (name, value) in [
            ("F_SOFTCAP", row_flags::SOFTCAP),
            ("F_DENSE", row_flags::DENSE_TEACHER),
            ("F_GATHER", row_flags::GATHER),
            ("TAIL_NONE", crate::problem::terms::TailMode::Unnormalized.code()),
            ("DIV_JSD", crate::problem::terms::Divergence::Jsd { beta: 0.5 }.code()),
        ] {
            assert!(
                generated.contains(&format!("const {name}: u32 = {value}u;\n")),
                "{generated}"
            );
        }
        assert!(
            generated.contains("const TAIL_FLOOR: f32 = 5.9604645e-8;\n"),
            "{generated}"
        );
        for shader in [KL_ROWS_WGSL, TOPK_ROWS_WGSL] {
            assert_eq!(shader.text.matches(FLAGS_MARKER).count(), 1, "{}", shader.file);
            let source = shader.source();
            for line in generated.lines() {
                assert_eq!(source.matches(line).count(), 1, "{}: {line}", shader.file);
            }
        }
    }

    #[test]
    fn every_kernel_has_one_name_and_a_layout_round_trip() {
        let names: std::collections::BTreeSet<_> = KernelId::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), KernelId::ALL.len());
        for layout in [HeadLayout::Logits, HeadLayout::Dx] {
            assert_eq!(KernelId::gemm(layout).gemm_layout(), Some(layout));
        }
        assert_eq!(KernelId::KlRows.gemm_layout(), None);
        for k in KernelId::ALL {
            assert_eq!(k.params_bytes() % 16, 0, "{k}");
            assert!(k.params_bytes() <= KernelId::MAX_PARAMS_BYTES, "{k}");
            for shader in k.shaders() {
                assert!(
                    shader.text.contains(&format!("fn {}(", k.name())),
                    "{}: {k}",
                    shader.file
                );
                assert_eq!(shader.params, k.params(), "{}", shader.file);
                assert_eq!(shader.text.matches(PARAMS_MARKER).count(), 1, "{}", shader.file);
                assert!(shader.source().contains("var<uniform> params: "), "{}", shader.file);
            }
        }
    }

    #[test]
    fn every_shader_takes_the_host_constants_from_core() {
        let shared = shared_wgsl();
        for stage in crate::toolkit::resident_kernels::ShardStage::ALL {
            let line = format!("const STAGE_{}: u32 = {}u;\n", stage.name(), stage.code());
            assert!(shared.contains(&line), "{shared}");
        }
        assert!(shared.contains("const WG: u32 = 256u;\n"), "{shared}");
        assert!(shared.contains("const MAX_K: u32 = 2048u;\n"), "{shared}");
        // 2^-40 in f32's shortest digits.
        assert!(shared.contains("const ALPHA_FLOOR: f32 = 9.094947e-13;\n"), "{shared}");
        let names: Vec<&str> = shared
            .lines()
            .filter_map(|l| l.strip_prefix("const "))
            .filter_map(|l| l.split(':').next())
            .collect();
        for k in KernelId::ALL {
            for shader in k.shaders() {
                assert_eq!(shader.source().matches(&shared).count(), 1, "{}", shader.file);
                for name in &names {
                    let own = format!("const {name}:");
                    assert!(!shader.text.contains(&own), "{} declares {name} itself", shader.file);
                }
            }
        }
    }

    #[test]
    fn workgroup_counts_follow_the_tiles() {
        let d = GemmDesc::dense(128, 192, 32, HeadLayout::Logits);
        assert_eq!(d.workgroups(GemmKernel::Tiled), 2 * 3);
        let coop = GemmKernel::Coop {
            kernel: CoopGemm::parse("staged:r4").unwrap(),
            subgroup: 32,
        };
        assert_eq!(d.workgroups(coop), 2);
        let split = GemmDesc {
            k_parts: 3,
            c_part_stride: 128 * 192,
            ..d
        };
        assert_eq!(split.workgroups(GemmKernel::Tiled), 2 * 3 * 3);
        assert_eq!(split.workgroups(coop), 2 * 3);
        let sum = SumPartsDesc {
            len: 4 * 256 + 4,
            parts: 2,
            part_stride: 2048,
            accumulate: false,
        };
        assert_eq!(sum.workgroups(), 2);
        let h = HiddenInDesc::f32(3, 5, 16, 16);
        assert_eq!(h.workgroups(), 1);
        let h = HiddenInDesc {
            rows_padded: 32,
            ld: 1000,
            ..h
        };
        assert_eq!(h.workgroups(), 125);
        assert_eq!(KernelId::GemmDx.build(coop).invocations, 256);
        assert_eq!(KernelId::GemmDx.build(coop).source, KernelSource::Wgsl(GEMM_COOP_WGSL));

        // A GLSL tile: 128 × 128 C tiles, its SPIR-V for the layout, entry
        // `main`, the layout's own workgroup memory.
        let glsl = GemmKernel::Coop {
            kernel: CoopGemm::parse("glsl:bm128.bk64.s1").unwrap(),
            subgroup: 32,
        };
        assert_eq!(d.workgroups(glsl), 2);
        let build = KernelId::GemmDx.build(glsl);
        let tile = crate::toolkit::GlslTile::from_name("bm128.bk64.s1").unwrap();
        assert_eq!(
            build.source,
            KernelSource::Glsl {
                tile,
                layout: HeadLayout::Dx,
                filter: false,
            }
        );
        assert_eq!(build.source.name(), "gemm_nn_bm128_bk64_s1");
        assert_eq!((build.entry, build.invocations), ("main", 128));
        assert_eq!(build.workgroup_bytes, tile.layout_shared_bytes(true));
        assert!(build.overrides.is_empty() && build.matrix_units);
    }

    #[test]
    fn a_device_is_checked_against_every_kernel() {
        let big = KernelLimits::H200_SPIRV;
        assert_eq!(device_misfit(&big), None);
        let small = KernelLimits {
            shared_bytes: 16 << 10,
            ..big
        };
        let why = device_misfit(&small).unwrap();
        assert_eq!(why, "25636 bytes of workgroup memory for topk_rows (has 16384)");
        let narrow = KernelLimits {
            invocations: 128,
            ..big
        };
        assert!(device_misfit(&narrow).unwrap().contains("256 invocations"));
    }
}
