"""headkl: the distillation loss's vocabulary head on any Vulkan GPU.

The PyTorch API (these import torch) is laid out as Liger-Kernel's is:
``headkl.nn`` has the loss modules ``HeadKLLoss`` and ``FullVocabKLLoss``
(``nn.Module``s whose backward gives ``hidden.grad``, and the head's
gradient where the head requires grad), ``headkl.head`` has
``Head`` (top-k and gather on a head uploaded once), ``headkl.functional``
the functions ``topk`` and ``gather``, ``headkl.ops`` the operations over
tensors under them and ``headkl.distributed`` the vocabulary-parallel
loss's collectives. ``headkl.torch`` has all of these under one name.

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

from ._native import DeviceError, __version__, check, devices

__all__ = ["DeviceError", "__version__", "check", "devices"]
