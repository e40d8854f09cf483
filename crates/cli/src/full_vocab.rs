//! `headkl loss --teacher-hidden TH --teacher-head TW`: the exact
//! full-vocabulary divergence from the teacher's hidden rows and head
//! (`Engine::head_kl_full_vocab`), with the top-k path's inputs, checks
//! and output.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use headkl_core::{Backend, HeadWeights, Hidden, HiddenData, LossOptions, LossOutput, SliceOptions, TailMode};
use headkl_files::inputs::{check_loss_options, read_head, read_hidden, read_labels, read_weights};
use headkl_files::sources::Sources;
use headkl_files::TensorFile;

use crate::environment::Settings;
use crate::error::CliError;
use crate::io::check_output_not_input;
use crate::jobs::{write_loss, InputArgs, JobInputs, LossArgs};
use crate::select::{open_and_run, resolve_announced, BackendArgs, Job};

/// `headkl loss` with `(teacher_hidden, teacher_head)` in place of a top-k
/// file.
pub(crate) fn loss(
    backend: &BackendArgs,
    settings: &Arc<Settings>,
    inputs: &InputArgs,
    args: &LossArgs,
    shards: &crate::shard::ShardArgs,
    (teacher_hidden, teacher_head): (&Path, &Path),
) -> Result<(), CliError> {
    // The options that read a top-k file have nothing to read here.
    let terms = &args.terms;
    for (given, option) in [
        (terms.teacher_form != headkl_core::TeacherForm::Probs, "--teacher-form"),
        (terms.tail != TailMode::Renormalize, "--tail"),
        (terms.teacher_temperature.is_some(), "--teacher-temperature"),
        (args.allow_teacher_mismatch, "--allow-teacher-mismatch"),
    ] {
        if given {
            return Err(CliError::option(
                option,
                "reads a top-k teacher file (--teacher); the teacher's hidden rows give its full distribution at --temperature",
            ));
        }
    }
    let mut all_inputs: Vec<&Path> = vec![&inputs.head, &inputs.hidden, teacher_hidden, teacher_head];
    all_inputs.extend(args.weights.as_deref());
    all_inputs.extend(terms.labels.as_deref());
    check_output_not_input(&args.out, &all_inputs)?;
    let head_file = TensorFile::open(&inputs.head)?;
    let hidden_file = TensorFile::open(&inputs.hidden)?;
    let t_head_file = TensorFile::open(teacher_head)?;
    let t_hidden_file = TensorFile::open(teacher_hidden)?;
    let weights_file = args.weights.as_deref().map(TensorFile::open).transpose()?;
    let labels_file = terms.labels.as_deref().map(TensorFile::open).transpose()?;
    let head_t = head_file.tensor(&inputs.head_tensor)?;
    let hidden_t = hidden_file.tensor(&inputs.hidden_tensor)?;
    let t_head_t = t_head_file.tensor(&args.teacher_head_tensor)?;
    let t_hidden_t = t_hidden_file.tensor(&args.teacher_hidden_tensor)?;
    let (weights_t, labels_t) = args.weights_and_labels(weights_file.as_ref(), labels_file.as_ref())?;

    let (head_elems, vocab, hs) = read_head(&head_t)?;
    let (hidden_elems, ntok) = read_hidden(&hidden_t, &head_t, hs)?;
    let (t_head_elems, t_vocab, t_hs) = read_head(&t_head_t)?;
    if t_vocab != vocab {
        return Err(t_head_t
            .error(format!(
                "V = {t_vocab}, but the student's head {} has V = {vocab}: the heads must share the vocabulary",
                head_t.describe()
            ))
            .into());
    }
    let (t_hidden_elems, t_ntok) = read_hidden(&t_hidden_t, &t_head_t, t_hs)?;
    if t_ntok != ntok {
        return Err(t_hidden_t
            .error(format!(
                "ntok = {t_ntok}, but the student's hidden rows {} have ntok = {ntok}",
                hidden_t.describe()
            ))
            .into());
    }
    // The device flags a row whose logits are not finite without saying
    // whose: the teacher's rows are scanned here, so such an error names
    // the student's.
    if let Some((t, c)) = first_non_finite(t_hidden_elems.data(), t_hs) {
        return Err(t_hidden_t.error(format!("row {t}, column {c} is not finite")).into());
    }
    let weights = weights_t.as_ref().map(|w| read_weights(w, ntok)).transpose()?;
    let labels = labels_t.as_ref().map(|l| read_labels(l, ntok)).transpose()?;
    let sources = Sources {
        weights: weights_t.as_ref(),
        labels: labels_t.as_ref(),
        total_given: args.total.is_some(),
        ..Sources::new(&head_t, &hidden_t)
    };
    let teacher_sources = Sources {
        head: &t_head_t,
        hidden: &t_hidden_t,
        ..sources
    };
    let opts = args.loss_options(weights, labels);
    let resolved = check_loss_options(&opts, ntok, vocab, &sources)?;
    headkl_core::check_full_vocab_terms(&resolved).map_err(|e| sources.map(e, "loss options"))?;
    let inputs = JobInputs::check(&sources, head_elems.data(), hidden_elems.data(), vocab, ntok, hs)?;
    let t_head =
        HeadWeights::new(t_head_elems.data(), vocab, t_hs).map_err(|e| teacher_sources.map(e, "teacher head"))?;
    let t_hidden =
        Hidden::new(t_hidden_elems.data(), ntok, t_hs).map_err(|e| teacher_sources.map(e, "teacher hidden"))?;
    let outputs = args.open_outputs(&all_inputs)?;
    let target = resolve_announced(backend, "headkl", settings)?;
    if shards.plan(vocab, &target)?.is_some() {
        return Err(CliError::option(
            "--shards",
            "the full-vocabulary divergence (--teacher-hidden) runs on one device",
        ));
    }
    let start = Instant::now();
    let result = open_and_run(
        &target,
        FullVocabJob {
            inputs,
            teacher_sources: &teacher_sources,
            settings,
            t_head,
            t_hidden,
            opts,
        },
    )?;
    let head_identity = head_t.identity();
    // The teacher's full distribution: k is V, no softcap (refused above),
    // the form and tail are the defaults (any other was refused).
    let shape = headkl_core::Shape::new(ntok, vocab, hs, vocab);
    let record = args.record(
        &result,
        &resolved,
        shape,
        (&resolved.terms, &head_identity, teacher_hidden),
    );
    write_loss(outputs, &result, &record, start)
}

