//! The conformance suite itself is tested: a backend with one planted bug
//! must fail it, in the part that should catch that bug, and a faithful
//! wrapper must pass. Errors and panics inside a case fail that case only.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::cell::Cell;

use headkl_conformance::resident::{resident_case_count, run_resident};
use headkl_conformance::shard::Serial;
use headkl_conformance::shard_resident::{resident_shard_case_count, run_resident_shard_cases};
use headkl_conformance::{case_count, part_case_count, run_part, run_suite, Part, SuiteConfig};
use headkl_core::resident::status::{self, FLAGGED_ROW, S_LOGITS};
use headkl_core::toolkit::{
    GemmDesc, HiddenInDesc, KernelId, Kernels, KlDesc, Launch, RowCopyDesc, ShardStage, SumPartsDesc, TopkDesc,
    TransposeDesc,
};
use headkl_core::{Backend, DeviceBuffer, Divergence, Error, ResidentBackend, Result, TailMode};
use headkl_reference::{CpuBackend, CpuBuffer};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    None,
    NoAccumulate,
    IgnoreAlpha,
    GemmWritesPastRegion,
    KlPadLeftNaN,
    KlLossOffset,
    TopkSwapFirstTwo,
    TopkProbsOff,
    TopkNoNaNFlag,
    /// `hidden_in` writes only the real rows × columns: the padding keeps
    /// whatever the operand held.
    HiddenInPadNotZeroed,
    Diagnostics,
    TopkErrors,
    GemmDxPanics,
    /// A split-K GEMM runs its first part only, over the whole reduction.
    SplitFirstPartOnly,
    /// The sum of parts leaves the last part out.
    SumSkipsLastPart,
    /// The head gradient's transpose drops each chunk's last token.
    TransposeDropsLastRow,
    /// The KL kernel ignores the softcap.
    KlIgnoresSoftcap,
    /// The KL kernel reads every tail mode as renormalize.
    KlIgnoresTail,
    /// The KL kernel drops the hard-label term.
    KlIgnoresHard,
    /// The KL kernel drops the label smoothing.
    KlIgnoresSmoothing,
    /// The KL kernel drops the z-loss.
    KlIgnoresZLoss,
    /// The KL kernel takes the soft weight as 1.
    KlIgnoresSoftWeight,
    /// The KL kernel computes the forward KL whatever the divergence.
    KlIgnoresDivergence,
    /// The KL kernel takes the JSD's β as 0.5.
    KlIgnoresBeta,
    /// The gather writes each row's lse 1e-2 too high.
    GatherLseOff,
    /// The KL kernel reads a dense teacher's logits one column off (each
    /// row rotated by one within the vocabulary).
    KlDenseTeacherShifted,
    /// The KL kernel's lse output is off by 1e-3.
    KlLseOffset,
    /// The top-k kernel ignores the softcap.
    TopkIgnoresSoftcap,
    /// The top-k kernel writes probabilities over the k when asked for
    /// log-probabilities.
    TopkIgnoresLogprobs,
    /// The logits GEMM's row statistics: each row's first group's sum
    /// 1.5 times too large.
    RowStatsSumOff,
    /// The KL kernel's block mask clears blocks it must keep (it judges
    /// them at ε = 1): the dx GEMM skips most of the gradient.
    FilterMaskTooCoarse,
    /// The filtered dx GEMM computes every block (reads no mask).
    GemmIgnoresMask,
    /// The KL kernel reads a flagged row's coefficient word
    /// (`FLAGGED_ROW`) as 0: the row's loss comes out finite.
    KlIgnoresFlaggedRow,
    /// The loss-out kernel reports a flagged row as non-finite logits
    /// (it tests the loss word, not the lse).
    LossOutFlagsFlaggedRows,
    /// The resident gather's ids kernel reads an id past V as none without
    /// flagging it.
    GatherInIgnoresRange,
    /// A deferred head gradient's parking copies drop each chunk's last
    /// token.
    ParkDropsLastRow,
    /// A GEMM scaled by a device word reads the status buffer's first
    /// word instead.
    DeviceAlphaWrongWord,
    /// A GEMM scaled by a device word overwrites C where it should add
    /// into it (beta 0 for 1): the deferred dx GEMM's later vocabulary
    /// slices drop the earlier ones'.
    ScaledGemmOverwrites,
    /// `shard_rows`' partials step writes the row's lse 1/64 high (the
    /// merged log-sum-exp, and so every shard's loss and gradient, drift).
    ShardRowsLseOff,
}

