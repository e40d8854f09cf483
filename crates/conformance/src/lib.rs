//! headkl-conformance: the conformance suite every backend runs, written
//! once and generic over a [`Backend`]; its seeded case generator
//! ([`generator`], the crate's own, not proptest's: `headkl check` ships
//! it); and the test harness (settings, logger, [`open_or_skip`], the
//! per-backend record `scripts/test.sh` prints).
//!
//! A crate of its own beside `headkl-reference`, whose f64 formulas
//! ([`headkl_reference::direct`]) and [`Tolerance`] judge every case: a
//! program that wants the CPU backend does not link the test machinery.
//! It adds no dependency beyond `headkl-reference`'s.
//!
//! The suite's five parts ([`Part`]):
//! - **kernels**: the backend's primitives called directly on crafted
//!   inputs with poisoned (NaN) outputs: GEMM in both head layouts with
//!   exact small-integer data (results exact in f32), offsets, wide
//!   strides, `alpha ≠ 1` and accumulation; `hidden_in` (f32, f16 and
//!   bf16 rows into the padded f16 operand) and its zero pad;
//!   `kl_rows` and `topk_rows` against the formulas on the same f32 logits
//!   (ties, one residue class mod 256, k = 1, k = 2048, non-finite rows);
//! - **driver cases**: [`SuiteConfig::cases`] cases drawn by
//!   [`crate::generator::draw_case_params`] from the suite's seed, alternating
//!   `head_kl` and `topk`, run through [`Engine`] and compared with
//!   [`headkl_reference::direct`] by [`Tolerance`];
//! - **regressions**: a fixed list of named cases;
//! - **head gradient**: `LossConfig::head_grad` against
//!   [`headkl_reference::direct::head_kl_and_head_grad_f64`] over a fixed list of
//!   named cases (every divergence and term, weights and reductions,
//!   chunks, slices, a vocabulary order, f32/f16/bf16 rows, the
//!   full-vocabulary teacher, the block filter), with the gradient off,
//!   on and on again on one engine;
//! - **errors**: non-finite hidden rows must fail with
//!   [`headkl_core::Error::NonFiniteHidden`] naming the first bad token;
//!   several slices with several chunks; recovery after an error; memory
//!   returned when an engine is dropped.
//!
//! After every case the backend's diagnostics are drained
//! ([`Backend::take_diagnostics`]); any message fails the case. A backend
//! error or a panic inside a case fails that case and the suite goes on.
//!
//! ```
//! use headkl_conformance::{run_suite, SuiteConfig};
//! use headkl_reference::CpuBackend;
//!
//! let backend = CpuBackend::new();
//! let cfg = SuiteConfig { cases: 2, seed: 7 };
//! let report = run_suite(&backend, &cfg, &mut |case| {
//!     if !case.passed {
//!         eprintln!("FAIL {}: {}", case.name, case.message);
//!     }
//! });
//! assert_eq!(report.backend, "reference");
//! assert_eq!(report.passed, report.cases, "{:?}", report.failures);
//! ```
//!
//! A backend crate runs it with one line in `tests/conformance.rs`:
//!
//! ```text
//! headkl_conformance::conformance_tests!("wgpu", headkl_wgpu::WgpuBackend::open(None));
//! ```

#![warn(missing_docs)]

mod cases;
pub mod generator;
mod harness;
mod kernels;
mod overlap;
pub mod resident;
pub mod shard;
pub mod shard_resident;
pub mod threads;
pub mod trainer;

use std::panic::AssertUnwindSafe;

pub use harness::{ensure_runtime_dir, harness_env, harness_suite, open_or_skip};

use headkl_core::toolkit::settings::{self, Env};
use headkl_core::{Backend, DeviceInfo, Engine};

use crate::generator::{draw_case_params, Case, CaseKind, Rng};
use headkl_reference::tolerance::Tolerance;

/// Default seed of the drawn cases when `HEADKL_SEED` is not set.
pub const DEFAULT_SEED: u64 = 0x4845_4144_4b4c_0001;

/// Default number of drawn cases when `HEADKL_CASES` is not set.
pub const DEFAULT_CASES: usize = 16;

