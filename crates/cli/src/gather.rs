//! `headkl gather`: the log-probabilities over the full vocabulary at ids
//! the caller gives (the teacher's side of on-policy distillation: score
//! the student's top-k with the teacher), written as a teacher file that
//! `loss --teacher-form logprobs` reads as it is.

use std::path::PathBuf;
use std::sync::Arc;

use headkl_core::{Backend, Gathered, TopkOptions};
use headkl_files::inputs::{read_head, read_hidden, read_ids};
use headkl_files::provenance::TeacherRecord;
use headkl_files::sources::Sources;
use headkl_files::TensorFile;

use crate::environment::Settings;
use crate::error::CliError;
use crate::io::{check_output_not_input, OutTensor, PendingOutput};
use crate::jobs::{InputArgs, JobInputs};
use crate::options::BudgetArg;
use crate::select::{BackendArgs, Job};
use crate::text::fmt_bytes;

/// Options of `headkl gather` beyond the head and hidden rows.
#[derive(clap::Args, Clone, Debug)]
pub struct GatherArgs {
    /// The ids to score: tensor `ids` (I64, I32 or U32) `[ntok][k]`, k ≤ 2048; a negative id is none (its value -inf). A `topk` output's `ids` tensor works as it is
    #[arg(long, value_name = "I.safetensors")]
    pub ids: PathBuf,
    /// Temperature τ of the log-probabilities (> 0)
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Logit softcap c: values from c·tanh(z/c) before τ (> 0) [default: none]
    #[arg(long, allow_negative_numbers = true)]
    pub softcap: Option<f32>,
    /// Logit scale S: z = S·x·Wᵀ before the softcap and τ (> 0)
    #[arg(long, value_name = "S", default_value_t = 1.0, allow_negative_numbers = true)]
    pub logit_scale: f32,
    #[command(flatten)]
    pub budget: BudgetArg,
    /// Output safetensors file: `ids` I64 and `logprobs` F32 `[ntok][k]`, `lse` F32 `[ntok]`
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,
}

/// The gather on one engine (on the shards: [`crate::shard::Sharded`]).
pub(crate) struct GatherJob<'a> {
    pub(crate) inputs: JobInputs<'a>,
    pub(crate) ids: &'a [i64],
    pub(crate) opts: &'a TopkOptions,
}

impl Job for GatherJob<'_> {
    type Output = Result<Gathered, CliError>;

    fn run<B: Backend>(self, backend: B) -> Self::Output {
        let label = "gather: head upload, then tokens";
        self.inputs.run_call(backend, label, "gather", |engine, hidden| {
            engine.logprobs_at(hidden, self.ids, self.opts)
        })
    }
}

/// `headkl gather`.
pub fn run(
    backend: &BackendArgs,
    settings: &Arc<Settings>,
    inputs: &InputArgs,
    args: &GatherArgs,
    shards: &crate::shard::ShardArgs,
) -> Result<(), CliError> {
    check_output_not_input(&args.out, &[&inputs.head, &inputs.hidden, &args.ids])?;
    let head_file = TensorFile::open(&inputs.head)?;
    let hidden_file = TensorFile::open(&inputs.hidden)?;
    let ids_file = TensorFile::open(&args.ids)?;
    let head_t = head_file.tensor(&inputs.head_tensor)?;
    let hidden_t = hidden_file.tensor(&inputs.hidden_tensor)?;
    let ids_t = ids_file.tensor("ids")?;
    let (head_elems, vocab, hs) = read_head(&head_t)?;
    let (hidden_elems, ntok) = read_hidden(&hidden_t, &head_t, hs)?;
    let (ids, k) = read_ids(&ids_t, (&hidden_t, ntok))?;
    let sources = Sources {
        ids: Some(&ids_t),
        ..Sources::new(&head_t, &hidden_t)
    };
    let opts = TopkOptions {
        temperature: args.temperature,
        budget_bytes: args.budget.bytes,
        softcap: args.softcap,
        logit_scale: args.logit_scale,
        ..TopkOptions::new(k)
    };
    // Every option and id is checked before the head goes anywhere.
    opts.check(vocab).map_err(|e| sources.map(e, "gather options"))?;
    headkl_core::check_gather_ids(&ids, ntok, k, vocab).map_err(|e| sources.map(e, "ids"))?;
    let inputs = JobInputs::check(&sources, head_elems.data(), hidden_elems.data(), vocab, ntok, hs)?;
    let pending = PendingOutput::create(&args.out)?;
    let job = GatherJob {
        inputs,
        ids: &ids,
        opts: &opts,
    };
    let (result, start) = shards.run_job(backend, settings, vocab, || Ok(()), job)?;
    // Not renormalized: log-probabilities over the full vocabulary.
    let record = TeacherRecord {
        temperature: args.temperature,
        k,
        vocab,
        hs,
        ntok,
        renormalized: false,
        softcap: args.softcap,
        logit_scale: args.logit_scale,
        head: head_t.identity(),
    };
    let tensors = [
        OutTensor::i64("ids", vec![ntok, k], &ids),
        OutTensor::f32("logprobs", vec![ntok, k], &result.logprobs),
        OutTensor::f32("lse", vec![ntok], &result.lse),
    ];
    pending.commit_tensors_with(&tensors, Some(record.to_metadata()))?;
    log::info!(
        "headkl: log-probabilities at {k} ids of {ntok} tokens over V = {vocab} in {:.3} s; wrote {} ({})",
        start.elapsed().as_secs_f64(),
        args.out.display(),
        fmt_bytes((ids.len() * 12 + ntok * 4) as u64)
    );
    Ok(())
}
