"""headkl's functional API, on a head given for the call alone (keep a
``Head`` or a loss module to call again without uploading the head each
time):

- ``topk`` and ``gather``: the teacher's exact top-k and the gather;
- ``head_kl_loss`` and ``full_vocab_kl_loss``: the two losses with the
  head (and the teacher's) passed per call, as Liger-Kernel's functional
  losses take them (``LigerFusedLinearJSD``'s argument order), with
  autograd to ``input`` and to a ``weight`` that requires grad.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._checks import _FLOATS, _tensor, _top_k
from ._options import _HEAD_KEYWORDS
from .head import Head
from .nn import FullVocabKLLoss, HeadKLLoss
from .ops.topk import Gathered, TopK

__all__ = ["Gathered", "TopK", "full_vocab_kl_loss", "gather", "head_kl_loss", "topk"]


def topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float = 1.0, **kwargs) -> TopK:
    """``Head(weight).topk(hidden, k, temperature=...)``: uploads the head for
    this call alone; keep a ``Head`` to call it again. ``backend``,
    ``device`` and ``f32_inputs`` go to ``Head``, the rest to ``Head.topk``."""
    weight = _tensor("weight", weight, _FLOATS, ndim=2)
    _top_k(k, weight.shape[0])  # before the head is uploaded
    head_kw = {key: kwargs.pop(key) for key in _HEAD_KEYWORDS if key in kwargs}
    return Head(weight, **head_kw).topk(hidden, k, temperature=temperature, **kwargs)


def gather(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, **kwargs
) -> Gathered:
    """``Head(weight).gather(hidden, ids, temperature=...)``, the head
    uploaded for this call alone."""
    head_kw = {key: kwargs.pop(key) for key in _HEAD_KEYWORDS if key in kwargs}
    return Head(weight, **head_kw).gather(hidden, ids, temperature=temperature, **kwargs)


def head_kl_loss(
    input: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_values: torch.Tensor,
    *,
    labels: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    total: Optional[float] = None,
    **options,
) -> torch.Tensor:
    """The top-k distillation loss of the student's hidden rows ``input``
    ``[..., hs]`` through the head ``weight`` ``[V][hs]`` against the
    teacher's top-k ``[..., k]``: ``HeadKLLoss(weight, **options)(input,
    teacher_ids, teacher_values, labels=..., weights=..., total=...)``, the
    head uploaded for this call alone (keep a ``HeadKLLoss`` to call it
    again without the upload). ``options`` are ``HeadKLLoss``'s keywords
    (``temperature``, ``reduction``, ``tail``, ``teacher_form``,
    ``divergence``, ``backend``, ``f32_inputs``, ...). Its backward gives
    ``input.grad`` and, where ``weight`` requires grad, ``weight.grad``."""
    loss_fn = HeadKLLoss(weight, **options)
    return loss_fn(input, teacher_ids, teacher_values, labels=labels, weights=weights, total=total)


def full_vocab_kl_loss(
    input: torch.Tensor,
    weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    shift_labels: Optional[torch.Tensor] = None,
    *,
    divergence: str = "jsd",
    beta: float = 0.5,
    labels: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    total: Optional[float] = None,
    **options,
) -> torch.Tensor:
    """The exact full-vocabulary divergence of the student (hidden rows
    ``input`` ``[..., hs]``, head ``weight`` ``[V][hs]``) from the teacher
    (``teacher_input`` ``[..., hs_T]``, ``teacher_weight`` ``[V][hs_T]``),
    in the argument order of Liger-Kernel's
    ``LigerFusedLinearJSD.forward(student_input, student_weight,
    teacher_input, teacher_weight, shift_labels=None)``:
    ``FullVocabKLLoss(weight, teacher_weight, divergence=..., beta=...,
    **options)(input, teacher_input, ...)``, both heads uploaded for this
    call alone (keep a ``FullVocabKLLoss`` to call it again without the
    uploads).

    ``shift_labels`` ``[...]``, as Liger's: the tokens whose label is
    ``ignore_index`` (or negative) are left out of the loss and of the
    mean's denominator (``labels=shift_labels`` with ``ignore_mask=True``).
    ``divergence`` (``"jsd"`` with ``beta``: 0 the forward KL, 1 the
    reverse, as Liger's ``jsd_beta``), ``temperature``, ``reduction`` and
    the rest of ``options`` are ``FullVocabKLLoss``'s keywords. Its
    backward gives ``input.grad`` and, where ``weight`` requires grad,
    ``weight.grad``; the teacher gets none (a teacher tensor that requires
    grad is refused: pass ``.detach()``)."""
    if shift_labels is not None:
        if labels is not None:
            raise ValueError("shift_labels: given with labels; pass one (shift_labels is labels with ignore_mask)")
        labels = shift_labels
        options.setdefault("ignore_mask", True)
    loss_fn = FullVocabKLLoss(weight, teacher_weight, divergence=divergence, beta=beta, **options)
    return loss_fn(input, teacher_input, labels=labels, weights=weights, total=total)
