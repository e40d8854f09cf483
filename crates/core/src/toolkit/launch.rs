//! One kernel launch: which kernel, its descriptor and its buffers in
//! binding order ([`Launch`]), the one thing a backend's
//! [`Backend::dispatch`] receives. [`Launch::check`] runs the kernel's
//! descriptor checks (`crate::toolkit::checks`) and is the only way to get the
//! [`Checked`] parameter block a GPU backend binds, so an unchecked
//! dispatch cannot be written. [`Kernels`] gives every backend the
//! per-kernel calls the driver makes, each building its launch.

use crate::error::Result;
use crate::toolkit::backend::{Backend, DeviceBuffer, GemmDesc, KlDesc, SumPartsDesc, TopkDesc, TransposeDesc};
use crate::toolkit::kernels::{GemmKernel, KernelBuild, KernelId, KL_FLAGS};
use crate::toolkit::params::{
    GatherRowsParams, GemmParams, HeadGradOutParams, HiddenInParams, LabelsInParams, LossOutParams, RowParams,
    ShardRowsParams, StatusDetailParams, SumPartsParams, TeacherRowsParams, TopkOutParams, TransposeParams,
    WeightStatsParams,
};
use crate::toolkit::resident_kernels::{
    GatherRowsDesc, HeadGradOutDesc, HiddenInDesc, LabelsInDesc, LossOutDesc, ShardRowsDesc, StatusDetailDesc,
    TeacherRowsDesc, TopkOutDesc, WeightStatsDesc,
};

/// The launch table: one row a [`Launch`] variant, giving its descriptor
/// type, its buffers in binding order (the row's docs say what each holds),
/// its kernel, its workgroups and the check that makes its parameter block.
/// The macro makes the enum and every per-variant arm ([`Launch::id`], [`Launch::buffers`],
/// [`Launch::workgroups`], [`Launch::check`]) from it. `desc` and `gemm`
/// name the row's descriptor and the backend's GEMM kernel in the rows'
/// expressions.
macro_rules! launches {
    (
        binders($desc:ident, $gemm:ident);
        $(
            $(#[$doc:meta])*
            $variant:ident($Desc:ty) { $($buffer:ident),+ }
                => kernel $id:expr, workgroups $workgroups:expr, $block:ident($check:ident);
        )+
    ) => {
        /// One kernel launch: the descriptor (see each type's docs for what
        /// the kernel computes) and the buffers, named as the kernel binds
        /// them.
        #[derive(Debug)]
        pub enum Launch<'a, B> {
            $(
                $(#[$doc])*
                $variant {
                    $(
                        #[doc = concat!("The `", stringify!($buffer), "` binding (the variant's docs say what it holds).")]
                        $buffer: &'a B,
                    )+
                    /// What the kernel computes over them: the extents and options.
                    $desc: $Desc,
                },
            )+
        }

        impl<'a, B: DeviceBuffer> Launch<'a, B> {
            /// The kernel it launches.
            pub fn id(&self) -> KernelId {
                match *self {
                    $( Launch::$variant { $desc, .. } => { let _ = &$desc; $id } )+
                }
            }

            /// Its buffers in binding order (the catalogue's
            /// [`KernelId::bindings`]).
            pub fn buffers(&self) -> Vec<&'a B> {
                match *self {
                    $( Launch::$variant { $($buffer,)+ .. } => vec![$($buffer),+], )+
                }
            }

            /// Workgroups it dispatches; a GEMM's depend on the kernel `gemm`
            /// the backend runs for it (ignored for the other kernels).
            pub fn workgroups(&self, $gemm: GemmKernel) -> u64 {
                match *self {
                    $( Launch::$variant { $desc, .. } => $workgroups, )+
                }
            }

            /// Checks the descriptor against the buffers (each a binding of
            /// at most `max_binding` bytes): the kernel's [`crate::toolkit::checks`],
            /// every backend's first step of every dispatch.
            pub fn check(&self, max_binding: u64) -> Result<Checked> {
                let block = match *self {
                    $( Launch::$variant { $($buffer,)+ $desc } => {
                        Block::$block($desc.$check([$($buffer),+], max_binding)?)
                    } )+
                };
                Ok(Checked { id: self.id(), block })
            }
        }
    };
}

