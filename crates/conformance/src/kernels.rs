//! Kernel-level cases: each primitive of [`Backend`] on crafted inputs, with
//! every output buffer poisoned (NaN, or all-ones ids) first so an element
//! a kernel forgets to write, or writes outside its region, is caught.
//!
//! Offsets and strides are multiples of 16 elements, as the driver's are.

use half::{bf16, f16};
use headkl_core::toolkit::split::k_part_range;
use headkl_core::toolkit::{
    GemmDesc, GemmRowStats, HeadLayout, HiddenInDesc, Kernels, KlDesc, Launch, RowStats, SumPartsDesc, TopkDesc,
    TransposeDesc, STATS_GROUP_COLS,
};
use headkl_core::{Backend, Divergence, HiddenDtype, LossTerms, TailMode, NO_LABEL};

use super::CaseErrors;
use crate::generator::{residue_ids, Rng};
use headkl_reference::direct::{row_terms_f64, softmax_over, topk_of_row, DirectLoss, DirectTopK, RowTeacher};
use headkl_reference::tolerance::Tolerance;

/// Extra elements after every region, poisoned, to catch overruns.
const TAIL: usize = 16;

/// A GEMM on exact small integers.
#[derive(Clone, Debug)]
pub(crate) struct GemmSpec {
    m: usize,
    n: usize,
    k: usize,
    layout: HeadLayout,
    a_offset: usize,
    lda: usize,
    ldb: usize,
    c_offset: usize,
    ldc: usize,
    alpha: f32,
    accumulate: bool,
    /// Split-K parts, each into its own C block (1: no split).
    k_parts: usize,
    /// Size the buffers to the regions exactly (no poisoned tail), so the
    /// largest shape fits a small binding.
    tight: bool,
    /// Row statistics ([`headkl_core::toolkit::RowStats`]): this GEMM's first group
    /// and its real columns; the region follows C's, a poisoned gap apart.
    stats: Option<(usize, usize)>,
    /// The dx GEMM's block filter ([`GemmDesc::mask_rows`]; 0: off): every
    /// row's mask clears the same blocks, whose A entries are not zero, so
    /// only a kernel that skips exactly them gets C right.
    mask_rows: usize,
    /// A stored as columns, `[k][m]` ([`GemmDesc::a_columns`]): `lda` is
    /// then the stride of its k rows.
    a_columns: bool,
}

/// How a crafted logits row looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Row {
    /// N(0, 3²).
    Normal,
    /// All equal.
    Flat,
    /// Uniform in ±60.
    Large,
    /// Values from {0, 1, 2, 3}: exact ties everywhere.
    Ties,
    /// The top logits all at ids `≡ r (mod 256)`, two of them tied.
    Residue,
    /// Logit `−0.01·j`: the top is the lowest ids.
    Descending,
    /// Logit `0.01·j`: the top is the highest ids.
    Ascending,
    /// Around −50.
    NegLarge,
    /// Normal, coefficient 0 (a masked token).
    Masked,
    /// Normal, half the teacher's probabilities exactly 0.
    ZeroProbs,
    /// All NaN: what a NaN in a hidden row makes of its logits.
    Nan,
    /// One +inf among finite values.
    PosInf,
    /// Descending, with one NaN whose sign bit is set (its order-preserving
    /// key sorts below every other, so no selection picks it up): at logit
    /// 7300 where the row is that long (word 1825: the fourth of the four
    /// 16-byte loads in the row kernels' second round), else mid-row.
    OneNan,
    /// ±inf alternating: what an infinite hidden value makes of its logits.
    Infs,
}

impl Row {
    fn bad(self) -> bool {
        matches!(self, Row::Nan | Row::PosInf | Row::OneNan | Row::Infs)
    }
}

/// A row kernel case (`kl_rows` or `topk_rows`).
#[derive(Clone, Debug)]
pub(crate) struct RowSpec {
    name: &'static str,
    rows: usize,
    /// Rows past `rows` in every buffer, which must stay untouched.
    extra_rows: usize,
    vocab: usize,
    ld: usize,
    k: usize,
    patterns: Vec<Row>,
    seed: u64,
    /// `topk_rows` only: write log-probabilities over the full row (the
    /// cap, for both kernels, is `terms.softcap`).
    logprobs: bool,
    /// `kl_rows` only: τ, the tail mode and the terms (default: the
    /// seed's loss).
    temperature: f32,
    tail: TailMode,
    terms: LossTerms,
}

/// One kernel-level case.
#[derive(Clone, Debug)]
pub(crate) enum KernelCase {
    Gemm(GemmSpec),
    SumParts(SumPartsDesc),
    HiddenIn(HiddenInDesc),
    Transpose(TransposeDesc),
    Kl(RowSpec),
    Topk(RowSpec),
    /// `topk_rows` in gather mode: `k` ids a row (the kernel's k is one
    /// more, the lse's column).
    Gather(RowSpec),
}

/// A GEMM case, one argument per [`GemmDesc`] field so a case reads as one
/// line: `gemm!(m, n, k, layout, a_offset, lda, ldb, c_offset, ldc, alpha,
/// accumulate)`, unsplit, without statistics or filter.
macro_rules! gemm {
    ($m:expr, $n:expr, $k:expr, $layout:expr, $a_offset:expr, $lda:expr, $ldb:expr, $c_offset:expr, $ldc:expr, $alpha:expr, $accumulate:expr) => {
        GemmSpec {
            m: $m,
            n: $n,
            k: $k,
            layout: $layout,
            a_offset: $a_offset,
            lda: $lda,
            ldb: $ldb,
            c_offset: $c_offset,
            ldc: $ldc,
            alpha: $alpha,
            accumulate: $accumulate,
            k_parts: 1,
            tight: false,
            stats: None,
            mask_rows: 0,
            a_columns: false,
        }
    };
}

impl GemmSpec {
    /// [`gemm!`] writing row statistics from group `first` over `cols` columns.
    const fn with_stats(self, first: usize, cols: usize) -> Self {
        GemmSpec {
            stats: Some((first, cols)),
            ..self
        }
    }

    /// [`gemm!`] (layout Dx, `a_offset + k <= lda`) with the block filter on
    /// every row.
    const fn filtered(self) -> Self {
        GemmSpec {
            mask_rows: self.m,
            ..self
        }
    }

    /// [`gemm!`] (layout Dx, unsplit) reading A as columns, `[k][m]`.
    const fn columns(self) -> Self {
        GemmSpec {
            a_columns: true,
            ..self
        }
    }

    /// [`gemm!`] split into `k_parts` parts.
    const fn split(self, k_parts: usize) -> Self {
        GemmSpec { k_parts, ..self }
    }

    /// [`gemm!`] with buffers exactly the size of their regions.
    const fn tight(self) -> Self {
        GemmSpec { tight: true, ..self }
    }
}

