//! Which backend and device runs a job: the `--backend`/`--device` options,
//! enumeration of every backend's devices, the `auto` policy (a pure
//! function over the enumerated candidates), and the one place that opens a
//! backend and hands it to generic code.

use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;

use clap::{Args, ValueEnum};
use headkl_core::toolkit::settings::CommonOptions;
use headkl_core::{Backend, DeviceInfo, ResidentBackend};
use headkl_vulkan::VulkanBackend;
use headkl_wgpu::WgpuBackend;
use serde::Serialize;

use crate::environment::Settings;
use crate::error::CliError;

/// The `auto` policy in words, for `--help` and `headkl devices`.
pub const AUTO_POLICY: &str = "\
auto picks the first usable device in this order:
  1. Vulkan with matrix units (cooperative matrices)
  2. wgpu with matrix units
  3. Vulkan without matrix units (tiled fallback GEMM)
  4. wgpu without matrix units
  5. reference (the f64 CPU backend; always there, so auto never fails)
Within one step a discrete GPU beats an integrated one, which beats a
virtual one; then the lower index. A software rasterizer (device type cpu:
lavapipe/llvmpipe, SwiftShader) is never picked: it runs the same work on
the same CPU several times slower than the reference (measured 4-5x on
lavapipe). --device N restricts auto to devices with index N.";

/// A backend named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The best usable device (see the auto policy).
    Auto,
    /// Raw Vulkan through ash.
    Vulkan,
    /// wgpu over Vulkan (or Metal/DX12).
    Wgpu,
    /// The f64 CPU reference.
    Reference,
}

impl BackendArg {
    /// The backend named `name` (as `--backend` spells it; any case where
    /// `ignore_case`), or `expected one of …` naming them all.
    pub fn parse(name: &str, ignore_case: bool) -> Result<Self, String> {
        BackendArg::from_str(name, ignore_case).map_err(|_| {
            let names: Vec<String> = BackendArg::value_variants()
                .iter()
                .filter_map(|b| b.to_possible_value().map(|p| p.get_name().to_string()))
                .collect();
            format!("expected one of {}", names.join(", "))
        })
    }
}

/// A concrete backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Raw Vulkan through ash.
    Vulkan,
    /// wgpu.
    Wgpu,
    /// The f64 CPU reference.
    Reference,
}

impl BackendKind {
    /// Every backend, in the `auto` policy's order.
    pub const ALL: [BackendKind; 3] = [BackendKind::Vulkan, BackendKind::Wgpu, BackendKind::Reference];

    /// The backend's name as `--backend` and `HEADKL_REQUIRE` spell it.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Vulkan => "vulkan",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Reference => "reference",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `--backend` and `--device`, shared by every subcommand.
#[derive(Args, Clone, Debug, Default)]
pub struct BackendArgs {
    /// Backend to run on: auto, vulkan, wgpu or reference [env: HEADKL_BACKEND]
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// Device index within the backend, as `headkl devices` lists them
    /// [env: HEADKL_DEVICE]
    #[arg(long)]
    pub device: Option<usize>,
}

impl BackendArgs {
    /// The options with `HEADKL_BACKEND` and `HEADKL_DEVICE` filled in where
    /// the command line left them out (the command line wins).
    pub fn with_settings(&self, settings: &Settings) -> Self {
        Self {
            backend: self.backend.or(settings.backend),
            device: self.device.or(settings.device()),
        }
    }
}

/// One device a backend enumerated.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Its backend.
    pub kind: BackendKind,
    /// Its index within the backend (what `--device` takes).
    pub index: usize,
    /// What it offers.
    pub info: DeviceInfo,
}

/// Every backend's devices, and the backends whose enumeration failed.
#[derive(Clone, Debug, Default)]
pub struct Enumeration {
    /// Devices found, backend by backend in policy order.
    pub candidates: Vec<Candidate>,
    /// Backends that could not enumerate, with why.
    pub failures: Vec<(BackendKind, String)>,
}

impl Enumeration {
    /// Why `kind` has no devices, if its enumeration failed.
    pub fn failure(&self, kind: BackendKind) -> Option<&str> {
        self.failures
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, why)| why.as_str())
    }
}

/// What `auto` chose and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AutoPick {
    /// The backend.
    pub kind: BackendKind,
    /// The device index within it.
    pub index: usize,
    /// Why, in words.
    pub reason: String,
}

