"""The top-k distillation loss over tensors (``HeadKLLoss``'s forward): the
inputs checked, then one ``headkl::head_kl_loss`` custom op where torch has
them (``custom``), else the autograd Function; either re-reads the head
where it changed and computes the loss with its gradients through the
zero-copy path (CUDA tensors on the engine's own GPU) or on host memory
(the sharded loss's phases through ``distributed``); the head's gradient,
where it requires grad, on host memory."""

from __future__ import annotations

from typing import Optional

import torch

from .._checks import _row_marks, _teacher_top_k, _trainable
from .._cuda_direct import _CudaDirect
from .._hints import explaining
from .._host import _on_host, _say_head_grad_on_host, _spec, _to_device
from .._precision import _say_f32
from ..distributed import sharded_loss
from ._reduce import _effective_weights, _host_result, _reduced
from .autograd import _HeadKLFunction, _LossCall
from .custom import _custom_op_for, head_kl_op


def head_kl_loss(
    head,
    options: dict,
    hidden: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_values: torch.Tensor,
    *,
    process_group=None,
    **marks,
) -> torch.Tensor:
    """The loss of ``hidden`` ``[..., hs]`` against the teacher's top-k
    ``[..., k]`` through ``head`` (a ``Head``), with ``options`` as
    ``_loss_options`` makes them: a scalar, or ``[...]`` with
    ``reduction="none"``; its backward gives ``hidden.grad``, and the
    head's ``weight.grad`` where the head's tensor requires grad (and grad
    is on). The arguments are ``HeadKLLoss.forward``'s (``marks``: its
    ``labels``, ``weights`` and ``total``); ``process_group`` is the
    sharded loss's (a head with ``shard``)."""
    flat, lead = head._hidden(hidden)
    ntok = flat.shape[0]
    teacher_ids, teacher_values = _teacher_top_k(teacher_ids, teacher_values, lead, hidden)
    k = teacher_ids.shape[-1]
    labels, weights, total = _row_marks(lead, hidden, **marks)
    if options["hard_weight"] > 0 and labels is None:
        raise ValueError(f"labels: needed with weight_hard_loss={options['hard_weight']}")
    weight = _trainable(head)
    ids, values = teacher_ids.reshape(ntok, k), teacher_values.reshape(ntok, k)
    if _custom_op_for(head, options):
        loss = head_kl_op(head, options, flat, ids, values, labels, weights, weight, total)
    else:
        call = _loss_call(head, options, (flat, ids, values, labels, weights), total, weight, process_group)
        loss = _HeadKLFunction.apply(flat, weight, call)
    return loss.reshape(lead if options["reduction"] == "none" else ())


def _loss_call(head, options: dict, inputs, total: Optional[float], weight, process_group=None) -> _LossCall:
    """The engine's call for the checked ``inputs`` (``flat``, ``ids``,
    ``values``, ``labels``, ``weights``, each ``[ntok]`` first), on the
    head re-read first where it changed: the autograd Function's forward,
    and the body of the ``headkl::head_kl_loss`` custom op; ``weight`` the
    head's tensor where its gradient is asked, else None."""
    flat, _, _, labels, weights = inputs
    ntok = flat.shape[0]
    head._refresh()
    _say_f32(flat)
    zero_copy = None
    if flat.device.type == "cuda":
        zero_copy = _zero_copy(head, options, flat.device, weight is not None)
    if zero_copy is not None and weight is not None:
        # The CUDA backend: the head's gradient from the same call.
        def head_grad_on_device(g):
            g = g.to(device=flat.device, dtype=torch.float32)
            w = _effective_weights(options, labels, weights, ntok, flat.device) * g
            sums = dict(options, reduction="sum")
            return zero_copy.loss(sums, flat, inputs[1], inputs[2], labels, w, w, None, head_grad=True)[2]

        return _LossCall(
            lambda: _device_loss(zero_copy, options, *inputs, total, head_grad=True),
            head_grad_on_device if options["reduction"] == "none" else None,
        )
    if zero_copy is not None:
        return _LossCall(lambda: _device_loss(zero_copy, options, *inputs, total))
    grad_device = None if weight is None else weight.device

    def head_grad_of(g):
        g = g.to(device=flat.device, dtype=torch.float32)
        w = _effective_weights(options, labels, weights, ntok, flat.device) * g
        sums = dict(options, reduction="sum")
        return _host_loss(head, sums, process_group, *inputs[:4], w, None, flat.device, grad_device)[2]

    return _LossCall(
        lambda: _host_loss(head, options, process_group, *inputs, total, flat.device, grad_device),
        head_grad_of if weight is not None and options["reduction"] == "none" else None,
    )


def _zero_copy(head, options: dict, device: torch.device, head_grad: bool):
    """The direct path for CUDA tensors on ``device``, or None (then host
    copies, logged once with why); where the head's gradient is asked, only
    the CUDA backend's path computes it (Vulkan's zero-copy path does not);
    the head keeps whether the loss's last CUDA call went zero-copy
    (``HeadKLLoss.zero_copy``)."""
    why = None
    if options["teacher_temperature"] is not None:
        why = "teacher_temperature runs through host copies"
    # A flag, not the buffers: a head read again lets the last engine go.
    zero_copy = head._zero_copy(device, why)
    if zero_copy is not None and head_grad and not isinstance(zero_copy, _CudaDirect):
        _say_head_grad_on_host("the zero-copy path does not compute the head's gradient")
        zero_copy = None
    head._loss_zero_copy = zero_copy is not None
    return zero_copy


def _device_loss(zero_copy, options: dict, flat, ids, values, labels, weights, total, head_grad: bool = False):
    """The loss, ``dx`` and, with ``head_grad``, the head's gradient (else
    None) through the direct path (the CUDA backend's, or the engine's
    buffers shared with CUDA)."""
    w = _effective_weights(options, labels, weights, flat.shape[0], flat.device)
    if head_grad:
        per_token, dx, dw = zero_copy.loss(options, flat, ids, values, labels, weights, w, total, head_grad=True)
    else:
        per_token, dx = zero_copy.loss(options, flat, ids, values, labels, weights, w, total)[:2]
        dw = None
    return _reduced(options["reduction"], per_token, w, total), dx, dw


def _host_loss(head, options: dict, group, flat, ids, values, labels, weights, total, device, grad_device=None):
    """The loss, ``dx`` (on ``device``) and, with ``grad_device``, the
    head's gradient (f32, there; else None), on host memory; the engine's
    refusals with what to do (``explaining``)."""
    with explaining(options, flat, values):
        return _host_call(head, options, group, flat, ids, values, labels, weights, total, device, grad_device)


def _host_call(head, options: dict, group, flat, ids, values, labels, weights, total, device, grad_device):
    """``_host_loss``'s engine call, the whole head's or the sharded loss's phases."""
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
    head_grad = None
    if head.shard is None:
        if grad_device is not None:
            head_grad = torch.empty((head.vocab_size, hs), dtype=torch.float32)
        mean = engine.head_kl(
            _spec(host), ntok, teacher, spec(labels_host), spec(weights_host), (_spec(dx), _spec(per_token)), options,
            spec(head_grad),
        )  # fmt: skip
    else:
        if labels_host is not None:
            raise ValueError("labels: the sharded loss takes no hard term or ignore mask")
        mean, dx = sharded_loss(engine, host, teacher, spec(weights_host), options, (dx, per_token), device, group)
    loss, dx = _host_result(options, mean, per_token, dx, labels_host, weights_host, device)
    return loss, dx, None if head_grad is None else _to_device(head_grad, grad_device)
