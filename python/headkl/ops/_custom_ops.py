"""The ``headkl::`` custom ops' registrations (``torch.library.custom_op``,
``register_fake``, ``register_autograd``); ``headkl.ops.custom`` imports
this where the running torch has them, and says what the ops are."""

import inspect

import torch

from .._registry import _head_of
from .autograd import _head_gradient, _once_differentiable
from .custom import _OPTIONS_SCHEMA, _REDUCTION, _ROWS, _TEACHERS, _options_of

_SCALARS = "float temperature, float? softcap, float logit_scale"
_TAGS = {}
if hasattr(torch.Tag, "cudagraph_unsafe") and "tags" in inspect.signature(torch.library.custom_op).parameters:
    # The ops wait for the host (and may re-read the head): never inside a CUDA graph.
    _TAGS = {"tags": (torch.Tag.cudagraph_unsafe,)}


def _op(name: str, schema: str):
    """``torch.library.custom_op`` of ``headkl::name`` with ``schema``,
    mutating no input."""
    return torch.library.custom_op(f"headkl::{name}", mutates_args=(), schema=schema, **_TAGS)


def _loss_call(kind, head, options, rows, weight, total):
    """The engine's call (``_LossCall``) of loss ``kind`` on the op's rows:
    ``hidden``, the teacher's two tensors, ``labels``, ``weights``."""
    hidden, a, _, labels, weights = rows
    if kind == "head_kl":
        from .loss import _loss_call as call

        return call(head, options, (hidden, *rows[1:3], labels, weights), total, weight)
    from .full_vocab import _loss_call as call

    return call(head, options, hidden, a, labels, weights, weight, total)


def _register_loss(kind: str):
    a, b = _TEACHERS[kind]
    rows = _ROWS.format(a, b)
    loss_schema = f"({rows}, float? total, bool head_grad, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor)"
    grad_schema = f"({rows}, Tensor unit_grad, Tensor grad, {_OPTIONS_SCHEMA}) -> Tensor"

    @_op(f"{kind}_loss", loss_schema)
    def loss_op(hidden, a, b, labels, weights, weight, handle, total, head_grad, given, *options):
        head = _head_of(handle)
        call = _loss_call(kind, head, _options_of(given, *options), (hidden, a, b, labels, weights),
                          weight if head_grad else None, total)  # fmt: skip
        loss, dx, unit_grad = call.forward()
        return loss, dx, weight.new_empty((0,), dtype=torch.float32) if unit_grad is None else unit_grad

    @loss_op.register_fake
    def _(hidden, a, b, labels, weights, weight, handle, total, head_grad, given, *options):
        ntok, hs = hidden.shape
        per_token = given >> _REDUCTION & 1 and options[_REDUCTION] == "none"
        loss = hidden.new_empty((ntok,) if per_token else (), dtype=torch.float32)
        dx = hidden.new_empty((ntok, hs), dtype=torch.float32)
        return loss, dx, weight.new_empty(tuple(weight.shape) if head_grad else (0,), dtype=torch.float32)

    @_op(f"{kind}_head_grad", grad_schema)
    def head_grad_op(hidden, a, b, labels, weights, weight, handle, unit_grad, grad, given, *options):
        call = _loss_call(kind, _head_of(handle), _options_of(given, *options), (hidden, a, b, labels, weights),
                          weight, None)  # fmt: skip
        grad = grad.to(unit_grad.device)
        return _head_gradient(unit_grad, grad, call.head_grad_of, weight.dtype, weight.device)

    @head_grad_op.register_fake
    def _(hidden, a, b, labels, weights, weight, handle, unit_grad, grad, given, *options):
        return torch.empty_like(weight, memory_format=torch.contiguous_format)

    def setup_context(ctx, inputs, output):
        hidden, a, b, labels, weights, weight, handle, total, head_grad, given, *options = inputs
        _, dx, unit_grad = output
        ctx.mark_non_differentiable(dx, unit_grad)
        # dx and the unit gradient get no gradient: without this, autograd
        # hands backward a zero tensor of each (at shape A, 5 GB of f32
        # zeros shaped as the head's gradient).
        ctx.set_materialize_grads(False)
        ctx.per_token = _options_of(given, *options).get("reduction") == "none"
        ctx.dtype, ctx.weight_dtype, ctx.weight_device = hidden.dtype, weight.dtype, weight.device
        ctx.head_grad, ctx.nargs = head_grad, len(inputs)
        if head_grad and ctx.per_token:
            # The second call's arguments; the head kept alive for it.
            ctx.handle, ctx.head, ctx.options = handle, _head_of(handle), (given, *options)
            ctx.save_for_backward(dx, unit_grad, hidden, a, b, labels, weights, weight)
        else:
            ctx.save_for_backward(dx, unit_grad)

    def backward(ctx, grad, _grad_dx, _grad_unit):
        if grad is None:  # no gradient reached the loss (grads not materialized)
            return (None,) * ctx.nargs
        saved = ctx.saved_tensors
        dx, unit_grad = saved[:2]
        scale = grad.reshape(-1, 1) if ctx.per_token else grad
        grad_hidden = (dx * scale).to(ctx.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.head_grad and ctx.needs_input_grad[5]:
            if len(saved) > 2:
                grad_weight = head_grad_op(*saved[2:], ctx.handle, unit_grad, grad, *ctx.options)
            else:
                grad = grad.to(unit_grad.device)
                grad_weight = _head_gradient(unit_grad, grad, None, ctx.weight_dtype, ctx.weight_device)
        return (grad_hidden, None, None, None, None, grad_weight) + (None,) * (ctx.nargs - 6)

    loss_op.register_autograd(_once_differentiable(backward), setup_context=setup_context)


for _kind in _TEACHERS:
    _register_loss(_kind)


@_op("topk", f"(Tensor hidden, Tensor weight, int head, int k, {_SCALARS}, bool logprobs) -> (Tensor, Tensor)")
def _topk_op(hidden, weight, handle, k, temperature, softcap, logit_scale, logprobs):
    from .topk import _topk

    options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
    return _topk(_head_of(handle), hidden, k, options, logprobs)


@_topk_op.register_fake
def _(hidden, weight, handle, k, temperature, softcap, logit_scale, logprobs):
    ntok = hidden.shape[0]
    return hidden.new_empty((ntok, k), dtype=torch.int64), hidden.new_empty((ntok, k), dtype=torch.float32)


@_op("gather", f"(Tensor hidden, Tensor ids, Tensor weight, int head, {_SCALARS}) -> (Tensor, Tensor)")
def _gather_op(hidden, ids, weight, handle, temperature, softcap, logit_scale):
    from .topk import _gather

    options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
    return _gather(_head_of(handle), hidden, ids, options)


@_gather_op.register_fake
def _(hidden, ids, weight, handle, temperature, softcap, logit_scale):
    ntok, k = ids.shape
    return hidden.new_empty((ntok, k), dtype=torch.float32), hidden.new_empty((ntok,), dtype=torch.float32)
