//! Every kernel descriptor checked against its buffers, once, for every
//! backend. Each check returns the kernel's parameter block (with its grid
//! width still 0), so a backend cannot dispatch a descriptor it did not
//! check; every extent goes into the block through `u32::try_from`, and an
//! extent past 32 bits is an [`Error::BadDescriptor`].
//!
//! The GEMMs are built without runtime bounds checks: these checks are what
//! keep their every index inside its buffer (shaders/README.md).

use crate::align::ALIGN;
use crate::error::{Error, Result};
use crate::problem::terms::TeacherForm;
use crate::problem::MAX_K;
use crate::toolkit::backend::{
    DeviceBuffer, GemmDesc, GemmRowStats, HeadLayout, KlDesc, RowStats, SumPartsDesc, TopkDesc, TransposeDesc,
    STATS_GROUP_COLS,
};
use crate::toolkit::kernels::{bad_descriptor, require, KernelId};
use crate::toolkit::params::{
    row_flags, GatherRowsParams, GemmParams, HeadGradOutParams, HiddenInParams, LabelsInParams, LossOutParams,
    RowParams, ShardRowsParams, StatusDetailParams, SumPartsParams, TeacherRowsParams, TopkOutParams, TransposeParams,
    WeightStatsParams,
};
use crate::toolkit::resident_kernels::{
    GatherRowsDesc, HeadGradOutDesc, HiddenInDesc, LabelsInDesc, LossOutDesc, ShardRowsDesc, ShardStage,
    StatusDetailDesc, TeacherRowsDesc, TopkOutDesc, WeightStatsDesc,
};
use crate::toolkit::split::k_part_len;
use crate::toolkit::status::WORDS;

/// `value` as `u32`, or an error naming `field` of `kernel`.
fn index(kernel: KernelId, field: &'static str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| {
        bad_descriptor(
            kernel,
            field,
            value as u128,
            "exceeds the kernels' 32-bit indices".into(),
        )
    })
}

/// Elements spanned by `rows` rows of `cols` elements at row stride `ld`,
/// from element `offset`; 0 when the region is empty.
fn span(offset: usize, rows: usize, ld: usize, cols: usize) -> u128 {
    if rows == 0 || cols == 0 {
        0
    } else {
        offset as u128 + (rows as u128 - 1) * ld as u128 + cols as u128
    }
}

/// Checks that a region of `elems` elements of `elem_bytes` bytes fits in
/// `buffer`, in one binding of at most `max_binding` bytes, and can be
/// indexed with 32 bits.
fn fits(
    kernel: KernelId,
    what: &'static str,
    elems: u128,
    elem_bytes: u128,
    buffer: &impl DeviceBuffer,
    max_binding: u64,
) -> Result<()> {
    let needed = elems * elem_bytes;
    let len = buffer.len();
    let limit = len.min(max_binding);
    require(needed <= u128::from(limit), kernel, what, needed, || {
        format!("bytes needed, but the buffer binds {limit} (length {len}, binding limit {max_binding})")
    })?;
    // Kernels index elements (and compare against products of extents)
    // in u32.
    require(elems < 1 << 32, kernel, what, needed, || {
        format!("bytes span {elems} elements, past the kernels' 32-bit indices")
    })
}

/// Checks `value ≥ min`, naming both.
fn at_least(kernel: KernelId, field: &'static str, value: usize, min_name: &str, min: usize) -> Result<()> {
    require(value >= min, kernel, field, value as u128, || {
        format!("below {min_name} = {min}")
    })
}

/// Checks that `value` is a multiple of `unit`.
fn multiple(kernel: KernelId, field: &'static str, value: usize, unit: usize) -> Result<()> {
    require(value.is_multiple_of(unit), kernel, field, value as u128, || {
        format!("not a multiple of {unit}")
    })
}

/// A transfer of `bytes` bytes at `offset` into or out of a buffer of
/// `len` bytes: an error unless it lies inside. `what` is `upload` or
/// `download`.
pub fn check_transfer(what: &'static str, offset: u64, bytes: u64, len: u64) -> Result<()> {
    if offset.checked_add(bytes).is_none_or(|end| end > len) {
        return Err(Error::TransferOutOfRange {
            what,
            offset,
            bytes,
            len,
        });
    }
    Ok(())
}

