"""The autograd Function under both losses: the engine gives the loss and
its gradient ``dx`` in one call (forward), and backward scales the kept
``dx`` by the incoming gradient, once: a second derivative raises."""

from __future__ import annotations

import functools

import torch
from torch._C import _functions as _autograd_functions


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


class _HeadKLFunction(torch.autograd.Function):
    """The loss, computed with its gradient in one call; backward scales the
    kept gradient by the incoming one (once: a second derivative raises).

    ``apply(hidden, run)``: ``hidden`` the ``[ntok][hs]`` rows the gradient
    is for, ``run()`` the call on them (host or zero-copy) that returns the
    loss (a scalar, or ``[ntok]``) and ``dx``."""

    @staticmethod
    def forward(ctx, hidden, run):
        loss, dx = run()
        ctx.save_for_backward(dx)
        ctx.per_token = loss.dim() > 0
        ctx.dtype = hidden.dtype
        return loss

    @staticmethod
    @_once_differentiable
    def backward(ctx, grad):
        (dx,) = ctx.saved_tensors
        scale = grad.reshape(-1, 1) if ctx.per_token else grad
        return (dx * scale).to(ctx.dtype), None
