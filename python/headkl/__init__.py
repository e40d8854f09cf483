"""headkl: the distillation loss's frozen vocabulary head on any Vulkan GPU.

``headkl.torch`` has the PyTorch API: ``HeadKLLoss`` (an ``nn.Module`` whose
backward gives ``hidden.grad``), ``Head`` (top-k and gather on a head
uploaded once), and the functions ``topk`` and ``gather``.

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