impl GemmDesc {
    /// Checks the GEMM against `[a, b, c]` and returns its block.
    pub fn check<B: DeviceBuffer>(&self, [a, b, c]: [&B; 3], max_binding: u64) -> Result<GemmParams> {
        let kernel = self.kernel();
        multiple(kernel, "m", self.m, ALIGN)?;
        multiple(kernel, "n", self.n, ALIGN)?;
        // With A as columns (a library GEMM) no tile reads past k.
        if !self.a_columns {
            multiple(kernel, "k", self.k, ALIGN)?;
        }
        // The matrix-unit kernels load A and B 8 halves (16 bytes) at a time.
        for (field, value) in [("a_offset", self.a_offset), ("lda", self.lda), ("ldb", self.ldb)] {
            multiple(kernel, field, value, 8)?;
        }
        // A's span: m rows of k, or (as columns) k rows of m.
        let a_span = match self.a_columns {
            false => {
                at_least(kernel, "lda", self.lda, "k", self.k)?;
                span(self.a_offset, self.m, self.lda, self.k)
            }
            true => {
                at_least(kernel, "lda", self.lda, "m", self.m)?;
                require(self.k_parts == 1, kernel, "k_parts", self.k_parts as u128, || {
                    "must be 1 with A as columns".into()
                })?;
                require(self.mask_rows == 0, kernel, "mask_rows", self.mask_rows as u128, || {
                    "must be 0 with A as columns".into()
                })?;
                span(self.a_offset, self.k, self.lda, self.m)
            }
        };
        at_least(kernel, "ldc", self.ldc, "n", self.n)?;
        let b_span = match self.b_layout {
            HeadLayout::Logits => {
                at_least(kernel, "ldb", self.ldb, "k", self.k)?;
                span(0, self.n, self.ldb, self.k)
            }
            HeadLayout::Dx => {
                at_least(kernel, "ldb", self.ldb, "n", self.n)?;
                span(0, self.k, self.ldb, self.n)
            }
        };
        require(self.k_parts >= 1, kernel, "k_parts", self.k_parts as u128, || {
            "must be at least 1".into()
        })?;
        // One part's C block, in elements from its first.
        let c_block = span(0, self.m, self.ldc, self.n);
        if self.k_parts > 1 {
            require(
                self.c_part_stride as u128 >= c_block,
                kernel,
                "c_part_stride",
                self.c_part_stride as u128,
                || format!("below one part's C block of {c_block} elements: the parts' blocks would overlap"),
            )?;
        }
        if self.m > 0 && self.n > 0 {
            fits(kernel, "A", a_span, 2, a, max_binding)?;
            fits(kernel, "B", b_span, 2, b, max_binding)?;
            if self.mask_rows > 0 {
                require(
                    self.b_layout == HeadLayout::Dx,
                    kernel,
                    "mask_rows",
                    self.mask_rows as u128,
                    || "the block filter is the dx GEMM's (layout Dx) only".into(),
                )?;
                at_least(kernel, "m", self.m, "mask_rows", self.mask_rows)?;
                require(
                    self.a_offset < self.lda,
                    kernel,
                    "a_offset",
                    self.a_offset as u128,
                    || {
                        format!(
                            "must be below lda = {} with the block filter (A starts in row 0)",
                            self.lda
                        )
                    },
                )?;
                // Every K step then lies inside one block (steps of at most
                // 64, split-K parts a multiple of 64 apart), so a kernel
                // skips exactly the clear blocks.
                multiple(kernel, "a_offset", self.a_offset, crate::problem::filter::BLOCK)?;
                let mask_end = self.m as u128 * self.lda as u128
                    + crate::problem::filter::mask_halves(self.mask_rows, self.lda) as u128;
                fits(kernel, "A's block mask", mask_end, 2, a, max_binding)?;
            }
            // The last part's block ends the region.
            let last = self.c_offset as u128 + (self.k_parts as u128 - 1) * self.c_part_stride as u128;
            fits(kernel, "C", last + c_block, 4, c, max_binding)?;
        }
        let mut stats = [0u32; 4];
        if let Some(rs) = &self.row_stats {
            let c_end = self.c_offset as u128 + c_block;
            stats = rs.check(kernel, self, c_end, c, max_binding)?;
        }
        Ok(GemmParams {
            m: index(kernel, "m", self.m)?,
            n: index(kernel, "n", self.n)?,
            k: index(kernel, "k", self.k)?,
            a_offset: index(kernel, "a_offset", self.a_offset)?,
            lda: index(kernel, "lda", self.lda)?,
            ldb: index(kernel, "ldb", self.ldb)?,
            c_offset: index(kernel, "c_offset", self.c_offset)?,
            ldc: index(kernel, "ldc", self.ldc)?,
            alpha: self.alpha,
            accumulate: u32::from(self.accumulate),
            grid_x: 0,
            k_parts: index(kernel, "k_parts", self.k_parts)?,
            k_part: index(kernel, "k", k_part_len(self.k, self.k_parts))?,
            c_part_stride: index(kernel, "c_part_stride", self.c_part_stride)?,
            stats_offset: stats[0],
            stats_ld: stats[1],
            stats_first: stats[2],
            stats_cols: stats[3],
            mask_rows: index(kernel, "mask_rows", self.mask_rows)?,
            mask_ld: match self.mask_rows {
                0 => 0,
                _ => index(kernel, "lda", crate::problem::filter::mask_words(self.lda))?,
            },
        })
    }
}

impl RowStats {
    /// Checks the region's layout and that `rows` rows of it fit in `buf`
    /// from element `after` on (it must not overlap the data it describes).
    fn check<B: DeviceBuffer>(
        &self,
        kernel: KernelId,
        rows: usize,
        after: u128,
        buf: &B,
        max_binding: u64,
    ) -> Result<()> {
        require(
            self.offset as u128 >= after,
            kernel,
            "row_stats.offset",
            self.offset as u128,
            || format!("inside the data it describes (which ends at element {after})"),
        )?;
        multiple(kernel, "row_stats.offset", self.offset, 4)?;
        multiple(kernel, "row_stats.ld", self.ld, 2)?;
        at_least(kernel, "row_stats.ld", self.ld, "row_stats.groups", self.groups)?;
        fits(
            kernel,
            "row statistics",
            span(self.offset, rows, 2 * self.ld, 2 * self.ld),
            4,
            buf,
            max_binding,
        )
    }
}

impl GemmRowStats {
    /// Checks the statistics of `gemm`, whose C region ends at element
    /// `c_end`, and returns the block's `[stats_offset, stats_ld,
    /// stats_first, stats_cols]`.
    fn check<B: DeviceBuffer>(
        &self,
        kernel: KernelId,
        gemm: &GemmDesc,
        c_end: u128,
        c: &B,
        max_binding: u64,
    ) -> Result<[u32; 4]> {
        require(
            gemm.k_parts == 1 && !gemm.accumulate,
            kernel,
            "row_stats",
            gemm.k_parts as u128,
            || "row statistics need the whole product: one part, no accumulation".into(),
        )?;
        require(self.at.offset > 0, kernel, "row_stats.offset", 0, || {
            "0 means no statistics".into()
        })?;
        let groups = self.first_group as u128 + gemm.n.div_ceil(STATS_GROUP_COLS) as u128;
        require(
            groups <= self.at.groups as u128,
            kernel,
            "row_stats.first_group",
            self.first_group as u128,
            || {
                format!(
                    "its {} columns' groups end at group {groups}, past the region's {}",
                    gemm.n, self.at.groups
                )
            },
        )?;
        require(self.cols <= gemm.n, kernel, "row_stats.cols", self.cols as u128, || {
            format!("past the GEMM's {} columns", gemm.n)
        })?;
        self.at.check(kernel, gemm.m, c_end, c, max_binding)?;
        Ok([
            index(kernel, "row_stats.offset", self.at.offset)?,
            index(kernel, "row_stats.ld", self.at.ld)?,
            index(kernel, "row_stats.first_group", self.first_group)?,
            index(kernel, "row_stats.cols", self.cols)?,
        ])
    }
}

