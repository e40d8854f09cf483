//! `headkl topk` and `headkl loss`: read safetensors inputs (through
//! `headkl_files::inputs`, which checks them), run the job on the chosen
//! backend, write safetensors outputs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use headkl_core::{
    Backend, Engine, GradType, GradValues, HeadData, HeadWeights, Hidden, HiddenData, LossConfig, LossOptions,
    LossOutput, LossTerms, Reduction, ResolvedLoss, Shape, SliceOptions, Teacher, TopK, TopkOptions,
};
use headkl_files::inputs::{
    check_loss_options, read_head, read_hidden, read_labels, read_teacher, read_weights, TeacherInput,
};
use headkl_files::provenance::{HeadIdentity, LossRecord, LossRun, TeacherRecord};
use headkl_files::sources::Sources;
use headkl_files::{TensorFile, TensorRef};

use crate::environment::Settings;
use crate::error::CliError;
use crate::io::{check_output_not_input, OutTensor, PendingOutput};
use crate::options::BudgetArg;
use crate::progress::Progress;
use crate::select::{describe, BackendArgs, Job};
use crate::terms::{LossTermArgs, TopkTermArgs};
use crate::text::fmt_bytes;

/// Arguments shared by `topk` and `loss`: the head and the hidden rows.
#[derive(clap::Args, Clone, Debug)]
pub struct InputArgs {
    /// The head `[V][hs]` (F16, BF16 or F32), e.g. a model shard
    #[arg(long, value_name = "FILE.safetensors")]
    pub head: PathBuf,
    /// Name of the head tensor in --head (e.g. `lm_head.weight` in a shard)
    #[arg(long, default_value = "weight", value_name = "NAME")]
    pub head_tensor: String,
    /// Hidden rows `[ntok][hs]` (F32, F16 or BF16), already normed
    #[arg(long, value_name = "FILE.safetensors")]
    pub hidden: PathBuf,
    /// Name of the hidden tensor in --hidden
    #[arg(long, default_value = "hidden", value_name = "NAME")]
    pub hidden_tensor: String,
}

/// What every one-call job runs on: the head and hidden rows, checked, and
/// where they came from.
#[derive(Clone, Copy)]
pub(crate) struct JobInputs<'a> {
    pub(crate) sources: &'a Sources<'a>,
    pub(crate) head: HeadWeights<'a>,
    pub(crate) hidden: Hidden<'a>,
}

impl<'a> JobInputs<'a> {
    /// The head `[vocab][hs]` and hidden rows `[ntok][hs]` checked, an
    /// error named by `sources`.
    pub(crate) fn check(
        sources: &'a Sources<'a>,
        head: HeadData<'a>,
        hidden: HiddenData<'a>,
        vocab: usize,
        ntok: usize,
        hs: usize,
    ) -> Result<Self, CliError> {
        Ok(Self {
            sources,
            head: HeadWeights::new(head, vocab, hs).map_err(|e| sources.map(e, "head"))?,
            hidden: Hidden::new(hidden, ntok, hs).map_err(|e| sources.map(e, "hidden"))?,
        })
    }

    /// How every one-call job starts: logs the device, opens a bar over
    /// the tokens labelled `label`, and uploads the head to an engine
    /// whose progress callback drives the bar. The caller keeps the bar
    /// for the call (bound before the engine, so it outlives it).
    pub(crate) fn start_engine<B: Backend>(&self, backend: B, label: &str) -> Result<(Progress, Engine<B>), CliError> {
        log::info!("headkl: running on {}", describe(backend.info()));
        let progress = Progress::new(label, self.hidden.ntok() as u64);
        let mut engine = Engine::new(backend, &self.head, SliceOptions::default())
            .map_err(|e| self.sources.map(e, "uploading the head"))?;
        engine.set_progress(Some(progress.callback()));
        Ok((progress, engine))
    }

