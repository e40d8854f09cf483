"""headkl: the distillation loss's vocabulary head on any Vulkan GPU.

The PyTorch API (these import torch) is laid out as Liger-Kernel's is:
``headkl.nn`` has the loss modules ``HeadKLLoss`` and ``FullVocabKLLoss``
(``nn.Module``s whose backward gives ``hidden.grad``, and the head's
gradient where the head requires grad), ``headkl.head`` has
``Head`` (top-k and gather on a head uploaded once), ``headkl.functional``
the functions ``topk``, ``gather``, ``head_kl_loss`` and
``full_vocab_kl_loss`` (the head given per call, as Liger's functional
losses take it), ``headkl.ops`` the operations over tensors under them
and ``headkl.distributed`` the vocabulary-parallel loss's collectives.
``headkl.torch`` has all of these under one name (the functional losses
under ``headkl.functional`` alone: ``headkl.ops`` has functions of the
same names over an uploaded ``Head``).

This module needs no torch:

- ``devices()`` lists every backend's devices, as ``headkl devices`` does;
- ``check(backend="auto", cases=16)`` runs the conformance suite that
  ``headkl check`` runs against the f64 reference, on this machine;
- ``DeviceError`` is what a failing device raises (bad input raises
  ``ValueError`` or ``TypeError`` naming the argument).

The backend is chosen per call site with ``backend=``: ``"auto"`` (the best
GPU, else the f64 CPU reference), ``"vulkan"``, ``"wgpu"`` or
``"reference"``; the ``HEADKL_*`` variables apply as for the command.
"""

from typing import Optional

from . import _native
from ._native import DeviceError, __version__
from ._stderr import quiet_mesa

__all__ = ["DeviceError", "__version__", "check", "devices"]


def devices() -> list:
    """Every backend's devices, as ``headkl devices`` lists them: a dict per
    device (``backend``, ``index``, ``name``, ``type``, ``matrix_units``,
    ``auto``: whether ``backend="auto"`` picks it), then one per backend
    that could not enumerate (``backend``, ``error``: why). Mesa's
    ``XDG_RUNTIME_DIR`` lines are kept off stderr (``_stderr``)."""
    return quiet_mesa(_native.devices)


def check(backend: str = "auto", device: Optional[int] = None, cases: int = 16, seed: int = 0x5EED) -> dict:
    """The conformance suite ``headkl check`` runs, against the f64
    reference, on ``backend`` (and ``device``) here: its report (``cases``,
    ``passed``, ``failures``: ``(case, seed, message)``, and the worst
    relative errors); failed cases do not raise. Mesa's ``XDG_RUNTIME_DIR``
    lines are kept off stderr; the rest of what it prints is written there
    when it ends."""
    return quiet_mesa(_native.check, backend, device, cases, seed)