/// The GEMM cases (`Out`: the logits layout, `Red`: the dx layout).
#[rustfmt::skip]
const GEMMS: &[GemmSpec] = {
    use HeadLayout::{Dx as Red, Logits as Out};
    &[
        gemm!(16, 16, 16, Out, 0, 16, 16, 0, 16, 1.0, false),
        gemm!(16, 16, 16, Red, 0, 16, 16, 0, 16, 2.0, true),
        gemm!(48, 80, 272, Out, 32, 288, 304, 48, 112, 0.5, false),
        gemm!(48, 80, 272, Red, 128, 304, 96, 48, 112, 0.5, true),
        gemm!(48, 80, 272, Out, 0, 272, 272, 0, 80, -0.25, true),
        gemm!(48, 80, 272, Red, 0, 272, 80, 0, 80, 1.0, false),
        gemm!(32, 144, 48, Out, 16, 64, 48, 160, 160, 2.0, true),
        gemm!(80, 48, 16, Red, 0, 32, 64, 16, 64, 1.0, false),
        // Split-K: k = 272 is no multiple of the parts' 192 (2 parts) or
        // 128 (3 parts); k = 128 in 3 parts of 64 leaves the last empty.
        gemm!(48, 80, 272, Out, 32, 288, 304, 48, 112, 0.5, false).split(2),
        gemm!(48, 80, 272, Out, 0, 272, 272, 0, 80, -0.25, true).split(3),
        gemm!(48, 80, 272, Red, 128, 304, 96, 48, 112, 0.5, true).split(2),
        gemm!(48, 80, 272, Red, 0, 272, 80, 0, 80, 1.0, false).split(3),
        gemm!(32, 144, 128, Red, 16, 144, 144, 160, 160, 2.0, false).split(3),
        gemm!(80, 48, 128, Out, 0, 128, 128, 16, 64, 1.0, true).split(3),
        // Row statistics: a partial last group (n = 80: 32 + 32 + 16
        // columns, 72 real), C inside a wider row, and a shape past one
        // tile each way with the padding past the real columns.
        gemm!(48, 80, 272, Out, 32, 288, 304, 48, 112, 0.5, false).with_stats(1, 72),
        gemm!(32, 144, 48, Out, 16, 64, 48, 160, 160, 2.0, false).with_stats(0, 144),
        gemm!(144, 272, 64, Out, 0, 64, 64, 0, 272, 1.0, false).with_stats(2, 259),
        // The block filter: K across three 2048-column mask windows, A
        // starting two blocks in (a filtered GEMM's A starts on a block),
        // whole and split.
        gemm!(16, 16, 4544, Red, 128, 4736, 16, 0, 16, 1.0, false).filtered(),
        gemm!(16, 32, 2560, Red, 64, 2688, 48, 16, 48, 0.5, true).filtered().split(3),
        gemm!(160, 128, 704, Red, 0, 704, 128, 0, 128, 1.0, false).filtered(),
        // A as columns (the head's gradient: the logits gradient `[tokens]
        // [vocab]` read as it is, a piece of its columns from a_offset): k
        // no multiple of 16 (a chunk's real tokens), over and under a tile.
        gemm!(48, 80, 37, Red, 8, 64, 80, 0, 80, 0.5, true).columns(),
        gemm!(32, 144, 272, Red, 16, 56, 160, 16, 160, 2.0, false).columns(),
    ]
};

/// The `sum_parts` cases: `(len, parts, part_stride, accumulate)`.
const SUMS: &[(usize, usize, usize, bool)] = &[
    (64, 1, 0, false),
    (1040, 3, 1056, false),
    (1040, 4, 1040, true),
    (4096, 2, 8192, true),
];

/// The largest shape, with buffers exactly the size of their regions
/// (C is 256 KiB) so it fits `generator::MIN_BINDING_BYTES`.
const LARGEST_GEMMS: &[GemmSpec] = &[
    gemm!(256, 256, 256, HeadLayout::Logits, 0, 256, 256, 0, 256, 1.0, false).tight(),
    gemm!(256, 256, 256, HeadLayout::Dx, 0, 256, 256, 0, 256, -0.5, true).tight(),
];

/// The `hidden_in` cases: `(dtype, src_offset, rows, cols, rows_padded,
/// ld)`. The host path's f32 rows (offset 0: its upload buffer) with
/// padding of rows, of columns, of both and of neither; and the resident
/// paths' chunk of the caller's rows at an offset (`start · hs`, so not a
/// multiple of 16; odd, for the 16-bit types, so a row starts in either
/// half of a word) in each type.
const HIDDEN_INS: &[(HiddenDtype, usize, usize, usize, usize, usize)] = &[
    (HiddenDtype::F32, 0, 5, 13, 16, 32),
    (HiddenDtype::F32, 0, 16, 48, 16, 48),
    (HiddenDtype::F32, 0, 33, 100, 48, 112),
    (HiddenDtype::F32, 39, 5, 13, 16, 32),
    (HiddenDtype::F16, 39, 5, 13, 16, 32),
    (HiddenDtype::Bf16, 33, 16, 33, 16, 48),
];

/// The `transpose` cases: `(rows, rows_padded, cols, ld_src)`. Shapes
/// that do not divide the kernel's 32 × 32 tile either way, `rows <
/// rows_padded` (zeros), `ld_src > cols`, none of the rows real, and one
/// of many tiles each way whose buffers still fit the smallest binding
/// the suite runs with (256 KiB).
const TRANSPOSES: &[(usize, usize, usize, usize)] = &[
    (5, 16, 13, 16),
    (16, 16, 48, 48),
    (32, 32, 64, 64),
    (33, 48, 100, 112),
    (40, 64, 257, 272),
    (0, 16, 7, 16),
    (100, 112, 1000, 1008),
];

/// A row kernel case's name and rows: how many, the vocabulary, the row
/// stride, k (the gather: ids a row) and each row's pattern.
type Rows = (&'static str, usize, usize, usize, usize, &'static [Row]);

/// The plain `kl_rows` cases (τ 1, renormalized tail, the soft term alone).
#[rustfmt::skip]
const KL_ROWS: &[Rows] = {
    use Row::*;
    &[
        ("general", 7, 300, 304, 8, &[Normal, Flat, Large, Ties, Descending, Masked, ZeroProbs]),
        ("k1", 3, 77, 80, 1, &[Normal, Large, Flat]),
        ("k_eq_v", 2, 40, 48, 40, &[Normal, ZeroProbs]),
        ("residue256", 3, 2100, 2112, 8, &[Residue, Residue, Large]),
        ("k2048", 2, 2100, 2112, 2048, &[Normal, Ties]),
        // Rows long enough for two rounds of the kernels' loops of four
        // 16-byte loads (2051 words), the last word partial; few enough
        // rows that each buffer fits the smallest binding the suite runs
        // with (256 KiB).
        ("wide", 4, 8_203, 8_208, 64, &[Normal, Large, OneNan, Ascending]),
        ("non_finite", 5, 100, 112, 4, &[Normal, Nan, PosInf, NegLarge, Infs]),
    ]
};

/// The rows of most loss-term cases, named `name`.
const fn terms_rows(name: &'static str) -> Rows {
    use Row::*;
    const PATTERNS: &[Row] = &[Normal, Flat, Large, Ties, Masked, ZeroProbs, Normal];
    (name, 7, 300, 304, 8, PATTERNS)
}

/// A softcap `c` alone.
fn cap(c: f32) -> LossTerms {
    LossTerms {
        softcap: Some(c),
        ..LossTerms::default()
    }
}

/// Every term at once but the logit scale, which acts in the logits GEMM,
/// not in these rows.
fn everything() -> LossTerms {
    LossTerms {
        soft_weight: 0.8,
        hard_weight: 0.5,
        label_smoothing: 0.1,
        z_loss: 1e-3,
        softcap: Some(30.0),
        ..LossTerms::default()
    }
}

/// `divergence` in place of the forward KL, alone.
fn only(divergence: Divergence) -> LossTerms {
    LossTerms {
        divergence,
        ..LossTerms::default()
    }
}

/// `divergence` in place of the forward KL, with [`everything`].
fn everything_with(divergence: Divergence) -> LossTerms {
    LossTerms {
        divergence,
        ..everything()
    }
}

/// The JSD of these cases.
const JSD: Divergence = Divergence::Jsd { beta: 0.4 };

/// A `kl_rows` case with the loss terms: the rows, τ, the tail mode and
/// the terms.
type KlTerms = (Rows, f32, TailMode, fn() -> LossTerms);