impl TransposeDesc {
    /// Checks the transpose against `[src, dst]` and returns its block.
    pub fn check<B: DeviceBuffer>(&self, [src, dst]: [&B; 2], max_binding: u64) -> Result<TransposeParams> {
        const K: KernelId = KernelId::Transpose;
        at_least(K, "rows_padded", self.rows_padded, "rows", self.rows)?;
        at_least(K, "ld_src", self.ld_src, "cols", self.cols)?;
        if self.rows > 0 && self.cols > 0 {
            fits(
                K,
                "src",
                span(0, self.rows, self.ld_src, self.cols),
                2,
                src,
                max_binding,
            )?;
        }
        if self.rows_padded > 0 && self.cols > 0 {
            fits(
                K,
                "dst",
                span(0, self.cols, self.rows_padded, self.rows_padded),
                2,
                dst,
                max_binding,
            )?;
        }
        Ok(TransposeParams {
            rows: index(K, "rows", self.rows)?,
            rows_padded: index(K, "rows_padded", self.rows_padded)?,
            cols: index(K, "cols", self.cols)?,
            ld_src: index(K, "ld_src", self.ld_src)?,
            grid_x: 0,
            _pad: [0; 3],
        })
    }
}

impl SumPartsDesc {
    /// Checks the sum against `[parts, dst]` and returns its block.
    pub fn check<B: DeviceBuffer>(&self, [parts, dst]: [&B; 2], max_binding: u64) -> Result<SumPartsParams> {
        const K: KernelId = KernelId::SumParts;
        // The kernel moves 4 floats (16 bytes) at a time.
        multiple(K, "len", self.len, 4)?;
        multiple(K, "part_stride", self.part_stride, 4)?;
        require(self.parts >= 1, K, "parts", self.parts as u128, || {
            "must be at least 1".into()
        })?;
        if self.parts > 1 {
            at_least(K, "part_stride", self.part_stride, "len", self.len)?;
        }
        if self.len > 0 {
            let end = (self.parts as u128 - 1) * self.part_stride as u128 + self.len as u128;
            fits(K, "parts", end, 4, parts, max_binding)?;
            fits(K, "dst", self.len as u128, 4, dst, max_binding)?;
        }
        Ok(SumPartsParams {
            len: index(K, "len", self.len)?,
            parts: index(K, "parts", self.parts)?,
            part_stride: index(K, "part_stride", self.part_stride)?,
            accumulate: u32::from(self.accumulate),
            grid_x: 0,
            _pad: [0; 3],
        })
    }
}

/// The checks the row kernels share: logits `[rows][ld]` f32, ids and
/// probs `[rows][k]`, `ld ≥ vocab` in whole 16-byte reads.
fn row_params<B: DeviceBuffer>(
    kernel: KernelId,
    (rows, vocab, ld, k): (usize, usize, usize, usize),
    max_k: usize,
    logits: &B,
    ids: &B,
    probs: &B,
    max_binding: u64,
) -> Result<RowParams> {
    multiple(kernel, "ld", ld, ALIGN)?;
    at_least(kernel, "ld", ld, "vocab", vocab)?;
    require(k >= 1 && k <= max_k, kernel, "k", k as u128, || {
        format!("not in 1..={max_k}")
    })?;
    fits(kernel, "logits", span(0, rows, ld, ld), 4, logits, max_binding)?;
    fits(kernel, "ids", span(0, rows, k, k), 4, ids, max_binding)?;
    fits(kernel, "probs", span(0, rows, k, k), 4, probs, max_binding)?;
    Ok(RowParams {
        rows: index(kernel, "rows", rows)?,
        vocab: index(kernel, "vocab", vocab)?,
        ld: index(kernel, "ld", ld)?,
        k: index(kernel, "k", k)?,
        ..RowParams::default()
    })
}

impl KlDesc {
    /// Checks the KL rows against `[logits, ids, probs, row_in, loss, grad]`
    /// and returns their block.
    pub fn check<B: DeviceBuffer>(
        &self,
        [logits, ids, probs, row_in, loss, grad]: [&B; 6],
        max_binding: u64,
    ) -> Result<RowParams> {
        const K: KernelId = KernelId::KlRows;
        let shape = (self.rows, self.vocab, self.ld, self.k);
        let params = row_params(K, shape, self.vocab.min(MAX_K), logits, ids, probs, max_binding)?;
        fits(K, "row_in", self.rows as u128 * 2, 4, row_in, max_binding)?;
        fits(K, "loss", self.rows as u128 * 4, 4, loss, max_binding)?;
        fits(K, "grad", span(0, self.rows, self.ld, self.ld), 2, grad, max_binding)?;
        let mut filter = (0.0, 0, 0);
        if let Some(f) = self.filter {
            crate::problem::filter::check_eps(f.eps)?;
            at_least(K, "mask_at", f.mask_at, "rows · ld", self.rows * self.ld)?;
            multiple(K, "mask_at", f.mask_at, 4)?;
            let end = f.mask_at as u128 + crate::problem::filter::mask_halves(self.rows, self.ld) as u128;
            fits(K, "grad's block mask", end, 2, grad, max_binding)?;
            filter = (
                f.eps,
                index(K, "mask_at", f.mask_at / 4)?,
                index(K, "ld", crate::problem::filter::mask_words(self.ld))?,
            );
        }
        let tau = self.temperature;
        if !(tau > 0.0 && tau.is_finite()) {
            return Err(Error::InvalidTemperature { value: tau });
        }
        self.terms.check()?;
        let t = &self.terms;
        let mut flags = self.tail.code() << row_flags::TAIL_SHIFT;
        if self.dense_teacher {
            // probs holds the teacher's logits, laid out as the student's;
            // the dense rows compute the soft term alone.
            require(self.k == 1, K, "k", self.k as u128, || {
                "must be 1 with a dense teacher".into()
            })?;
            fits(K, "probs", span(0, self.rows, self.ld, self.ld), 4, probs, max_binding)?;
            for (on, what) in [
                (t.softcap.is_some(), "softcap"),
                (t.hard_on(), "hard_weight"),
                (t.z_loss > 0.0, "z_loss"),
                (self.filter.is_some(), "filter"),
            ] {
                require(!on, K, what, 1, || "not taken with a dense teacher".into())?;
            }
            flags = row_flags::DENSE_TEACHER;
        }
        if t.softcap.is_some() {
            flags |= row_flags::SOFTCAP;
        }
        if t.hard_on() {
            flags |= row_flags::HARD;
        }
        if t.z_loss > 0.0 {
            flags |= row_flags::Z_LOSS;
        }
        if tau != 1.0 {
            flags |= row_flags::TAU;
            // Small integer τ: the second softmax by multiplication.
            if let Some(n) = [2u32, 3, 4].into_iter().find(|&n| tau == n as f32) {
                flags |= n << row_flags::TAU_POW_SHIFT;
            }
        }
        let divergence = t.divergence.effective();
        flags |= divergence.code() << row_flags::DIVERGENCE_SHIFT;
        if flags != 0 || t.soft_weight != 1.0 {
            flags |= row_flags::GENERAL;
        }
        // Set after GENERAL: the filter changes what is written, not which
        // loops compute it.
        if self.filter.is_some() {
            flags |= row_flags::FILTER;
        }
        let mut stats = (0, 0, 0);
        if let Some(rs) = self.row_stats.filter(|_| !self.dense_teacher) {
            if KlDesc::stats_suffice(t, tau) {
                rs.check(K, self.rows, span(0, self.rows, self.ld, self.ld), logits, max_binding)?;
                stats = (
                    index(K, "row_stats.offset", rs.offset)?,
                    index(K, "row_stats.ld", rs.ld)?,
                    index(K, "row_stats.groups", rs.groups)?,
                );
            }
        }
        Ok(RowParams {
            filter_eps: filter.0,
            mask_off4: filter.1,
            mask_ld: filter.2,
            flags,
            temperature: tau,
            stats_offset: stats.0,
            stats_ld: stats.1,
            stats_groups: stats.2,
            cap: t.softcap.map_or(0.0, |c| c / tau),
            soft_weight: t.soft_weight,
            hard_weight: t.hard_weight,
            smoothing: t.label_smoothing,
            z_loss: t.z_loss,
            beta: divergence.beta(),
            ..params
        })
    }
}