/// How many drawn cases to run, and their seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SuiteConfig {
    /// Drawn driver cases (`HEADKL_CASES`, default 16).
    pub cases: usize,
    /// Seed of the drawn cases (`HEADKL_SEED`, decimal or `0x` hex).
    pub seed: u64,
}

impl Default for SuiteConfig {
    /// [`DEFAULT_CASES`] drawn cases from [`DEFAULT_SEED`].
    fn default() -> Self {
        Self {
            cases: DEFAULT_CASES,
            seed: DEFAULT_SEED,
        }
    }
}

impl SuiteConfig {
    /// `HEADKL_CASES` and `HEADKL_SEED` where set, else the defaults.
    pub fn from_settings(settings: &SuiteSettings) -> Self {
        Self {
            cases: settings.cases.unwrap_or(DEFAULT_CASES),
            seed: settings.seed.unwrap_or(DEFAULT_SEED),
        }
    }
}

/// The backends `HEADKL_REQUIRE` can name.
pub const BACKEND_NAMES: [&str; 4] = ["cuda", "vulkan", "wgpu", "reference"];

/// The conformance suite's settings, as the environment gives them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SuiteSettings {
    /// `HEADKL_CASES`: drawn driver cases.
    pub cases: Option<usize>,
    /// `HEADKL_SEED`: the drawn cases' seed.
    pub seed: Option<u64>,
    /// `HEADKL_REQUIRE`: backends that must start (one of
    /// [`BACKEND_NAMES`] each), lowercase.
    pub require: Vec<&'static str>,
}

impl SuiteSettings {
    /// `HEADKL_CASES`, `HEADKL_SEED` and `HEADKL_REQUIRE`; a value that does
    /// not parse is an error naming it.
    pub fn from_env(env: &Env) -> headkl_core::Result<Self> {
        let require = match env.text(settings::REQUIRE)? {
            None => Vec::new(),
            Some(v) => v
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| {
                    BACKEND_NAMES
                        .iter()
                        .copied()
                        .find(|b| b.eq_ignore_ascii_case(s))
                        .ok_or_else(|| {
                            settings::invalid(
                                settings::REQUIRE,
                                &v,
                                &format!("`{s}` is not a backend ({})", BACKEND_NAMES.join(", ")),
                            )
                        })
                })
                .collect::<headkl_core::Result<_>>()?,
        };
        Ok(Self {
            cases: env.count(settings::CASES)?,
            seed: env.number(settings::SEED)?,
            require,
        })
    }

    /// Whether `HEADKL_REQUIRE` names `backend`.
    pub fn requires(&self, backend: &str) -> bool {
        self.require.iter().any(|b| b.eq_ignore_ascii_case(backend))
    }
}

/// The result of one case.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseOutcome {
    /// Case name (`kernels/…`, `driver#N …`, `regression/…`, `errors/…`).
    pub name: String,
    /// One line: shape and knobs.
    pub description: String,
    /// The suite seed that draws this case (drawn cases), 0 for fixed ones.
    pub seed: u64,
    /// Whether every check passed.
    pub passed: bool,
    /// What failed (empty when passed).
    pub message: String,
    /// The errors it measured.
    pub errors: CaseErrors,
}

impl CaseOutcome {
    /// A case that failed before it ran: `message` says why it could not be
    /// built.
    fn unbuilt(name: String, seed: u64, message: String) -> Self {
        CaseOutcome {
            name,
            description: String::new(),
            seed,
            passed: false,
            message,
            errors: CaseErrors::default(),
        }
    }
}

/// The results of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct SuiteReport {
    /// Backend name (`DeviceInfo::backend`).
    pub backend: String,
    /// Device name.
    pub device: String,
    /// Whether the device's GEMM runs on matrix units.
    pub matrix_units: bool,
    /// Cases run.
    pub cases: usize,
    /// Cases passed.
    pub passed: usize,
    /// The failed cases.
    pub failures: Vec<CaseOutcome>,
    /// Worst loss error over all cases (0 when none measured).
    pub worst_loss_err: f64,
    /// Worst dx error over all cases.
    pub worst_dx_err: f64,
    /// Worst top-k probability error over all cases.
    pub worst_prob_err: f64,
    /// Worst error of the head's gradient over all cases (0 when none
    /// measured).
    pub worst_head_grad_err: f64,
}