/// Rank of a device type within one step of the policy (lower is better).
fn type_rank(device_type: &str) -> u8 {
    match device_type.to_ascii_lowercase().as_str() {
        t if t.contains("discrete") => 0,
        t if t.contains("integrated") => 1,
        t if t.contains("virtual") => 2,
        t if t.contains("cpu") => 4,
        _ => 3,
    }
}

/// Whether a device is a software rasterizer (lavapipe/llvmpipe,
/// SwiftShader): Vulkan and wgpu report those as device type CPU.
pub fn is_software(info: &DeviceInfo) -> bool {
    info.device_type.to_ascii_lowercase().contains("cpu")
}

/// Why `auto` passes over a usable software device, in words.
pub const SOFTWARE_REASON: &str =
    "a software rasterizer: the CPU reference runs the same work several times faster (4-5x measured on lavapipe)";

/// The policy step of a usable GPU candidate (lower is better), or `None`
/// for the reference backend, an unusable device, or a software
/// rasterizer (which ranks below the reference).
fn step(c: &Candidate) -> Option<u8> {
    if c.info.unusable.is_some() || is_software(&c.info) {
        return None;
    }
    match (c.kind, c.info.matrix_units) {
        (BackendKind::Vulkan, true) => Some(1),
        (BackendKind::Wgpu, true) => Some(2),
        (BackendKind::Vulkan, false) => Some(3),
        (BackendKind::Wgpu, false) => Some(4),
        (BackendKind::Reference, _) => None,
    }
}

/// The best usable GPU candidate among `candidates` (all backends, or those
/// of one backend), honouring a device filter.
pub fn best_gpu(candidates: &[Candidate], device: Option<usize>) -> Option<&Candidate> {
    candidates
        .iter()
        .filter(|c| device.is_none_or(|d| c.index == d))
        .filter_map(|c| step(c).map(|s| (s, type_rank(&c.info.device_type), c.index, c)))
        .min_by_key(|&(s, t, i, c)| (s, t, c.kind, i))
        .map(|(_, _, _, c)| c)
}

/// The `auto` policy: a pure function of the enumerated candidates (see
/// [`AUTO_POLICY`]). Falls back to the reference backend, so it never fails.
pub fn auto_pick(candidates: &[Candidate], device: Option<usize>) -> AutoPick {
    if let Some(c) = best_gpu(candidates, device) {
        let name = &c.info.device_name;
        let reason = if c.info.matrix_units {
            let shapes: Vec<String> = c
                .info
                .matrix_shapes
                .iter()
                .map(|(m, n, k)| format!("{m}x{n}x{k}"))
                .collect();
            format!(
                "{} device {} ({name}) has matrix units ({}); {}",
                c.kind,
                c.index,
                shapes.join(", "),
                if c.kind == BackendKind::Vulkan {
                    "Vulkan with matrix units comes first"
                } else {
                    "no Vulkan device with matrix units"
                }
            )
        } else {
            format!(
                "no usable device has matrix units; {} device {} ({name}) is the best {} device without them",
                c.kind, c.index, c.kind
            )
        };
        return AutoPick {
            kind: c.kind,
            index: c.index,
            reason,
        };
    }
    let software = candidates
        .iter()
        .any(|c| c.kind != BackendKind::Reference && c.info.unusable.is_none() && is_software(&c.info));
    let why = match (device, software) {
        (Some(d), _) => format!("no usable Vulkan or wgpu GPU with index {d}"),
        (None, true) => "the only Vulkan/wgpu devices are software rasterizers, slower than the reference".to_string(),
        (None, false) => "no usable Vulkan or wgpu device".to_string(),
    };
    AutoPick {
        kind: BackendKind::Reference,
        index: 0,
        reason: format!("{why}; the CPU reference always runs"),
    }
}

/// Runs `f`, turning a panic inside a backend's enumeration or start-up
/// (a driver a backend does not expect) into [`headkl_core::Error::Backend`]
/// instead of a crash. The panic message still goes through the process's
/// hook (no hook swapping: tests run in parallel).
pub fn contained<T>(backend: &'static str, f: impl FnOnce() -> headkl_core::Result<T>) -> headkl_core::Result<T> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let msg = headkl_core::toolkit::panic_message(&*payload);
            Err(headkl_core::Error::Backend {
                backend,
                message: format!("panicked: {msg}"),
            })
        }
    }
}

