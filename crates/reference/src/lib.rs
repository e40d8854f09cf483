//! headkl-reference: the CPU backend and the f64 implementation of
//! headkl's math, and the one tolerance comparator.
//!
//! - [`direct`]: the DESIGN §1 formulas evaluated directly in f64 on the
//!   f16-rounded head and hidden rows, with no slicing or chunking. This is
//!   the truth every backend is compared with.
//! - [`cpu`]: [`CpuBackend`], a [`headkl_core::Backend`] whose kernels
//!   accumulate in f64. It is the always-available `reference` backend and
//!   lets the core driver's slicing and chunking be tested with no GPU.
//! - [`tolerance`]: [`Tolerance`], the comparator with DESIGN §5's bounds.
//!
//! The case generator and the conformance suite every backend runs are
//! `headkl-conformance`, which judges its cases with [`direct`] and
//! [`Tolerance`]. This crate depends on `headkl-core`, `half`, `bytemuck`,
//! `thiserror` and `log` only: a program that wants the CPU backend does
//! not link the test machinery.
//!
//! ```
//! use headkl_core::{Engine, HeadData, HeadWeights, Hidden, HiddenData, SliceOptions, TopkOptions};
//! use headkl_reference::CpuBackend;
//!
//! // A head of V = 4 tokens over hs = 2, and one hidden row.
//! let w = [1.0f32, 0.0, 0.0, 1.0, -1.0, 0.0, 0.5, 0.5];
//! let head = HeadWeights::new(HeadData::F32(&w), 4, 2)?;
//! let x = [2.0f32, 1.0];
//! let hidden = Hidden::new(HiddenData::F32(&x), 1, 2)?;
//! let mut engine = Engine::new(CpuBackend::new(), &head, SliceOptions::default())?;
//! let top = engine.topk(&hidden, &TopkOptions::new(2))?;
//! assert_eq!(top.ids, vec![0, 3]); // logits 2, 1, −2, 1.5
//! # Ok::<(), headkl_core::Error>(())
//! ```

#![warn(missing_docs)]

pub mod cpu;
pub mod direct;
pub mod lm;
mod par;
pub mod rng;
pub mod tolerance;

pub use cpu::{CpuBackend, CpuBuffer, Precision};
pub use tolerance::{Mismatch, Tolerance};
