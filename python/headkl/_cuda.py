"""CUDA's side of the zero-copy path: the driver API of ``libcuda.so.1``
(the NVIDIA driver's own library, loaded with ``ctypes.CDLL``; no CUDA
toolkit, no extra package) imports the memory and the timeline semaphore
the Vulkan backend exports as POSIX fds, and orders torch's stream with
them.

Loading the library happens in ``Driver()`` only, so importing this module
never fails on a machine without CUDA.
"""

from __future__ import annotations

import ctypes
import os
from typing import List, Optional

CUresult = ctypes.c_int
CUdeviceptr = ctypes.c_ulonglong

# CUexternalMemoryHandleType / CUexternalSemaphoreHandleType (cuda.h).
_MEMORY_OPAQUE_FD = 1
_SEMAPHORE_TIMELINE_FD = 9
_MEMORY_DEDICATED = 1


class _Win32Handle(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_void_p), ("name", ctypes.c_void_p)]


class _Handle(ctypes.Union):
    _fields_ = [("fd", ctypes.c_int), ("win32", _Win32Handle), ("nvSciObj", ctypes.c_void_p)]


class _MemoryHandleDesc(ctypes.Structure):
    """CUDA_EXTERNAL_MEMORY_HANDLE_DESC."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("handle", _Handle),
        ("size", ctypes.c_ulonglong),
        ("flags", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 16),
    ]


class _BufferDesc(ctypes.Structure):
    """CUDA_EXTERNAL_MEMORY_BUFFER_DESC."""

    _fields_ = [
        ("offset", ctypes.c_ulonglong),
        ("size", ctypes.c_ulonglong),
        ("flags", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 16),
    ]


class _SemaphoreHandleDesc(ctypes.Structure):
    """CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("handle", _Handle),
        ("flags", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 16),
    ]


class _NvSciSync(ctypes.Union):
    _fields_ = [("fence", ctypes.c_void_p), ("reserved", ctypes.c_ulonglong)]


class _SignalInner(ctypes.Structure):
    _fields_ = [
        ("fence_value", ctypes.c_ulonglong),
        ("nvSciSync", _NvSciSync),
        ("keyedMutex_key", ctypes.c_ulonglong),
        ("reserved", ctypes.c_uint * 12),
    ]


class _SignalParams(ctypes.Structure):
    """CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS."""

    _fields_ = [("params", _SignalInner), ("flags", ctypes.c_uint), ("reserved", ctypes.c_uint * 16)]


class _KeyedMutexWait(ctypes.Structure):
    _fields_ = [("key", ctypes.c_ulonglong), ("timeoutMs", ctypes.c_uint)]


class _WaitInner(ctypes.Structure):
    _fields_ = [
        ("fence_value", ctypes.c_ulonglong),
        ("nvSciSync", _NvSciSync),
        ("keyedMutex", _KeyedMutexWait),
        ("reserved", ctypes.c_uint * 10),
    ]


class _WaitParams(ctypes.Structure):
    """CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS."""

    _fields_ = [("params", _WaitInner), ("flags", ctypes.c_uint), ("reserved", ctypes.c_uint * 16)]


# The sizes cuda.h gives on x86-64 Linux: a mismatch would corrupt the calls.
assert ctypes.sizeof(_MemoryHandleDesc) == 104
assert ctypes.sizeof(_BufferDesc) == 88
assert ctypes.sizeof(_SemaphoreHandleDesc) == 96
assert ctypes.sizeof(_SignalParams) == 144
assert ctypes.sizeof(_WaitParams) == 144


class CudaUnavailable(RuntimeError):
    """libcuda cannot be loaded, or lacks an entry point the path needs."""


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetUuid": [ctypes.POINTER(ctypes.c_char * 16), ctypes.c_int],
    "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuImportExternalMemory": [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_MemoryHandleDesc)],
    "cuExternalMemoryGetMappedBuffer": [ctypes.POINTER(CUdeviceptr), ctypes.c_void_p, ctypes.POINTER(_BufferDesc)],
    "cuDestroyExternalMemory": [ctypes.c_void_p],
    "cuMemFree_v2": [CUdeviceptr],
    "cuImportExternalSemaphore": [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_SemaphoreHandleDesc)],
    "cuSignalExternalSemaphoresAsync": [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(_SignalParams),
        ctypes.c_uint,
        ctypes.c_void_p,
    ],
    "cuWaitExternalSemaphoresAsync": [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(_WaitParams),
        ctypes.c_uint,
        ctypes.c_void_p,
    ],
    "cuDestroyExternalSemaphore": [ctypes.c_void_p],
}


