//! headkl's readers of what other programs write, apart from the command
//! that runs them, so that the fuzz harness (`crates/fuzz`) and any other
//! program reach the same parsers without the `headkl` command:
//!
//! - [`tensors`]: safetensors files, memory-mapped, their header checked
//!   ([`TensorFile`], [`TensorRef`]);
//! - [`provenance`]: the `headkl.*` metadata `topk` and `loss` write, and
//!   the checks `loss` makes of a teacher file against its run;
//! - [`inputs`]: the head, hidden rows, teacher, weights and labels read
//!   from their tensors with the checks `headkl loss` makes, and
//!   [`sources`], which traces a core error back to the file, tensor or
//!   option that caused it;
//! - [`vocab_order`]: vocabulary-order files;
//! - `fuzz` (feature `fuzzing`): the fuzz targets' bodies over all of
//!   these, the tune cache and the `HEADKL_*` settings.
//!
//! Every error is a [`FilesError`] naming its file and tensor (or option)
//! on one line; [`FilesError::is_input`] tells bad input (the command exits
//! 2) from a device failure. Nothing here prints; notes and warnings go
//! to the `log` facade.

pub mod error;
pub mod inputs;
pub mod provenance;
pub mod sources;
pub mod tensors;
pub mod vocab_order;

#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz;

// The unit tests replay the fuzz corpora under the same allocation cap as
// the harness.
#[cfg(test)]
#[global_allocator]
static ALLOC: fuzz::CappedAlloc = fuzz::CappedAlloc;

pub use error::FilesError;
pub use tensors::{TensorFile, TensorRef};
