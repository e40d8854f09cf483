//! `headkl._native`: the Python package's native module. `headkl.torch`
//! is its public face (an `nn.Module` loss, `topk`, `gather`); this module
//! takes tensors as `(address, elements, dtype)` after the Python side has
//! checked them, and runs headkl's engine on them in place.

mod cuda;
mod engine;
mod errors;
mod memory;
mod options;
mod shared;

use headkl_conformance::resident::run_resident;
use headkl_conformance::shard::{run_shard_cases, Serial};
use headkl_conformance::shard_resident::run_resident_shard_cases;
use headkl_conformance::{run_suite, SuiteConfig, SuiteReport};
use headkl_core::toolkit::settings::Env;
use headkl_core::{Backend, ResidentBackend};
use headkl_runtime::{auto_pick, enumerate_all, open_and_run, resolve, Job, Selection, Settings};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::sync::Arc;

use crate::errors::{start, to_py, DeviceError};

fn settings() -> PyResult<Arc<Settings>> {
    Ok(Arc::new(Settings::from_env(&Env::process()).map_err(to_py)?))
}

/// Every backend's devices, as `headkl devices` lists them: a list of
/// dicts (`backend`, `index`, `name`, `type`, `matrix_units`, `auto`: whether
/// `backend="auto"` picks it), then one dict per backend that could not
/// enumerate (`backend`, `error`).
#[pyfunction]
fn devices(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let settings = settings()?;
    let found = py.detach(|| enumerate_all(&settings));
    let pick = auto_pick(&found.candidates, None);
    let list = PyList::empty(py);
    for c in &found.candidates {
        let d = PyDict::new(py);
        d.set_item("backend", c.kind.name())?;
        d.set_item("index", c.index)?;
        d.set_item("name", &c.info.device_name)?;
        d.set_item("type", &c.info.device_type)?;
        d.set_item("matrix_units", c.info.matrix_units)?;
        d.set_item("auto", c.kind == pick.kind && c.index == pick.index)?;
        list.append(d)?;
    }
    for (kind, why) in &found.failures {
        let d = PyDict::new(py);
        d.set_item("backend", kind.name())?;
        d.set_item("error", why)?;
        list.append(d)?;
    }
    Ok(list)
}

/// The conformance suite (the one `headkl check` runs) on one backend:
/// the host cases and the sharded ones, and on a GPU the device-resident
/// ones too.
struct Suite(SuiteConfig);

impl Job for Suite {
    type Output = SuiteReport;

    fn run<B: Backend>(self, backend: B) -> SuiteReport {
        let mut report = run_suite(&backend, &self.0, &mut |_| ());
        report.absorb(run_shard_cases(&backend, &Serial, &mut |_| ()));
        report
    }

    fn run_resident<B: ResidentBackend>(self, backend: B) -> SuiteReport {
        let mut report = run_suite(&backend, &self.0, &mut |_| ());
        report.absorb(run_shard_cases(&backend, &Serial, &mut |_| ()));
        report.absorb(run_resident(&backend, &self.0, &mut |_| ()));
        report.absorb(run_resident_shard_cases(&backend, &Serial, &mut |_| ()));
        report
    }
}

/// `headkl check` from Python: the conformance suite on `backend`
/// (`device` as `devices()` numbers them), `cases` drawn cases from
/// `seed`. Returns a dict (`backend`, `device`, `matrix_units`, `cases`,
/// `passed`, `failures`: a list of `(case, seed, message)`, and the worst
/// relative errors); it does not raise on failed cases.
#[pyfunction]
#[pyo3(signature = (backend="auto", device=None, cases=16, seed=0x5eed))]
fn check<'py>(
    py: Python<'py>,
    backend: &str,
    device: Option<usize>,
    cases: usize,
    seed: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let arg = engine::backend_arg(backend)?;
    let settings = settings()?;
    let cfg = SuiteConfig { cases, seed };
    let report = py.detach(|| -> PyResult<SuiteReport> {
        let selection = Selection {
            backend: Some(arg),
            device,
        };
        let target = resolve(selection, &settings).map_err(start)?;
        open_and_run(&target, None, Suite(cfg)).map_err(start)
    })?;
    let d = PyDict::new(py);
    d.set_item("backend", &report.backend)?;
    d.set_item("device", &report.device)?;
    d.set_item("matrix_units", report.matrix_units)?;
    d.set_item("cases", report.cases)?;
    d.set_item("passed", report.passed)?;
    let failures: Vec<(String, u64, String)> = report
        .failures
        .iter()
        .map(|f| (f.name.clone(), f.seed, f.message.clone()))
        .collect();
    d.set_item("failures", failures)?;
    d.set_item("worst_loss_err", report.worst_loss_err)?;
    d.set_item("worst_dx_err", report.worst_dx_err)?;
    d.set_item("worst_prob_err", report.worst_prob_err)?;
    Ok(d)
}

/// Checks the loss's keyword options (as `HeadKLLoss` passes them) before
/// anything reaches a device: each value's range, and with `sharded` what
/// the sharded loss refuses. Raises `ValueError` naming the keyword.
#[pyfunction]
fn check_loss_options(options: &Bound<'_, PyDict>, sharded: bool) -> PyResult<()> {
    let (mut opts, reading) = options::loss_options(options)?;
    if sharded {
        headkl_core::shard::check_loss_terms(reading.tail, &opts).map_err(to_py)?;
    }
    if let Some(from) = reading.temperature {
        headkl_core::rescale_teacher(&[], 1, reading.form, reading.tail, from, opts.config.temperature)
            .map_err(to_py)?;
    }
    // Labels arrive with each call; here only their presence matters.
    if opts.config.terms.hard_on() || opts.ignore_mask {
        opts.labels = Some(vec![0]);
    }
    opts.resolve(1).map(drop).map_err(to_py)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(check, m)?)?;
    m.add_function(wrap_pyfunction!(check_loss_options, m)?)?;
    m.add_class::<engine::PyEngine>()?;
    m.add("DeviceError", m.py().get_type::<DeviceError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