    /// A job of one engine call: [`Self::start_engine`], then `call` on the
    /// engine and the hidden rows (the engine plans the chunks and reports
    /// each one), its error named by the sources under `what`.
    pub(crate) fn run_call<B: Backend, T>(
        &self,
        backend: B,
        label: &str,
        what: &str,
        call: impl FnOnce(&mut Engine<B>, &Hidden<'a>) -> headkl_core::Result<T>,
    ) -> Result<T, CliError> {
        let (_progress, mut engine) = self.start_engine(backend, label)?;
        call(&mut engine, &self.hidden).map_err(|e| self.sources.map(e, what).into())
    }
}

/// The top-k job on one engine (on the shards: [`crate::shard::Sharded`]).
pub(crate) struct TopkJob<'a> {
    pub(crate) inputs: JobInputs<'a>,
    pub(crate) opts: &'a TopkOptions,
}

impl Job for TopkJob<'_> {
    type Output = Result<TopK, CliError>;

    fn run<B: Backend>(self, backend: B) -> Self::Output {
        let label = "topk: head upload, then tokens";
        self.inputs
            .run_call(backend, label, "top-k", |engine, hidden| engine.topk(hidden, self.opts))
    }
}

/// The loss job on one engine (on the shards: [`crate::shard::Sharded`]).
pub(crate) struct LossJob<'a> {
    /// `HEADKL_TRACE`, `HEADKL_DX_SPLIT` and `HEADKL_NO_ROW_STATS` for the engine.
    pub(crate) settings: &'a Settings,
    pub(crate) inputs: JobInputs<'a>,
    pub(crate) teacher: &'a Teacher,
    pub(crate) opts: &'a LossOptions,
}

impl Job for LossJob<'_> {
    type Output = Result<LossOutput, CliError>;

    fn run<B: Backend>(self, backend: B) -> Self::Output {
        let label = "loss: head upload, then tokens";
        // The engine resolves total and gscale over every token.
        self.inputs.run_call(backend, label, "head_kl", |engine, hidden| {
            self.settings.runtime.apply(engine);
            engine.head_kl(hidden, self.teacher, self.opts)
        })
    }
}

/// `--reduction`'s value.
fn parse_reduction(s: &str) -> Result<Reduction, String> {
    Reduction::from_name(s).ok_or_else(|| format!("`{s}`: expected `mean`, `sum`, `batchmean` or `none`"))
}

/// The mean loss with six significant digits: the loss is computed from
/// f16 operands, so further digits are noise.
pub fn fmt_mean(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let decimals = (5 - v.abs().log10().floor() as i32).clamp(0, 12) as usize;
    format!("{v:.decimals$}")
}

/// `headkl topk`.
#[allow(clippy::too_many_arguments, reason = "the command's options, as parsed")]
pub fn topk(
    backend: &BackendArgs,
    settings: &Arc<Settings>,
    inputs: &InputArgs,
    args: &TopkArgs,
    shards: &crate::shard::ShardArgs,
) -> Result<(), CliError> {
    let TopkArgs {
        k,
        temperature,
        terms: ref extra,
        budget,
        ref out,
    } = *args;
    let budget = budget.bytes;
    check_output_not_input(out, &[&inputs.head, &inputs.hidden])?;
    let head_file = TensorFile::open(&inputs.head)?;
    let hidden_file = TensorFile::open(&inputs.hidden)?;
    let head_t = head_file.tensor(&inputs.head_tensor)?;
    let hidden_t = hidden_file.tensor(&inputs.hidden_tensor)?;
    let (head_elems, vocab, hs) = read_head(&head_t)?;
    let (hidden_elems, ntok) = read_hidden(&hidden_t, &head_t, hs)?;
    let sources = Sources::new(&head_t, &hidden_t);
    let opts = TopkOptions {
        temperature,
        budget_bytes: budget,
        softcap: extra.softcap,
        logit_scale: extra.logit_scale,
        logprobs: extra.logprobs,
        ..TopkOptions::new(k)
    };
    // Every option is checked before the head goes anywhere.
    opts.check(vocab).map_err(|e| sources.map(e, "top-k options"))?;
    let inputs = JobInputs::check(&sources, head_elems.data(), hidden_elems.data(), vocab, ntok, hs)?;
    let pending = PendingOutput::create(out)?;
    let job = TopkJob { inputs, opts: &opts };
    let (result, start) = shards.run_job(backend, settings, vocab, || Ok(()), job)?;
    let ids: Vec<i64> = result.ids.iter().map(|&i| i64::from(i)).collect();
    let record = TeacherRecord {
        temperature,
        k,
        vocab,
        hs,
        ntok,
        renormalized: true,
        softcap: extra.softcap,
        logit_scale: extra.logit_scale,
        head: head_t.identity(),
    };
    let mut tensors = vec![
        OutTensor::i64("ids", vec![ntok, k], &ids),
        OutTensor::f32("probs", vec![ntok, k], &result.probs),
    ];
    if extra.logprobs {
        tensors.push(OutTensor::f32("logprobs", vec![ntok, k], &result.logprobs));
    }
    pending.commit_tensors_with(&tensors, Some(record.to_metadata()))?;
    log::info!(
        "headkl: top-{k} of {ntok} tokens over V = {vocab} in {:.3} s; wrote {} ({})",
        start.elapsed().as_secs_f64(),
        out.display(),
        fmt_bytes((ids.len() * 12) as u64)
    );
    Ok(())
}

