//! The `headkl` command: list devices, check backends against the
//! reference, benchmark them, and run the teacher's top-k or the
//! distillation loss on safetensors files. The binary (`main.rs`) calls
//! [`main`]. What it reads that other programs write (safetensors files,
//! the provenance records, the teacher's checks, vocabulary orders) is
//! `headkl-files`'s, whose errors it maps to its exit codes.

mod bench;
mod ceiling;
mod check;
mod devices;
mod environment;
mod error;
mod full_vocab;
mod gather;
mod io;
mod jobs;
mod logger;
mod options;
mod plot;
mod progress;
mod select;
mod shard;
mod signals;
mod soak;
mod terms;
mod text;
mod tune;

// The command line's fuzz body, which its unit tests run over its corpus.
#[cfg(test)]
mod fuzz;

// The unit tests run that corpus under the fuzz targets' allocation cap.
#[cfg(test)]
#[global_allocator]
static ALLOC: headkl_files::fuzz::CappedAlloc = headkl_files::fuzz::CappedAlloc;

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::bench::{BenchConfig, Shape};
use crate::environment::Settings;
use crate::error::CliError;
use crate::jobs::{InputArgs, LossArgs};
use crate::select::{BackendArgs, AUTO_POLICY};

const EXIT_HELP: &str = "\
Exit codes: 0 success; 2 bad input (a file, tensor, option or HEADKL_*
setting, named in the message); 1 anything else (device errors, failed
checks).";

/// The environment section of `headkl --help`, from the one list of
/// variables in `headkl_core::toolkit::settings`.
fn env_help() -> String {
    format!(
        "{}\n{EXIT_HELP}\n\nEach subcommand's --help has its details; `headkl --help` lists the environment.",
        headkl_core::toolkit::settings::help_text()
    )
}

/// What every subcommand's -h ends with: the rest is in --help.
const SHORT_HELP: &str = "--help: details, the `auto` backend policy, exit codes.";

/// What `headkl -h` ends with.
const TOP_SHORT_HELP: &str =
    "--help: the environment (HEADKL_*) and exit codes; COMMAND --help: each command's details.";

/// What every subcommand's --help ends with: where the environment is listed.
const SUB_HELP: &str = "\
Environment: HEADKL_* variables are listed once, in `headkl --help`.
Exit codes: 0 success; 2 bad input (file, tensor, option or setting); 1 anything else.";

/// headkl: the distillation loss's vocabulary head on the GPU (CUDA on NVIDIA, Vulkan or wgpu elsewhere) or the f64 CPU reference.
#[derive(Parser, Debug)]
#[command(name = "headkl", version, after_help = TOP_SHORT_HELP, after_long_help = env_help())]
struct Cli {
    /// No progress bars and no informational lines: results, warnings and errors only
    #[arg(long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

fn parse_seed(s: &str) -> Result<u64, String> {
    let t = s.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse(),
    }
    .map_err(|e| format!("`{s}`: {e} (decimal or 0x hex)"))
}

fn parse_kernel(s: &str) -> Result<headkl_core::toolkit::CoopGemm, String> {
    headkl_core::toolkit::CoopGemm::parse(s).map_err(|e| e.to_string())
}

fn parse_shape(s: &str) -> Result<Shape, String> {
    s.parse()
}

/// `--filter-eps`: `auto` (2⁻¹⁵, Cut Cross-Entropy's f16 ε) or a number ≥ 0.
fn parse_filter_eps(s: &str) -> Result<f32, String> {
    if s.trim() == "auto" {
        return Ok(headkl_core::problem::filter::AUTO_EPS);
    }
    let v: f32 = s
        .trim()
        .parse()
        .map_err(|e| format!("`{s}`: {e} (auto or a number >= 0)"))?;
    if v >= 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(format!("`{s}`: must be auto or a finite number >= 0"))
    }
}