impl TopkDesc {
    /// Checks the top-k rows against `[logits, ids, probs]` and returns
    /// their block.
    pub fn check<B: DeviceBuffer>(&self, [logits, ids, probs]: [&B; 3], max_binding: u64) -> Result<RowParams> {
        let shape = (self.rows, self.vocab, self.ld, self.k);
        // A gather's k columns are the ids and the lse.
        let max_k = self.vocab.min(MAX_K) + usize::from(self.gather);
        let params = row_params(KernelId::TopkRows, shape, max_k, logits, ids, probs, max_binding)?;
        let mut flags = 0;
        if let Some(c) = self.cap {
            crate::problem::terms::check_softcap(c)?;
            flags |= row_flags::SOFTCAP;
        }
        if self.logprobs {
            flags |= row_flags::LOGPROBS;
        }
        if self.gather {
            flags |= row_flags::GATHER;
        }
        Ok(RowParams {
            flags,
            cap: self.cap.unwrap_or(0.0),
            ..params
        })
    }
}

// The device-resident kernels. Their buffers are the caller's views and
// the engine's scratch; every one is checked, like the driver's, though
// the resident kernels are also built with runtime bounds checks (what
// they index comes from the caller's data).

/// The status buffer holds its [`WORDS`] words.
fn status_fits<B: DeviceBuffer>(kernel: KernelId, status: &B, max_binding: u64) -> Result<()> {
    fits(kernel, "status", WORDS as u128, 4, status, max_binding)
}

/// `token0 + rows` (a token index the status buffer records) as `u32`.
fn tokens_end(kernel: KernelId, token0: usize, rows: usize) -> Result<u32> {
    index(kernel, "token0 + rows", token0.saturating_add(rows))
}

/// Checks `1 ≤ k ≤ MAX_K` (the teacher kernel keeps a row's ids in
/// workgroup memory).
fn teacher_k(kernel: KernelId, k: usize) -> Result<()> {
    require((1..=MAX_K).contains(&k), kernel, "k", k as u128, || {
        format!("not in 1..={MAX_K}")
    })
}

impl WeightStatsDesc {
    /// Checks the stats kernel against `[weights, status]` and returns its
    /// block.
    pub fn check<B: DeviceBuffer>(&self, [weights, status]: [&B; 2], max_binding: u64) -> Result<WeightStatsParams> {
        const K: KernelId = KernelId::WeightStats;
        if self.has_weights {
            fits(K, "weights", self.rows as u128, 4, weights, max_binding)?;
        }
        status_fits(K, status, max_binding)?;
        let tau = self.temperature;
        if !(tau > 0.0 && tau.is_finite()) {
            return Err(Error::InvalidTemperature { value: tau });
        }
        Ok(WeightStatsParams {
            rows: index(K, "rows", self.rows)?,
            has_weights: u32::from(self.has_weights),
            grid_x: 0,
            // 0: resolved on the device.
            total: self.total.unwrap_or(0.0),
            gscale: self.gscale.unwrap_or(0.0),
            inv_temperature: 1.0 / tau,
            grad_bound: self.grad_bound as f32,
            _pad: 0,
        })
    }
}