launches! {
    binders(desc, gemm);

    /// `C (+)= alpha · A · op(B)` ([`GemmDesc`]; its layout says which of the two
    /// GEMM kernels). Bindings: `a`: f16 A; `b`: f16 B (a head plane); `c`: f32 C.
    Gemm(GemmDesc) { a, b, c }
        => kernel desc.kernel(), workgroups desc.workgroups(gemm), Gemm(check);

    /// A split-K GEMM's partial blocks summed ([`SumPartsDesc`]). Bindings:
    /// `parts`: the blocks; `dst`: their sum.
    SumParts(SumPartsDesc) { parts, dst }
        => kernel KernelId::SumParts, workgroups desc.workgroups(), SumParts(check);

    /// f16 rows into columns ([`TransposeDesc`]). Bindings: `src`: f16 rows;
    /// `dst`: their columns.
    Transpose(TransposeDesc) { src, dst }
        => kernel KernelId::Transpose, workgroups desc.workgroups(), Transpose(check);

    /// The KL row kernel ([`KlDesc`]). Bindings: `logits`: f32 logits `[rows][ld]`;
    /// `ids`: teacher ids `[rows][k]`; `probs`: teacher probabilities `[rows][k]`;
    /// `coef`: per-row coefficients `[rows]`; `loss`: per-row loss `[rows]`;
    /// `grad`: f16 gradient `[rows][ld]`.
    KlRows(KlDesc) { logits, ids, probs, coef, loss, grad }
        => kernel KernelId::KlRows, workgroups desc.workgroups(), Rows(check);

    /// The exact top-k row kernel ([`TopkDesc`]). Bindings: `logits`: f32 logits
    /// `[rows][ld]`; `ids`: selected ids `[rows][k]`; `probs`: their probabilities
    /// `[rows][k]`.
    TopkRows(TopkDesc) { logits, ids, probs }
        => kernel KernelId::TopkRows, workgroups desc.workgroups(), Rows(check);

    /// Resident: the weights' total and gradient scale ([`WeightStatsDesc`]).
    /// Bindings: `weights`: the caller's weights `[rows]` (any buffer without
    /// them); `status`: the status buffer.
    WeightStats(WeightStatsDesc) { weights, status }
        => kernel KernelId::WeightStats, workgroups desc.workgroups(), WeightStats(check);

    /// Resident: teacher rows checked into scratch ([`TeacherRowsDesc`]). Bindings:
    /// `ids`: the caller's ids; `probs`: the caller's probabilities (or
    /// log-probabilities); `weights`: the caller's weights (any buffer without
    /// them); `status`: the status buffer; `ids_out`: clamped ids `[rows][k]`;
    /// `probs_out`: checked probabilities `[rows][k]`; `row_in`: the KL kernel's
    /// per-row inputs `[rows][2]`.
    TeacherRows(TeacherRowsDesc) { ids, probs, weights, status, ids_out, probs_out, row_in }
        => kernel KernelId::TeacherRows, workgroups desc.workgroups(), TeacherRows(check);

    /// Resident: labels checked into scratch ([`LabelsInDesc`]). Bindings:
    /// `labels`: the caller's labels (any buffer without them); `status`: the
    /// status buffer; `row_in`: the KL kernel's per-row inputs `[rows][2]`.
    LabelsIn(LabelsInDesc) { labels, status, row_in }
        => kernel KernelId::LabelsIn, workgroups desc.workgroups(), LabelsIn(check);

    /// Resident: hidden rows into the padded f16 operand ([`HiddenInDesc`]).
    /// Bindings: `src`: the caller's rows; `dst`: the padded f16 operand.
    HiddenIn(HiddenInDesc) { src, dst }
        => kernel KernelId::HiddenIn, workgroups desc.workgroups(), HiddenIn(check);

    /// Resident: a chunk's loss and dx out ([`LossOutDesc`]). Bindings:
    /// `loss_chunk`: kl_rows' `[rows][4]` loss, lse, soft, hard; `dx_chunk`: the
    /// chunk's dx `[rows][ld]`; `status`: the status buffer; `loss`: the caller's
    /// loss; `dx`: the caller's dx; `terms`: the caller's `[ntok][3]` terms (any
    /// buffer without them).
    LossOut(LossOutDesc) { loss_chunk, dx_chunk, status, loss, dx, terms }
        => kernel KernelId::LossOut, workgroups desc.workgroups(), LossOut(check);

    /// Resident: a piece of the head's gradient out ([`HeadGradOutDesc`]).
    /// Bindings: `piece`: its f32 rows; `status`: the status buffer; `dst`: the
    /// caller's `[V][hs]` gradient.
    HeadGradOut(HeadGradOutDesc) { piece, status, dst }
        => kernel KernelId::HeadGradOut, workgroups desc.workgroups(), HeadGradOut(check);

    /// Resident: a chunk's top-k out ([`TopkOutDesc`]). Bindings: `ids_chunk`: the
    /// chunk's ids; `probs_chunk`: the chunk's probabilities; `status`: the status
    /// buffer; `ids`: the caller's ids; `probs`: the caller's probabilities.
    TopkOut(TopkOutDesc) { ids_chunk, probs_chunk, status, ids, probs }
        => kernel KernelId::TopkOut, workgroups desc.workgroups(), TopkOut(check);

    /// Resident: the caller's gather ids into a chunk's gather rows
    /// ([`GatherRowsDesc`]). Bindings: `ids`: the caller's ids u32 `[ntok][k]`;
    /// `status`: the status buffer; `ids_chunk`: the chunk's gather rows
    /// `[rows][k + 1]`.
    GatherIn(GatherRowsDesc) { ids, status, ids_chunk }
        => kernel KernelId::GatherIn, workgroups desc.workgroups(), GatherRows(check_in);

    /// Resident: a chunk's gathered values out ([`GatherRowsDesc`]). Bindings:
    /// `values_chunk`: the chunk's values `[rows][k + 1]` (the top-k kernel's
    /// gather); `status`: the status buffer; `logprobs`: the caller's
    /// log-probabilities `[ntok][k]`; `lse`: the caller's lse `[ntok]`.
    GatherOut(GatherRowsDesc) { values_chunk, status, logprobs, lse }
        => kernel KernelId::GatherOut, workgroups desc.workgroups(), GatherRows(check_out);

    /// Resident: the first flagged row described ([`StatusDetailDesc`]). Bindings:
    /// `ids`: the caller's ids; `probs`: the caller's probabilities; `weights`: the
    /// caller's weights (any buffer without them); `status`: the status buffer;
    /// `labels`: the caller's labels (any buffer without them).
    StatusDetail(StatusDetailDesc) { ids, probs, weights, status, labels }
        => kernel KernelId::StatusDetail, workgroups desc.workgroups(), StatusDetail(check);

    /// Resident: a vocabulary shard's per-row step ([`ShardRowsDesc`]). Bindings:
    /// `loss_chunk`: the loss kernel's `[rows][4]`; `stats`: the merged statistics
    /// `[ntok][3]` (any buffer where unread); `partials`: a shard's partials
    /// `[ntok][3]` (any buffer where unused); `ids`: the chunk's teacher ids
    /// `[rows][k]`; `probs`: their probabilities; `row_in`: the loss kernel's
    /// per-row inputs `[rows][2]`; `status`: the status buffer.
    ShardRows(ShardRowsDesc) { loss_chunk, stats, partials, ids, probs, row_in, status }
        => kernel KernelId::ShardRows, workgroups desc.workgroups(), ShardRows(check);
}