struct Faulty {
    inner: CpuBackend,
    fault: Fault,
    calls: Cell<usize>,
}

impl Faulty {
    fn new(fault: Fault) -> Self {
        Self {
            inner: CpuBackend::new(),
            fault,
            calls: Cell::new(0),
        }
    }

    fn read<T: bytemuck::Pod + Default>(&self, b: &CpuBuffer, n: usize) -> Vec<T> {
        let mut v = vec![T::default(); n];
        self.inner.download(b, 0, bytemuck::cast_slice_mut(&mut v)).unwrap();
        v
    }

    fn write<T: bytemuck::Pod>(&self, b: &CpuBuffer, v: &[T]) {
        self.inner.upload(b, 0, bytemuck::cast_slice(v)).unwrap();
    }
}

impl Backend for Faulty {
    type Buffer = CpuBuffer;

    headkl_conformance::forward_backend!(info, alloc, upload, download);
    fn dispatch(&self, launch: Launch<'_, CpuBuffer>) -> Result<()> {
        match launch {
            Launch::HiddenIn { dst, desc, .. } if self.fault == Fault::HiddenInPadNotZeroed => {
                self.hidden_in_pad_kept(launch, dst, &desc)
            }
            Launch::Gemm { a, b, c, desc } => self.gemm(a, b, c, &desc),
            Launch::SumParts { parts, dst, desc } => self.sum_parts(parts, dst, &desc),
            Launch::Transpose { src, dst, desc } => self.transpose(src, dst, &desc),
            Launch::KlRows { desc, .. } => self.kl_rows(launch.bound()?, &desc),
            Launch::TopkRows { desc, .. } => self.topk_rows(launch.bound()?, &desc),
            Launch::LossOut {
                loss_chunk,
                status,
                desc,
                ..
            } if self.fault == Fault::LossOutFlagsFlaggedRows => {
                self.inner.dispatch(launch)?;
                let chunk: Vec<f32> = self.read(loss_chunk, desc.rows * 4);
                let mut words: Vec<u32> = self.read(status, status::WORDS);
                if let Some(r) = (0..desc.rows).find(|r| chunk[r * 4].to_bits() == FLAGGED_ROW) {
                    words[S_LOGITS] = words[S_LOGITS].min((desc.token0 + r) as u32);
                }
                self.write(status, &words);
                Ok(())
            }
            Launch::GatherIn { status, .. } if self.fault == Fault::GatherInIgnoresRange => {
                let words: Vec<u32> = self.read(status, status::WORDS);
                self.inner.dispatch(launch)?;
                self.write(status, &words);
                Ok(())
            }
            Launch::ShardRows { partials, desc, .. }
                if self.fault == Fault::ShardRowsLseOff && desc.stage == ShardStage::Partials =>
            {
                self.inner.dispatch(launch)?;
                let n = (desc.token0 + desc.rows) * 3;
                let mut words: Vec<f32> = self.read(partials, n);
                for r in desc.token0..desc.token0 + desc.rows {
                    words[r * 3] += 1.0 / 64.0;
                }
                self.write(partials, &words);
                Ok(())
            }
            // The device-resident kernels run as the reference does.
            other => self.inner.dispatch(other),
        }
    }
    headkl_conformance::forward_backend!(finish, memory, reset_peak_memory, take_kernel_times);
    /// The transposed head gradient by default (its faults are the
    /// transpose's); A read as columns, as the reference reads it, where
    /// the fault is in the deferred head gradient, which needs that.
    fn gemm_a_columns(&self) -> bool {
        matches!(
            self.fault,
            Fault::ParkDropsLastRow | Fault::DeviceAlphaWrongWord | Fault::ScaledGemmOverwrites
        )
    }
    fn take_diagnostics(&self) -> Vec<String> {
        self.calls.set(self.calls.get() + 1);
        if self.fault == Fault::Diagnostics && self.calls.get().is_multiple_of(5) {
            vec!["VUID-planted: fake validation error".into()]
        } else {
            Vec::new()
        }
    }
}

