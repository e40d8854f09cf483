"""``Head``: a head ``weight`` ``[V][hs]`` uploaded once to a backend, never
stale (a changed head is uploaded again at the next call), with the exact
top-k and the gather on it. Both loss modules keep one."""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple, Union

import torch

from ._checks import _FLOATS, _changed, _stamp, _tensor
from ._cuda_direct import _CudaDirect
from ._engine import _open_engine, _teacher_onto
from ._host import _on_host, _warn_host_copies
from ._precision import _f32_input, _f32_inputs, _say_f32
from ._registry import _register
from ._zero_copy import _ZeroCopy
from .ops.topk import head_gather, head_topk

__all__ = ["Head"]

log = logging.getLogger("headkl")


class Head:
    """A head ``weight`` ``[V][hs]`` uploaded once to a backend.

    ``backend``: ``"auto"`` (the best GPU, else the f64 CPU reference),
    ``"vulkan"``, ``"wgpu"`` or ``"reference"``; ``device``: the index
    within it, as ``headkl.devices()`` lists them. For a vocabulary shard,
    ``shard=(v0, v1)`` with ``vocab_size=V``: ``weight`` then holds the rows
    ``[v0, v1)`` alone.

    The head is never stale: the tensor given is kept (not copied) with its
    version counter, and a call that finds it changed since the upload (an
    in-place change such as an optimizer step or an EMA update, also made
    through the parameter ``weight`` was detached from, or its storage
    replaced with ``weight.set_()``) uploads it again first, said on the
    ``headkl`` logger. ``weight.data = ...`` on the parameter after
    ``.detach()`` is not seen: the detached tensor keeps the old storage.
    The results of ``topk`` and ``gather`` carry no gradient.

    ``f32_inputs``: float32 hidden rows and heads are computed as float16
    (the GEMMs' input): ``"f16"`` (the default) takes them so, said once at
    INFO on the ``headkl`` logger (about 3e-4 relative error on the
    gradients; a value past ±65504 is refused, naming it and how to scale);
    ``"error"`` refuses them with a ``TypeError`` (pass float16 or bfloat16).

    **Copies.** ``copy.deepcopy``, ``pickle`` and ``torch.save`` keep the
    head's tensor (a parameter as itself: in a deep copy of a model, a head
    tied to a parameter stays tied to the copied one), the backend's name
    and the options; the native engine is not carried: the copy opens its
    own, on the same backend name and device, at its first call. A copy of
    a head made from ``param.detach()`` shares the copied parameter's data
    but not its version counter: it sees the copy's ``set_()``, not its
    in-place steps (pass the parameter itself, or make the loss again).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        backend: str = "auto",
        device: Optional[int] = None,
        shard: Optional[Tuple[int, int]] = None,
        vocab_size: Optional[int] = None,
        f32_inputs: str = "f16",
    ):
        weight = _tensor("weight", weight, _FLOATS, ndim=2)
        self.f32_inputs = _f32_inputs(f32_inputs)
        _f32_input("weight", weight, self.f32_inputs)
        rows, hs = weight.shape
        shard_spec = None
        if shard is not None:
            if vocab_size is None:
                raise ValueError("vocab_size: needed with shard (the whole head's rows)")
            v0, v1 = (int(v) for v in shard)
            if v1 - v0 != rows:
                raise ValueError(f"shard: ({v0}, {v1}) holds {v1 - v0} rows, but weight has {rows}")
            shard_spec = (v0, v1, int(vocab_size))
        elif vocab_size is not None and vocab_size != rows:
            raise ValueError(f"vocab_size: {vocab_size}, but weight has {rows} rows and no shard is given")
        self._open = (backend, device, shard_spec)
        self._weight = weight
        self._teacher: Optional[torch.Tensor] = None  # FullVocabKLLoss's teacher head, kept as the head is
        self._engine: Any = None  # the native Engine
        self._zc: Optional[Union[_ZeroCopy, _CudaDirect]] = None
        self._no_zc = None if shard is None else "a vocabulary shard runs through host copies"
        self._loss_zero_copy = False  # whether the loss's last CUDA call went zero-copy
        self._uploads = self._teacher_uploads = 0
        self.shard = None if shard_spec is None else (shard_spec[0], shard_spec[1])
        self.vocab_size = rows if shard_spec is None else shard_spec[2]
        self.hidden_size = hs
        # What headkl's custom ops take in place of the head (headkl.ops.custom).
        self._handle = _register(self)
        _say_f32(weight)
        self._upload()

    # What a copy does not carry: the native engine and what hangs on it
    # (zero-copy buffers, device memory), the registry's handle, the stamps
    # of the tensors as they were uploaded; the copy makes its own.
    _NOT_COPIED = ("_engine", "_zc", "_handle", "_stamp", "_teacher_stamp", "_loss_zero_copy", "_no_zc")

    def __getstate__(self) -> dict:
        """The head's tensors (a parameter as itself), its backend's name and
        options, for ``copy``, ``pickle`` and ``torch.save``; not the native
        engine (not picklable, and bound to this process's device)."""
        return {key: value for key, value in self.__dict__.items() if key not in self._NOT_COPIED}

    def __setstate__(self, state: dict) -> None:
        """A copy: the engine opens on the same backend name and device at
        its first call (``_refresh``), and the copy takes its own handle."""
        self.__dict__.update(state)
        self._engine, self._zc, self._loss_zero_copy = None, None, False
        self._no_zc = None if self.shard is None else "a vocabulary shard runs through host copies"
        # No upload yet: what tells _refresh this is a copy to open.
        self._uploads = self._teacher_uploads = 0
        self._handle = _register(self)

    def __repr__(self) -> str:
        backend, device, _ = self._open
        parts = [f"vocab_size={self.vocab_size}", f"hidden_size={self.hidden_size}", f"dtype={self._weight.dtype}"]
        parts.append(f"backend={backend!r}")
        if device is not None:
            parts.append(f"device={device!r}")
        if self.shard is not None:
            parts.append(f"shard={self.shard!r}")
        if self.f32_inputs != "f16":
            parts.append(f"f32_inputs={self.f32_inputs!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def _upload(self) -> None:
        """Makes the engine from the head as it is now (and the teacher's
        head, where one is set), in place of the last one: that one's
        zero-copy buffers and device memory go first."""
        self._release()
        weight = self._weight
        stamp = _stamp(weight)
        engine = _open_engine(weight, _on_host("weight", weight), self._open)
        if self._teacher is not None:
            teacher_stamp = self._teacher_onto(engine)
        self._engine, self._stamp = engine, stamp
        self._uploads += 1
        if self._teacher is not None:
            self._teacher_stamp = teacher_stamp
            self._teacher_uploads += 1

    def _teacher_onto(self, engine):
        """Uploads the teacher's head to ``engine``; returns its stamp as read."""
        stamp = _stamp(self._teacher)
        _teacher_onto(engine, self._teacher)
        return stamp

    def _set_teacher(self, teacher_weight: torch.Tensor) -> None:
        """Sets the teacher's head (FullVocabKLLoss's), kept and re-read as the head is."""
        _f32_input("teacher_weight", teacher_weight, self.f32_inputs)
        _say_f32(teacher_weight)
        self._teacher = teacher_weight
        self._teacher_hidden_size = teacher_weight.shape[1]
        self._teacher_stamp = self._teacher_onto(self._engine)
        self._teacher_uploads += 1

    def _release(self) -> None:
        """Lets the engine go: once the device is done with the last
        zero-copy call (whose flagged errors are raised here, as the next
        call would), its shared buffers are freed."""
        if self._zc is not None:
            self._engine.synchronize()
            zc, self._zc = self._zc, None
            zc.close()
        self._engine = None

    def _refresh(self) -> None:
        """Uploads the head again where it changed since it was uploaded
        (the teacher's head alone where only that one changed), said on the
        ``headkl`` logger: a call never runs on a stale head."""
        if self._engine is None and self._uploads == 0:
            # A copy (or an unpickled head): its engine opens at its first call.
            log.debug("headkl: opening the engine of a copied head on backend %r", self._open[0])
            self._same_shape("weight", self._weight, (self._weight_rows, self.hidden_size))
            if self._teacher is not None:
                self._same_shape("teacher_weight", self._teacher, self._teacher_shape)
            self._upload()
            return
        why = "the last upload failed" if self._engine is None else _changed("weight", self._weight, self._stamp)
        if why is None and self._teacher is not None:
            teacher_why = _changed("teacher_weight", self._teacher, self._teacher_stamp)
            if teacher_why is not None:
                self._same_shape("teacher_weight", self._teacher, self._teacher_shape)
                log.info("headkl: re-read the teacher's head: %s since it was uploaded", teacher_why)
                self._teacher_stamp = self._teacher_onto(self._engine)
                self._teacher_uploads += 1
            return
        if why is None:
            return
        self._same_shape("weight", self._weight, (self._weight_rows, self.hidden_size))
        if self._teacher is not None:
            self._same_shape("teacher_weight", self._teacher, self._teacher_shape)
        if self._refill_on_device():
            log.info("headkl: re-read the head on the device: %s since it was read", why)
            return
        log.info("headkl: re-read the head: %s since it was uploaded", why)
        self._upload()

    def _refill_on_device(self) -> bool:
        """Where the head is a CUDA tensor and the engine the CUDA backend
        on its device (and no teacher head rides along): reads it again
        there, with no host copy of it (``_CudaDirect.refill``); False
        where it cannot, and the head is uploaded again from the host."""
        w = self._weight
        if self._engine is None or not w.is_cuda or self.shard is not None or self._teacher is not None:
            return False
        zc = self._zero_copy(w.device, quiet=True)
        if not isinstance(zc, _CudaDirect):
            return False
        zc.refill(w)
        self._stamp = _stamp(w)
        self._uploads += 1
        return True

    @property
    def _weight_rows(self) -> int:
        return self.vocab_size if self.shard is None else self.shard[1] - self.shard[0]

    @property
    def _teacher_shape(self) -> Tuple[int, int]:
        return (self.vocab_size, self._teacher_hidden_size)

    @staticmethod
    def _same_shape(name: str, t: torch.Tensor, shape: Tuple[int, int]) -> None:
        """A kept head changed must keep its shape (and a head's dtype)."""
        _tensor(name, t, _FLOATS)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"{name}: its shape changed from {tuple(shape)} to {tuple(t.shape)} since it was uploaded; "
                "make a new one for another head"
            )

    @property
    def info(self) -> dict:
        """The device: backend, name, type, driver, matrix units, GEMM kernels."""
        if self._engine is None:
            self._refresh()
        return self._engine.info()

    def synchronize(self) -> None:
        """Waits for the device and raises what the last zero-copy call
        flagged there (``ValueError``: an id ≥ V, a non-finite row)."""
        if self._engine is not None:
            self._engine.synchronize()

    def _zero_copy(self, device: torch.device, why_not: Optional[str] = None, quiet: bool = False):
        """The engine's direct path for CUDA tensors on device ``device``
        (the CUDA backend's, or Vulkan memory shared with CUDA), or None
        (then host copies, logged once with why, unless ``quiet``):
        ``why_not`` names a caller's reason."""
        if why_not is None and self._zc is None and self._no_zc is None:
            try:
                if self._engine.info()["backend"] == "cuda":
                    self._zc = _CudaDirect(self._engine, device, self.vocab_size)
                else:
                    self._zc = _ZeroCopy(self._engine, device)
            except Exception as e:  # noqa: BLE001 - any reason to fall back is said once
                self._no_zc = str(e)
        reason = why_not or self._no_zc
        if reason is not None:
            if not quiet:
                _warn_host_copies(reason)
            return None
        return self._zc

    def _hidden(self, hidden) -> Tuple[torch.Tensor, Tuple[int, ...]]:
        hidden = _tensor("hidden", hidden, _FLOATS)
        _f32_input("hidden", hidden, self.f32_inputs)
        if hidden.dim() < 1 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden: last dimension must be the head's hidden size {self.hidden_size}, got shape {tuple(hidden.shape)}"
            )
        if hidden.device.type not in ("cpu", "cuda"):
            raise TypeError(f"hidden: tensors on {hidden.device.type} are not supported (use cpu or cuda)")
        lead = tuple(hidden.shape[:-1])
        return hidden.reshape(-1, self.hidden_size), lead

    # The teacher's side: ``ops.topk``'s functions, as methods (``self`` is
    # their ``head``).
    topk = head_topk
    gather = head_gather