impl SuiteReport {
    /// Adds `other`'s cases (another part run on the same device, such as
    /// the resident cases) to this report.
    pub fn absorb(&mut self, other: SuiteReport) {
        self.cases += other.cases;
        self.passed += other.passed;
        self.failures.extend(other.failures);
        self.worst_loss_err = self.worst_loss_err.max(other.worst_loss_err);
        self.worst_dx_err = self.worst_dx_err.max(other.worst_dx_err);
        self.worst_prob_err = self.worst_prob_err.max(other.worst_prob_err);
        self.worst_head_grad_err = self.worst_head_grad_err.max(other.worst_head_grad_err);
    }

    /// Each failure as one `name: message` line.
    pub fn failure_lines(&self) -> Vec<String> {
        self.failures
            .iter()
            .map(|f| format!("{}: {}", f.name, f.message))
            .collect()
    }

    /// One line: backend, device, passed/run and the worst errors (the
    /// head gradient's where a case measured it).
    pub fn summary(&self) -> String {
        let head_grad = if self.worst_head_grad_err > 0.0 {
            format!(", head_grad err {:.2e}", self.worst_head_grad_err)
        } else {
            String::new()
        };
        format!(
            "{} on {}{}: {}/{} passed; worst loss err {:.2e}, dx err {:.2e}, prob err {:.2e}{head_grad}",
            self.backend,
            self.device,
            if self.matrix_units { " (matrix units)" } else { "" },
            self.passed,
            self.cases,
            self.worst_loss_err,
            self.worst_dx_err,
            self.worst_prob_err
        )
    }
}

/// A part of the suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The backend's kernels called directly.
    Kernels,
    /// `SuiteConfig::cases` drawn cases through the driver.
    DriverCases,
    /// The fixed regression cases.
    Regressions,
    /// The head's gradient (`LossConfig::head_grad`) cases.
    HeadGrad,
    /// Non-finite inputs, multi-slice/multi-chunk, recovery, memory.
    Errors,
    /// All of the above.
    All,
}

impl Part {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Part::Kernels => "kernels",
            Part::DriverCases => "driver_cases",
            Part::Regressions => "regressions",
            Part::HeadGrad => "head_grad",
            Part::Errors => "errors",
            Part::All => "all",
        }
    }

    fn includes(self, other: Part) -> bool {
        self == Part::All || self == other
    }
}

/// The errors one case measured, each where the case checks it (and
/// against its [`Tolerance`] bound).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CaseErrors {
    /// Loss error (relative).
    pub loss: Option<f64>,
    /// dx error (relative L2).
    pub dx: Option<f64>,
    /// Worst top-k probability error (relative).
    pub prob: Option<f64>,
    /// The head's gradient error (relative L2).
    pub head_grad: Option<f64>,
}

/// Cases the whole suite runs for `cfg`.
pub fn case_count(cfg: &SuiteConfig) -> usize {
    part_case_count(Part::All, cfg)
}

/// Cases one part runs for `cfg`.
pub fn part_case_count(part: Part, cfg: &SuiteConfig) -> usize {
    let mut n = 0;
    if part.includes(Part::Kernels) {
        n += kernels::kernel_cases().len();
    }
    if part.includes(Part::DriverCases) {
        n += cfg.cases;
    }
    if part.includes(Part::Regressions) {
        n += cases::regression_names().len();
    }
    if part.includes(Part::HeadGrad) {
        n += cases::head_grad_names().len();
    }
    if part.includes(Part::Errors) {
        n += cases::ERROR_CASES.len();
    }
    n
}

/// Runs the whole suite on `backend`; `progress` sees each case as it
/// finishes.
pub fn run_suite<B: Backend + ?Sized>(
    backend: &B,
    cfg: &SuiteConfig,
    progress: &mut dyn FnMut(&CaseOutcome),
) -> SuiteReport {
    run_part(backend, Part::All, cfg, progress)
}