impl ResidentBackend for Faulty {
    fn buffer_len(&self, buffer: &CpuBuffer) -> u64 {
        self.inner.buffer_len(buffer)
    }
    fn buffer_offset(&self, buffer: &CpuBuffer) -> u64 {
        self.inner.buffer_offset(buffer)
    }
    fn submit(&self) -> Result<()> {
        self.inner.submit()
    }
    fn window(&self, buffer: &CpuBuffer, offset: u64, len: u64) -> Option<CpuBuffer> {
        self.inner.window(buffer, offset, len)
    }
    fn defers_head_grad(&self) -> bool {
        self.inner.defers_head_grad()
    }
    fn copy_rows(&self, src: &CpuBuffer, dst: &CpuBuffer, desc: &RowCopyDesc) -> Result<()> {
        match self.fault == Fault::ParkDropsLastRow && desc.rows > 1 {
            true => self.inner.copy_rows(
                src,
                dst,
                &RowCopyDesc {
                    rows: desc.rows - 1,
                    ..*desc
                },
            ),
            false => self.inner.copy_rows(src, dst, desc),
        }
    }
    fn gemm_scaled_by_word(
        &self,
        (a, b, c): (&CpuBuffer, &CpuBuffer, &CpuBuffer),
        desc: &GemmDesc,
        scale: (&CpuBuffer, usize),
    ) -> Result<()> {
        let word = match self.fault {
            Fault::DeviceAlphaWrongWord => 0,
            _ => scale.1,
        };
        let desc = GemmDesc {
            accumulate: desc.accumulate && self.fault != Fault::ScaledGemmOverwrites,
            ..*desc
        };
        self.inner.gemm_scaled_by_word((a, b, c), &desc, (scale.0, word))
    }
}

fn cfg() -> SuiteConfig {
    SuiteConfig { cases: 4, seed: 99 }
}

/// Failures of `fault` in `part`, and every failure's message.
fn failures(fault: Fault, part: Part) -> Vec<String> {
    let b = Faulty::new(fault);
    let mut seen = 0;
    let report = run_part(&b, part, &cfg(), &mut |_| seen += 1);
    assert_eq!(seen, report.cases);
    assert_eq!(report.cases, part_case_count(part, &cfg()));
    report.failure_lines()
}

#[test]
fn a_faithful_backend_passes_everything() {
    let b = Faulty::new(Fault::None);
    let report = run_suite(&b, &cfg(), &mut |_| {});
    assert_eq!(report.cases, case_count(&cfg()));
    assert!(report.failures.is_empty(), "{:#?}", report.failures);
    assert!(report.worst_loss_err > 0.0 && report.worst_dx_err > 0.0 && report.worst_prob_err > 0.0);
    assert!(report.worst_head_grad_err > 0.0, "no case measured the head's gradient");
}

