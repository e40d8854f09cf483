//! `headkl check`: the conformance suite on every backend this machine can
//! start (or the one named), with progress, a table per backend, and every
//! failure printed with the seed that replays it.

use headkl_conformance::resident::{resident_case_count, run_resident};
use headkl_conformance::shard::{run_shard_cases, shard_case_count, Serial};
use headkl_conformance::shard_resident::{resident_shard_case_count, run_resident_shard_cases};
use headkl_conformance::{case_count, run_suite, CaseOutcome, SuiteConfig, SuiteReport};
use headkl_core::{Backend, ResidentBackend};
use std::sync::Arc;

use crate::environment::Settings;
use crate::error::is_validation;
use crate::error::CliError;
use crate::progress::Progress;
use crate::select::{
    open_and_run, required, resolve_announced, target_for, BackendArgs, BackendKind, Job, RunError, Target,
};
use crate::text::table;

/// Runs the suite on one backend, reporting each case as it finishes.
struct CheckJob<'a> {
    cfg: &'a SuiteConfig,
}

/// Reports one finished case on the progress bar (and a failure above it).
fn show(progress: &mut Progress, outcome: &CaseOutcome) {
    progress.message(outcome.name.clone());
    if !outcome.passed {
        progress.println(format!(
            "FAIL {} (seed {:#x}): {}",
            outcome.name, outcome.seed, outcome.message
        ));
    }
    progress.inc(&outcome.name);
}

fn progress_for(info: &headkl_core::DeviceInfo, cases: usize) -> Progress {
    Progress::new(format!("check {} ({})", info.backend, info.device_name), cases as u64)
}

/// On a GPU backend the suite also runs the device-resident cases: the
/// resident entry points against the reference and the host path, and
/// bad data on the device turned into the host path's typed errors.
impl Job for CheckJob<'_> {
    type Output = Result<SuiteReport, CliError>;

    fn run<B: Backend>(self, backend: B) -> Result<SuiteReport, CliError> {
        let mut progress = progress_for(backend.info(), case_count(self.cfg) + shard_case_count());
        let mut report = run_suite(&backend, self.cfg, &mut |o: &CaseOutcome| show(&mut progress, o));
        // Vocabulary-parallel: the head as 2 and 3 shards (engines) on this device.
        report.absorb(run_shard_cases(&backend, &Serial, &mut |o: &CaseOutcome| {
            show(&mut progress, o)
        }));
        progress.finish();
        Ok(report)
    }

    fn run_resident<B: ResidentBackend + Sync>(self, backend: B) -> Result<SuiteReport, CliError> {
        let total =
            case_count(self.cfg) + resident_case_count(self.cfg) + shard_case_count() + resident_shard_case_count();
        let mut progress = progress_for(backend.info(), total);
        let mut report = run_suite(&backend, self.cfg, &mut |o: &CaseOutcome| show(&mut progress, o));
        report.absorb(run_resident(&backend, self.cfg, &mut |o: &CaseOutcome| {
            show(&mut progress, o)
        }));
        report.absorb(run_shard_cases(&backend, &Serial, &mut |o: &CaseOutcome| {
            show(&mut progress, o)
        }));
        // The shards' two-phase loss on device buffers.
        report.absorb(run_resident_shard_cases(&backend, &Serial, &mut |o: &CaseOutcome| {
            show(&mut progress, o)
        }));
        progress.finish();
        Ok(report)
    }
}

/// A backend to check: where to open it, or why it cannot start.
enum Planned {
    Run(Target),
    CannotStart(BackendKind, headkl_core::Error),
}

/// The backends to check: the one named (auto resolves to its pick), or
/// every backend with its best usable device. A bad option fails here.
fn plan(args: &BackendArgs, settings: &Arc<Settings>) -> Result<Vec<Planned>, CliError> {
    if args.backend.is_some() {
        return Ok(vec![Planned::Run(resolve_announced(args, "check", settings)?)]);
    }
    BackendKind::ALL
        .iter()
        .map(|&kind| match target_for(kind, args.device, settings) {
            Ok(t) => Ok(Planned::Run(t)),
            Err(RunError::Start(kind, e)) => Ok(Planned::CannotStart(kind, e)),
            Err(RunError::Job(e)) => Err(e),
        })
        .collect()
}

fn fmt_err(e: f64) -> String {
    format!("{e:.2e}")
}

/// What the errors in the table are measured against.
pub const REFERENCE_NOTE: &str = "\
errors: relative to the f64 reference, which computes in f64 on the f16-rounded head and hidden
rows and passes the gradient through f16 as the device path does; the reference backend's own
row measures that f16 gradient path against the exact f64 formula, not an error of an exact answer.";

/// The summary table, one row per backend that ran.
fn render(reports: &[SuiteReport]) -> String {
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|r| {
            vec![
                r.backend.to_string(),
                r.device.clone(),
                if r.matrix_units { "on" } else { "off" }.to_string(),
                r.cases.to_string(),
                r.passed.to_string(),
                fmt_err(r.worst_loss_err),
                fmt_err(r.worst_dx_err),
                fmt_err(r.worst_prob_err),
            ]
        })
        .collect();
    table(
        &[
            "backend",
            "device",
            "matrix units",
            "cases",
            "passed",
            "worst loss err",
            "worst dx err",
            "worst prob err",
        ],
        &rows,
    )
}

/// Runs `headkl check`.
pub fn run(args: &BackendArgs, settings: &Arc<Settings>, cases: usize, seed: u64) -> Result<(), CliError> {
    let cfg = SuiteConfig { cases, seed };
    let args = &args.with_settings(settings);
    let explicit = args.backend.is_some();
    let mut reports = Vec::new();
    let mut problems = Vec::new();
    let mut skipped = Vec::new();
    for planned in plan(args, settings)? {
        let (kind, why) = match planned {
            Planned::Run(target) => match open_and_run(&target, CheckJob { cfg: &cfg }) {
                Ok(report) => {
                    reports.push(report);
                    continue;
                }
                Err(RunError::Start(kind, why)) => (kind, why),
                Err(RunError::Job(e)) => return Err(e),
            },
            Planned::CannotStart(kind, why) => (kind, why),
        };
        // A bad setting is the user's to fix: it fails, skipped or not.
        if is_validation(&why) {
            return Err(CliError::Setting(why));
        }
        let must = explicit || required(kind, settings);
        log::warn!("{kind}: cannot start: {why}{}", if must { "" } else { " (skipped)" });
        if !must {
            skipped.push(format!("{kind} (cannot start: {why})"));
        } else {
            problems.push(format!(
                "{kind} could not start{}: {why}",
                if explicit { "" } else { " and HEADKL_REQUIRE names it" }
            ));
        }
    }
    if !reports.is_empty() {
        println!("{}", render(&reports));
        println!("{REFERENCE_NOTE}\n");
    }
    for r in &reports {
        for f in &r.failures {
            println!(
                "FAILED {} / {} (replay with --seed {}): {}\n  {}\n",
                r.backend, f.name, f.seed, f.description, f.message
            );
            problems.push(format!("{}: case {} failed", r.backend, f.name));
        }
    }
    if problems.is_empty() {
        println!(
            "all {} cases passed on {} backend(s) (seed {seed:#x}); {} skipped{}",
            reports.iter().map(|r| r.cases).sum::<usize>(),
            reports.len(),
            skipped.len(),
            if skipped.is_empty() {
                String::new()
            } else {
                format!(": {}", skipped.join("; "))
            }
        );
        Ok(())
    } else {
        Err(CliError::CheckFailed(format!("check failed: {}", problems.join("; "))))
    }
}