/// Options of `headkl loss` beyond the head and hidden rows.
#[derive(clap::Args, Clone, Debug)]
pub struct LossArgs {
    /// Teacher top-k: tensors `ids` and `probs`, each `[ntok][k]`
    #[arg(long, value_name = "T.safetensors", required_unless_present = "teacher_hidden")]
    pub teacher: Option<PathBuf>,
    /// Instead of --teacher: the teacher's hidden rows `[ntok][hs_T]` (F32, F16 or BF16), for the
    /// exact divergence over the full vocabulary with --teacher-head (its logits are made chunk
    /// by chunk and never stored; the soft term alone: no --hard-weight, --z-loss, --softcap or
    /// --filter-eps)
    #[arg(
        long,
        value_name = "TH.safetensors",
        conflicts_with = "teacher",
        requires = "teacher_head"
    )]
    pub teacher_hidden: Option<PathBuf>,
    /// Name of the hidden tensor in --teacher-hidden
    #[arg(long, default_value = "hidden", value_name = "NAME")]
    pub teacher_hidden_tensor: String,
    /// The teacher's head `[V][hs_T]` for --teacher-hidden: the student's V, any hidden size
    #[arg(long, value_name = "TW.safetensors", requires = "teacher_hidden")]
    pub teacher_head: Option<PathBuf>,
    /// Name of the head tensor in --teacher-head
    #[arg(long, default_value = "weight", value_name = "NAME")]
    pub teacher_head_tensor: String,
    /// Per-token weights: tensor `weights` (or --weights-tensor) `[ntok]`
    #[arg(long, value_name = "W.safetensors")]
    pub weights: Option<PathBuf>,
    /// Name of the weights tensor in --weights
    #[arg(long, default_value = "weights", value_name = "NAME", requires = "weights")]
    pub weights_tensor: String,
    /// Temperature τ of the student logits (> 0)
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Scale of the f16 gradient [default: 2^14 · total / max w]
    #[arg(long, allow_negative_numbers = true)]
    pub gscale: Option<f32>,
    #[command(flatten)]
    pub terms: LossTermArgs,
    /// The weight the loss averages over (with --reduction mean) [default: Σ w]
    #[arg(long, allow_negative_numbers = true)]
    pub total: Option<f32>,
    /// How the per-token losses w_t·L_t reduce, as PyTorch's `reduction`: `mean` (Σ w L / total),
    /// `sum`, `batchmean` (Σ w L / ntok) or `none` (the output's `loss` tensor per token; the
    /// printed loss and the gradient are the sum's)
    #[arg(long, value_name = "R", default_value = "mean", value_parser = parse_reduction)]
    pub reduction: Reduction,
    #[command(flatten)]
    pub budget: BudgetArg,
    /// Output safetensors file
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,
    /// Use a teacher file made at another temperature, over another vocabulary or from another
    /// head (its metadata says so) instead of refusing it
    #[arg(long)]
    pub allow_teacher_mismatch: bool,
    /// The dx GEMM's block filter: skip blocks whose |∂L/∂s| entries are all at most ε
    /// (`auto` = 2^-15); the loss stays exact, dx drops what was skipped (a bound is printed)
    /// [default: off]
    #[arg(long, value_parser = crate::parse_filter_eps, value_name = "auto|E")]
    pub filter_eps: Option<f32>,
    /// Also write the head's gradient ∂loss/∂W `[V][hs]` (F32 tensor `grad`, the same scaling as
    /// the output's `grad` for the hidden rows) to this safetensors file, for a trainable head.
    /// The block filter does not apply to it; not with --shards
    #[arg(long, value_name = "DW.safetensors")]
    pub head_grad: Option<PathBuf>,
    /// The element type --head-grad writes: f32, or the head's own type as a trainer's
    /// `.grad` is (bf16, f16: each value rounded once to nearest even; a value past f16's
    /// ±65504 is an error naming it, not an infinity)
    #[arg(long, value_enum, value_name = "TYPE", default_value_t = GradDtype::F32, requires = "head_grad")]
    pub head_grad_dtype: GradDtype,
}