#[test]
fn each_planted_bug_is_caught() {
    use Part::{DriverCases, Errors, HeadGrad, Kernels, Regressions};
    // Each planted fault, and the parts and messages that must catch it.
    let expect: &[(Fault, &[(Part, &str)])] = &[
        // The head's gradient is the one GEMM the driver accumulates into
        // (across chunks): a case of several chunks catches it.
        (
            Fault::NoAccumulate,
            &[
                (Kernels, "gemm result"),
                (HeadGrad, "head_grad/chunks_ragged_last: head_grad: error"),
            ],
        ),
        (
            Fault::SumSkipsLastPart,
            &[
                // The driver sums slices with sum_parts (no GEMM accumulates),
                // so a multi-slice case catches a sum that drops a part.
                (Errors, "multi_slice_multi_chunk"),
                (Kernels, "sum_parts"),
                (Regressions, "dx_split2"),
            ],
        ),
        (
            Fault::IgnoreAlpha,
            &[
                (Kernels, "gemm result"),
                (Regressions, "dx"),
                (HeadGrad, "head_grad: error"),
            ],
        ),
        // Each chunk's last token dropped from the gradient: the kernel
        // case, and the head-gradient cases of one chunk and of several
        // (the last one ragged), on every input dtype.
        (
            Fault::TransposeDropsLastRow,
            &[
                (Kernels, "kernels/transpose_33x100_ld112_to_100x48:"),
                (HeadGrad, "head_grad/forward_ragged_v257_hs33: head_grad: error"),
                (HeadGrad, "head_grad/chunks_ragged_last: head_grad: error"),
                (HeadGrad, "head_grad/f16_hs64_one_partial_tile: head_grad: error"),
                (HeadGrad, "head_grad/bf16_ragged_chunks: head_grad: error"),
                (
                    HeadGrad,
                    "head_grad/full_vocab_reverse_tau2_slices_chunks: head_grad: error",
                ),
                (HeadGrad, "head_grad/filter_lm: head_grad: error"),
            ],
        ),
        (
            Fault::GemmWritesPastRegion,
            &[(Kernels, "gemm wrote outside its region")],
        ),
        (
            Fault::KlPadLeftNaN,
            &[(Kernels, "in the pad, want 0"), (Regressions, "dx")],
        ),
        (
            Fault::KlLossOffset,
            &[(Kernels, "loss: error"), (DriverCases, "loss: error")],
        ),
        (Fault::TopkSwapFirstTwo, &[(Kernels, "ids["), (Regressions, "topk ids")]),
        (
            Fault::TopkProbsOff,
            &[(Kernels, "topk probs"), (DriverCases, "topk probs")],
        ),
        (
            Fault::TopkNoNaNFlag,
            &[(Kernels, "want NaN"), (Errors, "NonFiniteHidden")],
        ),
        // The pad keeps the scratch's NaN poison: the kernel cases of every
        // type, and the host path's f32 rows (its chunk's logits NaN).
        (
            Fault::HiddenInPadNotZeroed,
            &[
                (Kernels, "kernels/hidden_in_f32_5x13_to_16x32: hidden_in:"),
                (Kernels, "kernels/hidden_in_bf16_16x33_to_16x48_from33: hidden_in:"),
                (Kernels, "in the pad, want 0"),
                (Regressions, "regression/tiny_v1_hs1_head_kl"),
                (Errors, "errors/nan_row_head_kl"),
            ],
        ),
        (Fault::Diagnostics, &[(Regressions, "VUID-planted")]),
        (Fault::TopkErrors, &[(Regressions, "planted topk failure")]),
        (Fault::GemmDxPanics, &[(Errors, "panicked: planted panic in gemm_dx")]),
        (
            Fault::SplitFirstPartOnly,
            &[(Kernels, "gemm_ab_48x80x272_parts3"), (Regressions, "dx_split3")],
        ),
        // One planted fault per loss term: each kernel case of the term,
        // and the driver-level regression case, must catch it.
        (
            Fault::KlIgnoresSoftcap,
            &[(Kernels, "kl_rows_softcap:"), (Regressions, "terms_softcap_tau2")],
        ),
        (
            Fault::KlIgnoresTail,
            &[
                (Kernels, "kl_rows_tail_bucket:"),
                (Kernels, "kl_rows_tail_none:"),
                (Regressions, "terms_bucket_logprobs"),
                (Kernels, "kl_rows_reverse_bucket_tau:"),
            ],
        ),
        (
            Fault::KlIgnoresHard,
            &[(Kernels, "kl_rows_hard:"), (Regressions, "terms_hard_smoothing")],
        ),
        (
            Fault::KlIgnoresSmoothing,
            &[(Kernels, "kl_rows_hard:"), (Regressions, "terms_hard_smoothing")],
        ),
        (
            Fault::KlIgnoresZLoss,
            &[(Kernels, "kl_rows_z_loss:"), (Regressions, "terms_z_loss")],
        ),
        (
            Fault::KlIgnoresSoftWeight,
            &[
                (Kernels, "kl_rows_soft_weight:"),
                (Regressions, "terms_everything"),
                (Regressions, "full_vocab_jsd_logit_scale"),
            ],
        ),
        (
            Fault::KlIgnoresDivergence,
            &[
                (Kernels, "kl_rows_reverse_renormalize:"),
                (Kernels, "kl_rows_jsd_bucket:"),
                (Regressions, "divergence_reverse_tail_none"),
                (Regressions, "divergence_jsd_renormalize_tau2"),
                (Regressions, "full_vocab_reverse_tau2"),
            ],
        ),
        (
            Fault::KlIgnoresBeta,
            &[
                (Kernels, "kl_rows_jsd_none_everything:"),
                (Regressions, "divergence_jsd_bucket_everything"),
                (Regressions, "full_vocab_jsd_logit_scale"),
            ],
        ),
        (
            Fault::GatherLseOff,
            &[(Kernels, "topk_rows_gather:"), (DriverCases, "logprobs_at")],
        ),
        (
            Fault::KlDenseTeacherShifted,
            &[
                (Regressions, "full_vocab_forward_masked"),
                (Regressions, "full_vocab_jsd_f16_unpadded"),
            ],
        ),
        (Fault::KlLseOffset, &[(Kernels, "lse: ")]),
        (
            Fault::TopkIgnoresSoftcap,
            &[
                (Kernels, "topk_rows_softcap:"),
                (Kernels, "topk_rows_logprobs_softcap_wide:"),
            ],
        ),
        (Fault::TopkIgnoresLogprobs, &[(Kernels, "topk_rows_logprobs:")]),
        (
            Fault::RowStatsSumOff,
            &[(Kernels, "gemm row statistics"), (DriverCases, "loss: error")],
        ),
        (
            Fault::GemmIgnoresMask,
            &[(Kernels, "kernels/gemm_ab_16x16x4544_filtered:")],
        ),
        (Fault::FilterMaskTooCoarse, &[(Errors, "filter_lm_dx_within_tolerance")]),
    ];
    for &(fault, caught_in) in expect {
        for &(part, needle) in caught_in {
            let f = failures(fault, part);
            assert!(
                f.iter().any(|m| m.contains(needle)),
                "{fault:?} in {part:?}: no failure mentions {needle:?}; failures: {f:#?}"
            );
        }
    }
}