impl TeacherRowsDesc {
    /// Checks the teacher kernel against `[ids, probs, weights, status,
    /// ids_out, probs_out, row_in]` and returns its block.
    pub fn check<B: DeviceBuffer>(
        &self,
        [ids, probs, weights, status, ids_out, probs_out, row_in]: [&B; 7],
        max_binding: u64,
    ) -> Result<TeacherRowsParams> {
        const K: KernelId = KernelId::TeacherRows;
        let (rows, k) = (self.rows, self.k);
        teacher_k(K, k)?;
        require(self.vocab >= 1, K, "vocab", 0, || "must be at least 1".into())?;
        fits(K, "ids", span(self.ids_offset, rows, k, k), 4, ids, max_binding)?;
        fits(K, "probs", span(self.probs_offset, rows, k, k), 4, probs, max_binding)?;
        if self.has_weights {
            let end = self.weights_offset as u128 + rows as u128;
            fits(K, "weights", end, 4, weights, max_binding)?;
        }
        status_fits(K, status, max_binding)?;
        fits(K, "ids_out", span(0, rows, k, k), 4, ids_out, max_binding)?;
        fits(K, "probs_out", span(0, rows, k, k), 4, probs_out, max_binding)?;
        fits(K, "row_in", rows as u128 * 2, 4, row_in, max_binding)?;
        // The status buffer records the first bad id as `token·k + entry`.
        let flat = (self.token0 as u128 + rows as u128) * k as u128;
        require(flat < 1 << 32, K, "token0", self.token0 as u128, || {
            format!("(token0 + rows) · k = {flat} exceeds the status buffer's 32-bit index")
        })?;
        Ok(TeacherRowsParams {
            rows: index(K, "rows", rows)?,
            k: index(K, "k", k)?,
            vocab: index(K, "vocab", self.vocab)?,
            token0: index(K, "token0", self.token0)?,
            ids_offset: index(K, "ids_offset", self.ids_offset)?,
            probs_offset: index(K, "probs_offset", self.probs_offset)?,
            weights_offset: index(K, "weights_offset", self.weights_offset)?,
            has_weights: u32::from(self.has_weights),
            logprobs: u32::from(self.form == TeacherForm::Logprobs),
            tail: self.tail.code(),
            grid_x: 0,
            _pad: 0,
        })
    }
}

impl LabelsInDesc {
    /// Checks the labels kernel against `[labels, status, row_in]` and
    /// returns its block.
    pub fn check<B: DeviceBuffer>(
        &self,
        [labels, status, row_in]: [&B; 3],
        max_binding: u64,
    ) -> Result<LabelsInParams> {
        const K: KernelId = KernelId::LabelsIn;
        if self.has_labels {
            let end = self.labels_offset as u128 + self.rows as u128;
            fits(K, "labels", end, 4, labels, max_binding)?;
        }
        status_fits(K, status, max_binding)?;
        fits(K, "row_in", self.rows as u128 * 2, 4, row_in, max_binding)?;
        tokens_end(K, self.token0, self.rows)?;
        Ok(LabelsInParams {
            rows: index(K, "rows", self.rows)?,
            vocab: index(K, "vocab", self.vocab)?,
            token0: index(K, "token0", self.token0)?,
            labels_offset: index(K, "labels_offset", self.labels_offset)?,
            has_labels: u32::from(self.has_labels),
            grid_x: 0,
            _pad: [0; 2],
        })
    }
}

impl HiddenInDesc {
    /// Checks the hidden-rows kernel against `[src, dst]` and returns its
    /// block.
    pub fn check<B: DeviceBuffer>(&self, [src, dst]: [&B; 2], max_binding: u64) -> Result<HiddenInParams> {
        const K: KernelId = KernelId::HiddenIn;
        at_least(K, "rows_padded", self.rows_padded, "rows", self.rows)?;
        at_least(K, "ld", self.ld, "cols", self.cols)?;
        let src_span = span(self.src_offset, self.rows, self.cols, self.cols);
        fits(K, "src", src_span, self.dtype.bytes() as u128, src, max_binding)?;
        let dst_span = span(0, self.rows_padded, self.ld, self.ld);
        fits(K, "dst", dst_span, 2, dst, max_binding)?;
        Ok(HiddenInParams {
            rows: index(K, "rows", self.rows)?,
            cols: index(K, "cols", self.cols)?,
            rows_padded: index(K, "rows_padded", self.rows_padded)?,
            ld: index(K, "ld", self.ld)?,
            src_offset: index(K, "src_offset", self.src_offset)?,
            dtype: self.dtype.code(),
            grid_x: 0,
            _pad: 0,
        })
    }
}

impl LossOutDesc {
    /// Checks the loss-out kernel against `[loss_chunk, dx_chunk, status,
    /// loss, dx, terms]` and returns its block.
    pub fn check<B: DeviceBuffer>(
        &self,
        [loss_chunk, dx_chunk, status, loss, dx, terms]: [&B; 6],
        max_binding: u64,
    ) -> Result<LossOutParams> {
        const K: KernelId = KernelId::LossOut;
        let (rows, hs) = (self.rows, self.hs);
        at_least(K, "ld", self.ld, "hs", hs)?;
        // kl_rows' [rows][4]: loss, lse, soft, hard.
        fits(K, "loss_chunk", rows as u128 * 4, 4, loss_chunk, max_binding)?;
        fits(K, "dx_chunk", span(0, rows, self.ld, hs), 4, dx_chunk, max_binding)?;
        status_fits(K, status, max_binding)?;
        let loss_end = self.loss_offset as u128 + rows as u128;
        fits(K, "loss", loss_end, 4, loss, max_binding)?;
        fits(K, "dx", span(self.dx_offset, rows, hs, hs), 4, dx, max_binding)?;
        if self.write_terms {
            fits(K, "terms", loss_end * 3, 4, terms, max_binding)?;
        }
        tokens_end(K, self.token0, rows)?;
        // One invocation per element of the chunk's dx.
        index(K, "rows · hs", rows.saturating_mul(hs))?;
        Ok(LossOutParams {
            rows: index(K, "rows", rows)?,
            hs: index(K, "hs", hs)?,
            ld: index(K, "ld", self.ld)?,
            token0: index(K, "token0", self.token0)?,
            loss_offset: index(K, "loss_offset", self.loss_offset)?,
            dx_offset: index(K, "dx_offset", self.dx_offset)?,
            accumulate: u32::from(self.accumulate),
            write_terms: u32::from(self.write_terms),
            grid_x: 0,
            _pad: [0; 3],
        })
    }
}

