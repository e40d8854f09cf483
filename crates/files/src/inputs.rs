//! The inputs of `headkl topk`, `gather` and `loss` read from their
//! tensors: the head, the hidden rows, the teacher's ids and values, the
//! weights and labels, each checked for shape and dtype against the
//! others as the command checks them (and the teacher file's metadata
//! against the run), and the loss options' checks that need them. An error
//! names the file and tensor at fault; the values' contents are the core's
//! to check (`Teacher`, `LossOptions::resolve`), traced back to their file
//! by [`Sources`].

use std::borrow::Cow;
use std::path::Path;

use half::{bf16, f16};
use headkl_core::{HeadData, HiddenData, LossOptions, ResolvedLoss};
use safetensors::Dtype;

use crate::error::FilesError;
use crate::provenance::{check_teacher, LossRun};
use crate::sources::Sources;
use crate::tensors::{TensorFile, TensorRef};

/// A head's elements, borrowed from the file or converted.
pub enum HeadElems<'a> {
    /// f16.
    F16(Cow<'a, [f16]>),
    /// bf16.
    Bf16(Cow<'a, [bf16]>),
    /// f32.
    F32(Cow<'a, [f32]>),
}

impl HeadElems<'_> {
    /// The head in the form the engine takes.
    pub fn data(&self) -> HeadData<'_> {
        match self {
            HeadElems::F16(d) => HeadData::F16(d),
            HeadElems::Bf16(d) => HeadData::Bf16(d),
            HeadElems::F32(d) => HeadData::F32(d),
        }
    }
}

/// Reads a head tensor `[V][hs]` (F16, BF16 or F32).
pub fn read_head<'a>(t: &TensorRef<'a>) -> Result<(HeadElems<'a>, usize, usize), FilesError> {
    let (vocab, hs) = t.matrix("[V][hs]")?;
    if vocab == 0 || hs == 0 {
        return Err(t.error(format!("shape [{vocab}, {hs}]: the head needs V ≥ 1 and hs ≥ 1")));
    }
    let elems = match t.dtype() {
        Dtype::F16 => HeadElems::F16(t.f16s()),
        Dtype::BF16 => HeadElems::Bf16(t.bf16s()),
        Dtype::F32 => HeadElems::F32(t.f32s()),
        _ => return Err(t.wrong_dtype("F16, BF16 or F32")),
    };
    Ok((elems, vocab, hs))
}

/// Hidden rows' elements, borrowed from the file or copied.
pub enum HiddenElems<'a> {
    /// f16.
    F16(Cow<'a, [f16]>),
    /// f32.
    F32(Cow<'a, [f32]>),
    /// bf16.
    Bf16(Cow<'a, [bf16]>),
}

impl HiddenElems<'_> {
    /// The rows in the form the engine takes.
    pub fn data(&self) -> HiddenData<'_> {
        match self {
            HiddenElems::F16(d) => HiddenData::F16(d),
            HiddenElems::F32(d) => HiddenData::F32(d),
            HiddenElems::Bf16(d) => HiddenData::Bf16(d),
        }
    }
}

/// Reads hidden rows `[ntok][hs]` (F32, F16 or BF16) and checks hs against the
/// head's.
pub fn read_hidden<'a>(
    t: &TensorRef<'a>,
    head: &TensorRef<'_>,
    head_hs: usize,
) -> Result<(HiddenElems<'a>, usize), FilesError> {
    let (ntok, hs) = t.matrix("[ntok][hs]")?;
    if ntok == 0 {
        return Err(t.error("shape [0, hs]: at least one token is needed"));
    }
    if hs != head_hs {
        // A head stored [hs][V] (as some exports do) shows up as a
        // mismatch whose other extent matches: say so.
        let transposed = head.matrix("[V][hs]").is_ok_and(|(rows, _)| rows == hs);
        return Err(t.error(format!(
            "hs = {hs}, but the head {} has hs = {head_hs}{}",
            head.describe(),
            if transposed {
                format!("; the head looks transposed (its first extent is {hs}): it must be [V][hs]")
            } else {
                String::new()
            }
        )));
    }
    let elems = match t.dtype() {
        Dtype::F32 => HiddenElems::F32(t.f32s()),
        Dtype::F16 => HiddenElems::F16(t.f16s()),
        Dtype::BF16 => HiddenElems::Bf16(t.bf16s()),
        _ => return Err(t.wrong_dtype("F32, F16 or BF16")),
    };
    Ok((elems, ntok))
}