/// The resident cases' failures under `fault`, every failure's message.
fn resident_failures(fault: Fault) -> Vec<String> {
    let b = Faulty::new(fault);
    let report = run_resident(&b, &cfg(), &mut |_| {});
    assert_eq!(report.cases, resident_case_count(&cfg()));
    report.failure_lines()
}

/// The resident cases hold a flagged row to DESIGN §8: a KL kernel that
/// ignores the flag leaves a finite loss, a loss-out kernel that reads the
/// flag as bad logits leaves a wrong status word; the faithful wrapper
/// passes.
#[test]
fn the_resident_suite_catches_an_ignored_flag() {
    let f = resident_failures(Fault::None);
    assert!(f.is_empty(), "{f:#?}");
    for (fault, needles) in [
        (
            Fault::KlIgnoresFlaggedRow,
            &[
                "resident_errors/nan_prob: flagged row 2: loss 0, want NaN",
                "resident_errors/id_is_vocab: flagged row 14",
                "resident_errors/id_minus_one: flagged row 22",
                "resident_errors/duplicate_id: flagged row 33",
                "resident_errors/negative_prob: flagged row 17",
                "resident_errors/nan_weight: flagged row 8",
                "resident_errors/all_masked: flagged row 0",
            ][..],
        ),
        (
            Fault::LossOutFlagsFlaggedRows,
            &["resident_flagged/loss_out: 2 rows: status S_LOGITS = 0x6"][..],
        ),
        (Fault::GatherInIgnoresRange, &["want IdOutOfRange"][..]),
        // hs 32 is the first case whose gradient is deferred (DeferredLayout,
        // its blocks parked by copies): tokens left unparked read what the
        // last call left there.
        (
            Fault::ParkDropsLastRow,
            &["resident_head_grad/matches: V 304, hs 32: F32: a second call gave another head gradient"][..],
        ),
        (
            Fault::DeviceAlphaWrongWord,
            &["resident_head_grad/matches: V 304, hs 32: F32: against the f64 reference"][..],
        ),
        // hs 64 parks the gradient's rows, and dx waits for a GEMM a slice.
        (
            Fault::ScaledGemmOverwrites,
            &["resident_head_grad/matches: V 304, hs 64: F32: dx with the head's gradient against dx without"][..],
        ),
    ] {
        let f = resident_failures(fault);
        for needle in needles {
            assert!(
                f.iter().any(|m| m.contains(needle)),
                "{fault:?}: no failure mentions {needle:?}; failures: {f:#?}"
            );
        }
    }
}

