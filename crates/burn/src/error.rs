//! headkl-burn's error: headkl's own errors as they are, and what a burn
//! caller gets wrong, or the device flags, in the caller's terms (its
//! tensors' names, its rows, its ids as it gave them, its calls).

use std::fmt;

/// What [`crate::HeadKl`]'s calls and [`crate::SharedDevice::open`] return.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// headkl's own error: a bad option value, a head value f16 cannot
    /// hold, the device.
    #[error(transparent)]
    Headkl(#[from] headkl_core::Error),
    /// An input's row count differs from the hidden rows'.
    #[error("hidden has {hidden} rows, {input} {rows}")]
    Rows {
        /// The input (`teacher.ids`, `teacher.probs`, `weights`).
        input: &'static str,
        /// Its rows.
        rows: usize,
        /// The hidden rows' count.
        hidden: usize,
    },
    /// The hidden rows' width differs from the head's hidden size.
    #[error("hidden has {got} columns, the head's hidden size is {head}")]
    HiddenWidth {
        /// The hidden rows' width.
        got: usize,
        /// The head's hidden size.
        head: usize,
    },
    /// The teacher's ids and probabilities differ in shape.
    #[error("teacher.ids is [{}][{}], teacher.probs [{}][{}]: they must match", ids[0], ids[1], probs[0], probs[1])]
    TeacherShape {
        /// `teacher.ids`'s dims.
        ids: [usize; 2],
        /// `teacher.probs`'s dims.
        probs: [usize; 2],
    },
    /// A tensor's dtype headkl cannot read there.
    #[error("{input} has dtype {dtype}; headkl reads {expected}")]
    Dtype {
        /// The input.
        input: &'static str,
        /// Its dtype, as burn names it.
        dtype: String,
        /// What is read there.
        expected: &'static str,
    },
    /// A tensor on another device than the head's.
    #[error("{input} is on {device}, the head on {expected}")]
    Device {
        /// The input.
        input: &'static str,
        /// Its device, briefly.
        device: String,
        /// The head's device, briefly.
        expected: String,
    },
    /// A trainable head ([`crate::HeadKl::loss_with_head`]) whose shape
    /// differs from the engine's head.
    #[error("head is [{}][{}], the engine's head [{}][{}]", got[0], got[1], expected[0], expected[1])]
    HeadShape {
        /// The tensor's dims.
        got: [usize; 2],
        /// The engine's `[vocab][hs]`.
        expected: [usize; 2],
    },
    /// A backward step's call for a trainable head's gradient (the
    /// per-token loss's node, [`crate::HeadKl::loss_with_head`]) failed: the
    /// head got no gradient from that node. Reported by the next
    /// [`crate::HeadKl::wait`] (a backward step cannot return an error).
    #[error("the head's gradient in a backward step: {source}; the head got none from the per-token loss")]
    Backward {
        /// What failed.
        source: Box<Error>,
    },
    /// What the device flagged in calls made since the last
    /// [`crate::HeadKl::wait`] (a bad teacher row or weight, a bad
    /// `total`, non-finite logits), reported by `wait` (or at once in
    /// checked mode), with the calls it can have come from.
    #[error("{calls}: {source}")]
    OnDevice {
        /// The calls since the last wait.
        calls: Calls,
        /// The first problem, as headkl's host path reports it; ids as
        /// the caller gave them (a signed −1 is −1).
        source: headkl_core::Error,
    },
}

/// `Result` with headkl-burn's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Which of [`crate::HeadKl`]'s calls made since the last wait an error
/// can have come from: calls are numbered from 1 per `HeadKl`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Calls {
    /// `(number, what)` of each call since the last wait, oldest first
    /// (`what`: `"loss"`, `"topk"`, or `"head gradient"` for a backward
    /// step's call for a trainable head, which reads the teacher of the
    /// loss call it backpropagates).
    pub calls: Vec<(u64, &'static str)>,
}

impl fmt::Display for Calls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.calls.as_slice() {
            [] => f.write_str("no call since the last wait"),
            [(n, what)] => write!(f, "{what} call {n}"),
            [(first, _), .., (last, _)] => {
                let whats: Vec<&str> = self.calls.iter().map(|(_, w)| *w).collect();
                write!(
                    f,
                    "one of calls {first}–{last} ({}), made without a wait between",
                    whats.join(", ")
                )
            }
        }
    }
}