/// The element type of `--head-grad`'s tensor.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradDtype {
    F32,
    Bf16,
    F16,
}

impl GradDtype {
    /// `values` (`[rows][cols]`) in this type, with its safetensors dtype:
    /// f32 as they are (borrowed), bf16 and f16 rounded once
    /// ([`headkl_core::GradValues::convert`]; an f16 value past ±65504, or
    /// one f32 holds as infinite, is the error naming its row and column).
    pub(crate) fn encode(self, values: &[f32], cols: usize) -> Result<(safetensors::Dtype, GradBytes<'_>), CliError> {
        use safetensors::Dtype;
        let (to, dtype) = match self {
            GradDtype::F32 => return Ok((Dtype::F32, GradBytes::F32(values))),
            GradDtype::Bf16 => (GradType::Bf16, Dtype::BF16),
            GradDtype::F16 => (GradType::F16, Dtype::F16),
        };
        let converted = GradValues::convert(values, cols, to, "head_grad")
            .map_err(|e| CliError::option("--head-grad-dtype", e.to_string()))?;
        Ok((dtype, GradBytes::Converted(converted)))
    }
}

/// `--head-grad`'s values as written: the f32 output itself, or converted.
#[derive(Debug)]
pub(crate) enum GradBytes<'a> {
    F32(&'a [f32]),
    Converted(GradValues),
}

impl GradBytes<'_> {
    /// The tensor's little-endian bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            GradBytes::F32(values) => bytemuck::cast_slice(values),
            GradBytes::Converted(values) => values.as_bytes(),
        }
    }
}