/// The `kl_rows` cases with the loss terms one at a time, then together
/// (README "Loss terms").
#[rustfmt::skip]
const KL_TERMS: &[KlTerms] = {
    use Divergence::Reverse;
    use Row::*;
    use TailMode::{Bucket, Renormalize, Unnormalized};
    &[
        (terms_rows("softcap"), 1.0, Renormalize, || cap(5.0)),
        (terms_rows("softcap_tau"), 0.5, Renormalize, || cap(5.0)),
        (terms_rows("tail_bucket"), 1.0, Bucket, LossTerms::default),
        (terms_rows("tail_none"), 1.0, Unnormalized, LossTerms::default),
        (terms_rows("hard"), 1.0, Renormalize,
            || LossTerms { hard_weight: 0.7, label_smoothing: 0.1, ..LossTerms::default() }),
        (terms_rows("hard_only"), 1.0, Renormalize,
            || LossTerms { soft_weight: 0.0, hard_weight: 1.0, ..LossTerms::default() }),
        (terms_rows("z_loss"), 1.0, Renormalize, || LossTerms { z_loss: 1e-2, ..LossTerms::default() }),
        (terms_rows("soft_weight"), 1.0, Renormalize, || LossTerms { soft_weight: 0.25, ..LossTerms::default() }),
        (terms_rows("everything_tau2"), 2.0, Bucket, everything),
        // The reverse KL and the JSD in each tail mode (DESIGN §1).
        (terms_rows("reverse_renormalize"), 1.0, Renormalize, || only(Reverse)),
        (terms_rows("reverse_bucket_tau"), 1.5, Bucket, || only(Reverse)),
        (terms_rows("reverse_none"), 1.0, Unnormalized, || only(Reverse)),
        (terms_rows("jsd_renormalize_tau"), 0.7, Renormalize, || only(JSD)),
        (terms_rows("jsd_bucket"), 1.0, Bucket, || only(JSD)),
        (terms_rows("jsd_none_everything"), 2.0, Unnormalized, || everything_with(JSD)),
        (("reverse_everything_wide", 3, 8_203, 8_208, 64, &[Normal, Large, Ascending]), 1.0, Bucket,
            || everything_with(Reverse)),
        (terms_rows("everything_none"), 0.7, Unnormalized, everything),
        (("everything_wide", 4, 8_203, 8_208, 64, &[Normal, Large, OneNan, Ascending]), 2.0, Bucket, everything),
        // τ = 1 (one softmax) and τ = 3 (the second softmax by cubing the
        // first: KlDesc's integer powers), over rows long enough for the
        // loops of four loads.
        (("everything_tau1_wide", 3, 8_203, 8_208, 64, &[Normal, Large, Ascending]), 1.0, Bucket, everything),
        (("everything_tau3_wide", 3, 8_203, 8_208, 64, &[Normal, Flat, Descending]), 3.0, Renormalize, everything),
        (("everything_non_finite", 5, 100, 112, 4, &[Normal, Nan, PosInf, NegLarge, Infs]), 1.5, Bucket, everything),
    ]
};

/// The `topk_rows` cases: the rows, a softcap on the scaled logits, and
/// whether the kernel also writes log-probabilities over the full row.
#[rustfmt::skip]
const TOPK: &[(Rows, Option<f32>, bool)] = {
    use Row::*;
    &[
        (("general", 8, 1000, 1008, 64, &[Normal, Flat, Large, Ties, Descending, Ascending, NegLarge, Normal]),
            None, false),
        (("k1", 4, 77, 80, 1, &[Normal, Flat, Ties, Ascending]), None, false),
        (("k_eq_v", 2, 40, 48, 40, &[Ties, Normal]), None, false),
        (("k256_wide_stride", 2, 700, 768, 256, &[Ties, Large]), None, false),
        (("k2048", 3, 2500, 2512, 2048, &[Normal, Ties, Flat]), None, false),
        (("softcap", 6, 1000, 1008, 64, &[Normal, Large, Ties, NegLarge, Nan, Flat]), Some(5.0), false),
        (("logprobs", 6, 1000, 1008, 64, &[Normal, Large, Ties, NegLarge, PosInf, Flat]), None, true),
        (("logprobs_softcap_wide", 3, 8_203, 8_208, 256, &[Normal, Large, Ascending]), Some(15.0), true),
        (("residue256", 4, 4000, 4000, 14, &[Residue, Residue, Residue, Ties]), None, false),
        (("non_finite", 5, 100, 112, 5, &[Normal, Nan, PosInf, Ties, Infs]), None, false),
        (("wide", 4, 8_203, 8_208, 64, &[Normal, Descending, OneNan, Residue]), None, false),
        (("wide_b", 3, 8_203, 8_208, 64, &[Ascending, Large, PosInf]), None, false),
    ]
};

/// The gather cases, the rows and a softcap: ids with repeats and a none,
/// non-finite rows, a cap, k = V (k + 1 columns) and rows long enough for
/// every loop.
#[rustfmt::skip]
const GATHER: &[(Rows, Option<f32>)] = {
    use Row::*;
    &[
        (("gather", 6, 300, 304, 8, &[Normal, Large, Nan, Ties, Flat, Infs]), None),
        (("gather_softcap", 4, 300, 304, 8, &[Normal, Large, Descending]), Some(5.0)),
        (("gather_k_eq_v", 2, 40, 48, 40, &[Normal, Ties]), None),
        (("gather_wide", 3, 8_203, 8_208, 64, &[Normal, OneNan, Ascending]), None),
    ]
};

/// The row spec of `rows`: the default terms, τ 1, a renormalized tail,
/// and a seed of its vocabulary and k.
fn rows(&(name, rows, vocab, ld, k, patterns): &Rows) -> RowSpec {
    RowSpec {
        name,
        rows,
        extra_rows: 3,
        vocab,
        ld,
        k,
        patterns: patterns.to_vec(),
        seed: 0x5EED ^ (vocab as u64) << 16 ^ k as u64,
        logprobs: false,
        temperature: 1.0,
        tail: TailMode::Renormalize,
        terms: LossTerms::default(),
    }
}

/// `rows` with a softcap `cap` on the scaled logits.
fn capped(r: &Rows, cap: Option<f32>) -> RowSpec {
    RowSpec {
        terms: LossTerms {
            softcap: cap,
            ..LossTerms::default()
        },
        ..rows(r)
    }
}

/// The kernel-level cases, in order: the tables above turned into cases.
pub(crate) fn kernel_cases() -> Vec<KernelCase> {
    let gemm = |g: &GemmSpec| KernelCase::Gemm(g.clone());
    let sum = |&(len, parts, part_stride, accumulate): &(usize, usize, usize, bool)| {
        KernelCase::SumParts(SumPartsDesc {
            len,
            parts,
            part_stride,
            accumulate,
        })
    };
    let hidden_in =
        |&(dtype, src_offset, rows, cols, rows_padded, ld): &(HiddenDtype, usize, usize, usize, usize, usize)| {
            KernelCase::HiddenIn(HiddenInDesc {
                rows,
                cols,
                ld,
                rows_padded,
                src_offset,
                dtype,
            })
        };
    let transpose = |&(rows, rows_padded, cols, ld_src): &(usize, usize, usize, usize)| {
        KernelCase::Transpose(TransposeDesc {
            rows,
            rows_padded,
            cols,
            ld_src,
        })
    };
    let kl_terms = |(r, temperature, tail, terms): &KlTerms| {
        KernelCase::Kl(RowSpec {
            temperature: *temperature,
            tail: *tail,
            terms: terms(),
            ..rows(r)
        })
    };
    let topk = |(r, cap, logprobs): &(Rows, Option<f32>, bool)| {
        KernelCase::Topk(RowSpec {
            logprobs: *logprobs,
            ..capped(r, *cap)
        })
    };
    GEMMS
        .iter()
        .map(gemm)
        .chain(SUMS.iter().map(sum))
        .chain(LARGEST_GEMMS.iter().map(gemm))
        .chain(HIDDEN_INS.iter().map(hidden_in))
        .chain(TRANSPOSES.iter().map(transpose))
        .chain(KL_ROWS.iter().map(|r| KernelCase::Kl(rows(r))))
        .chain(KL_TERMS.iter().map(kl_terms))
        .chain(TOPK.iter().map(topk))
        .chain(GATHER.iter().map(|(r, cap)| KernelCase::Gather(capped(r, *cap))))
        .collect()
}