/// What a backend did when asked to run the GEMM kernels `choice` from
/// now on (`outcome`, from its `use_gemm`): either it took them, and then
/// the kernel cases pass with them (`Ok(true)`), or it refused with an
/// [`headkl_core::Error::InvalidSetting`] naming `HEADKL_GEMM` and the
/// choice (`Ok(false)`). A device without matrix units must refuse.
/// `Err` says what is wrong. Both GPU backends' tests call it with the
/// GLSL tiles: CI's lavapipe must refuse them, the H200 must run them.
pub fn gemm_choice_outcome<B: Backend + ?Sized>(
    backend: &B,
    choice: headkl_core::GemmChoice,
    outcome: headkl_core::Result<()>,
) -> Result<bool, String> {
    let matrix_units = backend.info().matrix_units;
    match outcome {
        Ok(()) if !matrix_units => Err(format!("{choice} accepted on a device without matrix units")),
        Ok(()) => {
            let report = run_part(backend, Part::Kernels, &SuiteConfig { cases: 0, seed: 0 }, &mut |_| {});
            match report.failures.first() {
                None if report.cases > 0 => Ok(true),
                None => Err("no kernel cases ran".into()),
                Some(f) => Err(format!("{choice}: {}: {}", f.name, f.message)),
            }
        }
        Err(headkl_core::Error::InvalidSetting { name, value, reason })
            if name == headkl_core::toolkit::gemm_choice::GEMM_ENV
                && value == choice.to_string()
                && !reason.is_empty() =>
        {
            Ok(false)
        }
        Err(other) => Err(format!("{choice}: not the typed refusal: {other:?}")),
    }
}

/// Runs one part of the suite on `backend`.
pub fn run_part<B: Backend + ?Sized>(
    backend: &B,
    part: Part,
    cfg: &SuiteConfig,
    progress: &mut dyn FnMut(&CaseOutcome),
) -> SuiteReport {
    let mut rec = Recorder::new(backend.info(), progress);
    let tol = Tolerance::default();
    if part.includes(Part::Kernels) {
        for kc in kernels::kernel_cases() {
            let outcome = run_one(backend, kc.name(), kc.describe(), 0, || kc.run(backend, &tol));
            rec.push(outcome);
        }
    }
    if part.includes(Part::DriverCases) {
        for index in 0..cfg.cases {
            let outcome = match driver_case(cfg.seed, index) {
                Ok(case) => {
                    let name = format!("driver#{index} {}", case.name);
                    run_one(backend, name, case.describe(), cfg.seed, || {
                        cases::check_case(backend, &case, &tol)
                    })
                }
                Err(message) => CaseOutcome::unbuilt(format!("driver#{index}"), cfg.seed, message),
            };
            rec.push(outcome);
        }
    }
    if part.includes(Part::Regressions) {
        for name in cases::regression_names() {
            let reg = cases::regression(name);
            let description = reg.as_ref().map_or_else(|e| e.clone(), |r| r.case.describe());
            let outcome = run_one(backend, format!("regression/{name}"), description, 0, || {
                cases::check_regression(backend, &reg?, &tol)
            });
            rec.push(outcome);
        }
    }
    if part.includes(Part::HeadGrad) {
        for &name in cases::head_grad_names() {
            let description = cases::describe_head_grad_case(name);
            let outcome = run_one(backend, format!("head_grad/{name}"), description, 0, || {
                cases::check_head_grad_case(backend, name, &tol)
            });
            rec.push(outcome);
        }
    }
    if part.includes(Part::Errors) {
        for &(name, what) in cases::ERROR_CASES {
            let outcome = run_one(backend, format!("errors/{name}"), what.to_string(), 0, || {
                cases::check_error_case(backend, name, &tol)
            });
            rec.push(outcome);
        }
    }
    rec.report
}

struct Recorder<'a> {
    report: SuiteReport,
    progress: &'a mut dyn FnMut(&CaseOutcome),
}

