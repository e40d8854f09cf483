//! safetensors files in: an input file memory-mapped, its header parsed
//! and checked, each tensor's bytes borrowed from the mapping.
//!
//! A multi-GB shard is never read whole, and a tensor's bytes are copied
//! only when they are misaligned for the element type. Every error names
//! the file (and the tensor) on one line.

use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use crate::error::FilesError;
use crate::provenance::HeadIdentity;

#[cfg(target_endian = "big")]
compile_error!("safetensors data is little-endian; headkl reads it in place and needs a little-endian host");

/// Bytes of the length prefix in front of a safetensors header.
const PREFIX_BYTES: usize = 8;

/// An input file's bytes: mapped from disk, or held (a fuzz target's input).
enum FileBytes {
    Mapped(Mmap),
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
    pub fn open(path: &Path) -> Result<Self, FilesError> {
        if path.is_dir() {
            return Err(FilesError::file(path, "is a folder, not a safetensors file"));
        }
        let file = File::open(path).map_err(|e| FilesError::file(path, format!("cannot open: {e}")))?;
        let len = file
            .metadata()
            .map_err(|e| FilesError::file(path, format!("cannot stat: {e}")))?
            .len();
        if len < PREFIX_BYTES as u64 {
            return Err(FilesError::file(
                path,
                format!("truncated: the file has {len} bytes, a safetensors file starts with an 8-byte header length"),
            ));
        }
        // SAFETY: the mapping is read-only and lives as long as this struct;
        // the file is an input the user does not rewrite while headkl runs
        // (as with any memory-mapped reader, truncating it underneath us
        // would fault).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| FilesError::file(path, format!("cannot map: {e}")))?;
        Self::parse(path, FileBytes::Mapped(map))
    }

    /// The same checks on bytes already in memory, named `path` in errors
    /// (a fuzz target's input).
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, FilesError> {
        Self::parse(path, FileBytes::Held(bytes))
    }

    fn parse(path: &Path, map: FileBytes) -> Result<Self, FilesError> {
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
    pub fn tensor_if_present(&self, name: &str) -> Result<Option<TensorRef<'_>>, FilesError> {
        if self.metadata.info(name).is_none() {
            return Ok(None);
        }
        self.tensor(name).map(Some)
    }

    /// Tensor `name`, or an error listing the tensors the file has.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>, FilesError> {
        let Some(info) = self.metadata.info(name) else {
            let names = self.names();
            let listed = if names.is_empty() {
                "the file holds no tensors".to_string()
            } else if names.len() > 8 {
                format!("the file holds {} tensors: {}, …", names.len(), names[..8].join(", "))
            } else {
                format!("the file holds: {}", names.join(", "))
            };
            return Err(FilesError::tensor(&self.path, name, format!("not found ({listed})")));
        };
        let (start, end) = info.data_offsets;
        // read_metadata checked that the offsets lie inside the data region.
        let data = self
            .map
            .get(self.data_start + start..self.data_start + end)
            .ok_or_else(|| FilesError::tensor(&self.path, name, "data offsets point outside the file"))?;
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
fn header_error(path: &Path, bytes: &[u8], e: SafeTensorError) -> FilesError {
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
    FilesError::file(path, problem)
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
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The stored bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }

    /// An error about this tensor.
    pub fn error(&self, problem: impl Into<String>) -> FilesError {
        FilesError::tensor(self.file, &self.name, problem)
    }

    /// A core error found in this tensor's values.
    pub fn core_error(&self, e: headkl_core::Error) -> FilesError {
        FilesError::in_tensor(e, self.file, &self.name)
    }

    /// Which head this tensor is, for a file's metadata (its file, name
    /// and a hash of its bytes).
    pub fn identity(&self) -> HeadIdentity {
        HeadIdentity::of(self.file, &self.name, self.data)
    }

    /// The file and tensor, for messages: `file (tensor `name`)`.
    pub fn describe(&self) -> String {
        format!("{} (tensor `{}`)", self.file.display(), self.name)
    }

    /// The shape as `[rows][cols]`; `layout` names the dimensions for the
    /// error message (e.g. `[ntok][hs]`).
    pub fn matrix(&self, layout: &str) -> Result<(usize, usize), FilesError> {
        match self.shape[..] {
            [rows, cols] => Ok((rows, cols)),
            _ => Err(self.error(format!("shape {:?}: expected 2 dimensions {layout}", self.shape))),
        }
    }

    /// The shape as `[len]`; `layout` names the dimension.
    pub fn vector(&self, layout: &str) -> Result<usize, FilesError> {
        match self.shape[..] {
            [len] => Ok(len),
            _ => Err(self.error(format!("shape {:?}: expected 1 dimension {layout}", self.shape))),
        }
    }

    /// An error for a dtype this input does not take.
    pub fn wrong_dtype(&self, expected: &str) -> FilesError {
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
    pub fn ids_i64(&self) -> Result<Cow<'a, [i64]>, FilesError> {
        match self.dtype {
            Dtype::I64 => Ok(self.cast()),
            Dtype::I32 => Ok(Cow::Owned(self.cast::<i32>().iter().map(|&v| i64::from(v)).collect())),
            Dtype::U32 => Ok(Cow::Owned(self.cast::<u32>().iter().map(|&v| i64::from(v)).collect())),
            _ => Err(self.wrong_dtype("I64, I32 or U32")),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("headkl-files-{tag}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn tensors_read_by_name_with_shape_and_dtype_checked() {
        let (pad, vals) = ([7u8], [1.5f32, -2.0, 3.25]);
        let bytes = safetensors::serialize(
            [
                (
                    "a",
                    safetensors::tensor::TensorView::new(Dtype::U8, vec![1], &pad).unwrap(),
                ),
                (
                    "b",
                    safetensors::tensor::TensorView::new(Dtype::F32, vec![1, 3], bytemuck::cast_slice(&vals)).unwrap(),
                ),
            ],
            None,
        )
        .unwrap();
        let f = TensorFile::from_bytes(Path::new("t.safetensors"), bytes).unwrap();
        assert_eq!(f.names(), ["a", "b"]);
        assert_eq!(f.metadata(), None);
        let b = f.tensor("b").unwrap();
        assert_eq!(b.matrix("[r][c]").unwrap(), (1, 3));
        assert_eq!(&b.f32s()[..], &vals);
        assert!(b
            .vector("[n]")
            .unwrap_err()
            .to_string()
            .contains("expected 1 dimension [n]"));
        assert_eq!(
            b.ids_i64().unwrap_err().to_string(),
            "t.safetensors: tensor `b`: dtype F32: expected I64, I32 or U32"
        );
        let missing = f.tensor("c").err().unwrap().to_string();
        assert_eq!(missing, "t.safetensors: tensor `c`: not found (the file holds: a, b)");
        assert!(f.tensor_if_present("c").unwrap().is_none());
        assert_eq!(f.tensor_if_present("a").unwrap().expect("a is there").bytes(), &pad);
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
        let e = TensorFile::open(&dir).err().unwrap();
        assert!(e.is_input() && e.to_string().contains("is a folder"), "{e}");
        fs::remove_dir_all(dir).unwrap();
    }
}