/// The shards' two-phase loss on device buffers catches a `shard_rows`
/// step that writes a wrong statistic; the faithful wrapper passes.
#[test]
fn the_resident_shard_cases_catch_a_wrong_partial() {
    let run = |fault| {
        let b = Faulty::new(fault);
        let report = run_resident_shard_cases(&b, &Serial, &mut |_| {});
        assert_eq!(report.cases, resident_shard_case_count());
        report.failure_lines()
    };
    let clean = run(Fault::None);
    assert!(clean.is_empty(), "{clean:#?}");
    let f = run(Fault::ShardRowsLseOff);
    assert!(!f.is_empty(), "a drifted shard lse went unnoticed");
    assert!(f.iter().any(|m| m.contains("loss")), "{f:#?}");
}

#[test]
fn a_failure_message_names_the_case_and_the_worst_element() {
    let f = failures(Fault::KlLossOffset, Part::Regressions);
    let m = f
        .iter()
        .find(|m| m.starts_with("regression/v17_hs17_ntok17_k17_head_kl"))
        .unwrap();
    assert!(m.contains("worst: [") && m.contains("exceeds bound 1.000e-4"), "{m}");
}

/// Each kernel of the reference with its planted fault ([`Backend::dispatch`]
/// sends every launch here). Inherent, so they take precedence over
/// [`Kernels`]'s methods of the same names.
impl Faulty {
    /// `hidden_in` as the reference runs it, then the padding outside
    /// `rows × cols` put back as it was.
    fn hidden_in_pad_kept(&self, launch: Launch<'_, CpuBuffer>, dst: &CpuBuffer, d: &HiddenInDesc) -> Result<()> {
        let before: Vec<u16> = self.read(dst, d.rows_padded * d.ld);
        self.inner.dispatch(launch)?;
        let mut after: Vec<u16> = self.read(dst, d.rows_padded * d.ld);
        for (i, v) in after.iter_mut().enumerate() {
            if i / d.ld >= d.rows || i % d.ld >= d.cols {
                *v = before[i];
            }
        }
        self.write(dst, &after);
        Ok(())
    }
    fn gemm(&self, a: &CpuBuffer, b: &CpuBuffer, c: &CpuBuffer, d: &GemmDesc) -> Result<()> {
        let mut d = *d;
        match self.fault {
            Fault::NoAccumulate => d.accumulate = false,
            Fault::IgnoreAlpha => d.alpha = 1.0,
            Fault::GemmDxPanics if d.kernel() == KernelId::GemmDx => panic!("planted panic in gemm_dx"),
            Fault::SplitFirstPartOnly => d.k_parts = 1,
            Fault::GemmIgnoresMask => d.mask_rows = 0,
            _ => {}
        }
        self.inner.gemm(a, b, c, &d)?;
        if let (Fault::RowStatsSumOff, Some(rs)) = (self.fault, d.row_stats) {
            for row in 0..d.m {
                let o = (rs.at.offset + row * 2 * rs.at.ld + 2 * rs.first_group + 1) as u64 * 4;
                let mut word = [0u8; 4];
                self.inner.download(c, o, &mut word)?;
                let sum = f32::from_ne_bytes(word) * 1.5;
                self.inner.upload(c, o, &sum.to_ne_bytes())?;
            }
        }
        if self.fault == Fault::GemmWritesPastRegion {
            let end = d.c_offset + (d.m - 1) * d.ldc + d.n;
            if (end as u64 + 1) * 4 <= c.len() {
                self.inner.upload(c, end as u64 * 4, &0f32.to_ne_bytes())?;
            }
        }
        Ok(())
    }
    fn sum_parts(&self, parts: &CpuBuffer, dst: &CpuBuffer, d: &SumPartsDesc) -> Result<()> {
        let mut d = *d;
        if self.fault == Fault::SumSkipsLastPart && d.parts > 1 {
            d.parts -= 1;
        }
        self.inner.sum_parts(parts, dst, &d)
    }
    fn transpose(&self, src: &CpuBuffer, dst: &CpuBuffer, d: &TransposeDesc) -> Result<()> {
        let mut d = *d;
        if self.fault == Fault::TransposeDropsLastRow && d.rows > 0 {
            d.rows -= 1;
        }
        self.inner.transpose(src, dst, &d)
    }
    fn kl_rows(&self, [logits, ids, probs, coef, loss, grad]: [&CpuBuffer; 6], d: &KlDesc) -> Result<()> {
        if self.fault == Fault::KlIgnoresFlaggedRow {
            let mut words: Vec<u32> = self.read(coef, d.rows * 2);
            for w in words.iter_mut().step_by(2).filter(|w| **w == FLAGGED_ROW) {
                *w = 0f32.to_bits();
            }
            self.write(coef, &words);
        }
        if self.fault == Fault::KlDenseTeacherShifted && d.dense_teacher {
            let mut t: Vec<f32> = self.read(probs, d.rows * d.ld);
            for row in t.chunks_exact_mut(d.ld) {
                row[..d.vocab].rotate_left(1);
            }
            self.write(probs, &t);
        }
        let mut d = *d;
        match self.fault {
            Fault::FilterMaskTooCoarse => {
                if let Some(f) = &mut d.filter {
                    f.eps = 1.0;
                }
            }
            Fault::KlIgnoresSoftcap => d.terms.softcap = None,
            Fault::KlIgnoresTail => d.tail = TailMode::Renormalize,
            Fault::KlIgnoresHard => d.terms.hard_weight = 0.0,
            Fault::KlIgnoresSmoothing => d.terms.label_smoothing = 0.0,
            Fault::KlIgnoresZLoss => d.terms.z_loss = 0.0,
            Fault::KlIgnoresSoftWeight => d.terms.soft_weight = 1.0,
            Fault::KlIgnoresDivergence => d.terms.divergence = Divergence::Forward,
            Fault::KlIgnoresBeta => {
                if let Divergence::Jsd { beta } = &mut d.terms.divergence {
                    *beta = 0.5;
                }
            }
            _ => {}
        }
        let d = &d;
        self.inner.kl_rows(logits, ids, probs, coef, loss, grad, d)?;
        match self.fault {
            Fault::KlPadLeftNaN if d.ld > d.vocab => {
                let mut g: Vec<u16> = self.read(grad, d.rows * d.ld);
                for t in 0..d.rows {
                    g[t * d.ld + d.vocab] = 0xFFFF;
                }
                self.write(grad, &g);
            }
            // Per row: [loss, lse, soft, hard].
            Fault::KlLossOffset | Fault::KlLseOffset => {
                let word = usize::from(self.fault == Fault::KlLseOffset);
                let mut l: Vec<f32> = self.read(loss, d.rows * 4);
                l.iter_mut().skip(word).step_by(4).for_each(|v| *v += 1e-3);
                self.write(loss, &l);
            }
            _ => {}
        }
        Ok(())
    }
    fn topk_rows(&self, [logits, ids, probs]: [&CpuBuffer; 3], d: &TopkDesc) -> Result<()> {
        if self.fault == Fault::TopkErrors {
            return Err(Error::Backend {
                backend: "reference",
                message: "planted topk failure".into(),
            });
        }
        let mut d = *d;
        match self.fault {
            Fault::TopkIgnoresSoftcap => d.cap = None,
            Fault::TopkIgnoresLogprobs => d.logprobs = false,
            _ => {}
        }
        let d = &d;
        self.inner.topk_rows(logits, ids, probs, d)?;
        let n = d.rows * d.k;
        match self.fault {
            Fault::GatherLseOff if d.gather => {
                let mut p: Vec<f32> = self.read(probs, n);
                for row in p.chunks_exact_mut(d.k) {
                    row[d.k - 1] += 1e-2;
                }
                self.write(probs, &p);
            }
            Fault::TopkSwapFirstTwo if d.k >= 2 => {
                let (mut i, mut p): (Vec<u32>, Vec<f32>) = (self.read(ids, n), self.read(probs, n));
                for t in 0..d.rows {
                    i.swap(t * d.k, t * d.k + 1);
                    p.swap(t * d.k, t * d.k + 1);
                }
                self.write(ids, &i);
                self.write(probs, &p);
            }
            Fault::TopkProbsOff => {
                let mut p: Vec<f32> = self.read(probs, n);
                p.iter_mut().for_each(|v| *v *= 1.001);
                self.write(probs, &p);
            }
            Fault::TopkNoNaNFlag => {
                let mut p: Vec<f32> = self.read(probs, n);
                p.iter_mut().filter(|v| v.is_nan()).for_each(|v| *v = 0.5);
                self.write(probs, &p);
            }
            _ => {}
        }
        Ok(())
    }
}