#[derive(Subcommand, Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "the parsed command line: one value a process, never moved in a loop"
)]
enum Command {
    /// List every backend × device, what it offers, and which one `auto` picks
    #[command(
        long_about = "List every backend × device: name, driver, type, matrix units and their shapes, \
f16, subgroup size, largest storage binding, memory, and whether headkl can run on it (or why not). \
A backend that cannot enumerate (e.g. no Vulkan loader) gets one row saying why. The row `auto` \
picks is marked with `*`, with the reason.",
        after_help = SHORT_HELP,
        after_long_help = format!("{AUTO_POLICY}\n\n--backend NAME lists only that backend's devices.\n\n{SUB_HELP}")
    )]
    Devices {
        #[command(flatten)]
        backend: BackendArgs,
        /// Print JSON instead of a table (each row has `auto: true|false`)
        #[arg(long)]
        json: bool,
    },
    /// Run the conformance suite against the f64 reference on every backend
    #[command(
        long_about = "Run the conformance suite (the same cases as the backends' tests: odd shapes, \
k from 1 to 2048, ties, masked tokens, τ ≠ 1, several slices and chunks) against the f64 reference, \
on every backend this machine can start, or only the one --backend names. Prints a table per \
backend (cases, passed, worst loss / dx / prob errors, matrix units, device) and each failure with \
the seed that replays it. Exits 1 on any failure, or when a backend named by --backend or \
HEADKL_REQUIRE cannot start; other backends that cannot start are skipped with the reason.",
        after_help = SHORT_HELP,
        after_long_help = format!("{AUTO_POLICY}\n\n{SUB_HELP}")
    )]
    Check {
        #[command(flatten)]
        backend: BackendArgs,
        /// Drawn (random) cases on top of the fixed ones [env: HEADKL_CASES] [default: 16]
        #[arg(long)]
        cases: Option<usize>,
        /// Seed of the drawn cases, decimal or 0x hex [env: HEADKL_SEED] [default: 0x484541444b4c0001]
        #[arg(long, value_parser = parse_seed)]
        seed: Option<u64>,
    },
    /// Time head_kl and topk on one backend (or all) and compare
    #[command(
        long_about = "Time head_kl (loss + dx) and topk on random f16 data. The head is uploaded once, \
outside the timing, and head_kl's outputs are kept from call to call (`Engine::head_kl_into`, as a \
training loop keeps its gradient buffer); each job gets --warmup untimed calls, then --iters timed ones. \
Reports the median \
and min–max wall ms per call, the GPU ms (sum of kernel timestamps per call, median) with a per-kernel \
breakdown where the backend times kernels, effective TFLOP/s (4·ntok·V·hs for head_kl, 2·ntok·V·hs \
for topk; from GPU time when there is one, else wall), and peak device memory beyond the head.\n\n\
Shapes: A = 4096:248320:5120:64, B = 8192:151936:4096:64, S = 8192:151936:896:64 (a 0.5B \
student), M = 8192:128256:2048:64 (a 1B student), or NTOK:V:HS:K. Without --shape each \
backend gets a size it finishes in seconds: reference 64:4096:256:16, a software device (lavapipe) \
64:8192:256:64, a GPU without matrix units 256:32768:1024:64, with matrix units 1024:65536:4096:64.\n\n\
Without --backend (or with auto) runs auto's pick; --all runs every backend that starts (the CPU \
reference is left out of --all for large shapes).\n\n\
Before making the data, bench times a warm call on a small head to estimate the run, and states \
the memory it needs; past 5 minutes or past the machine's memory it asks to go on (on a terminal) \
or refuses with exit 2 unless --yes. The bar's time left follows the same estimate.",
        after_help = SHORT_HELP,
        after_long_help = format!("{AUTO_POLICY}\n\n{SUB_HELP}")
    )]
    Bench {
        #[command(flatten)]
        backend: BackendArgs,
        #[command(flatten)]
        config: BenchConfig,
    },
    /// Call one engine many times and check that nothing drifts or leaks
    #[command(
        long_about = "Call one engine --calls times through the host path (head_kl with its outputs \
kept from call to call) and --calls times through the device-resident path (inputs in device \
buffers, a wait a call), on random f16 data: every call's loss and dx must equal the first call's \
bit for bit (the resident path's dx is read every 100 calls), and after --warmup calls the device \
memory the backend holds must stay exactly flat and the process's resident host memory within \
16 MiB. Then --threads engines on threads, --thread-calls calls each, all at once: every answer \
must equal one engine's bit for bit. Prints a line per path (calls, time, memory first → last \
(max)) and exits 1 on any difference or growth.\n\n\
Shapes as bench's: A, B, S, M or NTOK:V:HS:K; without --shape, the backend's bench default. \
A GPU backend is needed (the resident path); without --backend, auto's pick.",
        after_help = SHORT_HELP,
        after_long_help = format!("{AUTO_POLICY}\n\n{SUB_HELP}")
    )]
    Soak {
        #[command(flatten)]
        backend: BackendArgs,
        #[command(flatten)]
        config: soak::SoakConfig,
    },
    /// Time every matrix-unit GEMM kernel on this device and keep the fastest
    #[command(
        long_about = "Time every matrix-unit GEMM kernel (the direct one, the staged one at each \
K step, rows of subgroups and stage count, and the GLSL tiles where the device can run them: \
subgroups of 32 and Vulkan 1.3, or wgpu with PASSTHROUGH_SHADERS; elsewhere they show as does not \
start) on one device, at the two GEMMs head_kl runs: the logits \
x·Wᵀ ([M][K]·[N][K]ᵀ) and the input gradient g·W ([M][N]·[N][K]). Each kernel first runs the \
conformance suite's kernel cases against the f64 reference; one that fails is never picked. Kernels \
within 1.25× of the best time for either GEMM run a second round, and keep the faster of their two \
medians, so one slow measurement does not decide. The \
fastest correct kernel for each GEMM is written to the tune cache (~/.cache/headkl/gemm-tune.tsv, \
or HEADKL_CACHE_DIR), keyed by backend, device and driver; both GPU backends read it when they open \
that device, unless HEADKL_GEMM names kernels. The CUDA backend has nothing to tune here (it says so): its \
GEMMs are cuBLASLt's, whose candidates it times on each shape's first call and keeps in \
cublaslt-picks.tsv beside the tune cache.\n\n\
Shape: --shape M:N:K, each a multiple of 16; default 4096:124160:5120 (4.4 GB) on a device with \
16 GiB or more (or a discrete GPU that does not report its memory), else 1024:32768:4096.",
        after_help = SHORT_HELP,
        after_long_help = format!("{AUTO_POLICY}\n\n{SUB_HELP}")
    )]
    Tune {
        #[command(flatten)]
        backend: BackendArgs,
        #[command(flatten)]
        config: tune::TuneConfig,
    },
    /// The teacher's exact top-k ids and probabilities of x·Wᵀ
    #[command(
        long_about = "The teacher's exact top-k per hidden row: ids of the k largest logits of x·Wᵀ \
(descending; ties: lowest id first) and their probabilities, the softmax over those k at --temperature. \
Exact for every k ≤ 2048.\n\n\
Inputs: --head holds tensor `weight` (or --head-tensor, e.g. `lm_head.weight` of a shard) [V][hs] in \
F16, BF16 or F32; --hidden holds tensor `hidden` (or --hidden-tensor) [ntok][hs] in F32, F16 or BF16. \
Output --out: `ids` I64 [ntok][k] and `probs` F32 [ntok][k] (with --logprobs also `logprobs` F32 \
[ntok][k], the log-probabilities at τ over the full vocabulary, as `loss --teacher-form logprobs` reads \
them), written to a temporary file and renamed when complete (a failed run leaves an existing file \
untouched). Its metadata (headkl.*) records how it was made: format version, temperature, k, V, hs, \
ntok, whether probs are renormalized over the k, the softcap, whether log-probs are held, and the \
head (file, tensor, fold64 hash of the tensor's bytes), which `loss` checks.",
        after_help = SHORT_HELP,
        after_long_help = format!("{AUTO_POLICY}\n\n{SUB_HELP}")
    )]
    Topk {
        #[command(flatten)]
        backend: BackendArgs,
        #[command(flatten)]
        inputs: InputArgs,
        #[command(flatten)]
        args: jobs::TopkArgs,
        #[command(flatten)]
        shards: shard::ShardArgs,
    },
    /// Log-probabilities over the full vocabulary at given ids (score the student's top-k with the teacher)
    #[command(
        long_about = "The log-probabilities at --temperature over the full vocabulary of x·Wᵀ at the ids --ids gives, and each token's log-sum-exp, with no [ntok][V] tensor leaving the device: what `torch.log_softmax(z / τ, -1).gather(-1, ids)` computes (z = S·x·Wᵀ, softcapped if asked). For on-policy distillation: run `topk` on the student's hidden rows, `gather` on the teacher's at those ids, then `loss --divergence reverse --teacher-form logprobs` on the student.