impl LossArgs {
    /// What `loss` records in its output's metadata: these options, the
    /// resolved `total` and `gscale`, the extents and where the head and
    /// the teacher came from.
    pub(crate) fn record<'a>(
        &'a self,
        result: &LossOutput,
        resolved: &ResolvedLoss,
        shape: Shape,
        (terms, head, teacher): (&'a LossTerms, &'a HeadIdentity, &'a Path),
    ) -> LossRecord<'a> {
        LossRecord {
            mean: result.mean,
            reduction: self.reduction,
            temperature: self.temperature,
            total: resolved.total,
            gscale: resolved.gscale,
            shape,
            softcap: terms.softcap,
            terms,
            teacher_form: self.terms.teacher_form,
            tail: self.terms.tail,
            head,
            teacher,
            weights: self.weights.as_deref(),
            labels: self.terms.labels.as_deref(),
        }
    }

    /// `--out` and `--head-grad` opened for writing (before anything is
    /// computed, so a bad path fails first).
    pub(crate) fn open_outputs(&self, inputs: &[&Path]) -> Result<LossOutputs<'_>, CliError> {
        let out = PendingOutput::create(&self.out)?;
        let head_grad = self.head_grad_output(inputs)?;
        Ok(LossOutputs {
            out: (out, &self.out),
            head_grad: head_grad.zip(self.head_grad.as_deref()),
            head_grad_dtype: self.head_grad_dtype,
        })
    }

    /// `--head-grad`'s file, checked against the inputs and `--out` and
    /// opened for writing.
    fn head_grad_output(&self, inputs: &[&Path]) -> Result<Option<PendingOutput>, CliError> {
        let Some(path) = &self.head_grad else {
            return Ok(None);
        };
        let mut taken = inputs.to_vec();
        taken.push(&self.out);
        crate::io::check_output_of("--head-grad", path, &taken)?;
        if path == &self.out {
            return Err(CliError::option(
                "--head-grad",
                "is the same file as --out; choose another",
            ));
        }
        PendingOutput::create(path).map(Some)
    }

    /// The `--weights` and `--labels` tensors, from their files where given.
    pub(crate) fn weights_and_labels<'f>(
        &self,
        weights_file: Option<&'f TensorFile>,
        labels_file: Option<&'f TensorFile>,
    ) -> Result<(Option<TensorRef<'f>>, Option<TensorRef<'f>>), CliError> {
        let weights = weights_file.map(|f| f.tensor(&self.weights_tensor)).transpose()?;
        let labels = labels_file.map(|f| f.tensor("labels")).transpose()?;
        Ok((weights, labels))
    }

    /// The loss options these flags set, with the weights and labels read
    /// from their files (`headkl loss`, with the top-k teacher or the
    /// teacher's hidden rows).
    pub(crate) fn loss_options(&self, weights: Option<Vec<f32>>, labels: Option<Vec<i64>>) -> LossOptions {
        LossOptions {
            config: LossConfig {
                temperature: self.temperature,
                total: self.total,
                reduction: self.reduction,
                gscale: self.gscale,
                budget_bytes: self.budget.bytes,
                terms: self.terms.terms(),
                filter_eps: self.filter_eps,
                head_grad: self.head_grad.is_some(),
                ..LossConfig::default()
            },
            weights,
            labels,
            ignore_index: self.terms.ignore_index,
            ignore_mask: self.terms.ignore_mask,
        }
    }
}

/// Options of `headkl topk` beyond the head and hidden rows.
#[derive(clap::Args, Clone, Debug)]
pub struct TopkArgs {
    /// Entries per row (1 ≤ k ≤ min(V, 2048))
    #[arg(short = 'k', long = "k")]
    pub k: usize,
    /// Temperature τ of the probabilities (> 0)
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[command(flatten)]
    pub terms: TopkTermArgs,
    #[command(flatten)]
    pub budget: BudgetArg,
    /// Output safetensors file
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,
}