/// Lists one backend's devices, as `open` would use them with the
/// settings (`HEADKL_NO_COOPMAT` turns matrix units off in the listing).
pub fn enumerate_backend(kind: BackendKind, settings: &Settings) -> headkl_core::Result<Vec<DeviceInfo>> {
    let mut infos = match kind {
        BackendKind::Vulkan => contained("vulkan", || {
            headkl_vulkan::enumerate_with(&settings.vulkan.common.gemm_sources)
        })?,
        BackendKind::Wgpu => contained("wgpu", headkl_wgpu::enumerate)?,
        BackendKind::Reference => vec![headkl_reference::CpuBackend::new().info().clone()],
    };
    if settings.wgpu.common.force_fallback {
        for info in &mut infos {
            info.matrix_units = false;
        }
    }
    Ok(infos)
}

/// Lists every backend's devices; a backend that cannot enumerate is
/// recorded with why (a machine without a Vulkan loader still lists the
/// reference).
pub fn enumerate_all(settings: &Settings) -> Enumeration {
    let mut e = Enumeration::default();
    for kind in BackendKind::ALL {
        match enumerate_backend(kind, settings) {
            Ok(infos) if infos.is_empty() => e.failures.push((kind, "no devices found".into())),
            Ok(infos) => {
                e.candidates.extend(
                    infos
                        .into_iter()
                        .enumerate()
                        .map(|(index, info)| Candidate { kind, index, info }),
                )
            }
            Err(why) => e.failures.push((kind, why.to_string())),
        }
    }
    e
}

/// The device of `kind` to run on when no `auto` is involved: the best
/// usable one (or the one `device` names), or why there is none. A device
/// index the backend does not have is a bad option (exit 2).
pub fn target_for(kind: BackendKind, device: Option<usize>, settings: &Arc<Settings>) -> Result<Target, RunError> {
    if kind == BackendKind::Reference {
        check_index(kind, device, 1)?;
        return Ok(Target {
            kind,
            device,
            auto_reason: None,
            settings: settings.clone(),
        });
    }
    let candidates: Vec<Candidate> = enumerate_backend(kind, settings)
        .map_err(|e| RunError::Start(kind, e))?
        .into_iter()
        .enumerate()
        .map(|(index, info)| Candidate { kind, index, info })
        .collect();
    if !candidates.is_empty() {
        check_index(kind, device, candidates.len())?;
    }
    let usable = |c: &&Candidate| c.info.unusable.is_none() && device.is_none_or(|d| c.index == d);
    // A named backend runs where it can, software rasterizers included.
    if let Some(c) = best_gpu(&candidates, device).or_else(|| candidates.iter().find(usable)) {
        return Ok(Target {
            kind,
            device: Some(c.index),
            auto_reason: None,
            settings: settings.clone(),
        });
    }
    let why: Vec<String> = candidates
        .iter()
        .filter(|c| device.is_none_or(|d| c.index == d))
        .map(|c| {
            format!(
                "device {} ({}): {}",
                c.index,
                c.info.device_name,
                c.info.unusable.as_deref().unwrap_or("not usable")
            )
        })
        .collect();
    Err(RunError::Start(
        kind,
        headkl_core::Error::NoDevice {
            backend: kind.name(),
            reason: if why.is_empty() {
                "no devices found".into()
            } else {
                why.join("; ")
            },
        },
    ))
}

/// `--device` within `count` devices of `kind`, else a bad option.
fn check_index(kind: BackendKind, device: Option<usize>, count: usize) -> Result<(), RunError> {
    match device {
        Some(d) if d >= count => Err(RunError::Job(CliError::option(
            "--device",
            format!(
                "{kind} has no device {d} ({count} device{}; `headkl devices` lists them)",
                if count == 1 { "" } else { "s" }
            ),
        ))),
        _ => Ok(()),
    }
}

/// A backend and device to open, with the settings it opens with.
#[derive(Clone, Debug)]
pub struct Target {
    /// The backend.
    pub kind: BackendKind,
    /// The device index (`None`: the backend's default).
    pub device: Option<usize>,
    /// Why `auto` chose it, when it did.
    pub auto_reason: Option<String>,
    /// The command's settings (the backends' options among them).
    pub settings: Arc<Settings>,
}

