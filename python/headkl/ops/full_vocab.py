"""The full-vocabulary divergence over tensors (``FullVocabKLLoss``'s
forward): the teacher given by its own hidden rows and head, on host
memory (CUDA tensors through host copies)."""

from __future__ import annotations

from typing import Optional

import torch

from .._checks import _FLOATS, _row_arrays, _same_device, _tensor
from .._host import _on_host, _spec
from ._reduce import _host_result
from .autograd import _HeadKLFunction


def full_vocab_kl_loss(
    head,
    options: dict,
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    *,
    labels: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    total: Optional[float] = None,
) -> torch.Tensor:
    """The divergence of ``hidden`` ``[..., hs]`` through ``head`` (a
    ``Head`` with the teacher's head set) from ``teacher_hidden`` ``[...,
    hs_T]`` through the teacher's head, with ``options`` as
    ``_loss_options`` makes them: a scalar, or ``[...]`` with
    ``reduction="none"``; its backward gives ``hidden.grad``. The
    arguments are ``FullVocabKLLoss.forward``'s."""
    flat, lead = head._hidden(hidden)
    ntok, hs = flat.shape
    teacher_hidden_size = head._teacher_hidden_size
    teacher_hidden = _tensor("teacher_hidden", teacher_hidden, _FLOATS)
    _same_device("teacher_hidden", teacher_hidden, hidden)
    if tuple(teacher_hidden.shape) != lead + (teacher_hidden_size,):
        raise ValueError(
            f"teacher_hidden: expected shape {lead + (teacher_hidden_size,)}, got {tuple(teacher_hidden.shape)}"
        )
    labels, weights = _row_arrays(labels, weights, lead, hidden)
    labels = None if labels is None else _on_host("labels", labels)
    weights = None if weights is None else _on_host("weights", weights)
    options = dict(options, total=None if total is None else float(total))
    head._refresh()

    def run():
        host = _on_host("hidden", flat)
        teacher = _on_host("teacher_hidden", teacher_hidden.reshape(ntok, -1))
        dx = torch.empty((ntok, hs), dtype=torch.float32)
        per_token = torch.empty(ntok, dtype=torch.float32)
        spec = lambda t: None if t is None else _spec(t)  # noqa: E731
        mean = head._engine.head_kl_full_vocab(
            _spec(host), ntok, _spec(teacher), teacher.shape[1], spec(labels), spec(weights),
            (_spec(dx), _spec(per_token)), options,
        )  # fmt: skip
        return _host_result(options, mean, per_token, dx, labels, weights, hidden.device)

    return _HeadKLFunction.apply(flat, run).reshape(lead if options["reduction"] == "none" else ())