impl HeadGradOutDesc {
    /// Checks the head-gradient copy against `[piece, status, dst]` and
    /// returns its block.
    pub fn check<B: DeviceBuffer>(&self, [piece, status, dst]: [&B; 3], max_binding: u64) -> Result<HeadGradOutParams> {
        const K: KernelId = KernelId::HeadGradOut;
        let (rows, hs) = (self.rows, self.hs);
        at_least(K, "ld", self.ld, "hs", hs)?;
        fits(K, "piece", span(0, rows, self.ld, hs), 4, piece, max_binding)?;
        status_fits(K, status, max_binding)?;
        fits(K, "dst", span(self.dst_offset, rows, hs, hs), 4, dst, max_binding)?;
        // One invocation per element copied.
        index(K, "rows · hs", rows.saturating_mul(hs))?;
        Ok(HeadGradOutParams {
            rows: index(K, "rows", rows)?,
            hs: index(K, "hs", hs)?,
            ld: index(K, "ld", self.ld)?,
            dst_offset: index(K, "dst_offset", self.dst_offset)?,
            grid_x: 0,
            _pad: [0; 3],
        })
    }
}

impl GatherRowsDesc {
    /// The block both gather kernels read, its extents checked.
    fn params(&self, kernel: KernelId) -> Result<GatherRowsParams> {
        require(self.k >= 1 && self.k <= MAX_K, kernel, "k", self.k as u128, || {
            format!("not in 1..={MAX_K}")
        })?;
        tokens_end(kernel, self.token0, self.rows)?;
        Ok(GatherRowsParams {
            rows: index(kernel, "rows", self.rows)?,
            k: index(kernel, "k", self.k)?,
            vocab: index(kernel, "vocab", self.vocab)?,
            token0: index(kernel, "token0", self.token0)?,
            ids_offset: index(kernel, "ids_offset", self.ids_offset)?,
            out_offset: index(kernel, "out_offset", self.out_offset)?,
            grid_x: 0,
            _pad: 0,
        })
    }

    /// Checks the gather-in kernel against `[ids, status, ids_chunk]`.
    pub fn check_in<B: DeviceBuffer>(
        &self,
        [ids, status, ids_chunk]: [&B; 3],
        max_binding: u64,
    ) -> Result<GatherRowsParams> {
        const K: KernelId = KernelId::GatherIn;
        let (rows, k) = (self.rows, self.k);
        fits(K, "ids", span(self.ids_offset, rows, k, k), 4, ids, max_binding)?;
        status_fits(K, status, max_binding)?;
        fits(K, "ids_chunk", span(0, rows, k + 1, k + 1), 4, ids_chunk, max_binding)?;
        self.params(K)
    }

    /// Checks the gather-out kernel against `[values_chunk, status,
    /// logprobs, lse]`.
    pub fn check_out<B: DeviceBuffer>(
        &self,
        [values_chunk, status, logprobs, lse]: [&B; 4],
        max_binding: u64,
    ) -> Result<GatherRowsParams> {
        const K: KernelId = KernelId::GatherOut;
        let (rows, k) = (self.rows, self.k);
        fits(
            K,
            "values_chunk",
            span(0, rows, k + 1, k + 1),
            4,
            values_chunk,
            max_binding,
        )?;
        status_fits(K, status, max_binding)?;
        fits(
            K,
            "logprobs",
            span(self.out_offset, rows, k, k),
            4,
            logprobs,
            max_binding,
        )?;
        fits(K, "lse", span(self.token0, rows, 1, 1), 4, lse, max_binding)?;
        self.params(K)
    }
}

impl TopkOutDesc {
    /// Checks the top-k-out kernel against `[ids_chunk, probs_chunk,
    /// status, ids, probs]` and returns its block.
    pub fn check<B: DeviceBuffer>(
        &self,
        [ids_chunk, probs_chunk, status, ids, probs]: [&B; 5],
        max_binding: u64,
    ) -> Result<TopkOutParams> {
        const K: KernelId = KernelId::TopkOut;
        let (rows, k) = (self.rows, self.k);
        require(k >= 1, K, "k", 0, || "must be at least 1".into())?;
        fits(K, "ids_chunk", span(0, rows, k, k), 4, ids_chunk, max_binding)?;
        fits(K, "probs_chunk", span(0, rows, k, k), 4, probs_chunk, max_binding)?;
        status_fits(K, status, max_binding)?;
        fits(K, "ids", span(self.ids_offset, rows, k, k), 4, ids, max_binding)?;
        fits(K, "probs", span(self.probs_offset, rows, k, k), 4, probs, max_binding)?;
        tokens_end(K, self.token0, rows)?;
        Ok(TopkOutParams {
            rows: index(K, "rows", rows)?,
            k: index(K, "k", k)?,
            token0: index(K, "token0", self.token0)?,
            ids_offset: index(K, "ids_offset", self.ids_offset)?,
            probs_offset: index(K, "probs_offset", self.probs_offset)?,
            grid_x: 0,
            _pad: [0; 2],
        })
    }
}

impl ShardRowsDesc {
    /// Checks a shard step against `[loss_chunk, stats, partials, ids,
    /// probs, row_in, status]` (only the buffers its stage uses) and
    /// returns its block.
    pub fn check<B: DeviceBuffer>(
        &self,
        [loss_chunk, stats, partials, ids, probs, row_in, status]: [&B; 7],
        max_binding: u64,
    ) -> Result<ShardRowsParams> {
        const K: KernelId = KernelId::ShardRows;
        let (rows, k) = (self.rows, self.k);
        require(k >= 1, K, "k", 0, || "must be at least 1".into())?;
        require(self.v0 < self.v1, K, "v1", self.v1 as u128, || {
            format!("must be above v0 = {}", self.v0)
        })?;
        require(k <= self.v1 - self.v0, K, "k", k as u128, || {
            format!("above the shard's {} rows", self.v1 - self.v0)
        })?;
        let entries = rows as u128 * k as u128;
        // [ntok][3] rows of the partials and statistics, to the chunk's end.
        let per_token = (self.token0 as u128 + rows as u128) * 3;
        use ShardStage as S;
        let stage = self.stage;
        if matches!(stage, S::Map | S::MapFinish) {
            fits(K, "ids", entries, 4, ids, max_binding)?;
        }
        if matches!(stage, S::Map | S::MapFinish | S::Partials) {
            fits(K, "probs", entries, 4, probs, max_binding)?;
        }
        if stage == S::MapFinish {
            fits(K, "row_in", rows as u128 * 2, 4, row_in, max_binding)?;
        }
        if matches!(stage, S::Partials | S::Lse1 | S::Loss) {
            fits(K, "loss_chunk", rows as u128 * 4, 4, loss_chunk, max_binding)?;
        }
        if matches!(stage, S::MapFinish | S::Loss) {
            fits(K, "stats", per_token, 4, stats, max_binding)?;
        }
        if matches!(stage, S::Partials | S::Lse1 | S::MapFinish) {
            fits(K, "partials", per_token, 4, partials, max_binding)?;
        }
        if stage == S::Partials {
            status_fits(K, status, max_binding)?;
        }
        index(K, "(token0 + rows) · 3", per_token as usize)?;
        index(K, "rows · k", rows.saturating_mul(k))?;
        Ok(ShardRowsParams {
            rows: index(K, "rows", rows)?,
            k: index(K, "k", k)?,
            v0: index(K, "v0", self.v0)?,
            v1: index(K, "v1", self.v1)?,
            token0: tokens_end(K, self.token0, rows).and_then(|_| index(K, "token0", self.token0))?,
            stage: stage.code(),
            lse1_too: u32::from(self.lse1_too),
            grid_x: 0,
        })
    }
}