impl KernelCase {
    pub(crate) fn name(&self) -> String {
        match self {
            KernelCase::Gemm(g) => format!(
                "kernels/gemm_{}_{}x{}x{}{}{}{}{}",
                match g.layout {
                    HeadLayout::Logits => "abt",
                    HeadLayout::Dx => "ab",
                },
                g.m,
                g.n,
                g.k,
                if g.accumulate { "_acc" } else { "" },
                if g.mask_rows > 0 { "_filtered" } else { "" },
                if g.a_columns { "_cols" } else { "" },
                if g.k_parts > 1 {
                    format!("_parts{}", g.k_parts)
                } else {
                    String::new()
                }
            ),
            KernelCase::SumParts(s) => format!(
                "kernels/sum_parts_{}x{}{}",
                s.parts,
                s.len,
                if s.accumulate { "_acc" } else { "" }
            ),
            KernelCase::HiddenIn(h) => format!(
                "kernels/hidden_in_{}_{}x{}_to_{}x{}{}",
                dtype_name(h.dtype),
                h.rows,
                h.cols,
                h.rows_padded,
                h.ld,
                if h.src_offset > 0 {
                    format!("_from{}", h.src_offset)
                } else {
                    String::new()
                }
            ),
            KernelCase::Transpose(t) => format!(
                "kernels/transpose_{}x{}_ld{}_to_{}x{}",
                t.rows, t.cols, t.ld_src, t.cols, t.rows_padded
            ),
            KernelCase::Kl(r) => format!("kernels/kl_rows_{}", r.name),
            KernelCase::Topk(r) => format!("kernels/topk_rows_{}", r.name),
            KernelCase::Gather(r) => format!("kernels/topk_rows_{}", r.name),
        }
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            KernelCase::Gemm(g) => format!("{g:?}"),
            KernelCase::SumParts(s) => format!("{s:?}"),
            KernelCase::HiddenIn(h) => format!("{h:?}"),
            KernelCase::Transpose(t) => format!("{t:?}"),
            KernelCase::Kl(r) => format!(
                "rows={} vocab={} ld={} k={} rows: {:?} τ={} tail={} {:?}",
                r.rows,
                r.vocab,
                r.ld,
                r.k,
                r.patterns,
                r.temperature,
                r.tail.name(),
                r.terms
            ),
            KernelCase::Topk(r) => format!(
                "rows={} vocab={} ld={} k={} rows: {:?} cap={:?} logprobs={}",
                r.rows, r.vocab, r.ld, r.k, r.patterns, r.terms.softcap, r.logprobs
            ),
            KernelCase::Gather(r) => format!(
                "rows={} vocab={} ld={} ids={} rows: {:?} cap={:?} (gather)",
                r.rows, r.vocab, r.ld, r.k, r.patterns, r.terms.softcap
            ),
        }
    }

    pub(crate) fn run<B: Backend + ?Sized>(&self, b: &B, tol: &Tolerance) -> Result<CaseErrors, String> {
        match self {
            KernelCase::Gemm(g) => run_gemm(b, g),
            KernelCase::SumParts(s) => run_sum_parts(b, s),
            KernelCase::HiddenIn(h) => run_hidden_in(b, h),
            KernelCase::Transpose(t) => run_transpose(b, t),
            KernelCase::Kl(r) => run_kl(b, r, tol),
            KernelCase::Topk(r) => run_topk(b, r, tol),
            KernelCase::Gather(r) => run_gather(b, r, tol),
        }
    }
}

fn upload<B: Backend + ?Sized>(b: &B, bytes: &[u8], label: &'static str) -> Result<B::Buffer, String> {
    let buf = b
        .alloc(bytes.len() as u64, label)
        .map_err(|e| format!("alloc {label}: {e}"))?;
    b.upload(&buf, 0, bytes).map_err(|e| format!("upload {label}: {e}"))?;
    Ok(buf)
}

fn download<B: Backend + ?Sized, T: bytemuck::Pod + Default>(
    b: &B,
    buf: &B::Buffer,
    n: usize,
    label: &str,
) -> Result<Vec<T>, String> {
    let mut out = vec![T::default(); n];
    b.download(buf, 0, bytemuck::cast_slice_mut(&mut out))
        .map_err(|e| format!("download {label}: {e}"))?;
    Ok(out)
}

/// Up to five `(index, got, want)` lines and the count, for a message.
struct Bad {
    count: usize,
    lines: Vec<String>,
}

impl Bad {
    fn new() -> Self {
        Self {
            count: 0,
            lines: Vec::new(),
        }
    }

    fn push(&mut self, line: impl FnOnce() -> String) {
        self.count += 1;
        if self.lines.len() < 5 {
            self.lines.push(line());
        }
    }

    fn check(self, what: &str) -> Result<(), String> {
        if self.count == 0 {
            return Ok(());
        }
        Err(format!(
            "{what}: {} wrong element(s); first: {}",
            self.count,
            self.lines.join("; ")
        ))
    }
}

fn run_gemm<B: Backend + ?Sized>(b: &B, g: &GemmSpec) -> Result<CaseErrors, String> {
    let mut rng = Rng::new(0x6E44 ^ (g.m * 7 + g.n * 131 + g.k) as u64);
    let tail = if g.tight { 0 } else { TAIL };
    let small = |rng: &mut Rng, range: usize| rng.below(2 * range + 1) as f64 - range as f64;
    // A: [m][k] (or as columns [k][m]) at a_offset, stride lda; NaN
    // elsewhere (read outside = NaN in C).
    let mask_halves = match g.mask_rows {
        0 => 0,
        r => g.m * g.lda - (g.a_offset + (g.m - 1) * g.lda + g.k) + headkl_core::problem::filter::mask_halves(r, g.lda),
    };
    let a_at = |i: usize, l: usize| match g.a_columns {
        true => g.a_offset + l * g.lda + i,
        false => g.a_offset + i * g.lda + l,
    };
    let len_a = a_at(g.m - 1, g.k - 1) + 1 + mask_halves + tail;
    let mut a = vec![f16::NAN; len_a];
    let mut a_val = vec![0f64; g.m * g.k];
    // With the filter: whether column `col`'s 64-column block is kept (the
    // same in every row; about two in three).
    let block_kept = |col: usize| g.mask_rows == 0 || !(col / 64).is_multiple_of(3);
    for i in 0..g.m {
        for l in 0..g.k {
            let v = small(&mut rng, 3);
            a[a_at(i, l)] = f16::from_f64(v);
            // A skipped block adds nothing, whatever A holds there.
            a_val[i * g.k + l] = if block_kept(g.a_offset + l) { v } else { 0.0 };
        }
    }
    if g.mask_rows > 0 {
        let words = headkl_core::problem::filter::mask_words(g.lda);
        let mask_at = g.m * g.lda;
        for r in 0..g.mask_rows {
            for w in 0..words {
                let bits = (0..32).fold(0u32, |acc, bit| acc | u32::from(block_kept((w * 32 + bit) * 64)) << bit);
                let at = mask_at + (r * words + w) * 4;
                a[at..at + 4].copy_from_slice(&headkl_core::problem::filter::halves_of(bits));
            }
        }
    }
    // B: [n][k] or [k][n] from element 0, stride ldb.
    let (b_rows, b_cols) = match g.layout {
        HeadLayout::Logits => (g.n, g.k),
        HeadLayout::Dx => (g.k, g.n),
    };
    let len_b = (b_rows - 1) * g.ldb + b_cols + tail;
    let mut bm = vec![f16::NAN; len_b];
    let mut b_val = vec![0f64; b_rows * b_cols];
    for r in 0..b_rows {
        for c in 0..b_cols {
            let v = small(&mut rng, 3);
            bm[r * g.ldb + c] = f16::from_f64(v);
            b_val[r * b_cols + c] = v;
        }
    }
    // C: NaN everywhere; each part's block holds small integers when
    // accumulating. Blocks sit a poisoned gap apart.
    let block = (g.m - 1) * g.ldc + g.n;
    let stride = if g.k_parts > 1 {
        (block + 16).next_multiple_of(16)
    } else {
        0
    };
    let c_end = g.c_offset + (g.k_parts - 1) * stride + block;
    // The statistics region: a poisoned gap after C, one spare group per
    // row before this GEMM's and one after (which must stay NaN).
    let stats = g.stats.map(|(first, cols)| {
        let groups = first + g.n.div_ceil(STATS_GROUP_COLS) + 1;
        GemmRowStats {
            at: RowStats {
                offset: (c_end + 16).next_multiple_of(4),
                ld: groups.next_multiple_of(2),
                groups,
            },
            first_group: first,
            cols,
        }
    });
    let stats_end = stats.map_or(c_end, |rs| rs.at.offset + g.m * 2 * rs.at.ld);
    let len_c = stats_end + tail;
    let mut c = vec![f32::NAN; len_c];
    let mut want = vec![0f64; g.k_parts * g.m * g.n];
    for p in 0..g.k_parts {
        let range = k_part_range(g.k, g.k_parts, p);
        for i in 0..g.m {
            for j in 0..g.n {
                let mut s = 0f64;
                for l in range.clone() {
                    let bv = match g.layout {
                        HeadLayout::Logits => b_val[j * g.k + l],
                        HeadLayout::Dx => b_val[l * g.n + j],
                    };
                    s += a_val[i * g.k + l] * bv;
                }
                let mut w = f64::from(g.alpha) * s;
                if g.accumulate {
                    let init = small(&mut rng, 8);
                    c[g.c_offset + p * stride + i * g.ldc + j] = init as f32;
                    w += init;
                }
                want[(p * g.m + i) * g.n + j] = w;
            }
        }
    }
    let a_buf = upload(b, bytemuck::cast_slice(&a), "gemm A")?;
    let b_buf = upload(b, bytemuck::cast_slice(&bm), "gemm B")?;
    let c_buf = upload(b, bytemuck::cast_slice(&c), "gemm C")?;
    let desc = GemmDesc {
        m: g.m,
        n: g.n,
        k: g.k,
        a_offset: g.a_offset,
        lda: g.lda,
        a_columns: g.a_columns,
        b_layout: g.layout,
        ldb: g.ldb,
        c_offset: g.c_offset,
        ldc: g.ldc,
        alpha: g.alpha,
        accumulate: g.accumulate,
        k_parts: g.k_parts,
        c_part_stride: stride,
        row_stats: stats,
        mask_rows: g.mask_rows,
    };
    let ran = b.gemm(&a_buf, &b_buf, &c_buf, &desc);
    if g.mask_rows > 0 && !b.gemm_block_filter() {
        // A backend whose GEMM cannot skip blocks refuses the filtered one
        // with a typed error (its engines run the loss without the filter).
        return match ran {
            Err(headkl_core::Error::MissingFeature(_)) => Ok(CaseErrors::default()),
            Err(e) => Err(format!(
                "filtered gemm without the filter: want a missing-feature error, got: {e}"
            )),
            Ok(()) => Err("a backend without the block filter ran the filtered gemm".into()),
        };
    }
    if g.a_columns && !b.gemm_a_columns() {
        // The kernel GEMMs read A as rows: the call is refused, typed.
        return match ran {
            Err(headkl_core::Error::MissingFeature(_)) => Ok(CaseErrors::default()),
            Err(e) => Err(format!(
                "gemm with A as columns: want a missing-feature error, got: {e}"
            )),
            Ok(()) => Err("a backend whose GEMM reads A as rows ran one with A as columns".into()),
        };
    }
    ran.map_err(|e| format!("gemm: {e}"))?;
    let got: Vec<f32> = download(b, &c_buf, len_c, "C")?;
    let mut stats_bad = Bad::new();
    if let Some(rs) = &stats {
        check_row_stats(&got, rs, g, &want, &mut stats_bad);
    }
    let in_stats = |idx: usize| stats.is_some_and(|rs| (rs.at.offset..stats_end).contains(&idx));
    let mut inside = Bad::new();
    let mut outside = Bad::new();
    for (idx, &v) in got.iter().enumerate() {
        // (part, row, column) of the element, when inside a part's block.
        let at = idx.checked_sub(g.c_offset).and_then(|r| {
            let (p, r) = if g.k_parts > 1 {
                (r / stride, r % stride)
            } else {
                (0, r)
            };
            let (i, j) = (r / g.ldc, r % g.ldc);
            (p < g.k_parts && i < g.m && j < g.n).then_some((p, i, j))
        });
        if let Some((p, i, j)) = at {
            let w = want[(p * g.m + i) * g.n + j];
            // Small integers times a power of two: exact in f32.
            if f64::from(v) != w {
                inside.push(|| format!("part {p}: C[{i}][{j}] = {v}, want {w}"));
            }
        } else if !v.is_nan() && !in_stats(idx) {
            outside.push(|| format!("element {idx} (outside C's region) = {v}, want it untouched (NaN)"));
        }
    }
    inside.check("gemm result (exact integers expected; NaN means a read outside A or B)")?;
    outside.check("gemm wrote outside its region")?;
    stats_bad.check("gemm row statistics")?;
    Ok(CaseErrors::default())
}