/// The target one job runs on: the named backend, or `auto`'s pick
/// (`HEADKL_BACKEND` and `HEADKL_DEVICE` fill in what the command line
/// leaves out). A device index that no backend in question has is a bad
/// option (exit 2).
pub fn resolve(args: &BackendArgs, settings: &Arc<Settings>) -> Result<Target, RunError> {
    let args = args.with_settings(settings);
    match args.backend.unwrap_or(BackendArg::Auto) {
        BackendArg::Auto => {
            let e = enumerate_all(settings);
            if let Some(d) = args.device {
                if !e.candidates.iter().any(|c| c.index == d) {
                    return Err(RunError::Job(CliError::option(
                        "--device",
                        format!("no backend has a device {d} (`headkl devices` lists them)"),
                    )));
                }
            }
            let pick = auto_pick(&e.candidates, args.device);
            Ok(Target {
                kind: pick.kind,
                device: Some(pick.index),
                auto_reason: Some(pick.reason),
                settings: settings.clone(),
            })
        }
        named => {
            let kind = named_kind(named);
            let count = match kind {
                BackendKind::Reference => Some(1),
                // A backend that cannot enumerate fails at open, with why.
                _ => enumerate_backend(kind, settings)
                    .ok()
                    .map(|infos| infos.len())
                    .filter(|&n| n > 0),
            };
            if let Some(count) = count {
                check_index(kind, args.device, count)?;
            }
            Ok(Target {
                kind,
                device: args.device,
                auto_reason: None,
                settings: settings.clone(),
            })
        }
    }
}

/// [`resolve`], logging what `auto` picked and why.
pub fn resolve_announced(args: &BackendArgs, who: &str, settings: &Arc<Settings>) -> Result<Target, RunError> {
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

/// The concrete backend of a non-auto argument.
pub fn named_kind(arg: BackendArg) -> BackendKind {
    match arg {
        BackendArg::Vulkan => BackendKind::Vulkan,
        BackendArg::Wgpu => BackendKind::Wgpu,
        BackendArg::Reference | BackendArg::Auto => BackendKind::Reference,
    }
}

/// Whether `HEADKL_REQUIRE` names `kind`: failing to start it is an error,
/// not a skip.
pub fn required(kind: BackendKind, settings: &Settings) -> bool {
    settings.suite.requires(kind.name())
}

/// Work that runs on any backend. `run` is generic, so each backend's
/// buffer type stays static (no trait objects).
pub trait BackendJob {
    /// What the job returns.
    type Output;
    /// Runs the job on an opened backend.
    fn run<B: Backend>(self, backend: B) -> Result<Self::Output, CliError>;
}

/// Why [`open_and_run`] failed: the backend did not start, or the job failed.
#[derive(Debug)]
pub enum RunError {
    /// The backend could not be opened (a bad setting, or a device that
    /// cannot start: [`crate::error::is_validation`] tells them apart).
    Start(BackendKind, headkl_core::Error),
    /// The job failed.
    Job(CliError),
}

impl From<RunError> for CliError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Start(kind, source) => CliError::start(kind.name(), source),
            RunError::Job(e) => e,
        }
    }
}

/// Opens `target` and runs `job` on it.
pub fn open_and_run<J: BackendJob>(target: &Target, job: J) -> Result<J::Output, RunError> {
    open_and_run_gemm(target, None, job)
}

/// [`open_and_run`] with the matrix-unit GEMM kernels `gemm` (`None`: the
/// backend's own choice: `HEADKL_GEMM`, the tune cache, the default). The
/// backends' other options come from the settings.
pub fn open_and_run_gemm<J: BackendJob>(
    target: &Target,
    gemm: Option<headkl_core::GemmChoice>,
    job: J,
) -> Result<J::Output, RunError> {
    match target.kind {
        BackendKind::Reference => {
            if target.device.is_some_and(|d| d != 0) {
                return Err(RunError::Job(CliError::option(
                    "--device",
                    "the reference backend has one device, index 0",
                )));
            }
            job.run(headkl_reference::CpuBackend::new()).map_err(RunError::Job)
        }
        BackendKind::Wgpu => job.run(open_gpu::<WgpuBackend>(target, gemm)?).map_err(RunError::Job),
        BackendKind::Vulkan => job.run(open_gpu::<VulkanBackend>(target, gemm)?).map_err(RunError::Job),
    }
}

/// A GPU backend the command opens: its options are the settings' with the
/// command's device and GEMM kernels laid over them.
pub trait GpuBackend: ResidentBackend + Sync + Sized {
    /// The backend's name in messages.
    const NAME: &'static str;
    /// How the backend is opened.
    type Options: Clone;
    /// The settings' options for this backend (the `HEADKL_*` values).
    fn configured(settings: &Settings) -> &Self::Options;
    /// The part of `options` every backend shares (device, GEMM kernels).
    fn common(options: &mut Self::Options) -> &mut CommonOptions;
    /// Opens the backend with `options`.
    fn open_with(options: &Self::Options) -> headkl_core::Result<Self>;