impl<B> Clone for Launch<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Launch<'_, B> {}

impl<'a, B: DeviceBuffer> Launch<'a, B> {
    /// Its buffers in binding order as an array of `N` (a kernel's run
    /// names them by destructuring it); an error where the kernel binds a
    /// different number.
    pub fn bound<const N: usize>(&self) -> Result<[&'a B; N]> {
        let buffers = self.buffers();
        let count = buffers.len();
        buffers.try_into().map_err(|_| {
            crate::toolkit::kernels::bad_descriptor(
                self.id(),
                "buffers",
                count as u128,
                format!("the kernel binds {N}"),
            )
        })
    }
}

/// The parameter blocks a check makes, one variant a block type; the macro
/// makes [`Block`] and [`Checked::bytes`]' arms.
macro_rules! blocks {
    ($( $block:ident($Params:ty), )+) => {
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Block {
            $( $block($Params), )+
        }

        impl Block {
            /// The block's bytes for a grid `grid_x` workgroups wide.
            fn bytes(&self, grid_x: u32) -> Vec<u8> {
                match *self {
                    $( Block::$block(p) => bytemuck::bytes_of(&p.with_grid(grid_x)).to_vec(), )+
                }
            }
        }
    };
}

blocks! {
    Gemm(GemmParams),
    SumParts(SumPartsParams),
    Transpose(TransposeParams),
    Rows(RowParams),
    WeightStats(WeightStatsParams),
    TeacherRows(TeacherRowsParams),
    LabelsIn(LabelsInParams),
    HiddenIn(HiddenInParams),
    LossOut(LossOutParams),
    HeadGradOut(HeadGradOutParams),
    TopkOut(TopkOutParams),
    GatherRows(GatherRowsParams),
    StatusDetail(StatusDetailParams),
    ShardRows(ShardRowsParams),
}

