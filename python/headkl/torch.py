"""headkl for PyTorch: the fused top-k distillation loss with its gradient,
the teacher's exact top-k and the gather, on a head uploaded once (and
uploaded again where it changes: see ``Head``).

The head ``weight`` is ``[V][hs]`` (``nn.Linear(hs, V).weight``, or an
embedding matrix), float32, float16 or bfloat16; the hidden rows are
``[..., hs]`` in any of those dtypes. Per token, with ``s = x·Wᵀ/τ``::

    L_t  = Σ_k q_k · (log q_k − log_softmax(s)[id_k])     q: the teacher's k, renormalized
    loss = Σ_t w_t L_t / Σ_t w_t                           (reduction="mean")

and ``loss.backward()`` gives ``hidden.grad``; no ``[ntok][V]`` tensor is
ever made. A frozen head (``weight.detach()``) gets no gradient and costs
nothing more; a head that requires grad (a trainable ``lm_head.weight``, or
an embedding tied to it) gets ``weight.grad`` through autograd as well,
computed on host memory in the same call. The other divergences, tail
modes and terms are keywords of ``HeadKLLoss`` (the README's "Loss terms"
has each one's PyTorch formula).

Tensors on the CPU are read and written in place. CUDA tensors go
zero-copy where the engine runs on the Vulkan backend of the same GPU: the
engine's input and output buffers are Vulkan memory CUDA maps, and one
timeline semaphore orders the two on the device (torch's current stream
signals it once the inputs are in, and waits on it before reading the
outputs), with no host wait inside a step. Anywhere else CUDA tensors go
through host copies, said once on the ``headkl`` logger;
``host_copy_bytes()`` counts the bytes they moved.

The package is laid out as Liger-Kernel's is, and this module is its
PyTorch face as it was before, every name kept:

- ``headkl.nn``: the loss modules ``HeadKLLoss`` and ``FullVocabKLLoss``;
- ``headkl.head``: ``Head``, a head uploaded once (``topk``, ``gather``);
- ``headkl.functional``: ``topk``, ``gather`` and the losses ``head_kl_loss``
  and ``full_vocab_kl_loss`` on a head given per call;
- ``headkl.ops``: the operations over tensors under them (the two losses'
  autograd, the top-k and gather);
- ``headkl.distributed``: the vocabulary-parallel loss's collectives.

``CUSTOM_OPS`` says whether headkl's operations run as ``torch.library``
custom ops (``headkl::head_kl_loss`` and the rest: torch >= 2.4), which
``torch.compile(fullgraph=True)`` traces with no graph break; where not,
``CUSTOM_OPS_REASON`` says why, and the losses run through a
``torch.autograd.Function`` with the same results and errors.
"""

from __future__ import annotations

import logging

from . import _host, _native  # noqa: F401
from ._checks import (  # noqa: F401
    _FLOATS,
    _MAX_K,
    _changed,
    _frozen,
    _ids,
    _row_marks,
    _rows,
    _same_device,
    _stamp,
    _tensor,
    _top_k,
    _trainable,
    _unsharded,
)
from ._host import _NAMES, _on_host, _spec, _to_device, host_copy_bytes  # noqa: F401
from ._options import _DIVERGENCES, _FORMS, _REDUCTIONS, _TAILS, _loss_options  # noqa: F401
from ._safetensors import read_safetensors, write_safetensors
from ._zero_copy import _ZeroCopy  # noqa: F401
from .distributed import merge_partials as _merge_partials  # noqa: F401
from .functional import gather, topk
from .head import Head
from .nn import FullVocabKLLoss, HeadKLLoss, _HeadLoss  # noqa: F401
from .ops._reduce import _effective_weights, _reduced  # noqa: F401
from .ops.autograd import _HeadKLFunction, _LossCall, _once_differentiable  # noqa: F401
from .ops.custom import CUSTOM_OPS, CUSTOM_OPS_REASON
from .ops.topk import Gathered, TopK

__all__ = [
    "FullVocabKLLoss",
    "Head",
    "HeadKLLoss",
    "TopK",
    "Gathered",
    "topk",
    "gather",
    "read_safetensors",
    "write_safetensors",
    "CUSTOM_OPS",
    "CUSTOM_OPS_REASON",
]

log = logging.getLogger("headkl")


def __getattr__(name: str):
    # The host-copy state lives in ``_host``: read through, never a stale copy.
    if name in ("_host_copy_bytes", "_warned_host_copies"):
        return getattr(_host, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
