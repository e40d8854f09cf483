//! One kernel launch: which kernel, its descriptor and its buffers in
//! binding order ([`Launch`]), the one thing a backend's
//! [`Backend::dispatch`] receives. [`Launch::check`] runs the kernel's
//! descriptor checks (`crate::checks`) and is the only way to get the
//! [`Checked`] parameter block a GPU backend binds, so an unchecked
//! dispatch cannot be written. [`Kernels`] gives every backend the
//! per-kernel calls the driver makes, each building its launch.

use crate::backend::{Backend, ConvertDesc, DeviceBuffer, GemmDesc, KlDesc, SumPartsDesc, TopkDesc};
use crate::error::Result;
use crate::kernels::{GemmKernel, KernelBuild, KernelId, KL_FLAGS};
use crate::params::{
    ConvertParams, GatherRowsParams, GemmParams, HiddenInParams, LabelsInParams, LossOutParams, RowParams,
    ShardRowsParams, StatusDetailParams, SumPartsParams, TeacherRowsParams, TopkOutParams, WeightStatsParams,
};
use crate::resident::{
    GatherRowsDesc, HiddenInDesc, LabelsInDesc, LossOutDesc, ShardRowsDesc, StatusDetailDesc, TeacherRowsDesc,
    TopkOutDesc, WeightStatsDesc,
};