/// The teacher file's ids and values, checked against the run.
pub struct TeacherInput<'a> {
    /// The ids `[ntok][k]`, as i64.
    pub ids: Cow<'a, [i64]>,
    /// The values `[ntok][k]` (`probs` or `logprobs`).
    pub probs: Cow<'a, [f32]>,
    /// Entries per row.
    pub k: usize,
}

/// The ids of an `[ntok][k]` tensor and their `k`, its rows checked
/// against the hidden rows'.
pub fn read_ids<'a>(
    ids_t: &TensorRef<'a>,
    (hidden_t, ntok): (&TensorRef<'_>, usize),
) -> Result<(Cow<'a, [i64]>, usize), FilesError> {
    let (id_rows, k) = ids_t.matrix("[ntok][k]")?;
    if id_rows != ntok {
        return Err(ids_t.error(format!(
            "{id_rows} rows, but the hidden rows {} have ntok = {ntok}",
            hidden_t.describe()
        )));
    }
    Ok((ids_t.ids_i64()?, k))
}

/// Checks the teacher file against the run (its `headkl.*` metadata, then
/// the shapes and dtypes of `ids` and the values) and reads both; the
/// values' contents are `Teacher`'s to check.
pub fn read_teacher<'a>(
    path: &Path,
    file: &TensorFile,
    ids_t: &TensorRef<'a>,
    probs_t: &TensorRef<'a>,
    run: &LossRun<'_>,
    allow_mismatch: bool,
    (hidden_t, ntok): (&TensorRef<'_>, usize),
) -> Result<TeacherInput<'a>, FilesError> {
    check_teacher(path, file.metadata(), run, allow_mismatch)?;
    let (ids, k) = read_ids(ids_t, (hidden_t, ntok))?;
    let probs_shape = probs_t.matrix("[ntok][k]")?;
    if probs_shape != (ntok, k) {
        return Err(probs_t.error(format!(
            "shape [{}, {}], but `ids` is [{ntok}, {k}]",
            probs_shape.0, probs_shape.1
        )));
    }
    if probs_t.dtype() != Dtype::F32 {
        return Err(probs_t.wrong_dtype("F32"));
    }
    Ok(TeacherInput {
        ids,
        probs: probs_t.f32s(),
        k,
    })
}

/// Per-token weights `[ntok]` (F32).
pub fn read_weights(w: &TensorRef<'_>, ntok: usize) -> Result<Vec<f32>, FilesError> {
    let len = w.vector("[ntok]")?;
    if len != ntok {
        return Err(w.error(format!("{len} weights, but there are ntok = {ntok} hidden rows")));
    }
    if w.dtype() != Dtype::F32 {
        return Err(w.wrong_dtype("F32"));
    }
    Ok(w.f32s().into_owned())
}

/// The loss options' checks that need the token count and the vocabulary
/// (weights, labels, ranges), as `loss` runs them before the head goes
/// anywhere, returning them resolved; an error names the file it came from.
pub fn check_loss_options(
    opts: &LossOptions,
    ntok: usize,
    vocab: usize,
    sources: &Sources,
) -> Result<ResolvedLoss, FilesError> {
    let resolved = opts.resolve(ntok).map_err(|e| sources.map(e, "loss options"))?;
    resolved
        .check_labels(vocab)
        .map_err(|e| sources.map(e, "loss options"))?;
    Ok(resolved)
}

/// Hard labels `[ntok]` (I64 or I32).
pub fn read_labels(l: &TensorRef<'_>, ntok: usize) -> Result<Vec<i64>, FilesError> {
    let len = l.vector("[ntok]")?;
    if len != ntok {
        return Err(l.error(format!("{len} labels, but there are ntok = {ntok} hidden rows")));
    }
    if !matches!(l.dtype(), Dtype::I64 | Dtype::I32) {
        return Err(l.wrong_dtype("I64 or I32"));
    }
    Ok(l.ids_i64()?.into_owned())
}