Inputs: --head and --hidden as for `topk`; --ids holds `ids` (I64, I32 or U32) [ntok][k], k ≤ 2048, ids below V (repeats allowed; a negative id is none and gets -inf), e.g. a `topk` output. Output --out: `ids` I64 [ntok][k], `logprobs` F32 [ntok][k] and `lse` F32 [ntok], with the metadata `topk` writes (its temperature, softcap, logit scale, V and head), which `loss` checks.",
        after_help = SHORT_HELP,
        after_long_help = format!("{AUTO_POLICY}\n\n{SUB_HELP}")
    )]
    Gather {
        #[command(flatten)]
        backend: BackendArgs,
        #[command(flatten)]
        inputs: InputArgs,
        #[command(flatten)]
        args: gather::GatherArgs,
        #[command(flatten)]
        shards: shard::ShardArgs,
    },
    /// The distillation loss against the teacher's top-k, and its input gradient
    #[command(
        long_about = "The distillation loss: per token, the KL of the student (softmax of x·Wᵀ/τ over \
the full vocabulary) against the teacher's top-k renormalized over its k, the weighted mean \
Σ w_t L_t / total, and its gradient dx = ∂mean/∂x. Prints the mean loss.\n\n\
Inputs: --head and --hidden as for `topk`; --teacher holds `ids` (I64, I32 or U32) and `probs` (F32), \
each [ntok][k]: ids distinct per row and < V, probs non-negative and finite (renormalized here); \
--weights optionally holds `weights` (or --weights-tensor; F32) [ntok] (0 masks a token; default all 1). \
The loss terms (README \"Loss terms\"): --teacher-form logprobs reads tensor `logprobs` (each ≤ 0, \
over the full vocabulary) instead of `probs`; --tail bucket adds one bin for the teacher's mass outside \
its k, --tail none ignores it; --labels with --hard-weight adds the cross-entropy against the labels \
(with --label-smoothing); --z-loss adds λ·lse²; --softcap caps the logits c·tanh(z/c) before τ. \
Output --out: `loss` F32 [ntok] (per-token α_soft·soft + α_hard·hard + λ·lse², unweighted: the \
weights enter the mean and dx only), `lse` F32 [ntok] (log-sum-exp of the capped logits at τ = 1), \
with a hard term `soft` and `hard` F32 [ntok] (the unweighted parts), and `grad` F32 [ntok][hs] \
(dx), written to a temporary file and renamed when complete; its metadata (headkl.*) holds the mean \
at full precision and the options.\n\n\
A teacher file made by `headkl topk` records its temperature, softcap, V and head (file, tensor, a \
hash of the head's bytes): a mismatch with this run is refused (exit 2, both values named) unless \
--allow-teacher-mismatch. A file without that metadata is used with a note.",
        after_help = SHORT_HELP,
        after_long_help = format!("{AUTO_POLICY}\n\n{SUB_HELP}")
    )]
    Loss {
        #[command(flatten)]
        backend: BackendArgs,
        #[command(flatten)]
        inputs: InputArgs,
        #[command(flatten)]
        args: LossArgs,
        #[command(flatten)]
        shards: shard::ShardArgs,
    },
}