/// `headkl loss`.
pub fn loss(
    backend: &BackendArgs,
    settings: &Arc<Settings>,
    inputs: &InputArgs,
    args: &LossArgs,
    shards: &crate::shard::ShardArgs,
) -> Result<(), CliError> {
    args.terms.check()?;
    let teacher_path = match (&args.teacher, &args.teacher_hidden, &args.teacher_head) {
        (_, Some(hidden), Some(head)) => {
            return crate::full_vocab::loss(backend, settings, inputs, args, shards, (hidden, head));
        }
        (Some(t), _, _) => t.as_path(),
        _ => {
            return Err(CliError::option(
                "--teacher",
                "required (or --teacher-hidden with --teacher-head)",
            ))
        }
    };
    let mut all_inputs: Vec<&Path> = vec![&inputs.head, &inputs.hidden, teacher_path];
    if let Some(w) = &args.weights {
        all_inputs.push(w);
    }
    if let Some(l) = &args.terms.labels {
        all_inputs.push(l);
    }
    check_output_not_input(&args.out, &all_inputs)?;
    let head_file = TensorFile::open(&inputs.head)?;
    let hidden_file = TensorFile::open(&inputs.hidden)?;
    let teacher_file = TensorFile::open(teacher_path)?;
    let weights_file = args.weights.as_deref().map(TensorFile::open).transpose()?;
    let labels_file = args.terms.labels.as_deref().map(TensorFile::open).transpose()?;

    let head_t = head_file.tensor(&inputs.head_tensor)?;
    let hidden_t = hidden_file.tensor(&inputs.hidden_tensor)?;
    let ids_t = teacher_file.tensor("ids")?;
    // `probs`, or `logprobs` with --teacher-form logprobs.
    let probs_t = teacher_file.tensor(args.terms.teacher_tensor())?;
    let (weights_t, labels_t) = args.weights_and_labels(weights_file.as_ref(), labels_file.as_ref())?;

    let (head_elems, vocab, hs) = read_head(&head_t)?;
    let (hidden_elems, ntok) = read_hidden(&hidden_t, &head_t, hs)?;
    let head_identity = head_t.identity();
    // A teacher made at another temperature is checked against that one.
    let run = LossRun {
        temperature: args.terms.teacher_temperature.unwrap_or(args.temperature),
        temperature_option: match args.terms.teacher_temperature {
            Some(_) => "--teacher-temperature",
            None => "--temperature",
        },
        vocab,
        head: &head_identity,
        softcap: None,
    };
    let TeacherInput { ids, probs, k } = read_teacher(
        teacher_path,
        &teacher_file,
        &ids_t,
        &probs_t,
        &run,
        args.allow_teacher_mismatch,
        (&hidden_t, ntok),
    )?;
    let weights = weights_t.as_ref().map(|w| read_weights(w, ntok)).transpose()?;
    let labels = labels_t.as_ref().map(|l| read_labels(l, ntok)).transpose()?;

    let sources = Sources {
        total_given: args.total.is_some(),
        ..Sources::new(&head_t, &hidden_t).with_teacher(&ids_t, &probs_t, weights_t.as_ref(), labels_t.as_ref())
    };
    let (form, tail) = (args.terms.teacher_form, args.terms.tail);
    // Checked whole before the head goes anywhere.
    let mut teacher =
        Teacher::with_form(&ids, &probs, ntok, k, vocab, form, tail).map_err(|e| sources.map(e, "teacher"))?;
    // Read at the run's temperature: rescaled, then checked again.
    if let Some(from) = args.terms.teacher_temperature {
        let rescaled = headkl_core::rescale_teacher(&probs, k, form, tail, from, args.temperature)
            .map_err(|e| sources.map(e, "teacher"))?;
        teacher =
            Teacher::with_form(&ids, &rescaled, ntok, k, vocab, form, tail).map_err(|e| sources.map(e, "teacher"))?;
    }
    let opts = args.loss_options(weights, labels);
    // Every option is checked before the head goes anywhere.
    let resolved = check_loss_options(&opts, ntok, vocab, &sources)?;
    let inputs = JobInputs::check(&sources, head_elems.data(), hidden_elems.data(), vocab, ntok, hs)?;
    let outputs = args.open_outputs(&all_inputs)?;
    let job = LossJob {
        inputs,
        teacher: &teacher,
        opts: &opts,
        settings,
    };
    // The sharded loss refuses some terms before anything is opened or
    // uploaded.
    let check_sharded =
        || headkl_core::shard::check_loss_terms(tail, &opts).map_err(|e| sources.map(e, "loss options").into());
    let (result, start) = shards.run_job(backend, settings, vocab, check_sharded, job)?;
    let terms = args.terms.terms();
    let shape = Shape::new(ntok, vocab, hs, k);
    let record = args.record(&result, &resolved, shape, (&terms, &head_identity, teacher_path));
    write_loss(outputs, &result, &record, start)
}

