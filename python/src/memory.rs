//! The tensors' own memory, as `headkl.torch` hands it over: an address, an
//! element count and a dtype name per tensor (`tensor.data_ptr()`,
//! `tensor.numel()`, after the Python side has checked that the tensor is a
//! contiguous CPU tensor of that dtype and shape and holds it for the call).
//! No copy is made on either side.

use half::{bf16, f16};
use headkl_core::{HeadData, HiddenData};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// The element types the package passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
    I64,
}

impl Dtype {
    /// The dtype named `name` (torch's spelling).
    pub fn parse(name: &str) -> PyResult<Self> {
        Ok(match name {
            "float32" => Dtype::F32,
            "float16" => Dtype::F16,
            "bfloat16" => Dtype::Bf16,
            "int64" => Dtype::I64,
            other => return Err(PyTypeError::new_err(format!("unsupported dtype {other}"))),
        })
    }

    /// The hidden rows' element type it is, if it is a float.
    pub fn hidden(self) -> Option<headkl_core::HiddenDtype> {
        match self {
            Dtype::F32 => Some(headkl_core::HiddenDtype::F32),
            Dtype::F16 => Some(headkl_core::HiddenDtype::F16),
            Dtype::Bf16 => Some(headkl_core::HiddenDtype::Bf16),
            Dtype::I64 => None,
        }
    }

    fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::I64 => 8,
        }
    }
}

/// One tensor's memory: `(address, elements, dtype name)` from Python,
/// with the argument's name for errors.
#[derive(Clone, Copy, Debug)]
pub struct HostArray {
    what: &'static str,
    addr: usize,
    len: usize,
    dtype: Dtype,
}

impl HostArray {
    /// Reads `(addr, len, dtype)`; checks the address is non-null where
    /// there are elements and aligned to the element.
    pub fn new(what: &'static str, spec: (usize, usize, String)) -> PyResult<Self> {
        let (addr, len, dtype) = spec;
        let dtype = Dtype::parse(&dtype)?;
        if len > 0 && (addr == 0 || addr % dtype.size() != 0) {
            return Err(PyValueError::new_err(format!(
                "{what}: address {addr:#x} is null or not aligned to its {}-byte elements",
                dtype.size()
            )));
        }
        if len.checked_mul(dtype.size()).is_none_or(|b| b > isize::MAX as usize) {
            return Err(PyValueError::new_err(format!("{what}: {len} elements is too many")));
        }
        Ok(Self { what, addr, len, dtype })
    }

    /// Its element count.
    pub fn elements(&self) -> usize {
        self.len
    }

    fn expect(&self, dtype: Dtype) -> PyResult<()> {
        if self.dtype != dtype {
            return Err(PyTypeError::new_err(format!(
                "{}: expected {dtype:?}, got {:?}",
                self.what, self.dtype
            )));
        }
        Ok(())
    }

    /// The elements as `T`, read-only.
    ///
    /// # Safety
    /// The memory must stay valid and unwritten by others for `'a`.
    unsafe fn slice<'a, T>(&self) -> &'a [T] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: non-null and aligned (checked in `new`), `len` elements of
        // `T` (the dtype was checked by the caller), valid for `'a` (the
        // caller's contract: the Python side holds the tensor for the call).
        unsafe { std::slice::from_raw_parts(self.addr as *const T, self.len) }
    }

    /// The elements as `T`, writable.
    ///
    /// # Safety
    /// As [`Self::slice`], and no other view of the memory may exist for `'a`.
    unsafe fn slice_mut<'a, T>(&self) -> &'a mut [T] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `slice`; the Python side allocates each output
        // tensor fresh for the call, so nothing else aliases it.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.len) }
    }

    /// f32 elements.
    ///
    /// # Safety
    /// See [`Self::slice`].
    pub unsafe fn f32s<'a>(&self) -> PyResult<&'a [f32]> {
        self.expect(Dtype::F32)?;
        // SAFETY: the dtype is f32; the lifetime is the caller's contract.
        Ok(unsafe { self.slice() })
    }

    /// i64 elements.
    ///
    /// # Safety
    /// See [`Self::slice`].
    pub unsafe fn i64s<'a>(&self) -> PyResult<&'a [i64]> {
        self.expect(Dtype::I64)?;
        // SAFETY: the dtype is i64; the lifetime is the caller's contract.
        Ok(unsafe { self.slice() })
    }

    /// Writable f32 elements.
    ///
    /// # Safety
    /// See [`Self::slice_mut`].
    pub unsafe fn f32s_mut<'a>(&self) -> PyResult<&'a mut [f32]> {
        self.expect(Dtype::F32)?;
        // SAFETY: the dtype is f32; aliasing and lifetime are the caller's.
        Ok(unsafe { self.slice_mut() })
    }

    /// Writable i64 elements.
    ///
    /// # Safety
    /// See [`Self::slice_mut`].
    pub unsafe fn i64s_mut<'a>(&self) -> PyResult<&'a mut [i64]> {
        self.expect(Dtype::I64)?;
        // SAFETY: the dtype is i64; aliasing and lifetime are the caller's.
        Ok(unsafe { self.slice_mut() })
    }

    /// The float elements in their own dtype, through the constructor for
    /// that dtype (the variants of [`HiddenData`] or [`HeadData`]).
    ///
    /// # Safety
    /// See [`Self::slice`].
    unsafe fn floats<'a, T>(
        &self,
        f32s: fn(&'a [f32]) -> T,
        f16s: fn(&'a [f16]) -> T,
        bf16s: fn(&'a [bf16]) -> T,
    ) -> PyResult<T> {
        Ok(match self.dtype {
            // SAFETY: the dtype is f32; the lifetime is the caller's contract.
            Dtype::F32 => f32s(unsafe { self.slice() }),
            // SAFETY: the dtype is f16; the lifetime is the caller's contract.
            Dtype::F16 => f16s(unsafe { self.slice() }),
            // SAFETY: the dtype is bf16; the lifetime is the caller's contract.
            Dtype::Bf16 => bf16s(unsafe { self.slice() }),
            Dtype::I64 => return Err(self.not_float()),
        })
    }

    /// Hidden rows in their own dtype.
    ///
    /// # Safety
    /// See [`Self::slice`].
    pub unsafe fn hidden<'a>(&self) -> PyResult<HiddenData<'a>> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.floats(HiddenData::F32, HiddenData::F16, HiddenData::Bf16) }
    }

    /// A head in its own dtype.
    ///
    /// # Safety
    /// See [`Self::slice`].
    pub unsafe fn head<'a>(&self) -> PyResult<HeadData<'a>> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.floats(HeadData::F32, HeadData::F16, HeadData::Bf16) }
    }

    fn not_float(&self) -> PyErr {
        PyTypeError::new_err(format!(
            "{}: expected float32, float16 or bfloat16, got int64",
            self.what
        ))
    }
}