/// Checks the row statistics in `got` against the exact product `want`:
/// each of this GEMM's groups `(max, Σ exp(x − max))` over its real
/// columns (the max exact, the sum within 1e-5), the region's other groups
/// untouched (NaN).
fn check_row_stats(got: &[f32], rs: &GemmRowStats, g: &GemmSpec, want: &[f64], bad: &mut Bad) {
    let mine = rs.first_group..rs.first_group + g.n.div_ceil(STATS_GROUP_COLS);
    for i in 0..g.m {
        for group in 0..rs.at.ld {
            let o = rs.at.offset + i * 2 * rs.at.ld + 2 * group;
            let (m, s) = (got[o], got[o + 1]);
            if !mine.contains(&group) {
                if !(m.is_nan() && s.is_nan()) {
                    bad.push(|| format!("row {i} group {group} (not this GEMM's) = ({m}, {s}), want NaN"));
                }
                continue;
            }
            let j0 = (group - rs.first_group) * STATS_GROUP_COLS;
            let vals = &want[i * g.n + j0..i * g.n + (j0 + STATS_GROUP_COLS).min(rs.cols).max(j0)];
            let (want_m, want_s) = match vals.iter().copied().reduce(f64::max) {
                Some(top) => (top, vals.iter().map(|x| (x - top).exp()).sum()),
                None => (-3.0e38, 0.0),
            };
            if f64::from(m) != want_m as f32 as f64 || (f64::from(s) - want_s).abs() > 1e-5 * want_s.max(1.0) {
                bad.push(|| format!("row {i} group {group} = ({m}, {s}), want ({want_m}, {want_s})"));
            }
        }
    }
}

fn run_sum_parts<B: Backend + ?Sized>(b: &B, s: &SumPartsDesc) -> Result<CaseErrors, String> {
    let mut rng = Rng::new(0x5A3 ^ (s.len * 31 + s.parts) as u64);
    // Parts: small integers over 64 (exact sums in f32) inside each part,
    // NaN in the gaps and the tail (a read outside shows as NaN).
    let len_parts = (s.parts - 1) * s.part_stride + s.len + TAIL;
    let mut parts = vec![f32::NAN; len_parts];
    for p in 0..s.parts {
        for i in 0..s.len {
            parts[p * s.part_stride + i] = (rng.below(2001) as f32 - 1000.0) / 64.0;
        }
    }
    // dst: small integers when accumulating, NaN otherwise (each element
    // must be written), and a NaN tail that must stay.
    let mut dst = vec![f32::NAN; s.len + TAIL];
    if s.accumulate {
        for v in &mut dst[..s.len] {
            *v = rng.below(201) as f32 - 100.0;
        }
    }
    let want: Vec<f64> = (0..s.len)
        .map(|i| {
            let sum: f64 = (0..s.parts).map(|p| f64::from(parts[p * s.part_stride + i])).sum();
            if s.accumulate {
                f64::from(dst[i]) + sum
            } else {
                sum
            }
        })
        .collect();
    let parts_buf = upload(b, bytemuck::cast_slice(&parts), "sum parts")?;
    let dst_buf = upload(b, bytemuck::cast_slice(&dst), "sum dst")?;
    b.sum_parts(&parts_buf, &dst_buf, s)
        .map_err(|e| format!("sum_parts: {e}"))?;
    let got: Vec<f32> = download(b, &dst_buf, s.len + TAIL, "dst")?;
    let mut bad = Bad::new();
    for (i, &v) in got.iter().enumerate() {
        match want.get(i) {
            Some(&w) if f64::from(v) != w => bad.push(|| format!("dst[{i}] = {v}, want {w}")),
            None if !v.is_nan() => bad.push(|| format!("dst[{i}] past len = {v}, want it untouched (NaN)")),
            _ => {}
        }
    }
    bad.check("sum_parts (exact sums expected; NaN means a read outside the parts)")?;
    Ok(CaseErrors::default())
}

/// Spacing of f16 values around `v` (a normal f16 magnitude).
fn f16_ulp(v: f32) -> f32 {
    let e = v.abs().log2().floor();
    2f32.powf(e - 10.0)
}

/// The name of a hidden-rows type in case names.
fn dtype_name(dtype: HiddenDtype) -> &'static str {
    match dtype {
        HiddenDtype::F32 => "f32",
        HiddenDtype::F16 => "f16",
        HiddenDtype::Bf16 => "bf16",
    }
}

