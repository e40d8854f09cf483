//! The one error type of headkl-core.
//!
//! Validation variants name the field, the row where there is one, and the
//! value. Device variants carry what the caller needs to act: the bytes
//! asked for, the feature that was missing.

use thiserror::Error;

/// Everything headkl-core (and, through `From`, each backend) can fail with.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// `vocab = 0`.
    #[error("vocab = 0: the head needs at least one row")]
    VocabZero,
    /// `hs = 0`.
    #[error("hs = 0: the hidden size must be at least 1")]
    HiddenSizeZero,
    /// `ntok = 0`.
    #[error("ntok = 0: at least one token is needed")]
    NoTokens,
    /// `k = 0`.
    #[error("k = 0: the teacher top-k needs at least one entry per row")]
    KZero,
    /// `k > min(V, 2048)`.
    #[error("k = {k} exceeds min(V = {vocab}, 2048) = {max}")]
    KTooLarge {
        /// The k asked for.
        k: usize,
        /// The vocabulary size.
        vocab: usize,
        /// The largest k allowed.
        max: usize,
    },
    /// A buffer's length does not match the shape.
    #[error("{field}: length {got}, expected {expected}")]
    LengthMismatch {
        /// Which input.
        field: Field,
        /// Length required by the shape.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// The hidden size of the rows does not match the head's.
    #[error("hidden: hs = {got}, but the head has hs = {expected}")]
    HiddenSizeMismatch {
        /// The head's hidden size.
        expected: usize,
        /// The rows' hidden size.
        got: usize,
    },
    /// A teacher id is not below the vocabulary size.
    #[error("ids[{row}][{col}] = {id} is out of range (V = {vocab})")]
    IdOutOfRange {
        /// Token row.
        row: usize,
        /// Entry within the row.
        col: usize,
        /// The id.
        id: i64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A teacher id appears twice in a row.
    #[error("ids[{row}]: id {id} appears twice (entries {first} and {second})")]
    DuplicateId {
        /// Token row.
        row: usize,
        /// The repeated id.
        id: i64,
        /// Its first entry.
        first: usize,
        /// Its second entry.
        second: usize,
    },
    /// A teacher probability is negative.
    #[error("probs[{row}][{col}] = {value} is negative")]
    NegativeProbability {
        /// Token row.
        row: usize,
        /// Entry within the row.
        col: usize,
        /// The value.
        value: f32,
    },
    /// A teacher probability is NaN or infinite.
    #[error("probs[{row}][{col}] = {value} is not finite")]
    NonFiniteProbability {
        /// Token row.
        row: usize,
        /// Entry within the row.
        col: usize,
        /// The value.
        value: f32,
    },
    /// A teacher row whose probabilities sum to 0 (or overflow).
    #[error("probs[{row}] sums to {sum}: a row must have positive, finite mass")]
    ProbabilityRowSum {
        /// Token row.
        row: usize,
        /// The sum.
        sum: f64,
    },
    /// A token weight is negative.
    #[error("weights[{row}] = {value} is negative")]
    NegativeWeight {
        /// Token row.
        row: usize,
        /// The value.
        value: f32,
    },
    /// A token weight is NaN or infinite.
    #[error("weights[{row}] = {value} is not finite")]
    NonFiniteWeight {
        /// Token row.
        row: usize,
        /// The value.
        value: f32,
    },
    /// A `total` with a reduction other than the mean, which sets its own.
    #[error("total = {value} with reduction = {reduction}: a total is the mean's denominator (reduction = mean)")]
    TotalWithReduction {
        /// The reduction's name.
        reduction: &'static str,
        /// The total given.
        value: f32,
    },
    /// `total` is not positive and finite (also: every weight is 0 and no
    /// total was given).
    #[error("total = {value}: must be positive and finite")]
    TotalNotPositive {
        /// The value.
        value: f32,
    },
    /// `τ` is not positive and finite.
    #[error("temperature = {value}: must be positive and finite")]
    InvalidTemperature {
        /// The value.
        value: f32,
    },
    /// A vocabulary order that is not a permutation of the head's rows.
    #[error("vocabulary order: id {id} at position {position} is {reason}")]
    InvalidVocabOrder {
        /// The position at fault.
        position: usize,
        /// The id there.
        id: i64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A vocabulary order of another length than the head's vocabulary.
    #[error("vocabulary order of {got} ids for a head of {expected} rows")]
    VocabOrderLength {
        /// The head's vocabulary.
        expected: usize,
        /// The order's length.
        got: usize,
    },
    /// A vocabulary order given where it cannot apply.
    #[error("vocabulary order: {reason}")]
    VocabOrderUnsupported {
        /// Why, and what works instead.
        reason: &'static str,
    },
    /// The block filter's ε is negative or not finite.
    #[error("filter ε = {value}: must be finite and at least 0")]
    InvalidFilterEps {
        /// The value.
        value: f32,
    },
    /// `gscale` is not positive and finite.
    #[error("gscale = {value}: must be positive and finite")]
    InvalidGradScale {
        /// The value.
        value: f32,
    },
    /// A loss option outside its range (a weight, ε, λ or the softcap).
    #[error("{field} = {value}: {reason}")]
    InvalidLossOption {
        /// The option (`hard_weight`, `soft_weight`, `label_smoothing`,
        /// `z_loss`, `softcap`, `logit_scale`).
        field: &'static str,
        /// Its value.
        value: f32,
        /// The range it must lie in.
        reason: &'static str,
    },
    /// A hard-label weight above 0 with no labels to score.
    #[error("hard_weight = {value} but no labels were given: the hard term needs labels")]
    HardWeightWithoutLabels {
        /// The weight.
        value: f32,
    },
    /// `ignore_mask` with no labels to say which tokens are ignored.
    #[error("ignore_mask is set but no labels were given: the mask comes from the labels")]
    IgnoreMaskWithoutLabels,
    /// A label that is not below the vocabulary size.
    #[error("labels[{row}] = {label} is out of range (V = {vocab})")]
    LabelOutOfRange {
        /// Token row.
        row: usize,
        /// The label.
        label: i64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A teacher log-probability above 0 or NaN.
    #[error("logprobs[{row}][{col}] = {value}: a log-probability must be ≤ 0 and not NaN")]
    InvalidLogProbability {
        /// Token row.
        row: usize,
        /// Entry within the row.
        col: usize,
        /// The value.
        value: f32,
    },
    /// A teacher row whose mass is above 1 (beyond rounding) where the
    /// tail mode reads it as a share of the full vocabulary.
    #[error("probs[{row}] sums to {sum}: above 1 (tolerance {tolerance}), but tail mode {tail} reads the k entries as a share of the full vocabulary")]
    TeacherMassAboveOne {
        /// Token row.
        row: usize,
        /// The row's mass.
        sum: f64,
        /// The rounding allowed.
        tolerance: f64,
        /// The tail mode's name.
        tail: &'static str,
    },
    /// The memory budget is zero.
    #[error("budget = 0 bytes: the memory budget must be positive")]
    BudgetZero,
    /// A vocabulary shard's rows `[v0, v1)` are empty or outside the head
    /// (`crate::shard`).
    #[error("shard rows [{v0}, {v1}) are not a non-empty range inside the head of V = {vocab} rows")]
    ShardRange {
        /// First row.
        v0: usize,
        /// One past the last row.
        v1: usize,
        /// The whole head's rows.
        vocab: usize,
    },
    /// An option the sharded (vocabulary-parallel) calls do not take.
    #[error("{option} = {value}: not supported with a sharded head (vocabulary-parallel); {hint}")]
    ShardUnsupported {
        /// The option, as the command line names it.
        option: &'static str,
        /// Its value.
        value: String,
        /// What works instead.
        hint: &'static str,
    },
    /// The head's gradient ([`crate::problem::LossConfig::head_grad`])
    /// asked of an entry point that does not compute it.
    #[error("head_grad = true: not supported by {entry}; {hint}")]
    HeadGradUnsupported {
        /// The entry point.
        entry: &'static str,
        /// What works instead.
        hint: &'static str,
    },
    /// An option the exact full-vocabulary divergence (the teacher's
    /// hidden rows and head, [`crate::engine::Engine::head_kl_full_vocab`]) does
    /// not take.
    #[error("{option} = {value}: not supported with the teacher's hidden rows (the exact full-vocabulary divergence); {hint}")]
    FullVocabUnsupported {
        /// The option, as the command line names it.
        option: &'static str,
        /// Its value.
        value: String,
        /// What works instead.
        hint: &'static str,
    },
    /// [`crate::engine::Engine::head_kl_full_vocab`] on an engine without a
    /// teacher head ([`crate::engine::Engine::set_teacher_head`]).
    #[error(
        "no teacher head: upload one with Engine::set_teacher_head (--teacher-head) before the full-vocabulary loss"
    )]
    NoTeacherHead,
    /// A teacher head or its hidden rows that do not fit the student's.
    #[error("teacher {what} = {got}, expected {expected}")]
    TeacherHeadMismatch {
        /// What differs (`vocab`, `hidden rows' hs`, `tokens`).
        what: &'static str,
        /// The student's (or the teacher head's) value.
        expected: usize,
        /// The teacher's.
        got: usize,
    },
    /// Shard partials (or merged statistics) that do not belong together:
    /// another token count, k or head.
    #[error("shard partials: {what} = {got}, expected {expected}")]
    ShardMismatch {
        /// What differs (`tokens`, `vocab`, `k`).
        what: &'static str,
        /// The value the first shard (or the pending call) has.
        expected: usize,
        /// The value given.
        got: usize,
    },
    /// Two shards of a merge cover the same head rows.
    #[error("shards [{first_v0}, {first_v1}) and [{second_v0}, {second_v1}) overlap")]
    ShardOverlap {
        /// The first shard's rows (by v0).
        first_v0: usize,
        /// One past its last row.
        first_v1: usize,
        /// The second shard's first row.
        second_v0: usize,
        /// One past its last row.
        second_v1: usize,
    },
    /// The shards of a merge leave head rows `[from, to)` uncovered.
    #[error("no shard covers head rows [{from}, {to}) (V = {vocab})")]
    ShardGap {
        /// First uncovered row.
        from: usize,
        /// One past the last uncovered row.
        to: usize,
        /// The whole head's rows.
        vocab: usize,
    },
    /// A shard's phase two without its phase one.
    #[error("shard phase two ({call}) without a phase one before it: call the partials first")]
    ShardPhaseOrder {
        /// The call made.
        call: &'static str,
    },
    /// The memory budget does not fit even one row-tile of scratch.
    #[error("budget = {budget} bytes is below the {needed} bytes one chunk of {rows} rows needs; raise the budget")]
    BudgetTooSmall {
        /// The budget.
        budget: u64,
        /// Bytes the smallest chunk needs.
        needed: u64,
        /// Rows in the smallest chunk.
        rows: usize,
    },
    /// The device's binding limit cannot hold one aligned row of a buffer.
    #[error("{what}: one row of {row_bytes} bytes exceeds the device's largest binding ({max_binding} bytes)")]
    BindingTooSmall {
        /// Which buffer.
        what: &'static str,
        /// Bytes per row.
        row_bytes: u64,
        /// The device limit.
        max_binding: u64,
    },
    /// A head value is NaN or infinite.
    #[error("head[{row}][{col}] = {value} is not finite")]
    NonFiniteHead {
        /// Vocabulary row.
        row: usize,
        /// Hidden column.
        col: usize,
        /// The value.
        value: f32,
    },
    /// A head value past f16's range (|x| > 65504).
    #[error("head[{row}][{col}] = {value} is outside f16's range (±65504)")]
    HeadOutOfF16Range {
        /// Vocabulary row.
        row: usize,
        /// Hidden column.
        col: usize,
        /// The value.
        value: f32,
    },
    /// A gradient value asked for in f16 ([`crate::GradType::F16`]) that
    /// f16 cannot hold: it would round to infinity.
    #[error("{field}[{row}][{col}] = {value:e} is past f16's range (±65504): ask for bf16 or f32")]
    GradOutOfF16Range {
        /// The gradient (`head_grad`).
        field: &'static str,
        /// Its row.
        row: usize,
        /// Its column.
        col: usize,
        /// The f32 value.
        value: f32,
    },
    /// A hidden row produced a non-finite logit max or softmax sum on the
    /// device (a NaN or inf in the row, or values past f16's range).
    #[error("hidden[{token}]: the row's logits are not finite (NaN, inf or a value past f16's range in x)")]
    NonFiniteHidden {
        /// The first such token.
        token: usize,
    },
    /// A device buffer given to a device-resident entry point that cannot
    /// serve its role (too small for the shape, a misaligned view, a
    /// buffer the device cannot bind as storage).
    #[error("{field}: device buffer {reason}")]
    DeviceBuffer {
        /// Which buffer.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The device ran out of memory.
    #[error("out of device memory allocating {bytes} bytes for {what}; lower the memory budget (--budget) or use fewer tokens per call")]
    OutOfMemory {
        /// Bytes asked for.
        bytes: u64,
        /// Which buffer.
        what: &'static str,
    },
    /// The device was lost.
    #[error("device lost: {0}")]
    DeviceLost(String),
    /// A feature the backend needs is missing.
    #[error("missing feature: {0}")]
    MissingFeature(String),
    /// No device for this backend could be opened.
    #[error("{backend}: no usable device: {reason}")]
    NoDevice {
        /// The backend.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// A setting (an environment variable or option) that cannot be read.
    #[error("{name} = {value:?}: {reason}")]
    InvalidSetting {
        /// The variable or option.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An upload or download past the end of its buffer.
    #[error("{what}: {bytes} bytes at offset {offset} overrun a buffer of {len} bytes")]
    TransferOutOfRange {
        /// `upload` or `download`.
        what: &'static str,
        /// Byte offset into the buffer.
        offset: u64,
        /// Bytes to move.
        bytes: u64,
        /// The buffer's length.
        len: u64,
    },
    /// A kernel descriptor that does not fit its buffers, breaks the
    /// kernel's contract, or has an extent past the kernels' 32-bit indices.
    /// The driver never builds one: this is a caller of `Backend` at fault.
    #[error("{kernel}: {field} = {value}: {reason}")]
    BadDescriptor {
        /// The kernel ([`crate::toolkit::KernelId::name`]).
        kernel: &'static str,
        /// The descriptor field or buffer.
        field: &'static str,
        /// Its value (bytes, for a buffer).
        value: u128,
        /// What is wrong with it.
        reason: String,
    },
    /// Any other backend failure (pipeline build, driver error).
    #[error("{backend}: {message}")]
    Backend {
        /// The backend.
        backend: &'static str,
        /// What happened.
        message: String,
    },
    /// A driver call failed (a Vulkan result, a wgpu error): what headkl
    /// was doing and what the driver said (the message reads as
    /// [`Error::Backend`]'s would), and the driver's own error, kept as
    /// [`std::error::Error::source`].
    #[error("{backend}: {message}")]
    Driver {
        /// The backend.
        backend: &'static str,
        /// What headkl was doing.
        message: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
}

/// A driver's error inside [`Error::Driver`]: shared, so the error stays
/// `Clone`; two are equal when they read the same. `Error::source` returns
/// the driver's error itself (downcast it to `ash::vk::Result`, say), not
/// this wrapper.
#[derive(Clone, Debug)]
pub struct DriverError(std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>);

impl DriverError {
    /// Wraps a driver's error.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(error))
    }
}

impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for DriverError {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_string() == other.0.to_string()
    }
}

// `Error`'s derived `source` reaches the driver's error through this (the
// wrapper is not an error itself, so the one it holds is what callers see).
impl std::ops::Deref for DriverError {
    type Target = dyn std::error::Error + Send + Sync + 'static;
    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

/// Which input a [`Error::LengthMismatch`] is about: the caller routes
/// the error to the file or option that supplied it by this, not by text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Field {
    /// The head `[V][hs]`.
    Head,
    /// The hidden rows `[ntok][hs]`.
    Hidden,
    /// The teacher's ids `[ntok][k]`.
    Ids,
    /// The teacher's probabilities `[ntok][k]`.
    Probs,
    /// The teacher's log-probabilities `[ntok][k]`.
    Logprobs,
    /// The hard-label term's labels `[ntok]`.
    Labels,
    /// The per-token weights `[ntok]`.
    Weights,
    /// The teacher's rows against the hidden rows' `ntok`.
    TeacherRows,
    /// The host slice a download is read into (a caller of `Backend`).
    DownloadOutput,
}

impl Field {
    /// The name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Field::Head => "head",
            Field::Hidden => "hidden",
            Field::Ids => "ids",
            Field::Probs => "probs",
            Field::Logprobs => "logprobs",
            Field::Labels => "labels",
            Field::Weights => "weights",
            Field::TeacherRows => "teacher rows",
            Field::DownloadOutput => "download_end output",
        }
    }

    /// [`Error::LengthMismatch`] naming this field unless `got` is
    /// `expected`.
    pub(crate) fn check_len(self, expected: usize, got: usize) -> Result<()> {
        if got == expected {
            Ok(())
        } else {
            Err(Error::LengthMismatch {
                field: self,
                expected,
                got,
            })
        }
    }
}

impl std::fmt::Display for Field {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What kind of failure an [`Error`](enum@Error) is, which decides what the caller
/// does with it (the `headkl` command: its exit code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The data or an option the caller gave: fixable by the caller.
    Input,
    /// A setting (`HEADKL_*` variable or a backend option) that cannot be
    /// used.
    Setting,
    /// The device or its driver failed or lacks something.
    Device,
    /// A caller of the `Backend` trait broke its contract (a descriptor or
    /// transfer that does not fit its buffers): a bug, not bad input.
    Internal,
}

impl Error {
    /// The kind of this error. Every variant is listed: a new one must be
    /// classified where it is added.
    pub fn kind(&self) -> ErrorKind {
        use Error as E;
        match self {
            E::VocabZero
            | E::HiddenSizeZero
            | E::NoTokens
            | E::KZero
            | E::KTooLarge { .. }
            | E::HiddenSizeMismatch { .. }
            | E::IdOutOfRange { .. }
            | E::DuplicateId { .. }
            | E::NegativeProbability { .. }
            | E::NonFiniteProbability { .. }
            | E::ProbabilityRowSum { .. }
            | E::NegativeWeight { .. }
            | E::NonFiniteWeight { .. }
            | E::TotalNotPositive { .. }
            | E::TotalWithReduction { .. }
            | E::InvalidTemperature { .. }
            | E::InvalidFilterEps { .. }
            | E::InvalidVocabOrder { .. }
            | E::VocabOrderUnsupported { .. }
            | E::VocabOrderLength { .. }
            | E::InvalidGradScale { .. }
            | E::InvalidLossOption { .. }
            | E::HardWeightWithoutLabels { .. }
            | E::IgnoreMaskWithoutLabels
            | E::LabelOutOfRange { .. }
            | E::InvalidLogProbability { .. }
            | E::TeacherMassAboveOne { .. }
            | E::BudgetZero
            | E::ShardRange { .. }
            | E::ShardUnsupported { .. }
            | E::FullVocabUnsupported { .. }
            | E::HeadGradUnsupported { .. }
            | E::GradOutOfF16Range { .. }
            | E::NoTeacherHead
            | E::TeacherHeadMismatch { .. }
            | E::ShardMismatch { .. }
            | E::ShardOverlap { .. }
            | E::ShardGap { .. }
            | E::ShardPhaseOrder { .. }
            | E::BudgetTooSmall { .. }
            | E::NonFiniteHead { .. }
            | E::HeadOutOfF16Range { .. }
            | E::NonFiniteHidden { .. }
            | E::DeviceBuffer { .. } => ErrorKind::Input,
            E::LengthMismatch { field, .. } => match field {
                Field::DownloadOutput => ErrorKind::Internal,
                Field::Head
                | Field::Hidden
                | Field::Ids
                | Field::Probs
                | Field::Logprobs
                | Field::Labels
                | Field::Weights
                | Field::TeacherRows => ErrorKind::Input,
            },
            E::InvalidSetting { .. } => ErrorKind::Setting,
            E::OutOfMemory { .. }
            | E::DeviceLost(_)
            | E::MissingFeature(_)
            | E::NoDevice { .. }
            | E::BindingTooSmall { .. }
            | E::Backend { .. }
            | E::Driver { .. } => ErrorKind::Device,
            E::TransferOutOfRange { .. } | E::BadDescriptor { .. } => ErrorKind::Internal,
        }
    }
}

/// `Result` with headkl-core's [`Error`](enum@Error).
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver error is the source itself (not a wrapper), keeps `Error`
    /// comparable and cloneable, and classifies as a device error.
    #[test]
    fn a_driver_error_is_the_source() {
        use std::error::Error as _;
        let io = std::io::Error::other("driver said no");
        let e = Error::Driver {
            backend: "test",
            message: "creating a pipeline failed: driver said no".into(),
            source: DriverError::new(io),
        };
        assert_eq!(e.to_string(), "test: creating a pipeline failed: driver said no");
        let source = e.source().expect("a source");
        assert!(source.downcast_ref::<std::io::Error>().is_some(), "{source:?}");
        assert_eq!(e.clone(), e);
        assert_eq!(e.kind(), ErrorKind::Device);
    }

    #[test]
    fn kinds_follow_who_can_fix_it() {
        assert_eq!(Error::KZero.kind(), ErrorKind::Input);
        let length = |field| Error::LengthMismatch {
            field,
            expected: 4,
            got: 3,
        };
        assert_eq!(length(Field::Probs).kind(), ErrorKind::Input);
        assert_eq!(length(Field::DownloadOutput).kind(), ErrorKind::Internal);
        assert_eq!(
            length(Field::TeacherRows).to_string(),
            "teacher rows: length 3, expected 4"
        );
        let setting = Error::InvalidSetting {
            name: "HEADKL_GEMM",
            value: "x".into(),
            reason: "unknown".into(),
        };
        assert_eq!(setting.kind(), ErrorKind::Setting);
        assert_eq!(Error::DeviceLost("gone".into()).kind(), ErrorKind::Device);
        let descriptor = Error::BadDescriptor {
            kernel: "kl_rows",
            field: "k",
            value: 0,
            reason: "zero".into(),
        };
        assert_eq!(descriptor.kind(), ErrorKind::Internal);
    }
}