/// `loss`'s output files, opened for writing: `--out`'s and, for a
/// trainable head, `--head-grad`'s.
pub(crate) struct LossOutputs<'p> {
    pub out: (PendingOutput, &'p Path),
    pub head_grad: Option<(PendingOutput, &'p Path)>,
    /// The element type the head's gradient is written in.
    pub head_grad_dtype: GradDtype,
}

/// Writes `loss`'s output files and prints the loss (and the filter's
/// report).
pub(crate) fn write_loss(
    LossOutputs {
        out: (pending, out),
        head_grad,
        head_grad_dtype,
    }: LossOutputs<'_>,
    result: &LossOutput,
    record: &LossRecord<'_>,
    start: Instant,
) -> Result<(), CliError> {
    let headkl_core::Shape { ntok, vocab, hs, k } = record.shape;
    // Encoded first: a value f16 cannot hold fails before either file is written.
    let head_grad_bytes = match head_grad {
        Some(_) => Some(head_grad_dtype.encode(&result.head_grad, hs)?),
        None => None,
    };
    fn per_token<'a>(name: &'static str, v: &'a [f32]) -> OutTensor<'a> {
        OutTensor::f32(name, vec![v.len()], v)
    }
    let mut tensors = vec![per_token("loss", &result.loss), per_token("lse", &result.lse)];
    if record.terms.hard_on() {
        tensors.push(per_token("soft", &result.soft));
        tensors.push(per_token("hard", &result.hard));
    }
    tensors.push(OutTensor::f32("grad", vec![ntok, hs], &result.dx));
    pending.commit_tensors_with(&tensors, Some(record.to_metadata()))?;
    log::info!(
        "headkl: loss over {ntok} tokens (V = {vocab}, hs = {hs}, k = {k}) in {:.3} s; wrote {}",
        start.elapsed().as_secs_f64(),
        out.display()
    );
    if let Some(((pending, path), (dtype, bytes))) = head_grad.zip(head_grad_bytes) {
        let grad = [OutTensor {
            name: "grad",
            dtype,
            shape: vec![vocab, hs],
            data: bytes.bytes(),
        }];
        pending.commit_tensors_with(&grad, Some(record.to_metadata()))?;
        log::info!(
            "headkl: wrote the head's gradient [{vocab}][{hs}] ({dtype:?}) to {}",
            path.display()
        );
    }
    match record.reduction {
        Reduction::None => println!(
            "sum loss: {} (reduction none: the per-token losses are the output's `loss`)",
            fmt_mean(result.mean)
        ),
        r => println!("{} loss: {}", r.name(), fmt_mean(result.mean)),
    }
    if let Some(f) = result.filter {
        let norm = result.dx.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        println!(
            "dx block filter (ε = {:e}): skipped {:.1}% of the dx GEMM's blocks; what it dropped from dx is at most \
             {:.3e} in L2 norm ({:.2e} of ‖dx‖)",
            f.eps,
            100.0 * f.skipped_fraction(),
            f.dropped_bound,
            f.dropped_bound / norm.max(f64::MIN_POSITIVE)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::GradDtype;

    #[test]
    fn a_gradient_f16_cannot_hold_is_an_error_naming_its_place() {
        let values = [0.5f32, -1.0, 7.0e4, 2.0];
        let err = GradDtype::F16.encode(&values, 2).unwrap_err().to_string();
        assert!(
            err.contains("--head-grad-dtype") && err.contains("[1][0]") && err.contains("7e4"),
            "{err}"
        );
        let (dtype, bytes) = GradDtype::Bf16.encode(&values, 2).unwrap();
        let bytes = bytes.bytes();
        assert_eq!((dtype, bytes.len()), (safetensors::Dtype::BF16, 8));
        assert_eq!(&bytes[4..6], &half::bf16::from_f32(7.0e4).to_bits().to_le_bytes());
        let (dtype, bytes) = GradDtype::F32.encode(&values, 2).unwrap();
        assert_eq!(
            (dtype, bytes.bytes()),
            (safetensors::Dtype::F32, bytemuck::cast_slice::<f32, u8>(&values))
        );
    }
}