/// Element `i` of a `hidden_in` case's rows, as an f32 (before it is
/// stored as the case's type): small integers, fractions f16 rounds,
/// 65504 (f16's largest), values past f16's range of either sign, small
/// normal f16 magnitudes, ±inf and NaN.
fn hidden_value(i: usize) -> f32 {
    match i % 11 {
        0 => (i % 17) as f32 - 8.0,
        1 => 0.1 * i as f32,
        2 => -1.0 / 3.0 * (i % 5 + 1) as f32,
        3 => 65504.0,
        4 => -1e5,
        5 => 1e5,
        6 => 2.5e-3 * (i % 7 + 1) as f32,
        7 => -70000.0,
        8 => f32::INFINITY.copysign(if i.is_multiple_of(2) { 1.0 } else { -1.0 }),
        9 => f32::NAN,
        _ => 1000.0 + 0.3 * i as f32,
    }
}

/// `hidden_in` on rows of the case's type from `src_offset` (the
/// elements before them and a tail after them NaN, which the kernel must
/// not read), into a padded operand poisoned with NaN: inside `rows ×
/// cols` each value rounded to f16 (±inf from |v| ≥ 65520, NaN kept;
/// exact where the value is an f16 value, else either neighbour), 0 in
/// the pad, and NaN still past `rows_padded · ld`.
fn run_hidden_in<B: Backend + ?Sized>(b: &B, h: &HiddenInDesc) -> Result<CaseErrors, String> {
    let n = h.rows * h.cols;
    // The values the kernel reads, as f32 (each exactly the stored one).
    let mut values = Vec::with_capacity(n);
    // Elements of the source buffer: the offset's, the rows, the tail; a
    // whole number of 4-byte words.
    let len = (h.src_offset + n + TAIL).next_multiple_of(2);
    let bytes: Vec<u8> = match h.dtype {
        HiddenDtype::F32 => {
            let mut src = vec![f32::NAN; len];
            for i in 0..n {
                src[h.src_offset + i] = hidden_value(i);
                values.push(src[h.src_offset + i]);
            }
            bytemuck::cast_slice(&src).to_vec()
        }
        HiddenDtype::F16 => {
            let mut src = vec![f16::NAN; len];
            for i in 0..n {
                src[h.src_offset + i] = f16::from_f32(hidden_value(i));
                values.push(src[h.src_offset + i].to_f32());
            }
            bytemuck::cast_slice(&src).to_vec()
        }
        HiddenDtype::Bf16 => {
            let mut src = vec![bf16::NAN; len];
            for i in 0..n {
                src[h.src_offset + i] = bf16::from_f32(hidden_value(i));
                values.push(src[h.src_offset + i].to_f32());
            }
            bytemuck::cast_slice(&src).to_vec()
        }
    };
    let dst_len = h.rows_padded * h.ld + TAIL;
    let src_buf = upload(b, &bytes, "hidden_in src")?;
    let dst_buf = upload(b, bytemuck::cast_slice(&vec![f16::NAN; dst_len]), "hidden_in dst")?;
    b.dispatch(Launch::HiddenIn {
        src: &src_buf,
        dst: &dst_buf,
        desc: *h,
    })
    .map_err(|e| format!("hidden_in: {e}"))?;
    let got: Vec<f16> = download(b, &dst_buf, dst_len, "dst")?;
    let mut bad = Bad::new();
    for (idx, g) in got.iter().enumerate() {
        let (r, col) = (idx / h.ld, idx % h.ld);
        let gv = g.to_f32();
        if r < h.rows && col < h.cols {
            let v = values[r * h.cols + col];
            let ok = if v.is_nan() {
                g.is_nan()
            } else if v.abs() >= 65520.0 {
                gv == f32::INFINITY.copysign(v)
            } else if f16::from_f32(v).to_f32() == v {
                gv == v
            } else {
                // Either neighbour: WGSL leaves the rounding direction open.
                (gv - v).abs() < f16_ulp(v)
            };
            if !ok {
                bad.push(|| format!("dst[{r}][{col}] = {gv} from {v}"));
            }
        } else if idx < h.rows_padded * h.ld {
            if gv != 0.0 {
                bad.push(|| format!("dst[{r}][{col}] = {gv} in the pad, want 0"));
            }
        } else if !g.is_nan() {
            bad.push(|| format!("element {idx} past rows_padded·ld = {gv}, want it untouched (NaN)"));
        }
    }
    bad.check("hidden_in")?;
    Ok(CaseErrors::default())
}

/// The value `transpose`'s source holds at `[r][c]`: small multiples of
/// 1/64 (exact in f16), distinct along both rows and columns, with every
/// seventh of either sign's largest f16 magnitude and zeros of both signs
/// among them.
fn transpose_value(r: usize, c: usize) -> f16 {
    match (r * 131 + c * 17) % 97 {
        0 => f16::MAX,
        1 => f16::MIN,
        2 => f16::NEG_ZERO,
        3 => f16::ZERO,
        _ => f16::from_f32((((r * 31 + c * 7) % 2001) as f32 - 1000.0) / 64.0),
    }
}

fn run_transpose<B: Backend + ?Sized>(b: &B, t: &TransposeDesc) -> Result<CaseErrors, String> {
    // src: the real rows' `cols` columns hold values; the pad columns
    // (up to ld_src) and the rows past `rows` (up to rows_padded) hold
    // NaN, which the kernel must not move; a NaN tail after.
    let src_len = t.rows_padded * t.ld_src + TAIL;
    let mut src = vec![f16::NAN; src_len];
    for r in 0..t.rows {
        for c in 0..t.cols {
            src[r * t.ld_src + c] = transpose_value(r, c);
        }
    }
    // dst: NaN everywhere, each element of its `cols × rows_padded` must be
    // written and the tail after left alone.
    let dst_len = t.cols * t.rows_padded + TAIL;
    let src_buf = upload(b, bytemuck::cast_slice(&src), "transpose src")?;
    let dst_buf = upload(b, bytemuck::cast_slice(&vec![f16::NAN; dst_len]), "transpose dst")?;
    b.transpose(&src_buf, &dst_buf, t)
        .map_err(|e| format!("transpose: {e}"))?;
    let got: Vec<f16> = download(b, &dst_buf, dst_len, "dst")?;
    let mut bad = Bad::new();
    for (idx, g) in got.iter().enumerate() {
        let (c, r) = (idx / t.rows_padded.max(1), idx % t.rows_padded.max(1));
        if idx >= t.cols * t.rows_padded {
            if !g.is_nan() {
                bad.push(|| format!("element {idx} past cols·rows_padded = {g}, want it untouched (NaN)"));
            }
        } else if r < t.rows {
            let want = transpose_value(r, c);
            if g.to_bits() != want.to_bits() {
                bad.push(|| format!("dst[{c}][{r}] = {g}, want src[{r}][{c}] = {want}"));
            }
        } else if g.to_bits() != f16::ZERO.to_bits() {
            bad.push(|| format!("dst[{c}][{r}] = {g} for a row past rows = {}, want 0", t.rows));
        }
    }
    bad.check("transpose (exact values expected; NaN means a pad or a row past rows was moved)")?;
    Ok(CaseErrors::default())
}

impl RowSpec {
    /// The rows of every buffer: `rows` and the extra ones past them.
    fn total_rows(&self) -> usize {
        self.rows + self.extra_rows
    }
}