class Driver:
    """The CUDA driver API from ``libcuda.so.1``, initialised once."""

    def __init__(self, path: str = "libcuda.so.1"):
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise CudaUnavailable(f"cannot load {path} (the NVIDIA driver's CUDA library): {e}") from None
        self._fns = {}
        for name, argtypes in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise CudaUnavailable(f"{path} has no {name}") from None
            fn.argtypes = argtypes
            fn.restype = CUresult
            self._fns[name] = fn
        self.call("cuInit", 0)

    def call(self, name: str, *args) -> None:
        """Calls ``name``; a result other than CUDA_SUCCESS raises CudaError."""
        result = self._fns[name](*args)
        if result != 0:
            text = ctypes.c_char_p()
            self._fns["cuGetErrorName"](result, ctypes.byref(text))
            what = text.value.decode() if text.value else "unknown"
            raise CudaError(f"{name} failed: {what} ({result})")

    def device_uuid(self, ordinal: int) -> bytes:
        """The 16-byte UUID of CUDA device ``ordinal``."""
        device = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        uuid = (ctypes.c_char * 16)()
        self.call("cuDeviceGetUuid", ctypes.byref(uuid), device.value)
        return bytes(uuid.raw)

    def ensure_context(self, ordinal: int) -> None:
        """Makes device ``ordinal``'s primary context (torch's) current
        where this thread has none."""
        current = ctypes.c_void_p()
        self.call("cuCtxGetCurrent", ctypes.byref(current))
        if current.value:
            return
        device = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        context = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device.value)
        self.call("cuCtxSetCurrent", context)

    def import_memory(self, fd: int, size: int, dedicated: bool = True) -> "ExternalMemory":
        """Imports an opaque fd of ``size`` bytes of memory; on success CUDA
        owns the fd."""
        desc = _MemoryHandleDesc(type=_MEMORY_OPAQUE_FD, size=size, flags=_MEMORY_DEDICATED if dedicated else 0)
        desc.handle.fd = fd
        handle = ctypes.c_void_p()
        try:
            self.call("cuImportExternalMemory", ctypes.byref(handle), ctypes.byref(desc))
        except CudaError:
            os.close(fd)
            raise
        return ExternalMemory(self, handle, size)

    def import_timeline(self, fd: int) -> "ExternalTimeline":
        """Imports an opaque fd of a Vulkan timeline semaphore; on success
        CUDA owns the fd."""
        desc = _SemaphoreHandleDesc(type=_SEMAPHORE_TIMELINE_FD)
        desc.handle.fd = fd
        handle = ctypes.c_void_p()
        try:
            self.call("cuImportExternalSemaphore", ctypes.byref(handle), ctypes.byref(desc))
        except CudaError:
            os.close(fd)
            raise
        return ExternalTimeline(self, handle)


class ExternalMemory:
    """Imported memory and the device pointers mapped from it."""

    def __init__(self, driver: Driver, handle: ctypes.c_void_p, size: int):
        self._driver = driver
        self._handle: Optional[ctypes.c_void_p] = handle
        self._mapped: List[int] = []
        self.size = size

    def map(self, offset: int, size: int) -> int:
        """A device pointer to ``size`` bytes at ``offset``."""
        if self._handle is None:
            raise CudaError("the memory was closed")
        desc = _BufferDesc(offset=offset, size=size)
        pointer = CUdeviceptr()
        self._driver.call("cuExternalMemoryGetMappedBuffer", ctypes.byref(pointer), self._handle, ctypes.byref(desc))
        self._mapped.append(pointer.value)
        return pointer.value

    def close(self) -> None:
        """Frees the mapped pointers and the import (once)."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        for pointer in self._mapped:
            self._driver.call("cuMemFree_v2", pointer)
        self._mapped.clear()
        self._driver.call("cuDestroyExternalMemory", handle)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a lost context
            pass


class ExternalTimeline:
    """An imported Vulkan timeline semaphore, signalled and waited on in
    stream order."""

    def __init__(self, driver: Driver, handle: ctypes.c_void_p):
        self._driver = driver
        self._handle: Optional[ctypes.c_void_p] = handle

    def _array(self):
        if self._handle is None:
            raise CudaError("the semaphore was closed")
        return (ctypes.c_void_p * 1)(self._handle)

    def signal(self, value: int, stream: int) -> None:
        """The stream sets the timeline to ``value`` once its earlier work is done."""
        params = _SignalParams()
        params.params.fence_value = value
        self._driver.call("cuSignalExternalSemaphoresAsync", self._array(), ctypes.byref(params), 1, stream)

    def wait(self, value: int, stream: int) -> None:
        """The stream's later work waits for the timeline to reach ``value``."""
        params = _WaitParams()
        params.params.fence_value = value
        self._driver.call("cuWaitExternalSemaphoresAsync", self._array(), ctypes.byref(params), 1, stream)

    def close(self) -> None:
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        self._driver.call("cuDestroyExternalSemaphore", handle)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a lost context
            pass


_TYPESTR = {"float32": "<f4", "float16": "<f2", "int32": "<i4", "int64": "<i8", "bfloat16": "<i2"}


def _interface(pointer: int, shape: tuple, dtype) -> dict:
    """The ``__cuda_array_interface__`` (version 3) of a C-contiguous array."""
    name = str(dtype).replace("torch.", "")
    return {"shape": tuple(shape), "typestr": _TYPESTR[name], "data": (pointer, False), "version": 3, "strides": None, "stream": None}


class _Array:
    """What torch.as_tensor reads; it keeps the owner of the memory alive."""

    def __init__(self, interface: dict, owner: object):
        self.__cuda_array_interface__ = interface
        self.owner = owner


def tensor_at(pointer: int, shape: tuple, dtype, device_index: int, owner: object):
    """A torch CUDA tensor viewing ``pointer`` (no copy); it keeps ``owner``
    alive."""
    import torch

    with torch.cuda.device(device_index):
        t = torch.as_tensor(_Array(_interface(pointer, shape, dtype), owner), device=f"cuda:{device_index}")
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
