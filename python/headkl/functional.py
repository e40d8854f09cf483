"""headkl's functional API: the teacher's exact top-k and the gather on a
head given for the call alone (keep a ``Head`` to call them again without
uploading the head each time)."""

from __future__ import annotations

import torch

from ._checks import _FLOATS, _tensor, _top_k
from .head import Head
from .ops.topk import Gathered, TopK

__all__ = ["Gathered", "TopK", "gather", "topk"]


def topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float = 1.0, **kwargs) -> TopK:
    """``Head(weight).topk(hidden, k, temperature=...)``: uploads the head for
    this call alone; keep a ``Head`` to call it again. ``backend`` and
    ``device`` go to ``Head``, the rest to ``Head.topk``."""
    weight = _tensor("weight", weight, _FLOATS, ndim=2)
    _top_k(k, weight.shape[0])  # before the head is uploaded
    head_kw = {key: kwargs.pop(key) for key in ("backend", "device") if key in kwargs}
    return Head(weight, **head_kw).topk(hidden, k, temperature=temperature, **kwargs)


def gather(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, **kwargs
) -> Gathered:
    """``Head(weight).gather(hidden, ids, temperature=...)``, the head
    uploaded for this call alone."""
    head_kw = {key: kwargs.pop(key) for key in ("backend", "device") if key in kwargs}
    return Head(weight, **head_kw).gather(hidden, ids, temperature=temperature, **kwargs)
