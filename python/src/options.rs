//! The loss's and top-k's keyword options, from the dict `headkl.torch`
//! passes, into headkl's option structs. A name the module does not know,
//! or a value of the wrong type or out of range, is a `ValueError` naming
//! the keyword.

use headkl_core::{Divergence, LossOptions, LossTerms, Reduction, TailMode, TeacherForm, TopkOptions};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// How the teacher's values are read.
#[derive(Clone, Copy, Debug)]
pub struct TeacherReading {
    /// Probabilities or log-probabilities.
    pub form: TeacherForm,
    /// What happens to the mass outside the k.
    pub tail: TailMode,
    /// The temperature the teacher's values were made at (`None`: the
    /// loss's own).
    pub temperature: Option<f32>,
}

/// The keywords of the loss, each with its type; the Python wrapper
/// documents them.
const LOSS_KEYS: &[&str] = &[
    "temperature",
    "reduction",
    "tail",
    "teacher_form",
    "teacher_temperature",
    "divergence",
    "beta",
    "soft_weight",
    "hard_weight",
    "label_smoothing",
    "z_loss",
    "softcap",
    "logit_scale",
    "ignore_index",
    "ignore_mask",
    "filter_eps",
    "head_grad",
    "total",
    "gscale",
    "budget_bytes",
    "max_rows_per_chunk",
];

/// The keywords of top-k and the gather.
const TOPK_KEYS: &[&str] = &[
    "temperature",
    "softcap",
    "logit_scale",
    "budget_bytes",
    "max_rows_per_chunk",
];

fn bad(key: &str, value: impl std::fmt::Display, why: &str) -> PyErr {
    PyValueError::new_err(format!("{key}={value}: {why}"))
}

/// The dict's values, read by name; unknown names are refused up front.
struct Keywords<'a, 'py> {
    dict: &'a Bound<'py, PyDict>,
}

impl<'a, 'py> Keywords<'a, 'py> {
    fn new(dict: &'a Bound<'py, PyDict>, known: &[&str]) -> PyResult<Self> {
        for key in dict.keys() {
            let key: String = key.extract()?;
            if !known.contains(&key.as_str()) {
                return Err(PyValueError::new_err(format!(
                    "unknown option {key}; known: {}",
                    known.join(", ")
                )));
            }
        }
        Ok(Self { dict })
    }

    fn get<T: for<'b> FromPyObject<'b, 'py>>(&self, key: &str) -> PyResult<Option<T>> {
        match self.dict.get_item(key)? {
            None => Ok(None),
            Some(v) if v.is_none() => Ok(None),
            Some(v) => v.extract::<T>().map(Some).map_err(|_| {
                bad(
                    key,
                    v.repr().map_or_else(|_| "?".into(), |r| r.to_string()),
                    "wrong type",
                )
            }),
        }
    }

    fn name<T>(&self, key: &str, parse: impl Fn(&str) -> Option<T>, names: &str) -> PyResult<Option<T>> {
        match self.get::<String>(key)? {
            None => Ok(None),
            Some(v) => parse(&v)
                .map(Some)
                .ok_or_else(|| bad(key, format!("{v:?}"), &format!("expected one of {names}"))),
        }
    }
}

fn reduction(name: &str) -> Option<Reduction> {
    Some(match name {
        "mean" => Reduction::Mean,
        "sum" => Reduction::Sum,
        "batchmean" => Reduction::BatchMean,
        "none" => Reduction::None,
        _ => return None,
    })
}

/// The loss's options and how to read the teacher, from `kwargs` (labels
/// and weights come as arrays, beside).
pub fn loss_options(kwargs: &Bound<'_, PyDict>) -> PyResult<(LossOptions, TeacherReading)> {
    let kw = Keywords::new(kwargs, LOSS_KEYS)?;
    let mut opts = LossOptions::default();
    let mut terms = LossTerms::default();
    if let Some(t) = kw.get::<f32>("temperature")? {
        opts.config.temperature = t;
    }
    if let Some(r) = kw.name("reduction", reduction, "mean, sum, batchmean, none")? {
        opts.config.reduction = r;
    }
    let beta = kw.get::<f32>("beta")?.unwrap_or(0.5);
    if let Some(d) = kw.name(
        "divergence",
        |n| Divergence::from_name(n, beta),
        "forward, reverse, jsd",
    )? {
        terms.divergence = d;
    }
    for (key, slot) in [
        ("soft_weight", &mut terms.soft_weight),
        ("hard_weight", &mut terms.hard_weight),
        ("label_smoothing", &mut terms.label_smoothing),
        ("z_loss", &mut terms.z_loss),
        ("logit_scale", &mut terms.logit_scale),
    ] {
        if let Some(v) = kw.get::<f32>(key)? {
            *slot = v;
        }
    }
    terms.softcap = kw.get::<f32>("softcap")?;
    opts.config.terms = terms;
    if let Some(i) = kw.get::<i64>("ignore_index")? {
        opts.ignore_index = i;
    }
    opts.ignore_mask = kw.get::<bool>("ignore_mask")?.unwrap_or(false);
    opts.config.filter_eps = match kwargs.get_item("filter_eps")? {
        Some(v) if v.extract::<String>().is_ok_and(|s| s == "auto") => Some(headkl_core::problem::filter::AUTO_EPS),
        _ => kw.get::<f32>("filter_eps")?,
    };
    opts.config.head_grad = kw.get::<bool>("head_grad")?.unwrap_or(false);
    opts.config.gscale = kw.get::<f32>("gscale")?;
    opts.config.total = kw.get::<f32>("total")?;
    if let Some(b) = kw.get::<u64>("budget_bytes")? {
        opts.config.budget_bytes = b;
    }
    opts.config.max_rows_per_chunk = kw.get::<usize>("max_rows_per_chunk")?;
    let reading = TeacherReading {
        form: kw
            .name("teacher_form", TeacherForm::from_name, "probs, logprobs")?
            .unwrap_or(TeacherForm::Probs),
        tail: kw
            .name("tail", TailMode::from_name, "renormalize, bucket, none")?
            .unwrap_or(TailMode::Renormalize),
        temperature: kw.get::<f32>("teacher_temperature")?,
    };
    Ok((opts, reading))
}

/// Top-k's (and the gather's) options for `k`, from `kwargs`.
pub fn topk_options(k: usize, kwargs: &Bound<'_, PyDict>) -> PyResult<TopkOptions> {
    let kw = Keywords::new(kwargs, TOPK_KEYS)?;
    let mut opts = TopkOptions::new(k);
    if let Some(t) = kw.get::<f32>("temperature")? {
        opts.temperature = t;
    }
    opts.softcap = kw.get::<f32>("softcap")?;
    if let Some(s) = kw.get::<f32>("logit_scale")? {
        opts.logit_scale = s;
    }
    if let Some(b) = kw.get::<u64>("budget_bytes")? {
        opts.budget_bytes = b;
    }
    opts.max_rows_per_chunk = kw.get::<usize>("max_rows_per_chunk")?;
    Ok(opts)
}
