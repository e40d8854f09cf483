"""CUDA's side of headkl's zero-copy path.

PyTorch (CUDA) and headkl's Vulkan device share memory and one timeline
semaphore: the Vulkan backend exports them as POSIX opaque fds
(VK_KHR_external_memory_fd, VK_KHR_external_semaphore_fd), and this module
imports them into CUDA through the CUDA *driver* API.

The driver API comes from ``libcuda.so.1``, the library the NVIDIA driver
itself installs, loaded with ``ctypes.CDLL`` by ``Driver()``; no CUDA
toolkit and no extra package is needed. Nothing is loaded at import time, so
``import headkl._cuda`` works on any machine; ``Driver()`` raises
``CudaUnavailable`` where libcuda or an entry point it needs is missing.

The ctypes structures (in ``_cuda_h``, imported here under the same names)
mirror cuda.h (CUDA 12.6) byte for byte on x86-64 Linux (LP64); the size
and offset asserts there run at import and stop a layout slip before any
call is made.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from ._cuda_h import (  # noqa: F401 - the names cuda.h gives, as this module had them
    CUresult,
    CUdevice,
    CUdeviceptr,
    CUcontext,
    CUstream,
    CUexternalMemory,
    CUexternalSemaphore,
    CUDA_SUCCESS,
    CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD,
    CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_TIMELINE_SEMAPHORE_FD,
    CUDA_EXTERNAL_MEMORY_DEDICATED,
    _CUuuid,
    _Win32Handle,
    _MemoryHandle,
    CUDA_EXTERNAL_MEMORY_HANDLE_DESC,
    CUDA_EXTERNAL_MEMORY_BUFFER_DESC,
    _SemaphoreHandle,
    CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC,
    _Fence,
    _NvSciSync,
    _KeyedMutexSignal,
    _SignalParamsInner,
    CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS,
    _KeyedMutexWait,
    _WaitParamsInner,
    CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS,
    _REQUIRED,
    _OPTIONAL,
    _handle_fields,
    _params_inner_fields,
    _params_fields,
)

__all__ = [
    "CudaUnavailable",
    "CudaError",
    "Driver",
    "ExternalMemory",
    "ExternalTimeline",
    "tensor_at",
]

log = logging.getLogger("headkl")

# --- Errors ------------------------------------------------------------------


class CudaUnavailable(RuntimeError):
    """libcuda cannot be loaded, or lacks an entry point this module needs."""


class CudaError(RuntimeError):
    """A CUDA driver call returned something other than CUDA_SUCCESS."""

    def __init__(self, function: str, code: int = -1, name: Optional[str] = None):
        self.function = function
        self.code = code
        self.name = name
        what = f"{name}, CUresult {code}" if name else f"CUresult {code}"
        super().__init__(f"{function} failed ({what})")


class Driver:
    """The CUDA driver API of ``libcuda.so.1`` (ctypes.CDLL), with cuInit(0)
    done once, here."""

    def __init__(self, path: str = "libcuda.so.1"):
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise CudaUnavailable(
                f"cannot load {path}, the NVIDIA driver's CUDA library ({e}); "
                "the zero-copy path needs an NVIDIA GPU and its driver"
            ) from None
        self.path = path
        self._fns: Dict[str, Callable[..., int]] = {}
        for name, argtypes in _REQUIRED.items():
            fn = self._bind(name, argtypes)
            if fn is None:
                raise CudaUnavailable(f"{path} has no entry point {name} (driver too old?)")
            self._fns[name] = fn
        for name, argtypes in _OPTIONAL.items():
            fn = self._bind(name, argtypes)
            if fn is not None:
                self._fns[name] = fn
        uuid_name = "cuDeviceGetUuid_v2" if "cuDeviceGetUuid_v2" in self._fns else "cuDeviceGetUuid"
        if uuid_name not in self._fns:
            raise CudaUnavailable(f"{path} has neither cuDeviceGetUuid_v2 nor cuDeviceGetUuid")
        self._uuid_name = uuid_name
        self.call("cuInit", 0)
        log.debug("CUDA driver API loaded from %s", path)

    def _bind(self, name: str, argtypes: List[Any]) -> Optional[Callable[..., int]]:
        try:
            fn = getattr(self._lib, name)
        except AttributeError:
            return None
        fn.argtypes = argtypes
        fn.restype = CUresult
        return fn

    def error_name(self, code: int) -> Optional[str]:
        """cuGetErrorName's text for ``code`` ("CUDA_ERROR_..."), or None."""
        text = ctypes.c_char_p()
        if self._fns["cuGetErrorName"](code, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
            return None
        return text.value.decode("ascii", "replace")

    def call(self, name: str, *args: Any) -> None:
        """Calls entry point ``name``; a result other than CUDA_SUCCESS
        raises CudaError with the function's name, the code and its name."""
        code = self._fns[name](*args)
        if code != CUDA_SUCCESS:
            raise CudaError(name, code, self.error_name(code))

    def _device(self, ordinal: int) -> int:
        device = CUdevice()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        return device.value

    def device_uuid(self, ordinal: int) -> bytes:
        """The 16-byte UUID of CUDA device ``ordinal`` (to match against the
        Vulkan device's)."""
        uuid = _CUuuid()
        self.call(self._uuid_name, ctypes.byref(uuid), self._device(ordinal))
        return bytes(uuid.bytes)

    def ensure_context(self, ordinal: int) -> None:
        """Makes device ``ordinal``'s primary context (the one torch uses)
        current on this thread where none is; after torch.cuda has run on
        this thread that is usually already so."""
        current = CUcontext()
        self.call("cuCtxGetCurrent", ctypes.byref(current))
        device = self._device(ordinal)
        if current.value:
            if "cuCtxGetDevice" not in self._fns:
                return
            on = CUdevice()
            self.call("cuCtxGetDevice", ctypes.byref(on))
            if on.value == device:
                return
            # Imports land in the current context's device: with another
            # device's context current they would be on the wrong GPU. This
            # is what cudaSetDevice(ordinal) does.
            log.debug("another device's CUDA context is current; making device %d's primary one current", ordinal)
        primary = CUcontext()
        # The reference stays retained for the process's life, as torch's does.
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(primary), device)
        self.call("cuCtxSetCurrent", primary)

    def import_memory(self, fd: int, size: int, dedicated: bool = True) -> "ExternalMemory":
        """Imports ``size`` bytes of Vulkan memory exported as an opaque fd.
        On success CUDA owns ``fd``; on failure it is closed here."""
        desc = CUDA_EXTERNAL_MEMORY_HANDLE_DESC()
        desc.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD
        desc.handle.fd = fd
        desc.size = size
        desc.flags = CUDA_EXTERNAL_MEMORY_DEDICATED if dedicated else 0
        handle = self._import("cuImportExternalMemory", CUexternalMemory(), desc, fd)
        return ExternalMemory(self, handle, size)

    def import_timeline(self, fd: int) -> "ExternalTimeline":
        """Imports a Vulkan timeline semaphore exported as an opaque fd.
        On success CUDA owns ``fd``; on failure it is closed here."""
        desc = CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC()
        desc.type = CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_TIMELINE_SEMAPHORE_FD
        desc.handle.fd = fd
        return ExternalTimeline(self, self._import("cuImportExternalSemaphore", CUexternalSemaphore(), desc, fd))

    def _import(self, name: str, handle: Any, desc: Any, fd: int) -> int:
        """Calls the import entry point ``name`` into ``handle`` with
        ``desc``, which names ``fd``: the handle's value; on failure ``fd``
        is closed here (on success CUDA owns it)."""
        code = self._fns[name](ctypes.byref(handle), ctypes.byref(desc))
        if code != CUDA_SUCCESS:
            _close_quietly(fd)
            raise CudaError(name, code, self.error_name(code))
        return handle.value


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _finalizing() -> bool:
    # At interpreter shutdown libcuda may already be torn down (and torch's
    # context with it): calling it then can crash, and the process is going.
    return sys is None or sys.is_finalizing()