/// The first `(row, column)` of `rows` (`hs` wide) that is not finite.
fn first_non_finite(rows: HiddenData<'_>, hs: usize) -> Option<(usize, usize)> {
    let at = |i: usize| (i / hs, i % hs);
    match rows {
        HiddenData::F32(d) => d.iter().position(|v| !v.is_finite()).map(at),
        HiddenData::F16(d) => d.iter().position(|v| !v.is_finite()).map(at),
        HiddenData::Bf16(d) => d.iter().position(|v| !v.is_finite()).map(at),
    }
}

/// Runs the full-vocabulary loss on a backend in one engine call.
struct FullVocabJob<'a> {
    inputs: JobInputs<'a>,
    teacher_sources: &'a Sources<'a>,
    settings: &'a Settings,
    t_head: HeadWeights<'a>,
    t_hidden: Hidden<'a>,
    opts: LossOptions,
}

impl Job for FullVocabJob<'_> {
    type Output = Result<LossOutput, CliError>;

    fn run<B: Backend>(self, backend: B) -> Result<LossOutput, CliError> {
        let inputs = &self.inputs;
        let (_progress, mut engine) = inputs.start_engine(backend, "loss: the heads' upload, then tokens")?;
        engine
            .set_teacher_head(&self.t_head, SliceOptions::default())
            .map_err(|e| self.teacher_sources.map(e, "uploading the teacher's head"))?;
        engine.set_trace(self.settings.runtime.trace);
        engine.set_dx_split(self.settings.runtime.dx_split);
        engine
            .head_kl_full_vocab(&inputs.hidden, &self.t_hidden, &self.opts)
            .map_err(|e| inputs.sources.map(e, "head_kl_full_vocab").into())
    }
}
