//! headkl-reference: the f64 CPU implementation of headkl's math, the one
//! tolerance comparator, the proptest strategies and the conformance suite
//! every backend runs.
//!
//! - [`direct`]: the DESIGN §1 formulas evaluated directly in f64 on the
//!   f16-rounded head and hidden rows, with no slicing or chunking. This is
//!   the truth every backend is compared with.
//! - [`cpu`]: [`CpuBackend`], a [`headkl_core::Backend`] whose kernels
//!   accumulate in f64. It is the always-available `reference` backend and
//!   lets the core driver's slicing and chunking be tested with no GPU.
//! - [`tolerance`]: [`Tolerance`], the comparator with DESIGN §5's bounds.
//! - [`strategies`]: proptest strategies that draw [`strategies::Case`]s.
//! - [`conformance`]: the suite, generic over a backend, and the
//!   [`conformance_tests!`] macro that instantiates it in a backend crate.

#![warn(missing_docs)]

pub mod conformance;
pub mod cpu;
pub mod direct;
mod par;
pub mod strategies;
pub mod tolerance;

pub use cpu::{CpuBackend, CpuBuffer, Precision};
pub use tolerance::{Mismatch, Tolerance};