class _Imported:
    """What ExternalMemory and ExternalTimeline share: the driver, kept
    loaded while the import lives, and its handle (None once closed), with
    close() called when it is collected."""

    def __init__(self, driver: Driver, handle: int):
        self._driver = driver  # keeps libcuda loaded while this lives
        self._handle: Optional[int] = handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        if _finalizing():
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to from a finaliser
            pass


class ExternalMemory(_Imported):
    """Memory imported from Vulkan (cuImportExternalMemory of an OPAQUE_FD)
    and the device pointers mapped from it."""

    def __init__(self, driver: Driver, handle: int, size: int):
        super().__init__(driver, handle)
        self._mapped: List[int] = []
        self.size = size

    def map(self, offset: int, size: int) -> int:
        """A CUdeviceptr to ``size`` bytes at ``offset`` of the memory
        (cuExternalMemoryGetMappedBuffer); freed by close()."""
        if self._handle is None:
            raise RuntimeError("ExternalMemory.map: the memory was closed")
        desc = CUDA_EXTERNAL_MEMORY_BUFFER_DESC()
        desc.offset = offset
        desc.size = size
        pointer = CUdeviceptr()
        self._driver.call("cuExternalMemoryGetMappedBuffer", ctypes.byref(pointer), self._handle, ctypes.byref(desc))
        self._mapped.append(pointer.value)
        return pointer.value

    def close(self) -> None:
        """Frees every mapped pointer (cuMemFree), then the import
        (cuDestroyExternalMemory). Idempotent; every step is tried, and the
        first failure is raised at the end."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        mapped, self._mapped = self._mapped, []
        first: Optional[CudaError] = None
        for pointer in mapped:
            try:
                self._driver.call("cuMemFree_v2", pointer)
            except CudaError as e:
                first = first or e
        try:
            self._driver.call("cuDestroyExternalMemory", handle)
        except CudaError as e:
            first = first or e
        if first is not None:
            raise first


class ExternalTimeline(_Imported):
    """A Vulkan timeline semaphore imported into CUDA
    (CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_TIMELINE_SEMAPHORE_FD), signalled and
    waited on in a stream's order."""

    def _handles(self, what: str) -> "ctypes.Array[ctypes.c_void_p]":
        if self._handle is None:
            raise RuntimeError(f"ExternalTimeline.{what}: the semaphore was closed")
        return (CUexternalSemaphore * 1)(self._handle)

    def signal(self, value: int, stream: int) -> None:
        """Once the work queued on ``stream`` before this is done, the
        timeline is set to ``value`` (cuSignalExternalSemaphoresAsync)."""
        params = CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS()
        params.params.fence.value = value
        self._driver.call(
            "cuSignalExternalSemaphoresAsync", self._handles("signal"), ctypes.byref(params), 1, stream or None
        )

    def wait(self, value: int, stream: int) -> None:
        """Work queued on ``stream`` after this waits until the timeline
        reaches ``value`` (cuWaitExternalSemaphoresAsync); the host does not
        wait."""
        params = CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS()
        params.params.fence.value = value
        self._driver.call(
            "cuWaitExternalSemaphoresAsync", self._handles("wait"), ctypes.byref(params), 1, stream or None
        )

    def close(self) -> None:
        """cuDestroyExternalSemaphore; idempotent. Signals and waits already
        queued must be done first (the driver requires it)."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        self._driver.call("cuDestroyExternalSemaphore", handle)


# --- Tensors over device pointers -------------------------------------------

# __cuda_array_interface__ typestrs by torch dtype name. bfloat16 has none:
# it travels as int16 and is reinterpreted after (same size, no copy).
_TYPESTR = {
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "uint32": "<u4",
}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _interface(pointer: int, shape: Sequence[int], dtype: Any) -> Dict[str, Any]:
    """The ``__cuda_array_interface__`` (version 3) of a C-contiguous array
    of ``shape`` and torch ``dtype`` at device pointer ``pointer``."""
    name = _dtype_name(dtype)
    try:
        typestr = _TYPESTR[name]
    except KeyError:
        raise TypeError(f"tensor_at: no __cuda_array_interface__ typestr for {dtype}") from None
    return {
        "version": 3,
        "shape": tuple(int(d) for d in shape),
        "typestr": typestr,
        "data": (int(pointer), False),  # False: writable
        "strides": None,  # C-contiguous
        "stream": None,  # ordering is the caller's (the timeline semaphore)
    }


class _CudaArray:
    """What torch.as_tensor reads. torch keeps this object referenced for
    the tensor's life, so it holds ``owner`` (the imported memory) too."""

    def __init__(self, interface: Dict[str, Any], owner: object):
        self.__cuda_array_interface__ = interface
        self.owner = owner


def tensor_at(pointer: int, shape: tuple, dtype: Any, device_index: int, owner: object):
    """A torch CUDA tensor on device ``device_index`` viewing ``pointer``
    (no copy), of ``shape`` and ``dtype``, C-contiguous; it keeps ``owner``
    alive as long as it (or a view of it) lives."""
    import torch

    array = _CudaArray(_interface(pointer, shape, dtype), owner)
    with torch.cuda.device(device_index):
        tensor = torch.as_tensor(array, device=torch.device("cuda", device_index))
    if _dtype_name(dtype) == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    # as_tensor copies where the pointer's device differs from the one
    # asked for; a copy would silently break the sharing.
    if tensor.numel() and tensor.data_ptr() != int(pointer):
        raise RuntimeError(
            f"tensor_at: torch copied the memory at {pointer:#x} instead of viewing it "
            f"(is it on CUDA device {device_index}?)"
        )
    return tensor