impl<'a> Recorder<'a> {
    /// An empty report for the backend `info` describes.
    fn new(info: &DeviceInfo, progress: &'a mut dyn FnMut(&CaseOutcome)) -> Self {
        Recorder {
            report: SuiteReport {
                backend: info.backend.to_string(),
                device: info.device_name.clone(),
                matrix_units: info.matrix_units,
                cases: 0,
                passed: 0,
                failures: Vec::new(),
                worst_loss_err: 0.0,
                worst_dx_err: 0.0,
                worst_prob_err: 0.0,
                worst_head_grad_err: 0.0,
            },
            progress,
        }
    }

    fn push(&mut self, o: CaseOutcome) {
        let r = &mut self.report;
        r.cases += 1;
        let worst = |w: &mut f64, e: Option<f64>| {
            if let Some(e) = e.filter(|e| e.is_finite()) {
                *w = w.max(e);
            }
        };
        worst(&mut r.worst_loss_err, o.errors.loss);
        worst(&mut r.worst_dx_err, o.errors.dx);
        worst(&mut r.worst_prob_err, o.errors.prob);
        worst(&mut r.worst_head_grad_err, o.errors.head_grad);
        (self.progress)(&o);
        if o.passed {
            r.passed += 1;
        } else {
            r.failures.push(o);
        }
    }
}

/// Runs one case: catches a panic, drains diagnostics, and turns it all
/// into an outcome.
fn run_one<B: Backend + ?Sized>(
    backend: &B,
    name: String,
    description: String,
    seed: u64,
    f: impl FnOnce() -> Result<CaseErrors, String>,
) -> CaseOutcome {
    let result = match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = headkl_core::toolkit::panic_message(&*payload);
            Err(format!("panicked: {msg}"))
        }
    };
    let diagnostics = backend.take_diagnostics();
    let (mut passed, mut message, m) = match result {
        Ok(m) => (true, String::new(), m),
        Err(e) => (false, e, CaseErrors::default()),
    };
    if !diagnostics.is_empty() {
        passed = false;
        if !message.is_empty() {
            message.push_str("; ");
        }
        message.push_str(&format!(
            "{} diagnostic(s): {}",
            diagnostics.len(),
            diagnostics.join(" | ")
        ));
    }
    CaseOutcome {
        name,
        description,
        seed,
        passed,
        message,
        errors: m,
    }
}

/// The seed of drawn case `index` under `suite_seed`.
fn case_seed(suite_seed: u64, index: usize) -> u64 {
    Rng::new(suite_seed ^ (index as u64).wrapping_mul(0xA076_1D64_78BD_642F)).next_u64()
}

/// Drawn case `index` of a suite seeded with `suite_seed` (even indices
/// `head_kl`, odd `topk`): rebuilds a failing case alone for a replay.
pub fn driver_case(suite_seed: u64, index: usize) -> Result<Case, String> {
    let kind = if index.is_multiple_of(2) {
        CaseKind::HeadKl
    } else {
        CaseKind::Topk
    };
    Ok(Case::from_params(&draw_case_params(kind, case_seed(suite_seed, index))))
}

/// Runs `case` on `backend` through the driver and compares it with the
/// direct f64 formula: `Ok` with the errors measured, or `Err` with what
/// failed (a backend error, or a [`headkl_reference::Mismatch`] message).
pub fn check_case<B: Backend + ?Sized>(backend: &B, case: &Case) -> Result<CaseErrors, String> {
    cases::check_case(backend, case, &Tolerance::default())
}

/// The body of each test [`crate::conformance_tests!`] generates: opens the
/// backend (or skips), runs `part` with [`SuiteConfig::default`], logs a
/// summary, and panics listing every failure.
pub fn run_test<B: Backend>(backend_name: &str, open: impl FnOnce() -> headkl_core::Result<B>, part: Part) {
    let cfg = SuiteConfig::from_settings(&harness_suite());
    let name = part.name();
    let Some(report) = harness::run_recorded(backend_name, open, name, name, |backend, progress| {
        run_part(backend, part, &cfg, progress)
    }) else {
        return;
    };
    if !report.failures.is_empty() {
        let mut msg = format!(
            "{} of {} conformance cases failed on {} ({}); replay with HEADKL_SEED={:#x} HEADKL_CASES={}",
            report.failures.len(),
            report.cases,
            report.backend,
            report.device,
            cfg.seed,
            cfg.cases
        );
        for f in &report.failures {
            msg.push_str(&format!("\n- {}\n    {}\n    ", f.name, f.description));
            if let Some(index) = f.name.strip_prefix("driver#").and_then(|s| s.split(' ').next()) {
                msg.push_str(&format!(
                    "seed {:#x} (rebuild: headkl_conformance::driver_case({:#x}, {index})): ",
                    f.seed, f.seed
                ));
            }
            msg.push_str(&f.message);
        }
        panic!("{msg}");
    }
    // A run that checked nothing would pass vacuously.
    assert!(report.cases > 0 || cfg.cases == 0, "no conformance cases ran");
}