    /// The settings' options on `target`'s device with the GEMM kernels
    /// `gemm` (`None`: the backend's own choice).
    fn options(target: &Target, gemm: Option<headkl_core::GemmChoice>) -> Self::Options {
        let mut options = Self::configured(&target.settings).clone();
        let common = Self::common(&mut options);
        common.device = target.device.or(common.device);
        common.gemm = gemm;
        options
    }
}

/// [`GpuBackend`] for `$backend`, named `$name` in messages: its options,
/// of type `$options`, are the settings' field `$settings`.
macro_rules! gpu_backend {
    ($backend:ident, $name:literal, $options:ty, $settings:ident) => {
        impl GpuBackend for $backend {
            const NAME: &'static str = $name;
            type Options = $options;

            fn configured(settings: &Settings) -> &Self::Options {
                &settings.$settings
            }

            fn common(options: &mut Self::Options) -> &mut CommonOptions {
                &mut options.common
            }

            fn open_with(options: &Self::Options) -> headkl_core::Result<Self> {
                $backend::open_with(options)
            }
        }
    };
}

gpu_backend!(WgpuBackend, "wgpu", headkl_wgpu::OpenOptions, wgpu);
gpu_backend!(VulkanBackend, "vulkan", headkl_vulkan::VulkanOptions, vulkan);

/// Opens `B` on `target`'s device, a panic inside it contained; a failure
/// is a start error of `target`'s kind.
pub fn open_gpu<B: GpuBackend>(target: &Target, gemm: Option<headkl_core::GemmChoice>) -> Result<B, RunError> {
    let options = B::options(target, gemm);
    contained(B::NAME, || B::open_with(&options)).map_err(|e| RunError::Start(target.kind, e))
}

/// A job that also runs the device-resident entry points (a
/// [`BackendJob`] for a backend with [`ResidentBackend`]).
pub trait ResidentJob {
    /// What the job returns.
    type Output;
    /// Runs the job on an opened backend.
    fn run_resident<B: ResidentBackend + Sync>(self, backend: B) -> Result<Self::Output, CliError>;
}

/// [`open_and_run`] for a [`ResidentJob`]: the GPU backends only (the CPU
/// reference has no device buffers), which is an error naming `--resident`.
pub fn open_and_run_resident<J: ResidentJob>(target: &Target, job: J) -> Result<J::Output, RunError> {
    match target.kind {
        BackendKind::Reference => Err(RunError::Job(CliError::option(
            "--resident",
            "the reference backend has no device buffers; use --backend wgpu or vulkan",
        ))),
        BackendKind::Wgpu => job
            .run_resident(open_gpu::<WgpuBackend>(target, None)?)
            .map_err(RunError::Job),
        BackendKind::Vulkan => job
            .run_resident(open_gpu::<VulkanBackend>(target, None)?)
            .map_err(RunError::Job),
    }
}

