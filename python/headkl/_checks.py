"""The checks of what a call is given, before anything goes to a device: each
refusal names the argument (``TypeError`` for a wrong type or dtype,
``ValueError`` for a wrong shape, value or device); whether a call computes
the head's gradient (``_trainable``); and what tells whether a kept head
changed since it was uploaded (``_stamp``, ``_changed``)."""

from __future__ import annotations

import logging
import operator
from typing import Optional, Sequence, Tuple

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# The most entries a top-k row holds: the engine's MAX_K (crates/core/src/problem.rs).
_MAX_K = 2048


def _tensor(name: str, t, dtypes: Sequence[torch.dtype], ndim: Optional[int] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} is not one of {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def _frozen(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a teacher's tensor), refused where it requires grad: the loss
    returns no gradient for it, and a dropped gradient must not pass in
    silence."""
    if t.requires_grad:
        raise ValueError(
            f"{name}: requires grad, but headkl returns no gradient for the teacher's side (only hidden and the "
            f"student's head weight get one); pass {name}.detach(), or make it under torch.no_grad()"
        )
    return t


def _trainable(head) -> Optional[torch.Tensor]:
    """The head's tensor where this call computes its gradient (it requires
    grad and grad is on), else None (a frozen head: nothing more is done);
    the sharded loss refuses it."""
    weight = head._weight
    if not (weight.requires_grad and torch.is_grad_enabled()):
        return None
    _unsharded(weight, head.shard)
    return weight


def _unsharded(weight: torch.Tensor, shard) -> None:
    """Refuses a head that requires grad with ``shard``: the sharded loss
    does not compute the head's gradient."""
    if shard is not None and weight.requires_grad:
        raise ValueError(
            "weight: requires grad, but the sharded loss (shard=...) does not compute the head's gradient; "
            "pass weight.detach() for a frozen head, or run the loss unsharded"
        )


def _stamp(t: torch.Tensor) -> Tuple[Optional[int], int]:
    """What tells whether ``t`` changed: its version counter (bumped by every
    in-place change, and shared with the tensor it was detached or sliced
    from) and where its data is (moved by ``t.data = ...`` or ``t.set_()``)."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        version = None
    return version, t.data_ptr()


def _changed(name: str, t: torch.Tensor, stamp: Tuple[Optional[int], int]) -> Optional[str]:
    """Why ``t`` differs from when ``stamp`` was taken, or None."""
    version, pointer = _stamp(t)
    if pointer != stamp[1]:
        return f"{name}'s storage was replaced"
    if version != stamp[0]:
        return f"{name} changed in place (tensor version {stamp[0]} -> {version})"
    return None


def _top_k(k, vocab: int) -> int:
    """``k`` as an int, checked against ``min(V, 2048)`` before anything is
    allocated for it."""
    if isinstance(k, bool):
        raise TypeError(f"k: expected an int, got {k!r}")
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"k: expected an int, got {type(k).__name__}") from None
    limit = min(vocab, _MAX_K)
    if k < 1:
        raise ValueError(f"k: {k}; the top-k needs at least one entry per row (1 <= k <= {limit})")
    if k > limit:
        raise ValueError(
            f"k: {k} is more than {limit}, the most the top-k takes (k <= min(V = {vocab}, {_MAX_K})); "
            "for the full vocabulary use FullVocabKLLoss"
        )
    return k


def _ids(name: str, t) -> torch.Tensor:
    t = _tensor(name, t, (torch.int64, torch.int32))
    return t.to(torch.int64)


def _same_device(name: str, t: torch.Tensor, hidden: torch.Tensor) -> None:
    if t.device != hidden.device:
        raise ValueError(f"{name}: on {t.device}, but hidden is on {hidden.device}")


def _rows(name: str, t: torch.Tensor, lead: Tuple[int, ...]) -> None:
    if tuple(t.shape) != lead:
        raise ValueError(f"{name}: expected shape {lead} (hidden's leading dimensions), got {tuple(t.shape)}")


def _row_marks(lead: Tuple[int, ...], hidden: torch.Tensor, *, labels=None, weights=None, total=None):
    """A loss's per-token marks, as its ``forward`` takes them: ``labels``
    (int64) and ``weights`` (float32), each optional, checked against
    hidden's leading dimensions and device and flattened to ``[ntok]``,
    and ``total`` (a float, or None)."""
    if labels is not None:
        labels = _ids("labels", labels)
        _rows("labels", labels, lead)
        _same_device("labels", labels, hidden)
        labels = labels.reshape(-1)
    if weights is not None:
        if isinstance(weights, torch.Tensor) and not (weights.dtype.is_floating_point or weights.dtype.is_complex):
            # A mask (bool or integer, as an attention mask comes): 1 keeps a token, 0 drops it.
            weights = weights.to(torch.float32)
        weights = _tensor("weights", weights, _FLOATS + (torch.float64,))
        _rows("weights", weights, lead)
        _same_device("weights", weights, hidden)
        weights = weights.reshape(-1).to(torch.float32)
    return labels, weights, None if total is None else float(total)


def _teacher_top_k(teacher_ids, teacher_values, lead: Tuple[int, ...], hidden: torch.Tensor):
    """The teacher's top-k ``[..., k]``: ids (int64) and values, checked
    against hidden's leading dimensions and device."""
    teacher_ids = _ids("teacher_ids", teacher_ids)
    teacher_values = _tensor("teacher_values", teacher_values, _FLOATS + (torch.float64,))
    if teacher_ids.dim() < 1 or tuple(teacher_ids.shape[:-1]) != lead:
        raise ValueError(f"teacher_ids: expected shape {lead} + (k,), got {tuple(teacher_ids.shape)}")
    if teacher_values.shape != teacher_ids.shape:
        raise ValueError(
            f"teacher_values: shape {tuple(teacher_values.shape)} differs from teacher_ids' {tuple(teacher_ids.shape)}"
        )
    for name, t in (("teacher_ids", teacher_ids), ("teacher_values", teacher_values)):
        _same_device(name, t, hidden)
    if teacher_values.requires_grad:
        _say_teacher_values_get_no_gradient()
    return teacher_ids, teacher_values


_said_teacher_no_grad = False


def _say_teacher_values_get_no_gradient() -> None:
    """Says once, on the ``headkl`` logger (WARNING), that teacher values
    that require grad get none: the loss treats the teacher as a fixed
    target, as a distillation loss does."""
    global _said_teacher_no_grad
    if not _said_teacher_no_grad:
        logging.getLogger("headkl").warning(
            "headkl: teacher_values requires grad, but the loss gives the teacher no gradient "
            "(it is a fixed target); pass teacher_values.detach() to say so"
        )
        _said_teacher_no_grad = True
