//! headkl's runtime: the one layer that opens any backend. It lists every
//! backend's devices, holds the `auto` policy and the `HEADKL_*` settings
//! the backends open with, and runs work on whichever backend a [`Target`]
//! names, through one match over the backends ([`on_kind`]). The `headkl`
//! command and the Python package both stand on it, so they pick and open
//! devices one way.
//!
//! Work that runs on a backend is generic over it, so each backend's
//! buffer type stays static: a [`Job`] for one device, a [`ShardsJob`] for
//! several devices of one backend, or an [`AnyEngine`], an engine whose
//! backend is chosen at run time (the Python package holds one).
//!
//! A new backend is one [`BackendKind`] variant, one [`RuntimeBackend`]
//! impl and one arm of [`on_kind`], all in this crate.
//!
//! ```
//! use std::sync::Arc;
//! use headkl_core::{HeadData, HeadWeights, Hidden, LossOptions, LossOutput, Teacher};
//! use headkl_runtime::{resolve, AnyEngine, BackendArg, BackendKind, LossCall, LossTeacher, Selection, Settings};
//!
//! let (vocab, hs, ntok) = (64, 16, 4);
//! let w: Vec<f32> = (0..vocab * hs).map(|i| ((i % 7) as f32 - 3.0) / 8.0).collect();
//! let x: Vec<f32> = (0..ntok * hs).map(|i| ((i % 5) as f32 - 2.0) / 4.0).collect();
//! let head = HeadWeights::new(HeadData::F32(&w), vocab, hs)?;
//!
//! // `Selection::default()` is `auto` (or HEADKL_BACKEND); here the CPU reference.
//! let settings = Arc::new(Settings::default());
//! let chosen = Selection { backend: Some(BackendArg::Named(BackendKind::Reference)), device: None };
//! let target = resolve(chosen, &settings)?;
//! let mut any = AnyEngine::open(&target, &head, None)?; // None: the whole head
//!
//! let teacher = Teacher::new(&[1, 2, 3, 4], &[1.0; 4], ntok, 1, vocab)?;
//! let mut out = LossOutput::default();
//! let hidden = Hidden::f32(&x, ntok, hs)?;
//! let opts = LossOptions::default();
//! let call = LossCall::new(&hidden, LossTeacher::TopK(&teacher), &opts);
//! any.engine().loss_into(call, &mut out)?;
//! assert_eq!(any.engine().info().backend, "reference");
//! assert!(out.mean.is_finite() && out.dx.len() == ntok * hs);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod backend;
mod engine;
mod error;
mod kind;
mod policy;
mod run;
mod settings;
mod target;

pub use backend::{contained, on_kind, RuntimeBackend, Visit};
pub use engine::{AnyEngine, HostEngine, HostShard, LossCall, LossTeacher};
pub use error::{Error, Field};
pub use kind::{BackendArg, BackendKind};
pub use policy::{auto_pick, best_gpu, describe, is_software, AutoPick, Candidate, AUTO_POLICY, SOFTWARE_REASON};
pub use run::{open_and_run, open_and_run_shards, open_backend, Job, OpenVisit, ShardsJob};
pub use settings::Settings;
pub use target::{enumerate_all, enumerate_backend, resolve, target_for, Enumeration, Selection, Target};