/// A launch's parameter block, checked against its buffers: only
/// [`Launch::check`] makes one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Checked {
    id: KernelId,
    block: Block,
}

impl Checked {
    /// The kernel.
    pub fn id(&self) -> KernelId {
        self.id
    }

    /// The parameter block's bytes for a dispatch whose grid is `grid_x`
    /// workgroups wide (the kernels unfold a folded grid with it).
    pub fn bytes(&self, grid_x: u32) -> Vec<u8> {
        self.block.bytes(grid_x)
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

/// The driver's kernel calls on any backend, each one [`Launch`] through
/// [`Backend::dispatch`].
pub trait Kernels: Backend {
    /// `C (+)= alpha · A · op(B)` (see [`GemmDesc`]); timed as
    /// [`GemmDesc::kernel`].
    fn gemm(&self, a: &Self::Buffer, b: &Self::Buffer, c: &Self::Buffer, desc: &GemmDesc) -> Result<()> {
        // The parameter block has no such field: a kernel GEMM would read
        // A as rows.
        if desc.a_columns && !self.gemm_a_columns() {
            return Err(crate::error::Error::MissingFeature(format!(
                "{}: a GEMM reading A as columns (GemmDesc::a_columns)",
                self.info().backend
            )));
        }
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

    /// f16 rows into columns (see [`TransposeDesc`]).
    fn transpose(&self, src: &Self::Buffer, dst: &Self::Buffer, desc: &TransposeDesc) -> Result<()> {
        self.dispatch(Launch::Transpose { src, dst, desc: *desc })
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
    use crate::error::Error;
    use crate::toolkit::backend::HeadLayout;

    use crate::toolkit::backend::Len;

    /// Each launch names its kernel and its buffers in the catalogue's
    /// binding order, and its check is the descriptor's.
    #[test]
    fn launches_follow_the_catalogue() {
        let big = Len(1 << 24);
        let gemm = GemmDesc::dense(32, 48, 64, HeadLayout::Dx);
        let launches = [
            Launch::HiddenIn {
                src: &big,
                dst: &big,
                desc: HiddenInDesc::f32(3, 5, 16, 16),
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
        let stats = crate::toolkit::backend::GemmRowStats {
            at: crate::toolkit::backend::RowStats {
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
        use crate::problem::terms::{TailMode, TeacherForm};
        use crate::toolkit::resident_kernels::HiddenDtype;
        use crate::toolkit::status::WORDS;
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