/// Describes a device in one line for progress messages.
pub fn describe(info: &DeviceInfo) -> String {
    format!(
        "{} on {} ({}, matrix units {})",
        info.backend,
        info.device_name,
        info.device_type,
        if info.matrix_units { "on" } else { "off" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(backend: &'static str, name: &str, ty: &str, mu: bool, unusable: Option<&str>) -> DeviceInfo {
        DeviceInfo {
            backend,
            device_name: name.into(),
            driver: "test".into(),
            device_type: ty.into(),
            matrix_units: mu,
            gemm: None,
            queue: None,
            matrix_shapes: if mu { vec![(16, 16, 16)] } else { vec![] },
            shader_f16: true,
            subgroup_size: Some(32),
            max_binding_bytes: 1 << 30,
            max_buffer_bytes: 1 << 30,
            memory_bytes: None,
            unusable: unusable.map(String::from),
        }
    }

    fn cand(kind: BackendKind, index: usize, info: DeviceInfo) -> Candidate {
        Candidate { kind, index, info }
    }

    fn reference() -> Candidate {
        cand(BackendKind::Reference, 0, info("reference", "cpu", "cpu", false, None))
    }

    #[test]
    fn vulkan_with_matrix_units_first() {
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "llvmpipe", "cpu", false, None)),
            cand(BackendKind::Vulkan, 1, info("vulkan", "H200", "discrete", true, None)),
            cand(BackendKind::Wgpu, 0, info("wgpu", "H200", "discrete", true, None)),
            reference(),
        ];
        let p = auto_pick(&c, None);
        assert_eq!((p.kind, p.index), (BackendKind::Vulkan, 1));
        assert!(p.reason.contains("matrix units"), "{}", p.reason);
    }

    #[test]
    fn wgpu_with_matrix_units_beats_vulkan_without() {
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "gpu", "discrete", false, None)),
            cand(BackendKind::Wgpu, 0, info("wgpu", "gpu", "discrete", true, None)),
            reference(),
        ];
        let p = auto_pick(&c, None);
        assert_eq!((p.kind, p.index), (BackendKind::Wgpu, 0));
    }

    #[test]
    fn vulkan_without_beats_wgpu_without_and_unusable_devices_are_skipped() {
        let c = vec![
            cand(
                BackendKind::Vulkan,
                0,
                info("vulkan", "old", "discrete", true, Some("no shaderFloat16")),
            ),
            cand(BackendKind::Wgpu, 0, info("wgpu", "igpu", "integrated", false, None)),
            cand(
                BackendKind::Vulkan,
                1,
                info("vulkan", "igpu", "integrated", false, None),
            ),
            reference(),
        ];
        let p = auto_pick(&c, None);
        assert_eq!((p.kind, p.index), (BackendKind::Vulkan, 1));
        assert!(p.reason.contains("no usable device has matrix units"), "{}", p.reason);
    }

    #[test]
    fn discrete_beats_integrated_within_a_step() {
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "vgpu", "virtual", false, None)),
            cand(
                BackendKind::Vulkan,
                1,
                info("vulkan", "igpu", "integrated", false, None),
            ),
            cand(BackendKind::Vulkan, 2, info("vulkan", "dgpu", "discrete", false, None)),
        ];
        assert_eq!(auto_pick(&c, None).index, 2);
        assert_eq!(auto_pick(&c, Some(0)).index, 0);
    }

    #[test]
    fn falls_back_to_reference() {
        let p = auto_pick(&[reference()], None);
        assert_eq!((p.kind, p.index), (BackendKind::Reference, 0));
        let p = auto_pick(&[], None);
        assert_eq!(p.kind, BackendKind::Reference);
        let c = vec![cand(
            BackendKind::Wgpu,
            0,
            info("wgpu", "gpu", "discrete", true, Some("missing f16")),
        )];
        let p = auto_pick(&c, None);
        assert_eq!(p.kind, BackendKind::Reference);
        assert!(p.reason.contains("reference"), "{}", p.reason);
        let c = vec![cand(BackendKind::Wgpu, 0, info("wgpu", "gpu", "discrete", true, None))];
        assert_eq!(auto_pick(&c, Some(3)).kind, BackendKind::Reference);
    }

    #[test]
    fn contained_turns_panics_into_errors() {
        let r: headkl_core::Result<()> = contained("probe", || panic!("boom"));
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("probe") && msg.contains("panicked: boom"), "{msg}");
        assert_eq!(contained("probe", || Ok(3)).ok(), Some(3));
    }

    #[test]
    fn software_rasterizers_rank_below_the_reference() {
        // lavapipe on both GPU backends: auto runs the reference, and says why.
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "llvmpipe", "cpu", false, None)),
            cand(BackendKind::Wgpu, 0, info("wgpu", "llvmpipe", "Cpu", false, None)),
            reference(),
        ];
        let p = auto_pick(&c, None);
        assert_eq!(p.kind, BackendKind::Reference, "{}", p.reason);
        assert!(p.reason.contains("software rasterizers"), "{}", p.reason);
        // Even with matrix units claimed, a CPU-type device is not a GPU.
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "SwiftShader", "cpu", true, None)),
            reference(),
        ];
        assert_eq!(auto_pick(&c, None).kind, BackendKind::Reference);
        // A real GPU still wins over the reference.
        let c = vec![
            cand(BackendKind::Vulkan, 0, info("vulkan", "llvmpipe", "cpu", false, None)),
            cand(
                BackendKind::Vulkan,
                1,
                info("vulkan", "igpu", "integrated", false, None),
            ),
            reference(),
        ];
        assert_eq!(
            (auto_pick(&c, None).kind, auto_pick(&c, None).index),
            (BackendKind::Vulkan, 1)
        );
    }
}
