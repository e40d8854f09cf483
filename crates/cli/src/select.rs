//! Which backend and device runs a job, as the command line says it: the
//! `--backend`/`--device` options, and the runtime's errors as the
//! command's. Enumeration, the `auto` policy and opening a backend are the
//! runtime's (`headkl_runtime`), shared with the Python package.

use clap::Args;
use headkl_runtime::Selection;

pub use headkl_runtime::{
    auto_pick, describe, enumerate_all, enumerate_backend, is_software, AutoPick, BackendArg, BackendKind, Enumeration,
    Job, ShardsJob, Target, AUTO_POLICY, SOFTWARE_REASON,
};

use crate::environment::Settings;
use crate::error::CliError;

/// `--backend` as the command line spells it.
fn parse_backend(name: &str) -> Result<BackendArg, String> {
    BackendArg::parse(name, false)
}

/// `--backend` and `--device`, shared by every subcommand.
#[derive(Args, Clone, Debug, Default)]
pub struct BackendArgs {
    /// Backend to run on: auto, cuda, vulkan, wgpu or reference [env: HEADKL_BACKEND]
    #[arg(long, value_parser = parse_backend)]
    pub backend: Option<BackendArg>,
    /// Device index within the backend, as `headkl devices` lists them
    /// [env: HEADKL_DEVICE]
    #[arg(long)]
    pub device: Option<usize>,
}

impl BackendArgs {
    /// The runtime's selection these options make.
    pub fn selection(&self) -> Selection {
        Selection {
            backend: self.backend,
            device: self.device,
        }
    }

    /// The options with `HEADKL_BACKEND` and `HEADKL_DEVICE` filled in where
    /// the command line left them out (the command line wins).
    pub fn with_settings(&self, settings: &Settings) -> Self {
        let s = self.selection().with_settings(&settings.runtime);
        Self {
            backend: s.backend,
            device: s.device,
        }
    }
}

/// Why opening a backend and running a job failed: the backend did not
/// start, or the job (or a bad option) failed.
#[derive(Debug)]
pub enum RunError {
    /// The backend could not be opened (a bad setting, or a device that
    /// cannot start: [`crate::error::is_validation`] tells them apart).
    Start(BackendKind, headkl_core::Error),
    /// The job failed.
    Job(CliError),
}

impl From<headkl_runtime::Error> for RunError {
    fn from(e: headkl_runtime::Error) -> Self {
        match e {
            headkl_runtime::Error::Start { kind, source } => RunError::Start(kind, source),
            headkl_runtime::Error::BadOption { field, message } => {
                RunError::Job(CliError::option(field.flag(), message))
            }
            headkl_runtime::Error::Engine { source } => RunError::Job(CliError::device("opening the engine", source)),
        }
    }
}

impl From<RunError> for CliError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Start(kind, source) => CliError::start(kind.name(), source),
            RunError::Job(e) => e,
        }
    }
}

/// The target one job runs on: the named backend, or `auto`'s pick
/// (`HEADKL_BACKEND` and `HEADKL_DEVICE` fill in what the command line
/// leaves out). A device index that no backend in question has is a bad
/// option (exit 2).
pub fn resolve(args: &BackendArgs, settings: &Settings) -> Result<Target, RunError> {
    Ok(headkl_runtime::resolve(args.selection(), &settings.runtime)?)
}

/// [`resolve`], logging what `auto` picked and why.
pub fn resolve_announced(args: &BackendArgs, who: &str, settings: &Settings) -> Result<Target, RunError> {
    let target = resolve(args, settings)?;
    if let Some(reason) = &target.auto_reason {
        log::info!(
            "{who}: auto picked {} device {}: {reason}",
            target.kind,
            target.device.unwrap_or(0)
        );
    }
    Ok(target)
}

/// The device of `kind` to run on when no `auto` is involved (see
/// [`headkl_runtime::target_for`]).
pub fn target_for(kind: BackendKind, device: Option<usize>, settings: &Settings) -> Result<Target, RunError> {
    Ok(headkl_runtime::target_for(kind, device, &settings.runtime)?)
}

/// Whether `HEADKL_REQUIRE` names `kind`: failing to start it is an error,
/// not a skip.
pub fn required(kind: BackendKind, settings: &Settings) -> bool {
    settings.suite.requires(kind.name())
}

/// Opens `target` and runs `job` on it.
pub fn open_and_run<T, J: Job<Output = Result<T, CliError>>>(target: &Target, job: J) -> Result<T, RunError> {
    open_and_run_gemm(target, None, job)
}

/// [`open_and_run`] with the matrix-unit GEMM kernels `gemm` (`None`: the
/// backend's own choice: `HEADKL_GEMM`, the tune cache, the default). The
/// backends' other options come from the settings.
pub fn open_and_run_gemm<T, J: Job<Output = Result<T, CliError>>>(
    target: &Target,
    gemm: Option<headkl_core::GemmChoice>,
    job: J,
) -> Result<T, RunError> {
    headkl_runtime::open_and_run(target, gemm, job)?.map_err(RunError::Job)
}

/// The error of a job that needs device buffers, run on the reference.
pub fn no_device_buffers(option: &'static str) -> CliError {
    CliError::option(
        option,
        "the reference backend has no device buffers; use --backend wgpu or vulkan",
    )
}
