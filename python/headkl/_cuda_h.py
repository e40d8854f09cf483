"""cuda.h on x86-64 Linux, as ctypes: the types, constants and structures
headkl's zero-copy path hands the CUDA driver API (``_cuda.Driver``), their
layouts checked at import, and the entry points it binds with their
argument types. Nothing is loaded here: ``import headkl._cuda_h`` works on
any machine."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List

# --- Types and constants (cuda.h) -------------------------------------------

CUresult = ctypes.c_int
CUdevice = ctypes.c_int
CUdeviceptr = ctypes.c_ulonglong  # unsigned long long on LP64
CUcontext = ctypes.c_void_p
CUstream = ctypes.c_void_p
CUexternalMemory = ctypes.c_void_p
CUexternalSemaphore = ctypes.c_void_p

CUDA_SUCCESS = 0
CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD = 1
CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_TIMELINE_SEMAPHORE_FD = 9
CUDA_EXTERNAL_MEMORY_DEDICATED = 0x1


class _CUuuid(ctypes.Structure):
    """CUuuid: ``char bytes[16]``."""

    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _Win32Handle(ctypes.Structure):
    """The ``win32`` member of the handle unions (unused on Linux, but it
    sets the union's size to 16)."""

    _fields_ = [("handle", ctypes.c_void_p), ("name", ctypes.c_void_p)]


def _handle_fields(nv_sci_name: str) -> List[Any]:
    """The fields of a handle union: the two differ only in the name of
    their NvSci member."""
    return [
        ("fd", ctypes.c_int),
        ("win32", _Win32Handle),
        (nv_sci_name, ctypes.c_void_p),
    ]


class _MemoryHandle(ctypes.Union):
    """CUDA_EXTERNAL_MEMORY_HANDLE_DESC::handle."""

    _fields_ = _handle_fields("nvSciBufObject")


class CUDA_EXTERNAL_MEMORY_HANDLE_DESC(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),  # CUexternalMemoryHandleType
        ("handle", _MemoryHandle),
        ("size", ctypes.c_ulonglong),
        ("flags", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 16),
    ]


class CUDA_EXTERNAL_MEMORY_BUFFER_DESC(ctypes.Structure):
    _fields_ = [
        ("offset", ctypes.c_ulonglong),
        ("size", ctypes.c_ulonglong),
        ("flags", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 16),
    ]


class _SemaphoreHandle(ctypes.Union):
    """CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC::handle."""

    _fields_ = _handle_fields("nvSciSyncObj")


class CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),  # CUexternalSemaphoreHandleType
        ("handle", _SemaphoreHandle),
        ("flags", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 16),
    ]


class _Fence(ctypes.Structure):
    """params.fence: the timeline value to signal or wait for."""

    _fields_ = [("value", ctypes.c_ulonglong)]


class _NvSciSync(ctypes.Union):
    """params.nvSciSync."""

    _fields_ = [("fence", ctypes.c_void_p), ("reserved", ctypes.c_ulonglong)]


class _KeyedMutexSignal(ctypes.Structure):
    _fields_ = [("key", ctypes.c_ulonglong)]


def _params_inner_fields(keyed_mutex: Any, reserved_words: int) -> List[Any]:
    """The fields of a signal's or a wait's ``params`` member: the two
    differ only in keyedMutex and the reserved words after it."""
    return [
        ("fence", _Fence),
        ("nvSciSync", _NvSciSync),
        ("keyedMutex", keyed_mutex),
        ("reserved", ctypes.c_uint * reserved_words),
    ]


def _params_fields(inner: Any) -> List[Any]:
    """The fields of CUDA_EXTERNAL_SEMAPHORE_{SIGNAL,WAIT}_PARAMS around
    their ``params`` member."""
    return [
        ("params", inner),
        ("flags", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 16),
    ]


class _SignalParamsInner(ctypes.Structure):
    """CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS::params."""

    _fields_ = _params_inner_fields(_KeyedMutexSignal, 12)


class CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS(ctypes.Structure):
    _fields_ = _params_fields(_SignalParamsInner)


class _KeyedMutexWait(ctypes.Structure):
    _fields_ = [("key", ctypes.c_ulonglong), ("timeoutMs", ctypes.c_uint)]


class _WaitParamsInner(ctypes.Structure):
    """CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS::params."""

    _fields_ = _params_inner_fields(_KeyedMutexWait, 10)


class CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS(ctypes.Structure):
    _fields_ = _params_fields(_WaitParamsInner)


# The layouts cuda.h gives on x86-64 Linux. The driver reads these bytes
# blindly, so a slip here would corrupt a call instead of failing it.
assert ctypes.sizeof(ctypes.c_void_p) == 8, "headkl._cuda assumes a 64-bit process"
assert ctypes.sizeof(_CUuuid) == 16
assert ctypes.sizeof(_MemoryHandle) == 16
assert ctypes.sizeof(CUDA_EXTERNAL_MEMORY_HANDLE_DESC) == 104
assert CUDA_EXTERNAL_MEMORY_HANDLE_DESC.handle.offset == 8
assert CUDA_EXTERNAL_MEMORY_HANDLE_DESC.size.offset == 24
assert CUDA_EXTERNAL_MEMORY_HANDLE_DESC.flags.offset == 32
assert CUDA_EXTERNAL_MEMORY_HANDLE_DESC.reserved.offset == 36
assert ctypes.sizeof(CUDA_EXTERNAL_MEMORY_BUFFER_DESC) == 88
assert CUDA_EXTERNAL_MEMORY_BUFFER_DESC.flags.offset == 16
assert CUDA_EXTERNAL_MEMORY_BUFFER_DESC.reserved.offset == 20
assert ctypes.sizeof(CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC) == 96
assert CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC.handle.offset == 8
assert CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC.flags.offset == 24
assert CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC.reserved.offset == 28
assert _SignalParamsInner.reserved.offset == 24
assert _WaitParamsInner.keyedMutex.offset == 16
assert _WaitParamsInner.reserved.offset == 32
for _inner, _params in (
    (_SignalParamsInner, CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS),
    (_WaitParamsInner, CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS),
):
    assert ctypes.sizeof(_inner) == 72
    assert ctypes.sizeof(_params) == 144
    assert _params.flags.offset == 72
    assert _params.reserved.offset == 76
del _inner, _params

# --- Entry points ------------------------------------------------------------

# Every function called, by the name libcuda exports (cuda.h's macros map
# e.g. cuMemFree to cuMemFree_v2), with its argument types; all return
# CUresult. The names without a suffix are the legacy-default-stream
# variants, which is what PyTorch (built without per-thread default streams)
# uses too.
_REQUIRED: Dict[str, List[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(CUdevice), ctypes.c_int],
    "cuCtxGetCurrent": [ctypes.POINTER(CUcontext)],
    "cuCtxSetCurrent": [CUcontext],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(CUcontext), CUdevice],
    "cuImportExternalMemory": [
        ctypes.POINTER(CUexternalMemory),
        ctypes.POINTER(CUDA_EXTERNAL_MEMORY_HANDLE_DESC),
    ],
    "cuExternalMemoryGetMappedBuffer": [
        ctypes.POINTER(CUdeviceptr),
        CUexternalMemory,
        ctypes.POINTER(CUDA_EXTERNAL_MEMORY_BUFFER_DESC),
    ],
    "cuMemFree_v2": [CUdeviceptr],
    "cuDestroyExternalMemory": [CUexternalMemory],
    "cuImportExternalSemaphore": [
        ctypes.POINTER(CUexternalSemaphore),
        ctypes.POINTER(CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC),
    ],
    "cuSignalExternalSemaphoresAsync": [
        ctypes.POINTER(CUexternalSemaphore),
        ctypes.POINTER(CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS),
        ctypes.c_uint,
        CUstream,
    ],
    "cuWaitExternalSemaphoresAsync": [
        ctypes.POINTER(CUexternalSemaphore),
        ctypes.POINTER(CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS),
        ctypes.c_uint,
        CUstream,
    ],
    "cuDestroyExternalSemaphore": [CUexternalSemaphore],
}

# Used where present: cuDeviceGetUuid_v2 (CUDA 11.4+) gives the same UUID
# Vulkan's VkPhysicalDeviceIDProperties::deviceUUID does, also under MIG;
# cuCtxGetDevice lets ensure_context notice another device's context.
_OPTIONAL: Dict[str, List[Any]] = {
    "cuDeviceGetUuid_v2": [ctypes.POINTER(_CUuuid), CUdevice],
    "cuDeviceGetUuid": [ctypes.POINTER(_CUuuid), CUdevice],
    "cuCtxGetDevice": [ctypes.POINTER(CUdevice)],
}