/// Crafted logits `[rows + extra][ld]` (pad columns NaN: they must be
/// ignored) and their f64 copies per real row, drawn from the case's seed;
/// with the generator, for the case's further draws.
fn crafted_logits(r: &RowSpec) -> (Rng, Vec<f32>, Vec<Vec<f64>>) {
    let mut rng = Rng::new(r.seed);
    let total_rows = r.total_rows();
    let mut logits = vec![f32::NAN; total_rows * r.ld];
    let mut rows64 = Vec::with_capacity(r.rows);
    for t in 0..r.rows {
        let pattern = r.patterns[t % r.patterns.len()];
        let row = &mut logits[t * r.ld..t * r.ld + r.vocab];
        for (j, v) in row.iter_mut().enumerate() {
            *v = match pattern {
                Row::Flat => 0.75,
                Row::Large => (120.0 * rng.uniform() - 60.0) as f32,
                Row::Ties => rng.below(4) as f32,
                Row::Descending | Row::OneNan => -0.01 * j as f32,
                Row::Ascending => 0.01 * j as f32,
                Row::NegLarge => (-50.0 + rng.normal()) as f32,
                _ => (3.0 * rng.normal()) as f32,
            };
        }
        match pattern {
            Row::Residue => {
                let count = (r.k + 2).min(r.vocab.div_ceil(256));
                let ids = residue_ids(&mut rng, r.vocab, count);
                for (rank, &j) in ids.iter().enumerate() {
                    row[j] = 12.0 + 0.25 * (count - rank) as f32;
                }
                if count >= 2 {
                    row[ids[1]] = row[ids[0]];
                }
            }
            Row::Nan => row.fill(f32::NAN),
            Row::PosInf => row[r.vocab / 3] = f32::INFINITY,
            Row::OneNan => row[if r.vocab > 7300 { 7300 } else { r.vocab / 2 }] = f32::from_bits(0xffc0_0000),
            Row::Infs => {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = if j % 3 == 1 { f32::NEG_INFINITY } else { f32::INFINITY };
                }
            }
            _ => {}
        }
        rows64.push(row.iter().map(|&v| f64::from(v)).collect());
    }
    (rng, logits, rows64)
}

fn run_kl<B: Backend + ?Sized>(b: &B, r: &RowSpec, tol: &Tolerance) -> Result<CaseErrors, String> {
    let (mut rng, logits, rows64) = crafted_logits(r);
    let total_rows = r.total_rows();
    let mut ids = vec![0u32; total_rows * r.k];
    let mut probs = vec![0f32; total_rows * r.k];
    let mut row_in = vec![0u32; total_rows * 2];
    for t in 0..r.rows {
        let pattern = r.patterns[t % r.patterns.len()];
        let row_ids = if pattern == Row::Residue {
            residue_ids(&mut rng, r.vocab, r.k)
        } else {
            rng.distinct(r.vocab, r.k)
        };
        let mut p: Vec<f64> = (0..r.k)
            .map(|q| {
                if pattern == Row::ZeroProbs && q % 2 == 1 {
                    0.0
                } else {
                    rng.uniform() + 0.01
                }
            })
            .collect();
        let s: f64 = p.iter().sum();
        // Outside renormalize, the k hold a share of the vocabulary: every
        // third row all of it (an empty tail), the others 60–90%.
        let mass = match r.tail {
            TailMode::Renormalize => 1.0,
            // (Not under the reverse KL: a tail of rounding error against
            // the floored teacher tail is ill-conditioned.)
            _ if t % 3 == 2 && r.terms.divergence.effective() != Divergence::Reverse => 1.0,
            _ => 0.6 + 0.3 * rng.uniform(),
        };
        p.iter_mut().for_each(|v| *v *= mass / s);
        for q in 0..r.k {
            ids[t * r.k + q] = row_ids[q] as u32;
            probs[t * r.k + q] = p[q] as f32;
        }
        let coef = if pattern == Row::Masked {
            0.0
        } else {
            1024.0 * (t + 1) as f32
        };
        // With a hard term: the label among the k, outside them, or none.
        let label = match t % 3 {
            _ if !r.terms.hard_on() => NO_LABEL,
            0 => row_ids[0] as u32,
            1 => (0..r.vocab)
                .find(|j| !row_ids.contains(j))
                .map_or(NO_LABEL, |j| j as u32),
            _ => NO_LABEL,
        };
        row_in[2 * t] = coef.to_bits();
        row_in[2 * t + 1] = label;
    }
    let logits_buf = upload(b, bytemuck::cast_slice(&logits), "kl logits")?;
    let ids_buf = upload(b, bytemuck::cast_slice(&ids), "kl ids")?;
    let probs_buf = upload(b, bytemuck::cast_slice(&probs), "kl probs")?;
    let row_in_buf = upload(b, bytemuck::cast_slice(&row_in), "kl row_in")?;
    let loss_buf = upload(b, bytemuck::cast_slice(&vec![f32::NAN; total_rows * 4]), "kl loss")?;
    let grad_buf = upload(b, bytemuck::cast_slice(&vec![f16::NAN; total_rows * r.ld]), "kl grad")?;
    let desc = KlDesc {
        temperature: r.temperature,
        tail: r.tail,
        terms: r.terms,
        ..KlDesc::plain(r.rows, r.vocab, r.ld, r.k)
    };
    b.kl_rows(
        &logits_buf,
        &ids_buf,
        &probs_buf,
        &row_in_buf,
        &loss_buf,
        &grad_buf,
        &desc,
    )
    .map_err(|e| format!("kl_rows: {e}"))?;
    let out: Vec<f32> = download(b, &loss_buf, total_rows * 4, "loss")?;
    let grad: Vec<f16> = download(b, &grad_buf, total_rows * r.ld, "grad")?;

    // The formulas in f64 on the same f32 logits, for the finite rows:
    // [loss, lse, soft, hard] and c·∂L/∂s.
    let mut want: [Vec<f64>; 4] = Default::default();
    let mut got: [Vec<f32>; 4] = Default::default();
    let (mut want_grad, mut got_grad) = (vec![], vec![]);
    let mut bad = Bad::new();
    for (t, s) in rows64.iter().enumerate() {
        let pattern = r.patterns[t % r.patterns.len()];
        if pattern.bad() {
            if !out[t * 4].is_nan() {
                bad.push(|| format!("loss[{t}] = {} for a row with a non-finite logit, want NaN", out[t * 4]));
            }
            continue;
        }
        let teacher = RowTeacher {
            ids: &ids[t * r.k..(t + 1) * r.k],
            probs: &probs[t * r.k..(t + 1) * r.k],
            tail: r.tail,
        };
        let terms = row_terms_f64(s, teacher, row_in[2 * t + 1], r.temperature, &r.terms);
        for (i, v) in [terms.loss, terms.lse, terms.soft, terms.hard].into_iter().enumerate() {
            want[i].push(v);
            got[i].push(out[t * 4 + i]);
        }
        let c = f64::from(f32::from_bits(row_in[2 * t]));
        want_grad.extend(terms.grad.iter().map(|v| c * v));
        got_grad.extend(grad[t * r.ld..t * r.ld + r.vocab].iter().map(|v| v.to_f32()));
        for j in r.vocab..r.ld {
            let v = grad[t * r.ld + j].to_f32();
            if v != 0.0 {
                bad.push(|| format!("grad[{t}][{j}] = {v} in the pad, want 0"));
            }
        }
        if c == 0.0 {
            if let Some(j) = (0..r.vocab).find(|&j| grad[t * r.ld + j].to_f32() != 0.0) {
                bad.push(|| format!("grad[{t}][{j}] = {} with coefficient 0, want 0", grad[t * r.ld + j]));
            }
        }
    }
    for t in r.rows..total_rows {
        if let Some(i) = (0..4).find(|&i| !out[t * 4 + i].is_nan()) {
            bad.push(|| format!("loss[{t}][{i}] (past rows = {}) was written", r.rows));
        }
        if let Some(j) = (0..r.ld).find(|&j| !grad[t * r.ld + j].is_nan()) {
            bad.push(|| format!("grad[{t}][{j}] (past rows = {}) was written", r.rows));
        }
    }
    bad.check("kl_rows")?;
    let mut loss_err = 0f64;
    for (i, name) in ["loss", "lse", "soft part", "hard part"].into_iter().enumerate() {
        let want = DirectLoss::of_losses(std::mem::take(&mut want[i]));
        let n = want.loss.len().max(1) as f64;
        let got_mean = got[i].iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let err = tol
            .check_loss(&got[i], got_mean, &want)
            .map_err(|e| format!("{name}: {e}"))?;
        loss_err = loss_err.max(err);
    }
    let grad_err = tol
        .check_dx_rows(&got_grad, &want_grad, Some(r.vocab))
        .map_err(|e| format!("grad (f16, vs c·∂L/∂s): {e}"))?;
    Ok(CaseErrors {
        loss: Some(loss_err),
        dx: Some(grad_err),
        ..CaseErrors::default()
    })
}