/// One kernel launch: the descriptor (see each type's docs for what the
/// kernel computes) and the buffers, named as the kernel binds them.
#[derive(Debug)]
pub enum Launch<'a, B> {
    /// Hidden rows f32 → f16 ([`ConvertDesc`]).
    ConvertF16 {
        /// f32 rows.
        src: &'a B,
        /// The padded f16 operand.
        dst: &'a B,
        /// The extents.
        desc: ConvertDesc,
    },
    /// `C (+)= alpha · A · op(B)` ([`GemmDesc`]; its layout says which of
    /// the two GEMM kernels).
    Gemm {
        /// f16 A.
        a: &'a B,
        /// f16 B (a head plane).
        b: &'a B,
        /// f32 C.
        c: &'a B,
        /// The extents, strides and split.
        desc: GemmDesc,
    },
    /// A split-K GEMM's partial blocks summed ([`SumPartsDesc`]).
    SumParts {
        /// The blocks.
        parts: &'a B,
        /// Their sum.
        dst: &'a B,
        /// The lengths.
        desc: SumPartsDesc,
    },
    /// The KL row kernel ([`KlDesc`]).
    KlRows {
        /// f32 logits `[rows][ld]`.
        logits: &'a B,
        /// Teacher ids `[rows][k]`.
        ids: &'a B,
        /// Teacher probabilities `[rows][k]`.
        probs: &'a B,
        /// Per-row coefficients `[rows]`.
        coef: &'a B,
        /// Per-row loss `[rows]`.
        loss: &'a B,
        /// f16 gradient `[rows][ld]`.
        grad: &'a B,
        /// The extents.
        desc: KlDesc,
    },
    /// The exact top-k row kernel ([`TopkDesc`]).
    TopkRows {
        /// f32 logits `[rows][ld]`.
        logits: &'a B,
        /// Selected ids `[rows][k]`.
        ids: &'a B,
        /// Their probabilities `[rows][k]`.
        probs: &'a B,
        /// The extents.
        desc: TopkDesc,
    },
    /// Resident: the weights' total and gradient scale ([`WeightStatsDesc`]).
    WeightStats {
        /// The caller's weights `[rows]` (any buffer without them).
        weights: &'a B,
        /// The status buffer.
        status: &'a B,
        /// The options.
        desc: WeightStatsDesc,
    },
    /// Resident: teacher rows checked into scratch ([`TeacherRowsDesc`]).
    TeacherRows {
        /// The caller's ids.
        ids: &'a B,
        /// The caller's probabilities (or log-probabilities).
        probs: &'a B,
        /// The caller's weights (any buffer without them).
        weights: &'a B,
        /// The status buffer.
        status: &'a B,
        /// Clamped ids `[rows][k]`.
        ids_out: &'a B,
        /// Checked probabilities `[rows][k]`.
        probs_out: &'a B,
        /// The KL kernel's per-row inputs `[rows][2]`.
        row_in: &'a B,
        /// The extents and the teacher's form.
        desc: TeacherRowsDesc,
    },
    /// Resident: labels checked into scratch ([`LabelsInDesc`]).
    LabelsIn {
        /// The caller's labels (any buffer without them).
        labels: &'a B,
        /// The status buffer.
        status: &'a B,
        /// The KL kernel's per-row inputs `[rows][2]`.
        row_in: &'a B,
        /// The extents.
        desc: LabelsInDesc,
    },
    /// Resident: hidden rows into the padded f16 operand ([`HiddenInDesc`]).
    HiddenIn {
        /// The caller's rows.
        src: &'a B,
        /// The padded f16 operand.
        dst: &'a B,
        /// The extents and element type.
        desc: HiddenInDesc,
    },
    /// Resident: a chunk's loss and dx out ([`LossOutDesc`]).
    LossOut {
        /// kl_rows' `[rows][4]` loss, lse, soft, hard.
        loss_chunk: &'a B,
        /// The chunk's dx `[rows][ld]`.
        dx_chunk: &'a B,
        /// The status buffer.
        status: &'a B,
        /// The caller's loss.
        loss: &'a B,
        /// The caller's dx.
        dx: &'a B,
        /// The caller's `[ntok][3]` terms (any buffer without them).
        terms: &'a B,
        /// The extents.
        desc: LossOutDesc,
    },
    /// Resident: a chunk's top-k out ([`TopkOutDesc`]).
    TopkOut {
        /// The chunk's ids.
        ids_chunk: &'a B,
        /// The chunk's probabilities.
        probs_chunk: &'a B,
        /// The status buffer.
        status: &'a B,
        /// The caller's ids.
        ids: &'a B,
        /// The caller's probabilities.
        probs: &'a B,
        /// The extents.
        desc: TopkOutDesc,
    },
    /// Resident: the caller's gather ids into a chunk's gather rows
    /// ([`GatherRowsDesc`]).
    GatherIn {
        /// The caller's ids u32 `[ntok][k]`.
        ids: &'a B,
        /// The status buffer.
        status: &'a B,
        /// The chunk's gather rows `[rows][k + 1]`.
        ids_chunk: &'a B,
        /// The extents.
        desc: GatherRowsDesc,
    },
    /// Resident: a chunk's gathered values out ([`GatherRowsDesc`]).
    GatherOut {
        /// The chunk's values `[rows][k + 1]` (the top-k kernel's gather).
        values_chunk: &'a B,
        /// The status buffer.
        status: &'a B,
        /// The caller's log-probabilities `[ntok][k]`.
        logprobs: &'a B,
        /// The caller's lse `[ntok]`.
        lse: &'a B,
        /// The extents.
        desc: GatherRowsDesc,
    },
    /// Resident: the first flagged row described ([`StatusDetailDesc`]).
    StatusDetail {
        /// The caller's ids.
        ids: &'a B,
        /// The caller's probabilities.
        probs: &'a B,
        /// The caller's weights (any buffer without them).
        weights: &'a B,
        /// The status buffer.
        status: &'a B,
        /// The caller's labels (any buffer without them).
        labels: &'a B,
        /// The extents and the teacher's form.
        desc: StatusDetailDesc,
    },
    /// Resident: a vocabulary shard's per-row step ([`ShardRowsDesc`]).
    ShardRows {
        /// The loss kernel's `[rows][4]`.
        loss_chunk: &'a B,
        /// The merged statistics `[ntok][3]` (any buffer where unread).
        stats: &'a B,
        /// A shard's partials `[ntok][3]` (any buffer where unused).
        partials: &'a B,
        /// The chunk's teacher ids `[rows][k]`.
        ids: &'a B,
        /// Their probabilities.
        probs: &'a B,
        /// The loss kernel's per-row inputs `[rows][2]`.
        row_in: &'a B,
        /// The status buffer.
        status: &'a B,
        /// The step and the extents.
        desc: ShardRowsDesc,
    },
}

impl<B> Clone for Launch<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Launch<'_, B> {}

/// A launch's parameter block, checked against its buffers: only
/// [`Launch::check`] makes one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Checked {
    id: KernelId,
    block: Block,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Block {
    Convert(ConvertParams),
    Gemm(GemmParams),
    SumParts(SumPartsParams),
    Rows(RowParams),
    WeightStats(WeightStatsParams),
    TeacherRows(TeacherRowsParams),
    LabelsIn(LabelsInParams),
    HiddenIn(HiddenInParams),
    LossOut(LossOutParams),
    TopkOut(TopkOutParams),
    GatherRows(GatherRowsParams),
    StatusDetail(StatusDetailParams),
    ShardRows(ShardRowsParams),
}

