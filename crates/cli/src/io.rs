//! safetensors in and out.
//!
//! Inputs are memory-mapped: a multi-GB shard is never read whole, and a
//! tensor's bytes are borrowed from the mapping (copied only when they are
//! misaligned for the element type). Outputs go to a temporary file in the
//! target's directory and are renamed over it only once complete, so a
//! failed run leaves no partial file and never clobbers a good one.

use std::borrow::Cow;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorView};
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use crate::error::CliError;

#[cfg(target_endian = "big")]
compile_error!("safetensors data is little-endian; headkl reads it in place and needs a little-endian host");

/// Bytes of the length prefix in front of a safetensors header.
const PREFIX_BYTES: usize = 8;

/// An input file's bytes: mapped from disk, or held (a fuzz target's input).
enum FileBytes {
    Mapped(Mmap),
    #[cfg_attr(
        not(any(test, feature = "fuzzing")),
        allow(dead_code, reason = "made only by the fuzz targets")
    )]
    Held(Vec<u8>),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(map) => map,
            FileBytes::Held(bytes) => bytes,
        }
    }
}

/// An input safetensors file, mapped and with its header parsed and checked.
pub struct TensorFile {
    path: PathBuf,
    map: FileBytes,
    data_start: usize,
    metadata: Metadata,
}

impl TensorFile {
    /// Maps `path` and checks its header: the offsets of every tensor must
    /// lie inside the file and cover its data exactly.
    pub fn open(path: &Path) -> Result<Self, CliError> {
        if path.is_dir() {
            return Err(CliError::file(path, "is a folder, not a safetensors file"));
        }
        let file = File::open(path).map_err(|e| CliError::file(path, format!("cannot open: {e}")))?;
        let len = file
            .metadata()
            .map_err(|e| CliError::file(path, format!("cannot stat: {e}")))?
            .len();
        if len < PREFIX_BYTES as u64 {
            return Err(CliError::file(
                path,
                format!("truncated: the file has {len} bytes, a safetensors file starts with an 8-byte header length"),
            ));
        }
        // SAFETY: the mapping is read-only and lives as long as this struct;
        // the file is an input the user does not rewrite while headkl runs
        // (as with any memory-mapped reader, truncating it underneath us
        // would fault).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| CliError::file(path, format!("cannot map: {e}")))?;
        Self::parse(path, FileBytes::Mapped(map))
    }

    /// The same checks on bytes already in memory, named `path` in errors.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, CliError> {
        Self::parse(path, FileBytes::Held(bytes))
    }

    fn parse(path: &Path, map: FileBytes) -> Result<Self, CliError> {
        let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| header_error(path, &map, e))?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
            data_start: PREFIX_BYTES + header_len,
            metadata,
        })
    }

    /// The names of the tensors the file holds, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.metadata.tensors().into_keys().collect();
        names.sort();
        names
    }

    /// The file's `__metadata__` (string keys and values), if it has one.
    pub fn metadata(&self) -> Option<&std::collections::HashMap<String, String>> {
        self.metadata.metadata().as_ref()
    }

    /// The tensor `name` if the file holds one (`None` if not); a tensor
    /// that is there but malformed is an error as [`Self::tensor`] gives.
    /// (The fuzz target's teacher file may carry weights and labels.)
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn tensor_if_present(&self, name: &str) -> Result<Option<TensorRef<'_>>, CliError> {
        if self.metadata.info(name).is_none() {
            return Ok(None);
        }
        self.tensor(name).map(Some)
    }

    /// Tensor `name`, or an error listing the tensors the file has.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>, CliError> {
        let Some(info) = self.metadata.info(name) else {
            let names = self.names();
            let listed = if names.is_empty() {
                "the file holds no tensors".to_string()
            } else if names.len() > 8 {
                format!("the file holds {} tensors: {}, …", names.len(), names[..8].join(", "))
            } else {
                format!("the file holds: {}", names.join(", "))
            };
            return Err(CliError::tensor(&self.path, name, format!("not found ({listed})")));
        };
        let (start, end) = info.data_offsets;
        // read_metadata checked that the offsets lie inside the data region.
        let data = self
            .map
            .get(self.data_start + start..self.data_start + end)
            .ok_or_else(|| CliError::tensor(&self.path, name, "data offsets point outside the file"))?;
        Ok(TensorRef {
            file: &self.path,
            name: name.to_string(),
            dtype: info.dtype,
            shape: info.shape.clone(),
            data,
        })
    }
}

/// Names what is wrong with a file whose header does not parse.
fn header_error(path: &Path, bytes: &[u8], e: SafeTensorError) -> CliError {
    let declared = bytes
        .get(..PREFIX_BYTES)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0);
    let problem = match e {
        SafeTensorError::MetadataIncompleteBuffer => {
            let have = (bytes.len() as u64).saturating_sub(PREFIX_BYTES as u64 + declared);
            match declared_data_bytes(bytes, declared) {
                Some(need) if need > have => {
                    format!("truncated: the header describes {need} bytes of tensor data, the file holds {have}")
                }
                Some(need) => {
                    format!("corrupt: the header describes {need} bytes of tensor data, the file holds {have}")
                }
                None => format!("truncated or corrupt: the header's tensors do not cover the file's {have} data bytes"),
            }
        }
        SafeTensorError::InvalidHeaderLength | SafeTensorError::HeaderTooLarge => format!(
            "truncated or not a safetensors file: the header claims {declared} bytes, the file has {}",
            bytes.len()
        ),
        other => format!("not a valid safetensors file: {other}"),
    };
    CliError::file(path, problem)
}