fn run(cli: Cli, settings: &Arc<Settings>) -> Result<(), CliError> {
    progress::set_quiet(cli.quiet);
    logger::install(cli.quiet);
    match cli.command {
        Command::Devices { backend, json } => devices::run(&backend, json, settings),
        Command::Check { backend, cases, seed } => {
            let suite = &settings.suite;
            check::run(
                &backend,
                settings,
                cases.or(suite.cases).unwrap_or(headkl_conformance::DEFAULT_CASES),
                seed.or(suite.seed).unwrap_or(headkl_conformance::DEFAULT_SEED),
            )
        }
        Command::Bench { backend, config } => bench::run(&backend, settings, &config),
        Command::Soak { backend, config } => soak::run(&backend, settings, &config),
        Command::Tune { backend, config } => tune::run(&backend, settings, &config),
        Command::Topk {
            backend,
            inputs,
            args,
            shards,
        } => jobs::topk(&backend, settings, &inputs, &args, &shards),
        Command::Loss {
            backend,
            inputs,
            args,
            shards,
        } => jobs::loss(&backend, settings, &inputs, &args, &shards),
        Command::Gather {
            backend,
            inputs,
            args,
            shards,
        } => gather::run(&backend, settings, &inputs, &args, &shards),
    }
}

/// The whole command: parses the arguments and the environment, runs the
/// subcommand, prints an error as one line and maps it to the exit code.
pub fn main() -> ExitCode {
    signals::install();
    let cli = Cli::parse();
    match environment::read().and_then(|settings| run(cli, &Arc::new(settings))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("headkl: error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn seeds_parse_in_decimal_and_hex() {
        assert_eq!(parse_seed("17"), Ok(17));
        assert_eq!(parse_seed("0x11"), Ok(17));
        assert!(parse_seed("0xzz").is_err());
        // The help's default is the suite's.
        assert_eq!(headkl_conformance::DEFAULT_SEED, 0x4845_4144_4b4c_0001);
        assert_eq!(headkl_conformance::DEFAULT_CASES, 16);
    }

    #[test]
    fn help_names_policy_and_env() {
        let mut cmd = Cli::command();
        let help = cmd
            .find_subcommand_mut("devices")
            .unwrap()
            .render_long_help()
            .to_string();
        assert!(help.contains("Vulkan with matrix units"), "{help}");
        assert!(help.contains("headkl --help"), "{help}");
        // The environment is listed once, in the top-level help, whole.
        let top = Cli::command().render_long_help().to_string();
        for v in headkl_core::toolkit::settings::VARIABLES {
            assert_eq!(top.matches(&format!("  {}=", v.name)).count(), 1, "{}:\n{top}", v.name);
            assert!(
                !help.contains(&format!("  {}=", v.name)),
                "{} repeated in a subcommand",
                v.name
            );
        }
    }
}
