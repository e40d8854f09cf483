"""The autograd Function under both losses where headkl's custom ops are
off (``headkl.ops.custom``: an older torch, or a sharded head): the engine
gives the loss, its gradient ``dx`` and, where the head requires grad, the
head's gradient in one call (forward), and backward scales the kept
gradients by the incoming one, once: a second derivative raises. The
custom ops' autograd shares ``_head_gradient`` and ``_once_differentiable``."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch._C import _functions as _autograd_functions

from . import _scale


def _once_differentiable(backward):
    """``torch.autograd.function.once_differentiable``, also where the
    incoming gradient needs none: the gradient comes from the saved ``dx``,
    a function of the hidden rows with no derivative here, so with
    ``create_graph=True`` its use is PyTorch's "differentiate twice" error
    rather than a second derivative of zero."""

    @functools.wraps(backward)
    def wrapper(ctx, *args):
        with torch.no_grad():
            outputs = backward(ctx, *args)
        if not torch.is_grad_enabled():
            return outputs
        error = _autograd_functions.DelayedError(
            b"trying to differentiate twice a function that was marked with @once_differentiable", len(outputs)
        )
        marked = [None if o is None else o.detach().requires_grad_() for o in outputs]
        return error(*marked)

    return wrapper


class _LossCall(NamedTuple):
    """What ``_HeadKLFunction`` runs: ``forward()`` the call that returns
    the loss (a scalar, or ``[ntok]``), ``dx`` and the head's gradient
    (None where not asked), and ``head_grad_of(g)`` the head's gradient
    alone of ``Σ_t g_t · loss_t`` for per-token losses (``reduction="none"``)
    and an upstream gradient ``g ≥ 0`` (None where not needed)."""

    forward: Callable[[], Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]
    head_grad_of: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


class _HeadKLFunction(torch.autograd.Function):
    """The loss, computed with its gradients in one call; backward scales the
    kept gradients by the incoming one (once: a second derivative raises).

    ``apply(hidden, weight, call)``: ``hidden`` the ``[ntok][hs]`` rows the
    gradient ``dx`` is for; ``weight`` the head ``[V][hs]`` where the call
    computes its gradient (``call.forward`` returns it, f32 on the weight's
    device), else None; ``call`` a ``_LossCall``. The head's gradient comes
    back in the weight's dtype on its device, as PyTorch's ``.grad`` is, so
    a head tied to an input embedding gets the sum of both uses through
    autograd. With per-token losses (``reduction="none"``) the upstream
    gradient ``g`` weighs each token's share of the head's gradient: the
    call's gradient (made for ``g = 1``) times ``min(g)``, plus, where ``g``
    is not uniform, ``call.head_grad_of(g − min(g))``, one more call."""

    @staticmethod
    def forward(ctx, hidden, weight, call):
        loss, dx, head_grad = call.forward()
        ctx.per_token = loss.dim() > 0
        ctx.dtype = hidden.dtype
        ctx.head_grad = head_grad
        ctx.head_grad_of = call.head_grad_of if head_grad is not None and ctx.per_token else None
        if ctx.head_grad_of is not None:
            # The second call must see the head forward saw: autograd's
            # version check raises if it was changed in place since.
            ctx.save_for_backward(dx, weight)
        else:
            ctx.save_for_backward(dx)
        if head_grad is not None:
            ctx.weight_dtype, ctx.weight_device = weight.dtype, weight.device
        return loss

    @staticmethod
    @_once_differentiable
    def backward(ctx, grad):
        dx = ctx.saved_tensors[0]
        scale = grad.reshape(-1, 1) if ctx.per_token else grad
        grad_hidden = (dx * scale).to(ctx.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.head_grad is not None and ctx.needs_input_grad[1]:
            grad = grad.to(ctx.head_grad.device)
            grad_weight = _head_gradient(ctx.head_grad, grad, ctx.head_grad_of, ctx.weight_dtype, ctx.weight_device)
        return grad_hidden, grad_weight, None


def _head_gradient(head_grad, grad, head_grad_of, dtype, device) -> torch.Tensor:
    """The head's gradient for the upstream ``grad`` from ``head_grad`` (the
    call's, for a unit upstream gradient), in ``dtype`` on ``device``: a
    scalar ``grad`` scales it; per-token losses (``head_grad_of`` given)
    take ``min(grad)`` of it and ``head_grad_of(grad − min(grad))`` where
    ``grad`` is not uniform. Scaled and converted in one pass into the
    returned tensor: at shape A each full-size temporary is 5 GB."""
    scale = grad
    if head_grad_of is not None:
        scale = grad.min() if grad.numel() else grad.new_zeros(())
        rest = grad - scale
        if bool((rest > 0).any()):
            out = head_grad_of(rest).to(head_grad.device)
            out.addcmul_(head_grad, scale)
            return out.to(device=device, dtype=dtype)
    if head_grad.device != torch.device(device):
        return (head_grad * scale).to(device=device, dtype=dtype)
    out = torch.empty(head_grad.shape, dtype=dtype, device=device)
    return _scale.scale_into(head_grad, scale.to(head_grad.device), out)