/// Instantiates the conformance suite as `#[test]` functions
/// (`conformance_kernels`, `conformance_driver_cases`,
/// `conformance_regressions`, `conformance_head_grad`,
/// `conformance_errors`).
///
/// `$open` is an expression giving `headkl_core::Result<B>` for a backend
/// `B`; each test evaluates it once. A backend that cannot start says
/// `SKIP <name>: <why>` ([`open_or_skip`]), or fails when `HEADKL_REQUIRE` names it. The
/// `mod <ident>,` form wraps the tests in a module, for a second
/// instantiation in one file.
///
/// ```text
/// headkl_conformance::conformance_tests!("wgpu", headkl_wgpu::WgpuBackend::open(None));
/// headkl_conformance::conformance_tests!(mod small_binding, "reference",
///     Ok::<_, headkl_core::Error>(headkl_reference::CpuBackend::with_max_binding(256 << 10)));
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (mod $module:ident, $name:literal, $open:expr $(,)?) => {
        mod $module {
            #[allow(unused_imports, reason = "a suite may use only some of the names")]
            use super::*;
            $crate::conformance_tests!($name, $open);
        }
    };
    ($name:literal, $open:expr $(,)?) => {
        $crate::conformance_tests!(
            @parts $name,
            $open,
            conformance_kernels: Kernels,
            conformance_driver_cases: DriverCases,
            conformance_regressions: Regressions,
            conformance_head_grad: HeadGrad,
            conformance_errors: Errors,
        );
    };
    (@parts $name:literal, $open:expr, $($test:ident: $part:ident),+ $(,)?) => {
        $(
            #[test]
            fn $test() {
                $crate::run_test($name, || $open, $crate::Part::$part);
            }
        )+
    };
}

/// Builds an engine for `case` (shared by the case runners).
pub(crate) fn engine_for<'b, B: Backend + ?Sized>(backend: &'b B, case: &Case) -> Result<Engine<&'b B>, String> {
    let head = case.head_weights().map_err(|e| format!("case head: {e}"))?;
    Engine::new(backend, &head, case.slice_options()).map_err(|e| format!("Engine::new: {e}"))
}

#[cfg(test)]
mod settings_tests {
    use super::*;

    #[test]
    fn suite_settings_parse_and_bad_values_name_them() {
        let env = Env::from_pairs([
            (settings::CASES, "32"),
            (settings::SEED, "0x11"),
            (settings::REQUIRE, "wgpu, Vulkan"),
        ]);
        let s = SuiteSettings::from_env(&env).unwrap();
        assert_eq!((s.cases, s.seed), (Some(32), Some(17)));
        assert!(s.requires("wgpu") && s.requires("vulkan") && !s.requires("reference"));
        assert_eq!(SuiteConfig::from_settings(&s), SuiteConfig { cases: 32, seed: 17 });
        assert_eq!(
            SuiteConfig::from_settings(&SuiteSettings::from_env(&Env::from_pairs([])).unwrap()),
            SuiteConfig::default()
        );
        for (name, bad) in [
            (settings::REQUIRE, "wgpu,metal"),
            (settings::CASES, "-1"),
            (settings::SEED, "0xzz"),
        ] {
            let e = SuiteSettings::from_env(&Env::from_pairs([(name, bad)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(name) && e.contains(bad), "{name}={bad}: {e}");
        }
    }
}
