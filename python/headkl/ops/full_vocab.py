"""The full-vocabulary divergence over tensors (``FullVocabKLLoss``'s
forward): the teacher given by its own hidden rows and head, on host
memory (CUDA tensors through host copies), as one
``headkl::full_vocab_kl_loss`` custom op where torch has them (``custom``),
else through the autograd Function. The student's head gets a
gradient where it requires grad; the teacher's side gets none and is
refused where it requires grad."""

from __future__ import annotations

from typing import Optional

import torch

from .._checks import _FLOATS, _frozen, _row_marks, _same_device, _tensor, _trainable
from .._hints import explaining
from .._host import _on_host, _spec, _to_device
from .._precision import _f32_input, _say_f32
from ._reduce import _effective_weights, _host_result
from .autograd import _HeadKLFunction, _LossCall
from .custom import _custom_op_for, full_vocab_kl_op


def full_vocab_kl_loss(
    head,
    options: dict,
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    **marks,
) -> torch.Tensor:
    """The divergence of ``hidden`` ``[..., hs]`` through ``head`` (a
    ``Head`` with the teacher's head set) from ``teacher_hidden`` ``[...,
    hs_T]`` through the teacher's head, with ``options`` as
    ``_loss_options`` makes them: a scalar, or ``[...]`` with
    ``reduction="none"``; its backward gives ``hidden.grad``, and the
    student's ``weight.grad`` where that head requires grad. The
    arguments are ``FullVocabKLLoss.forward``'s (``marks``: its
    ``labels``, ``weights`` and ``total``)."""
    flat, lead = head._hidden(hidden)
    ntok, hs = flat.shape
    teacher_hidden_size = head._teacher_hidden_size
    teacher_hidden = _tensor("teacher_hidden", teacher_hidden, _FLOATS)
    _f32_input("teacher_hidden", teacher_hidden, head.f32_inputs)
    _same_device("teacher_hidden", teacher_hidden, hidden)
    if tuple(teacher_hidden.shape) != lead + (teacher_hidden_size,):
        raise ValueError(
            f"teacher_hidden: expected shape {lead + (teacher_hidden_size,)}, got {tuple(teacher_hidden.shape)}"
        )
    if torch.is_grad_enabled():
        # The teacher gets no gradient: refused rather than dropped in silence.
        _frozen("teacher_hidden", teacher_hidden)
        _frozen("teacher_weight", head._teacher)
    labels, weights, total = _row_marks(lead, hidden, **marks)
    weight = _trainable(head)
    teacher = teacher_hidden.reshape(ntok, teacher_hidden_size)
    if _custom_op_for(head, options):
        loss = full_vocab_kl_op(head, options, flat, teacher, labels, weights, weight, total)
    else:
        loss = _HeadKLFunction.apply(
            flat, weight, _loss_call(head, options, flat, teacher, labels, weights, weight, total)
        )
    return loss.reshape(lead if options["reduction"] == "none" else ())


def _loss_call(head, options: dict, flat, teacher, labels, weights, weight, total: Optional[float]) -> _LossCall:
    """The engine's call for the checked ``[ntok]``-first rows, on the
    heads re-read first where they changed: the autograd Function's
    forward, and the body of the ``headkl::full_vocab_kl_loss`` custom op;
    ``weight`` the student's head where its gradient is asked, else None."""
    ntok, hs = flat.shape
    labels = None if labels is None else _on_host("labels", labels)
    weights = None if weights is None else _on_host("weights", weights)
    options = dict(options, total=total)
    head._refresh()
    _say_f32(flat, teacher)

    def run(options=options, weights=weights):
        host = _on_host("hidden", flat)
        teacher_host = _on_host("teacher_hidden", teacher)
        dx = torch.empty((ntok, hs), dtype=torch.float32)
        per_token = torch.empty(ntok, dtype=torch.float32)
        head_grad = None if weight is None else torch.empty((head.vocab_size, hs), dtype=torch.float32)
        spec = lambda t: None if t is None else _spec(t)  # noqa: E731
        with explaining(options, flat, teacher_hidden=teacher):
            mean = head._engine.head_kl(
                _spec(host), ntok, (_spec(teacher_host), teacher_host.shape[1]), spec(labels), spec(weights),
                (_spec(dx), _spec(per_token)), options, spec(head_grad),
            )  # fmt: skip
        loss, dx = _host_result(options, mean, per_token, dx, labels, weights, flat.device)
        return loss, dx, None if head_grad is None else _to_device(head_grad, weight.device)

    def head_grad_of(g):
        w = _effective_weights(options, labels, weights, ntok, "cpu") * _on_host("grad", g).to(torch.float32)
        return run(dict(options, reduction="sum", total=None), w)[2]

    return _LossCall(run, head_grad_of if weight is not None and options["reduction"] == "none" else None)
