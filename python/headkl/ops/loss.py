"""The top-k distillation loss over tensors (``HeadKLLoss``'s forward): the
inputs checked, the head re-read where it changed, and the loss with its
gradient through the zero-copy path (CUDA tensors on the engine's own GPU)
or on host memory (the sharded loss's phases through ``distributed``)."""

from __future__ import annotations

from typing import Optional

import torch

from .._checks import _row_arrays, _teacher_top_k
from .._host import _on_host, _spec
from ..distributed import sharded_loss
from ._reduce import _effective_weights, _host_result, _reduced
from .autograd import _HeadKLFunction


def head_kl_loss(
    head,
    options: dict,
    hidden: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_values: torch.Tensor,
    *,
    labels: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    total: Optional[float] = None,
    process_group=None,
) -> torch.Tensor:
    """The loss of ``hidden`` ``[..., hs]`` against the teacher's top-k
    ``[..., k]`` through ``head`` (a ``Head``), with ``options`` as
    ``_loss_options`` makes them: a scalar, or ``[...]`` with
    ``reduction="none"``; its backward gives ``hidden.grad``. The
    arguments are ``HeadKLLoss.forward``'s; ``process_group`` is the
    sharded loss's (a head with ``shard``)."""
    flat, lead = head._hidden(hidden)
    ntok = flat.shape[0]
    teacher_ids, teacher_values = _teacher_top_k(teacher_ids, teacher_values, lead, hidden)
    k = teacher_ids.shape[-1]
    labels, weights = _row_arrays(labels, weights, lead, hidden)
    if options["hard_weight"] > 0 and labels is None:
        raise ValueError(f"labels: needed with weight_hard_loss={options['hard_weight']}")
    inputs = (flat, teacher_ids.reshape(ntok, k), teacher_values.reshape(ntok, k), labels, weights)
    total = None if total is None else float(total)
    head._refresh()
    zero_copy = _zero_copy(head, options, hidden.device) if hidden.device.type == "cuda" else None
    if zero_copy is not None:
        run = lambda: _device_loss(zero_copy, options, *inputs, total)  # noqa: E731
    else:
        run = lambda: _host_loss(head, options, process_group, *inputs, total, hidden.device)  # noqa: E731
    return _HeadKLFunction.apply(flat, run).reshape(lead if options["reduction"] == "none" else ())


def _zero_copy(head, options: dict, device: torch.device):
    """The zero-copy path for CUDA tensors on ``device``, or None (then
    host copies, logged once with why); the head keeps whether the loss's
    last CUDA call went zero-copy (``HeadKLLoss.zero_copy``)."""
    why = None
    if options["teacher_temperature"] is not None:
        why = "teacher_temperature runs through host copies"
    # A flag, not the buffers: a head read again lets the last engine go.
    zero_copy = head._zero_copy(device, why)
    head._loss_zero_copy = zero_copy is not None
    return zero_copy


def _device_loss(zero_copy, options: dict, flat, ids, values, labels, weights, total):
    """The loss and ``dx`` through the engine's buffers shared with CUDA."""
    w = _effective_weights(options, labels, weights, flat.shape[0], flat.device)
    per_token, dx = zero_copy.loss(options, flat, ids, values, labels, weights, w, total)
    return _reduced(options["reduction"], per_token, w, total), dx


def _host_loss(head, options: dict, group, flat, ids, values, labels, weights, total, device):
    """The loss and ``dx`` on host memory, on ``device``."""
    host = _on_host("hidden", flat)
    ntok, hs = host.shape
    k = ids.shape[1]
    ids = _on_host("teacher_ids", ids)
    values = _on_host("teacher_values", values.to(torch.float32))
    labels_host = None if labels is None else _on_host("labels", labels)
    weights_host = None if weights is None else _on_host("weights", weights)
    options = dict(options, total=total)
    engine = head._engine
    dx = torch.empty((ntok, hs), dtype=torch.float32)
    per_token = torch.empty(ntok, dtype=torch.float32)
    spec = lambda t: None if t is None else _spec(t)  # noqa: E731
    teacher = (_spec(ids), _spec(values), k)
    if head.shard is None:
        mean = engine.head_kl(
            _spec(host), ntok, teacher, spec(labels_host), spec(weights_host), (_spec(dx), _spec(per_token)), options
        )
    else:
        if labels_host is not None:
            raise ValueError("labels: the sharded loss takes no hard term or ignore mask")
        mean, dx = sharded_loss(engine, host, teacher, spec(weights_host), options, (dx, per_token), device, group)
    return _host_result(options, mean, per_token, dx, labels_host, weights_host, device)