/// The end of the furthest tensor the header declares (for messages about
/// a file whose data region does not match).
fn declared_data_bytes(bytes: &[u8], header_len: u64) -> Option<u64> {
    let header = bytes.get(PREFIX_BYTES..PREFIX_BYTES.checked_add(usize::try_from(header_len).ok()?)?)?;
    let v: serde_json::Value = serde_json::from_slice(header).ok()?;
    v.as_object()?
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .filter_map(|(_, t)| t.get("data_offsets")?.get(1)?.as_u64())
        .max()
}

/// One tensor of an input file, its bytes borrowed from the mapping.
pub struct TensorRef<'a> {
    file: &'a Path,
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: &'a [u8],
}

impl<'a> TensorRef<'a> {
    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The extents, outermost first.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The stored bytes.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }

    /// An error about this tensor.
    pub fn error(&self, problem: impl Into<String>) -> CliError {
        CliError::tensor(self.file, &self.name, problem)
    }

    /// A core error found in this tensor's values.
    pub fn core_error(&self, e: headkl_core::Error) -> CliError {
        CliError::from_core_in_tensor(e, self.file, &self.name)
    }

    /// Which head this tensor is, for a file's metadata (its file, name
    /// and a hash of its bytes).
    pub fn identity(&self) -> crate::provenance::HeadIdentity {
        crate::provenance::HeadIdentity::of(self.file, &self.name, self.data)
    }

    /// The file and tensor, for messages: `file (tensor `name`)`.
    pub fn describe(&self) -> String {
        format!("{} (tensor `{}`)", self.file.display(), self.name)
    }

    /// The shape as `[rows][cols]`; `layout` names the dimensions for the
    /// error message (e.g. `[ntok][hs]`).
    pub fn matrix(&self, layout: &str) -> Result<(usize, usize), CliError> {
        match self.shape[..] {
            [rows, cols] => Ok((rows, cols)),
            _ => Err(self.error(format!("shape {:?}: expected 2 dimensions {layout}", self.shape))),
        }
    }

    /// The shape as `[len]`; `layout` names the dimension.
    pub fn vector(&self, layout: &str) -> Result<usize, CliError> {
        match self.shape[..] {
            [len] => Ok(len),
            _ => Err(self.error(format!("shape {:?}: expected 1 dimension {layout}", self.shape))),
        }
    }

    /// An error for a dtype this input does not take.
    pub fn wrong_dtype(&self, expected: &str) -> CliError {
        self.error(format!("dtype {:?}: expected {expected}", self.dtype))
    }

    /// The elements as `T`, borrowed when aligned, copied when not.
    fn cast<T: bytemuck::Pod>(&self) -> Cow<'a, [T]> {
        match bytemuck::try_cast_slice::<u8, T>(self.data) {
            Ok(s) => Cow::Borrowed(s),
            // safetensors does not promise alignment of a tensor's offset.
            Err(_) => {
                let mut v = vec![T::zeroed(); self.data.len() / std::mem::size_of::<T>()];
                bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(self.data);
                Cow::Owned(v)
            }
        }
    }

    /// F32 elements (the caller checked the dtype).
    pub fn f32s(&self) -> Cow<'a, [f32]> {
        self.cast()
    }

    /// F16 elements (the caller checked the dtype).
    pub fn f16s(&self) -> Cow<'a, [f16]> {
        self.cast()
    }

    /// BF16 elements (the caller checked the dtype).
    pub fn bf16s(&self) -> Cow<'a, [bf16]> {
        self.cast()
    }

    /// Integer ids as i64, from I64, I32 or U32.
    pub fn ids_i64(&self) -> Result<Cow<'a, [i64]>, CliError> {
        match self.dtype {
            Dtype::I64 => Ok(self.cast()),
            Dtype::I32 => Ok(Cow::Owned(self.cast::<i32>().iter().map(|&v| i64::from(v)).collect())),
            Dtype::U32 => Ok(Cow::Owned(self.cast::<u32>().iter().map(|&v| i64::from(v)).collect())),
            _ => Err(self.wrong_dtype("I64, I32 or U32")),
        }
    }
}

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
    /// (how it was made: `crate::provenance`), and commits them.
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

    #[test]
    fn truncated_and_corrupt_files_are_named() {
        let dir = temp_dir("bad");
        let short = dir.join("short.safetensors");
        fs::write(&short, [1u8, 2, 3]).unwrap();
        let e = TensorFile::open(&short).err().unwrap().to_string();
        assert!(e.contains("short.safetensors") && e.contains("truncated"), "{e}");
        let garbage = dir.join("garbage.safetensors");
        let mut bytes = 20u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{not json at all!!!!");
        fs::write(&garbage, &bytes).unwrap();
        let e = TensorFile::open(&garbage).err().unwrap().to_string();
        assert!(
            e.contains("garbage.safetensors") && e.contains("not a valid safetensors"),
            "{e}"
        );
        fs::remove_dir_all(dir).unwrap();
    }
}