/// The gather: each row's ids drawn distinct, then the second repeating
/// the first and (k > 2) the last none; the output NaN-poisoned, the rows
/// past `rows` checked unwritten.
fn run_gather<B: Backend + ?Sized>(b: &B, r: &RowSpec, tol: &Tolerance) -> Result<CaseErrors, String> {
    let (mut rng, logits, rows64) = crafted_logits(r);
    let total_rows = r.total_rows();
    let (k, cols) = (r.k, r.k + 1);
    let mut ids = vec![u32::MAX; total_rows * cols];
    for t in 0..r.rows {
        let row = &mut ids[t * cols..t * cols + k];
        for (q, id) in rng.distinct(r.vocab, k).into_iter().enumerate() {
            row[q] = id as u32;
        }
        if k > 2 {
            row[1] = row[0];
            row[k - 1] = u32::MAX;
        }
    }
    let logits_buf = upload(b, bytemuck::cast_slice(&logits), "gather logits")?;
    let ids_buf = upload(b, bytemuck::cast_slice(&ids), "gather ids")?;
    let probs_buf = upload(
        b,
        bytemuck::cast_slice(&vec![f32::NAN; total_rows * cols]),
        "gather out",
    )?;
    let desc = TopkDesc {
        cap: r.terms.softcap,
        gather: true,
        ..TopkDesc::plain(r.rows, r.vocab, r.ld, cols)
    };
    b.topk_rows(&logits_buf, &ids_buf, &probs_buf, &desc)
        .map_err(|e| format!("topk_rows (gather): {e}"))?;
    let out: Vec<f32> = download(b, &probs_buf, total_rows * cols, "gather out")?;
    let mut bad = Bad::new();
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for (t, s) in rows64.iter().enumerate() {
        let pattern = r.patterns[t % r.patterns.len()];
        let row = &out[t * cols..(t + 1) * cols];
        if pattern.bad() {
            if !row[0].is_nan() {
                bad.push(|| format!("out[{t}][0] = {} for a row with a non-finite logit, want NaN", row[0]));
            }
            continue;
        }
        let values: Vec<f64> = match r.terms.softcap {
            Some(c) => s.iter().map(|&v| f64::from(c) * (v / f64::from(c)).tanh()).collect(),
            None => s.clone(),
        };
        let m = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + values.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        for q in 0..k {
            let id = ids[t * cols + q];
            match values.get(id as usize) {
                Some(&v) => {
                    got.push(row[q]);
                    want.push(v - lse);
                }
                None if row[q] != f32::NEG_INFINITY => {
                    bad.push(|| format!("out[{t}][{q}] = {} for no id, want -inf", row[q]));
                }
                None => {}
            }
        }
        got.push(row[k]);
        want.push(lse);
    }
    for t in r.rows..total_rows {
        if out[t * cols..(t + 1) * cols].iter().any(|v| !v.is_nan()) {
            bad.push(|| format!("row {t} (past rows = {}) was written", r.rows));
        }
    }
    bad.check("topk_rows (gather)")?;
    let mean = got.iter().map(|&v| f64::from(v)).sum::<f64>() / got.len().max(1) as f64;
    let err = tol
        .check_loss(&got, mean, &DirectLoss::of_losses(want))
        .map_err(|e| format!("gather (log-probabilities and lse): {e}"))?;
    Ok(CaseErrors {
        loss: Some(err),
        ..CaseErrors::default()
    })
}

fn run_topk<B: Backend + ?Sized>(b: &B, r: &RowSpec, tol: &Tolerance) -> Result<CaseErrors, String> {
    let (_, logits, rows64) = crafted_logits(r);
    let total_rows = r.total_rows();
    let logits_buf = upload(b, bytemuck::cast_slice(&logits), "topk logits")?;
    let ids_buf = upload(b, bytemuck::cast_slice(&vec![u32::MAX; total_rows * r.k]), "topk ids")?;
    let probs_buf = upload(b, bytemuck::cast_slice(&vec![f32::NAN; total_rows * r.k]), "topk probs")?;
    let desc = TopkDesc {
        cap: r.terms.softcap,
        logprobs: r.logprobs,
        ..TopkDesc::plain(r.rows, r.vocab, r.ld, r.k)
    };
    b.topk_rows(&logits_buf, &ids_buf, &probs_buf, &desc)
        .map_err(|e| format!("topk_rows: {e}"))?;
    let ids: Vec<u32> = download(b, &ids_buf, total_rows * r.k, "ids")?;
    let probs: Vec<f32> = download(b, &probs_buf, total_rows * r.k, "probs")?;

    let mut bad = Bad::new();
    let (mut good_ids, mut good_probs, mut good_logits, mut want_ids) = (vec![], vec![], vec![], vec![]);
    for (t, s) in rows64.iter().enumerate() {
        let pattern = r.patterns[t % r.patterns.len()];
        let row_ids = &ids[t * r.k..(t + 1) * r.k];
        if pattern.bad() {
            if !probs[t * r.k].is_nan() {
                bad.push(|| {
                    format!(
                        "probs[{t}][0] = {} for a row with a non-finite logit, want NaN",
                        probs[t * r.k]
                    )
                });
            }
            continue;
        }
        // Exact on its f32 input: the same ids, ties to the lowest id.
        let want = topk_of_row(s, r.k);
        if let Some(q) = (0..r.k).find(|&q| row_ids[q] != want[q]) {
            bad.push(|| {
                let show = |id: u32| s.get(id as usize).map_or("out of range".to_string(), |v| v.to_string());
                format!(
                    "ids[{t}][{q}] = {} (logit {}), want {} (logit {}) [{pattern:?} row]",
                    row_ids[q],
                    show(row_ids[q]),
                    want[q],
                    show(want[q])
                )
            });
            continue;
        }
        good_ids.extend_from_slice(row_ids);
        good_probs.extend_from_slice(&probs[t * r.k..(t + 1) * r.k]);
        // The values are the capped logits (the selection stays on the raw).
        match r.terms.softcap {
            Some(c) => {
                let c = f64::from(c);
                good_logits.extend(s.iter().map(|&v| c * (v / c).tanh()));
            }
            None => good_logits.extend_from_slice(s),
        }
        want_ids.extend(want);
    }
    for t in r.rows..total_rows {
        if (0..r.k).any(|q| ids[t * r.k + q] != u32::MAX || !probs[t * r.k + q].is_nan()) {
            bad.push(|| format!("row {t} (past rows = {}) was written", r.rows));
        }
    }
    bad.check("topk_rows")?;
    let ntok = good_ids.len() / r.k;
    let mut lp_err = None;
    if r.logprobs {
        // Log-probabilities over the full row; judged as values, then
        // turned into the softmax over the k for the probability check.
        let mut want_lp = Vec::with_capacity(good_ids.len());
        for t in 0..ntok {
            let row = &good_logits[t * r.vocab..(t + 1) * r.vocab];
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            want_lp.extend(want_ids[t * r.k..(t + 1) * r.k].iter().map(|&j| row[j as usize] - lse));
        }
        let want = DirectLoss::of_losses(want_lp);
        let got_mean = good_probs.iter().map(|&v| f64::from(v)).sum::<f64>() / good_probs.len().max(1) as f64;
        lp_err = Some(
            tol.check_loss(&good_probs, got_mean, &want)
                .map_err(|e| format!("topk logprobs: {e}"))?,
        );
        for lp in good_probs.chunks_exact_mut(r.k) {
            let m = lp.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
            let z: f64 = lp.iter().map(|&v| (f64::from(v) - m).exp()).sum();
            lp.iter_mut().for_each(|v| *v = ((f64::from(*v) - m).exp() / z) as f32);
        }
    }
    let mut want_probs = Vec::with_capacity(good_ids.len());
    for t in 0..ntok {
        want_probs.extend(softmax_over(
            &good_logits[t * r.vocab..(t + 1) * r.vocab],
            &want_ids[t * r.k..(t + 1) * r.k],
        ));
    }
    let want = DirectTopK {
        ids: want_ids,
        probs: want_probs,
        logits: good_logits,
        ntok,
        k: r.k,
    };
    let prob_err = tol
        .check_topk(&good_ids, &good_probs, &want)
        .map_err(|e| e.to_string())?;
    Ok(CaseErrors {
        prob: Some(prob_err),
        loss: lp_err,
        ..CaseErrors::default()
    })
}
