//! safetensors out (the inputs are `headkl_files::tensors`').
//!
//! Outputs go to a temporary file in the target's directory and are renamed
//! over it only once complete, so a failed run leaves no partial file and
//! never clobbers a good one; a signal removes the temporary
//! (`crate::signals`). The tensors' bytes are written as the host holds
//! them, little-endian (`headkl-files` refuses to build on a big-endian
//! host).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::error::CliError;

/// An output tensor: name, dtype, shape and little-endian bytes.
pub struct OutTensor<'a> {
    /// Tensor name.
    pub name: &'static str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// The elements' bytes.
    pub data: &'a [u8],
}

impl<'a> OutTensor<'a> {
    /// An I64 tensor of `shape`.
    pub fn i64(name: &'static str, shape: Vec<usize>, data: &'a [i64]) -> Self {
        Self {
            name,
            dtype: Dtype::I64,
            shape,
            data: bytemuck::cast_slice(data),
        }
    }

    /// An F32 tensor of `shape`.
    pub fn f32(name: &'static str, shape: Vec<usize>, data: &'a [f32]) -> Self {
        Self {
            name,
            dtype: Dtype::F32,
            shape,
            data: bytemuck::cast_slice(data),
        }
    }
}

/// An output file being made: a temporary sibling is created up front (so
/// an unwritable directory fails before the work), filled, and renamed over
/// the target by [`PendingOutput::commit`]. Dropped uncommitted, it removes
/// the temporary and leaves the target as it was.
pub struct PendingOutput {
    target: PathBuf,
    temp: PathBuf,
    file: Option<File>,
    /// Removes the temporary on SIGINT/SIGTERM while this lives.
    _on_signal: crate::signals::Registered,
}