impl StatusDetailDesc {
    /// Checks the status kernel against `[ids, probs, weights, status,
    /// labels]` and returns its block.
    pub fn check<B: DeviceBuffer>(
        &self,
        [ids, probs, weights, status, labels]: [&B; 5],
        max_binding: u64,
    ) -> Result<StatusDetailParams> {
        const K: KernelId = KernelId::StatusDetail;
        let (rows, k) = (self.rows, self.k);
        teacher_k(K, k)?;
        fits(K, "ids", span(0, rows, k, k), 4, ids, max_binding)?;
        fits(K, "probs", span(0, rows, k, k), 4, probs, max_binding)?;
        if self.has_weights {
            fits(K, "weights", rows as u128, 4, weights, max_binding)?;
        }
        status_fits(K, status, max_binding)?;
        if self.has_labels {
            fits(K, "labels", rows as u128, 4, labels, max_binding)?;
        }
        Ok(StatusDetailParams {
            rows: index(K, "rows", rows)?,
            k: index(K, "k", k)?,
            has_weights: u32::from(self.has_weights),
            logprobs: u32::from(self.form == TeacherForm::Logprobs),
            tail: self.tail.code(),
            has_labels: u32::from(self.has_labels),
            grid_x: 0,
            _pad: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::toolkit::backend::Len;

    fn field_of(e: Error) -> (&'static str, &'static str, u128) {
        match e {
            Error::BadDescriptor {
                kernel, field, value, ..
            } => (kernel, field, value),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn gemm_checks_name_the_field() {
        let d = GemmDesc::dense(32, 48, 64, HeadLayout::Dx);
        let (a, b, c) = (Len(32 * 64 * 2), Len(64 * 48 * 2), Len(32 * 48 * 4));
        let p = d.check([&a, &b, &c], u64::MAX).unwrap();
        assert_eq!((p.m, p.n, p.k, p.ldb), (32, 48, 64, 48));
        let short = Len(32 * 48 * 4 - 4);
        assert_eq!(
            field_of(d.check([&a, &b, &short], u64::MAX).unwrap_err()),
            ("gemm_dx", "C", 32 * 48 * 4)
        );
        // The binding limit counts like the length.
        assert_eq!(field_of(d.check([&a, &b, &c], 1024).unwrap_err()).1, "A");
        let odd = GemmDesc { m: 17, ..d };
        assert_eq!(
            field_of(odd.check([&a, &b, &c], u64::MAX).unwrap_err()),
            ("gemm_dx", "m", 17)
        );
        let narrow = GemmDesc { ldb: 32, ..d };
        assert_eq!(field_of(narrow.check([&a, &b, &c], u64::MAX).unwrap_err()).1, "ldb");
        let logits = GemmDesc::dense(16, 16, 16, HeadLayout::Logits);
        let small = Len(512);
        assert_eq!(logits.check([&small, &small, &Len(1024)], u64::MAX).unwrap().grid_x, 0);
    }

    #[test]
    fn split_k_checks_name_the_field() {
        // C blocks of 32 × 48 = 1536 elements.
        let d = GemmDesc {
            k_parts: 3,
            c_part_stride: 1536,
            ..GemmDesc::dense(32, 48, 272, HeadLayout::Dx)
        };
        let (a, b) = (Len(32 * 272 * 2), Len(272 * 48 * 2));
        let c = Len(3 * 1536 * 4);
        let p = d.check([&a, &b, &c], u64::MAX).unwrap();
        assert_eq!((p.k_parts, p.k_part, p.c_part_stride), (3, 128, 1536));
        let one = GemmDesc::dense(32, 48, 272, HeadLayout::Dx)
            .check([&a, &b, &c], u64::MAX)
            .unwrap();
        assert_eq!((one.k_parts, one.k_part), (1, 320));
        let none = GemmDesc { k_parts: 0, ..d };
        assert_eq!(
            field_of(none.check([&a, &b, &c], u64::MAX).unwrap_err()),
            ("gemm_dx", "k_parts", 0)
        );
        let overlap = GemmDesc {
            c_part_stride: 1535,
            ..d
        };
        assert_eq!(
            field_of(overlap.check([&a, &b, &c], u64::MAX).unwrap_err()),
            ("gemm_dx", "c_part_stride", 1535)
        );
        // The last part's block ends one element past C.
        let short = Len(3 * 1536 * 4 - 4);
        assert_eq!(
            field_of(d.check([&a, &b, &short], u64::MAX).unwrap_err()),
            ("gemm_dx", "C", 3 * 1536 * 4)
        );
        // A stride past 32 bits is an error, not a truncation, even where
        // the buffer would hold it.
        let far = GemmDesc {
            k_parts: 2,
            c_part_stride: 1 << 32,
            ..d
        };
        let big = Len(u64::MAX);
        assert_eq!(field_of(far.check([&a, &b, &big], u64::MAX).unwrap_err()).1, "C");
        let huge_parts = GemmDesc {
            k_parts: 1 << 33,
            c_part_stride: 0,
            m: 0,
            ..d
        };
        assert_eq!(
            field_of(huge_parts.check([&a, &b, &big], u64::MAX).unwrap_err()),
            ("gemm_dx", "k_parts", 1 << 33)
        );
    }

    #[test]
    fn sum_parts_checks_name_the_field() {
        let d = SumPartsDesc {
            len: 64,
            parts: 3,
            part_stride: 80,
            accumulate: false,
        };
        let (parts, dst) = (Len((2 * 80 + 64) * 4), Len(64 * 4));
        let p = d.check([&parts, &dst], u64::MAX).unwrap();
        assert_eq!((p.len, p.parts, p.part_stride, p.accumulate), (64, 3, 80, 0));
        for (bad, field, value) in [
            (SumPartsDesc { parts: 0, ..d }, "parts", 0),
            (SumPartsDesc { len: 62, ..d }, "len", 62),
            (SumPartsDesc { part_stride: 82, ..d }, "part_stride", 82),
            (SumPartsDesc { part_stride: 60, ..d }, "part_stride", 60),
        ] {
            assert_eq!(
                field_of(bad.check([&parts, &dst], u64::MAX).unwrap_err()),
                ("sum_parts", field, value)
            );
        }
        assert_eq!(
            field_of(d.check([&Len(4), &dst], u64::MAX).unwrap_err()),
            ("sum_parts", "parts", (2 * 80 + 64) * 4)
        );
        assert_eq!(field_of(d.check([&parts, &Len(4)], u64::MAX).unwrap_err()).1, "dst");
        // One part may have any stride.
        let one = SumPartsDesc {
            parts: 1,
            part_stride: 0,
            ..d
        };
        assert!(one.check([&dst, &dst], u64::MAX).is_ok());
    }

    #[test]
    fn extents_past_32_bits_are_errors_not_truncations() {
        let huge = 1usize << 33;
        let d = GemmDesc {
            c_offset: huge,
            ..GemmDesc::dense(16, 16, 16, HeadLayout::Logits)
        };
        let big = Len(u64::MAX);
        assert_eq!(field_of(d.check([&big, &big, &big], u64::MAX).unwrap_err()).1, "C");
        let k = TopkDesc::plain(1, huge, huge, 1);
        assert_eq!(field_of(k.check([&big, &big, &big], u64::MAX).unwrap_err()).1, "logits");
        let h = HiddenInDesc::f32(1, 1, 1 << 13, 1 << 20);
        assert_eq!(field_of(h.check([&big, &big], u64::MAX).unwrap_err()).1, "dst");
    }

    #[test]
    fn row_and_hidden_in_checks() {
        let kl = KlDesc::plain(4, 10, 16, 3);
        let (logits, ids, coef, grad) = (Len(4 * 16 * 4), Len(4 * 3 * 4), Len(4 * 4 * 4), Len(4 * 16 * 2));
        let p = kl.check([&logits, &ids, &ids, &coef, &coef, &grad], u64::MAX).unwrap();
        assert_eq!((p.rows, p.vocab, p.ld, p.k, p.flags), (4, 10, 16, 3, 0));
        // Every term on sets its bit; the cap is given on the scaled logits.
        let all = KlDesc {
            temperature: 2.0,
            tail: crate::problem::terms::TailMode::Unnormalized,
            terms: crate::problem::terms::LossTerms {
                hard_weight: 0.5,
                z_loss: 1e-4,
                softcap: Some(30.0),
                ..crate::problem::terms::LossTerms::default()
            },
            ..kl
        };
        let p = all.check([&logits, &ids, &ids, &coef, &coef, &grad], u64::MAX).unwrap();
        let expected = row_flags::SOFTCAP
            | (2 << row_flags::TAIL_SHIFT)
            | row_flags::HARD
            | row_flags::Z_LOSS
            | row_flags::TAU
            | (2 << row_flags::TAU_POW_SHIFT)
            | row_flags::GENERAL;
        assert_eq!((p.flags, p.cap, p.hard_weight), (expected, 15.0, 0.5));
        // τ not a small integer: no power; α_soft alone is not plain.
        let p = KlDesc {
            temperature: 1.5,
            ..all
        }
        .check([&logits, &ids, &ids, &coef, &coef, &grad], u64::MAX)
        .unwrap();
        assert_eq!(p.flags & (row_flags::TAU_POW_MASK << row_flags::TAU_POW_SHIFT), 0);
        let weighted = KlDesc {
            terms: crate::problem::terms::LossTerms {
                soft_weight: 0.5,
                ..crate::problem::terms::LossTerms::default()
            },
            ..kl
        };
        let p = weighted
            .check([&logits, &ids, &ids, &coef, &coef, &grad], u64::MAX)
            .unwrap();
        assert_eq!(p.flags, row_flags::GENERAL);
        let bad_cap = KlDesc {
            terms: crate::problem::terms::LossTerms {
                softcap: Some(-1.0),
                ..crate::problem::terms::LossTerms::default()
            },
            ..kl
        };
        assert!(matches!(
            bad_cap.check([&logits, &ids, &ids, &coef, &coef, &grad], u64::MAX),
            Err(Error::InvalidLossOption { field: "softcap", .. })
        ));
        let bad_k = KlDesc { k: 11, ..kl };
        assert_eq!(
            field_of(
                bad_k
                    .check([&logits, &ids, &ids, &coef, &coef, &grad], u64::MAX)
                    .unwrap_err()
            ),
            ("kl_rows", "k", 11)
        );
        let short = Len(4 * 4 * 4 - 4);
        assert_eq!(
            field_of(
                kl.check([&logits, &ids, &ids, &coef, &short, &grad], u64::MAX)
                    .unwrap_err()
            )
            .1,
            "loss"
        );
        let h = HiddenInDesc::f32(2, 5, 16, 1);
        assert_eq!(
            field_of(h.check([&Len(40), &Len(64)], u64::MAX).unwrap_err()),
            ("hidden_in", "rows_padded", 1)
        );
    }

    #[test]
    fn transfers_stay_inside() {
        assert!(check_transfer("upload", 8, 8, 16).is_ok());
        assert!(matches!(
            check_transfer("download", 9, 8, 16),
            Err(Error::TransferOutOfRange { offset: 9, .. })
        ));
        assert!(check_transfer("upload", u64::MAX, 2, 16).is_err());
    }
}