impl Checked {
    /// The kernel.
    pub fn id(&self) -> KernelId {
        self.id
    }

    /// The parameter block's bytes for a dispatch whose grid is `grid_x`
    /// workgroups wide (the kernels unfold a folded grid with it).
    pub fn bytes(&self, grid_x: u32) -> Vec<u8> {
        match self.block {
            Block::Convert(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::Gemm(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::SumParts(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::Rows(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::WeightStats(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::TeacherRows(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::LabelsIn(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::HiddenIn(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::LossOut(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::TopkOut(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::GatherRows(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::StatusDetail(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
            Block::ShardRows(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(),
        }
    }

    /// How to build the kernel for this launch where the GEMM runs as
    /// `gemm`: the catalogue's [`KernelId::build`], with the KL rows
    /// specialized to the launch's term set (the `KL_FLAGS` override, its
    /// block's flags), so each set is a pipeline of its own and the seed's
    /// loss compiles without the terms' code.
    pub fn build(&self, gemm: GemmKernel) -> KernelBuild {
        let mut build = self.id.build(gemm);
        build.overrides.extend(self.specialization());
        build
    }

    /// The override values [`build`](Self::build) adds to the catalogue's
    /// build: `KL_FLAGS` for the KL rows, none for the other kernels.
    pub fn specialization(&self) -> Vec<(&'static str, u32)> {
        match (self.id, self.block) {
            (KernelId::KlRows, Block::Rows(p)) => vec![(KL_FLAGS, p.flags)],
            _ => Vec::new(),
        }
    }

    /// The GEMM's block, for a backend that binds it to a kernel of its
    /// own choosing (the GLSL tiles); `None` for the other kernels.
    pub fn gemm_params(&self) -> Option<GemmParams> {
        match self.block {
            Block::Gemm(p) => Some(p),
            _ => None,
        }
    }
}

impl<'a, B: DeviceBuffer> Launch<'a, B> {
    /// The kernel it launches.
    pub fn id(&self) -> KernelId {
        match self {
            Launch::ConvertF16 { .. } => KernelId::ConvertF16,
            Launch::Gemm { desc, .. } => desc.kernel(),
            Launch::SumParts { .. } => KernelId::SumParts,
            Launch::KlRows { .. } => KernelId::KlRows,
            Launch::TopkRows { .. } => KernelId::TopkRows,
            Launch::WeightStats { .. } => KernelId::WeightStats,
            Launch::TeacherRows { .. } => KernelId::TeacherRows,
            Launch::LabelsIn { .. } => KernelId::LabelsIn,
            Launch::HiddenIn { .. } => KernelId::HiddenIn,
            Launch::LossOut { .. } => KernelId::LossOut,
            Launch::TopkOut { .. } => KernelId::TopkOut,
            Launch::GatherIn { .. } => KernelId::GatherIn,
            Launch::GatherOut { .. } => KernelId::GatherOut,
            Launch::StatusDetail { .. } => KernelId::StatusDetail,
            Launch::ShardRows { .. } => KernelId::ShardRows,
        }
    }

    /// Its buffers in binding order (the catalogue's
    /// [`KernelId::bindings`]).
    pub fn buffers(&self) -> Vec<&'a B> {
        match *self {
            Launch::ConvertF16 { src, dst, .. } => vec![src, dst],
            Launch::Gemm { a, b, c, .. } => vec![a, b, c],
            Launch::SumParts { parts, dst, .. } => vec![parts, dst],
            Launch::KlRows {
                logits,
                ids,
                probs,
                coef,
                loss,
                grad,
                ..
            } => vec![logits, ids, probs, coef, loss, grad],
            Launch::TopkRows { logits, ids, probs, .. } => vec![logits, ids, probs],
            Launch::WeightStats { weights, status, .. } => vec![weights, status],
            Launch::TeacherRows {
                ids,
                probs,
                weights,
                status,
                ids_out,
                probs_out,
                row_in,
                ..
            } => vec![ids, probs, weights, status, ids_out, probs_out, row_in],
            Launch::LabelsIn {
                labels, status, row_in, ..
            } => vec![labels, status, row_in],
            Launch::HiddenIn { src, dst, .. } => vec![src, dst],
            Launch::LossOut {
                loss_chunk,
                dx_chunk,
                status,
                loss,
                dx,
                terms,
                ..
            } => vec![loss_chunk, dx_chunk, status, loss, dx, terms],
            Launch::TopkOut {
                ids_chunk,
                probs_chunk,
                status,
                ids,
                probs,
                ..
            } => vec![ids_chunk, probs_chunk, status, ids, probs],
            Launch::GatherIn {
                ids, status, ids_chunk, ..
            } => vec![ids, status, ids_chunk],
            Launch::GatherOut {
                values_chunk,
                status,
                logprobs,
                lse,
                ..
            } => vec![values_chunk, status, logprobs, lse],
            Launch::StatusDetail {
                ids,
                probs,
                weights,
                status,
                labels,
                ..
            } => vec![ids, probs, weights, status, labels],
            Launch::ShardRows {
                loss_chunk,
                stats,
                partials,
                ids,
                probs,
                row_in,
                status,
                ..
            } => vec![loss_chunk, stats, partials, ids, probs, row_in, status],
        }
    }

    /// Workgroups it dispatches; a GEMM's depend on the kernel `gemm` the
    /// backend runs for it (ignored for the other kernels).
    pub fn workgroups(&self, gemm: GemmKernel) -> u64 {
        match self {
            Launch::ConvertF16 { desc, .. } => desc.workgroups(),
            Launch::Gemm { desc, .. } => desc.workgroups(gemm),
            Launch::SumParts { desc, .. } => desc.workgroups(),
            Launch::KlRows { desc, .. } => desc.workgroups(),
            Launch::TopkRows { desc, .. } => desc.workgroups(),
            Launch::WeightStats { desc, .. } => desc.workgroups(),
            Launch::TeacherRows { desc, .. } => desc.workgroups(),
            Launch::LabelsIn { desc, .. } => desc.workgroups(),
            Launch::HiddenIn { desc, .. } => desc.workgroups(),
            Launch::LossOut { desc, .. } => desc.workgroups(),
            Launch::TopkOut { desc, .. } => desc.workgroups(),
            Launch::GatherIn { desc, .. } | Launch::GatherOut { desc, .. } => desc.workgroups(),
            Launch::StatusDetail { desc, .. } => desc.workgroups(),
            Launch::ShardRows { desc, .. } => desc.workgroups(),
        }
    }

    /// Its buffers as the array its descriptor's `check` takes.
    fn bound<const N: usize>(&self) -> Result<[&'a B; N]> {
        let buffers = self.buffers();
        let count = buffers.len();
        buffers.try_into().map_err(|_| {
            crate::kernels::bad_descriptor(self.id(), "buffers", count as u128, format!("the kernel binds {N}"))
        })
    }

    /// Checks the descriptor against the buffers (each a binding of at most
    /// `max_binding` bytes): the kernel's [`crate::checks`], every backend's
    /// first step of every dispatch.
    pub fn check(&self, max_binding: u64) -> Result<Checked> {
        let block = match *self {
            Launch::ConvertF16 { src, dst, desc } => Block::Convert(desc.check([src, dst], max_binding)?),
            Launch::Gemm { a, b, c, desc } => Block::Gemm(desc.check([a, b, c], max_binding)?),
            Launch::SumParts { parts, dst, desc } => Block::SumParts(desc.check([parts, dst], max_binding)?),
            Launch::KlRows {
                logits,
                ids,
                probs,
                coef,
                loss,
                grad,
                desc,
            } => Block::Rows(desc.check([logits, ids, probs, coef, loss, grad], max_binding)?),
            Launch::TopkRows {
                logits,
                ids,
                probs,
                desc,
            } => Block::Rows(desc.check([logits, ids, probs], max_binding)?),
            Launch::WeightStats { desc, .. } => Block::WeightStats(desc.check(self.bound()?, max_binding)?),
            Launch::TeacherRows { desc, .. } => Block::TeacherRows(desc.check(self.bound()?, max_binding)?),
            Launch::LabelsIn { desc, .. } => Block::LabelsIn(desc.check(self.bound()?, max_binding)?),
            Launch::HiddenIn { desc, .. } => Block::HiddenIn(desc.check(self.bound()?, max_binding)?),
            Launch::LossOut { desc, .. } => Block::LossOut(desc.check(self.bound()?, max_binding)?),
            Launch::TopkOut { desc, .. } => Block::TopkOut(desc.check(self.bound()?, max_binding)?),
            Launch::GatherIn { desc, .. } => Block::GatherRows(desc.check_in(self.bound()?, max_binding)?),
            Launch::GatherOut { desc, .. } => Block::GatherRows(desc.check_out(self.bound()?, max_binding)?),
            Launch::StatusDetail { desc, .. } => Block::StatusDetail(desc.check(self.bound()?, max_binding)?),
            Launch::ShardRows { desc, .. } => Block::ShardRows(desc.check(self.bound()?, max_binding)?),
        };
        Ok(Checked { id: self.id(), block })
    }
}

/// The driver's kernel calls on any backend, each one [`Launch`] through
/// [`Backend::dispatch`].
pub trait Kernels: Backend {
    /// Converts hidden rows f32 → f16 (see [`ConvertDesc`]).
    fn convert_f16(&self, src: &Self::Buffer, dst: &Self::Buffer, desc: &ConvertDesc) -> Result<()> {
        self.dispatch(Launch::ConvertF16 { src, dst, desc: *desc })
    }

    /// `C (+)= alpha · A · op(B)` (see [`GemmDesc`]); timed as
    /// [`GemmDesc::kernel`].
    fn gemm(&self, a: &Self::Buffer, b: &Self::Buffer, c: &Self::Buffer, desc: &GemmDesc) -> Result<()> {
        self.dispatch(Launch::Gemm { a, b, c, desc: *desc })
    }

    /// Sums a split-K GEMM's partial blocks (see [`SumPartsDesc`]).
    fn sum_parts(&self, parts: &Self::Buffer, dst: &Self::Buffer, desc: &SumPartsDesc) -> Result<()> {
        self.dispatch(Launch::SumParts {
            parts,
            dst,
            desc: *desc,
        })
    }

    /// The KL row kernel (see [`KlDesc`]).
    #[allow(clippy::too_many_arguments, reason = "one buffer per binding of the kernel")]
    fn kl_rows(
        &self,
        logits: &Self::Buffer,
        ids: &Self::Buffer,
        probs: &Self::Buffer,
        coef: &Self::Buffer,
        loss: &Self::Buffer,
        grad: &Self::Buffer,
        desc: &KlDesc,
    ) -> Result<()> {
        self.dispatch(Launch::KlRows {
            logits,
            ids,
            probs,
            coef,
            loss,
            grad,
            desc: *desc,
        })
    }

    /// The exact top-k row kernel (see [`TopkDesc`]).
    fn topk_rows(
        &self,
        logits: &Self::Buffer,
        ids: &Self::Buffer,
        probs: &Self::Buffer,
        desc: &TopkDesc,
    ) -> Result<()> {
        self.dispatch(Launch::TopkRows {
            logits,
            ids,
            probs,
            desc: *desc,
        })
    }
}

impl<T: Backend + ?Sized> Kernels for T {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::HeadLayout;
    use crate::error::Error;

    struct Len(u64);
    impl DeviceBuffer for Len {
        fn len(&self) -> u64 {
            self.0
        }
    }

    /// Each launch names its kernel and its buffers in the catalogue's
    /// binding order, and its check is the descriptor's.
    #[test]
    fn launches_follow_the_catalogue() {
        let big = Len(1 << 24);
        let gemm = GemmDesc::dense(32, 48, 64, HeadLayout::Dx);
        let launches = [
            Launch::ConvertF16 {
                src: &big,
                dst: &big,
                desc: ConvertDesc {
                    rows: 3,
                    cols: 5,
                    rows_padded: 16,
                    ld: 16,
                },
            },
            Launch::Gemm {
                a: &big,
                b: &big,
                c: &big,
                desc: gemm,
            },
            Launch::SumParts {
                parts: &big,
                dst: &big,
                desc: SumPartsDesc {
                    len: 64,
                    parts: 2,
                    part_stride: 64,
                    accumulate: false,
                },
            },
            Launch::KlRows {
                logits: &big,
                ids: &big,
                probs: &big,
                coef: &big,
                loss: &big,
                grad: &big,
                desc: KlDesc::plain(4, 40, 48, 3),
            },
            Launch::TopkRows {
                logits: &big,
                ids: &big,
                probs: &big,
                desc: TopkDesc::plain(4, 40, 48, 3),
            },
        ];
        for launch in launches {
            let id = launch.id();
            assert_eq!(launch.buffers().len(), id.bindings().len(), "{id}");
            let checked = launch.check(u64::MAX).unwrap();
            assert_eq!(checked.id(), id);
            assert!(!checked.bytes(1).is_empty());
            assert_eq!(checked.gemm_params().is_some(), id.gemm_layout().is_some(), "{id}");
            assert!(launch.workgroups(GemmKernel::Tiled) > 0, "{id}");
        }
        assert_eq!(launches[1].id(), KernelId::GemmDx);
        // A buffer too small for the extents fails the check.
        let small = Len(16);
        let bad = Launch::Gemm {
            a: &small,
            b: &big,
            c: &big,
            desc: gemm,
        };
        assert!(matches!(bad.check(u64::MAX), Err(Error::BadDescriptor { .. })));
        // The block filter's A starts on a 64-column block; row statistics
        // need the whole product in one part.
        let filtered = |a_offset| Launch::Gemm {
            a: &big,
            b: &big,
            c: &big,
            desc: GemmDesc {
                a_offset,
                lda: 256,
                k: 128,
                mask_rows: 16,
                ..gemm
            },
        };
        assert!(filtered(64).check(u64::MAX).is_ok());
        let Err(Error::BadDescriptor { field, .. }) = filtered(32).check(u64::MAX) else {
            panic!("a filtered GEMM with A inside a block passed");
        };
        assert_eq!(field, "a_offset");
        let stats = crate::backend::GemmRowStats {
            at: crate::backend::RowStats {
                offset: 1 << 16,
                ld: 4,
                groups: 4,
            },
            first_group: 0,
            cols: 16,
        };
        let logits = GemmDesc {
            k_parts: 2,
            c_part_stride: 1 << 12,
            row_stats: Some(stats),
            ..GemmDesc::dense(32, 48, 64, HeadLayout::Logits)
        };
        let split = Launch::Gemm {
            a: &big,
            b: &big,
            c: &big,
            desc: logits,
        };
        let Err(Error::BadDescriptor { field, .. }) = split.check(u64::MAX) else {
            panic!("row statistics of a split product passed");
        };
        assert_eq!(field, "row_stats");
    }

    /// The resident kernels are launches like the others: their buffers
    /// follow the catalogue, every buffer (the status buffer too) is
    /// checked, and an offset past 32 bits is an error, not a truncation.
    #[test]
    fn resident_launches_check_every_buffer() {
        use crate::resident::status::WORDS;
        use crate::{HiddenDtype, TailMode, TeacherForm};
        let big = Len(1 << 24);
        let teacher = TeacherRowsDesc {
            rows: 5,
            k: 3,
            vocab: 40,
            token0: 10,
            ids_offset: 30,
            probs_offset: 30,
            weights_offset: 10,
            has_weights: true,
            form: TeacherForm::Probs,
            tail: TailMode::Renormalize,
        };
        let rows = |status: &'static Len, desc| Launch::TeacherRows {
            ids: &big,
            probs: &big,
            weights: &big,
            status,
            ids_out: &big,
            probs_out: &big,
            row_in: &big,
            desc,
        };
        static STATUS: Len = Len((WORDS * 4) as u64);
        static SHORT: Len = Len((WORDS * 4 - 4) as u64);
        let launch = rows(&STATUS, teacher);
        assert_eq!(launch.buffers().len(), KernelId::TeacherRows.bindings().len());
        assert_eq!(launch.workgroups(GemmKernel::Tiled), 5);
        let checked = launch.check(u64::MAX).unwrap();
        assert_eq!(checked.id(), KernelId::TeacherRows);
        assert_eq!(checked.bytes(7).len(), KernelId::TeacherRows.params().bytes);
        let Err(Error::BadDescriptor { field, .. }) = rows(&SHORT, teacher).check(u64::MAX) else {
            panic!("a short status buffer passed");
        };
        assert_eq!(field, "status");
        let far = TeacherRowsDesc {
            ids_offset: 1 << 33,
            ..teacher
        };
        assert!(matches!(
            rows(&STATUS, far).check(u64::MAX),
            Err(Error::BadDescriptor { .. })
        ));
        let hidden = HiddenInDesc {
            rows: 3,
            cols: 5,
            ld: 16,
            rows_padded: 16,
            src_offset: 10,
            dtype: HiddenDtype::Bf16,
        };
        // 25 bf16 elements need 50 bytes.
        let src = Len(48);
        let dst = Len(16 * 16 * 2);
        let launch = Launch::HiddenIn {
            src: &src,
            dst: &dst,
            desc: hidden,
        };
        assert!(matches!(
            launch.check(u64::MAX),
            Err(Error::BadDescriptor { field: "src", .. })
        ));
        let src = Len(52);
        let launch = Launch::HiddenIn {
            src: &src,
            dst: &dst,
            desc: hidden,
        };
        assert_eq!(launch.check(u64::MAX).unwrap().id(), KernelId::HiddenIn);
        assert_eq!(launch.workgroups(GemmKernel::Tiled), 1);
    }
}