impl PendingOutput {
    /// Creates the temporary file next to `target`.
    pub fn create(target: &Path) -> Result<Self, CliError> {
        let name = target
            .file_name()
            .ok_or_else(|| CliError::Output {
                file: target.to_path_buf(),
                problem: "not a file name".into(),
            })?
            .to_string_lossy()
            .into_owned();
        let dir = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        // Both are the user's to fix (exit 2), found before any work.
        if target.is_dir() {
            return Err(CliError::file(
                target,
                "is a folder; name the file to write (e.g. out.safetensors)",
            ));
        }
        if !dir.is_dir() {
            return Err(CliError::file(
                target,
                format!("the folder {} does not exist", dir.display()),
            ));
        }
        let mut last_err = None;
        for attempt in 0..100u32 {
            let temp = dir.join(format!(".{name}.{}.{attempt}.tmp", std::process::id()));
            // Registered before it exists: a signal between the two would
            // otherwise leave the file behind (seen in CI). Unlinking a name
            // that does not exist yet, or a stale one of an earlier process
            // with this id, is harmless.
            let on_signal = crate::signals::remove_on_signal(&temp);
            match OpenOptions::new().write(true).create_new(true).open(&temp) {
                Ok(file) => {
                    return Ok(Self {
                        target: target.to_path_buf(),
                        temp,
                        file: Some(file),
                        _on_signal: on_signal,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last_err = Some(e),
                Err(e) => {
                    return Err(CliError::Output {
                        file: target.to_path_buf(),
                        problem: format!("cannot create a temporary file in {}: {e}", dir.display()),
                    })
                }
            }
        }
        Err(CliError::Output {
            file: target.to_path_buf(),
            problem: format!("cannot create a temporary file: {last_err:?}"),
        })
    }

    /// Writes `bytes`, flushes them to disk and renames the file over the
    /// target.
    pub fn commit(mut self, bytes: &[u8]) -> Result<(), CliError> {
        let out_err = |what: &str, e: std::io::Error| CliError::Output {
            file: self.target.clone(),
            problem: format!("{what}: {e}"),
        };
        let Some(mut file) = self.file.take() else {
            return Err(CliError::Output {
                file: self.target.clone(),
                problem: "output already committed".into(),
            });
        };
        file.write_all(bytes).map_err(|e| out_err("write failed", e))?;
        file.sync_all().map_err(|e| out_err("sync failed", e))?;
        drop(file);
        fs::rename(&self.temp, &self.target).map_err(|e| out_err("rename failed", e))?;
        // Renamed: nothing left for Drop to remove.
        self.temp = PathBuf::new();
        Ok(())
    }

    /// Serializes `tensors` as safetensors, with the file's `__metadata__`
    /// (how it was made: `headkl_files::provenance`), and commits them.
    pub fn commit_tensors_with(
        self,
        tensors: &[OutTensor<'_>],
        metadata: Option<std::collections::HashMap<String, String>>,
    ) -> Result<(), CliError> {
        let mut views = Vec::with_capacity(tensors.len());
        for t in tensors {
            let view = TensorView::new(t.dtype, t.shape.clone(), t.data).map_err(|e| CliError::Output {
                file: self.target.clone(),
                problem: format!("tensor `{}`: {e}", t.name),
            })?;
            views.push((t.name, view));
        }
        let bytes = safetensors::serialize(views, metadata).map_err(|e| CliError::Output {
            file: self.target.clone(),
            problem: format!("serialize: {e}"),
        })?;
        self.commit(&bytes)
    }
}

impl Drop for PendingOutput {
    fn drop(&mut self) {
        if !self.temp.as_os_str().is_empty() {
            drop(self.file.take());
            // Best effort: a leftover temporary is harmless.
            let _ = fs::remove_file(&self.temp);
        }
    }
}

/// Writes a small text or binary file atomically (JSON reports, plots).
pub fn write_atomic(target: &Path, bytes: &[u8]) -> Result<(), CliError> {
    PendingOutput::create(target)?.commit(bytes)
}

/// Refuses an output path that names one of the inputs: renaming over an
/// input the run is reading would lose it.
pub fn check_output_not_input(out: &Path, inputs: &[&Path]) -> Result<(), CliError> {
    check_output_of("--out", out, inputs)
}

/// [`check_output_not_input`] for the output file of `option`.
pub fn check_output_of(option: &'static str, out: &Path, inputs: &[&Path]) -> Result<(), CliError> {
    let Ok(out_canon) = out.canonicalize() else {
        return Ok(()); // does not exist yet, so it is no input
    };
    for input in inputs {
        if input.canonicalize().is_ok_and(|c| c == out_canon) {
            return Err(CliError::option(
                option,
                format!("{} is also an input; choose another output file", out.display()),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use headkl_files::TensorFile;

    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("headkl-io-{tag}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn roundtrip_and_unaligned_copy() {
        let dir = temp_dir("rt");
        let path = dir.join("t.safetensors");
        // A 1-byte tensor first puts the f32 tensor at an odd offset.
        let pad = [7u8];
        let vals = [1.5f32, -2.0, 3.25];
        let out = PendingOutput::create(&path).unwrap();
        let meta = std::collections::HashMap::from([("headkl.format".to_string(), "1".to_string())]);
        out.commit_tensors_with(
            &[
                OutTensor {
                    name: "a",
                    dtype: Dtype::U8,
                    shape: vec![1],
                    data: &pad,
                },
                OutTensor {
                    name: "b",
                    dtype: Dtype::F32,
                    shape: vec![1, 3],
                    data: bytemuck::cast_slice(&vals),
                },
            ],
            Some(meta.clone()),
        )
        .unwrap();
        let f = TensorFile::open(&path).unwrap();
        assert_eq!(f.metadata(), Some(&meta));
        let b = f.tensor("b").unwrap();
        assert_eq!(b.matrix("[r][c]").unwrap(), (1, 3));
        assert_eq!(&b.f32s()[..], &vals);
        let missing = f.tensor("c").err().unwrap().to_string();
        assert!(missing.contains("`c`") && missing.contains("a, b"), "{missing}");
        assert!(f.tensor_if_present("c").unwrap().is_none());
        let present = f.tensor_if_present("b").unwrap().expect("b is there");
        assert_eq!(&present.f32s()[..], &vals);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn uncommitted_output_leaves_target_alone() {
        let dir = temp_dir("keep");
        let path = dir.join("o.bin");
        fs::write(&path, b"good").unwrap();
        {
            let _pending = PendingOutput::create(&path).unwrap();
        }
        assert_eq!(fs::read(&path).unwrap(), b"good");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "temporary file left behind");
        write_atomic(&path, b"new").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        fs::remove_dir_all(dir).unwrap();
    }
}
