"""The teacher's exact top-k and the gather over tensors, on a ``Head``
(``Head.topk`` and ``Head.gather``): through the zero-copy path where the
head has one for the hidden rows' GPU, else on host memory; each one
``headkl::topk`` or ``headkl::gather`` custom op where torch has them
(``custom``). Their results carry no gradient."""

from __future__ import annotations

from collections import namedtuple
from typing import Optional

import torch

from .._checks import _ids, _same_device, _top_k
from .._cuda_direct import _CudaDirect
from .._hints import explaining
from .._host import _NAMES, _on_host, _spec, _to_device
from .._precision import _say_f32
from .custom import _custom_op_for, gather_op, topk_op

TopK = namedtuple("TopK", ["ids", "values"])
TopK.__doc__ = "The top-k: ids [..., k] (int64, by descending logit) and their values (probs or logprobs)."
Gathered = namedtuple("Gathered", ["logprobs", "lse"])
Gathered.__doc__ = "Log-probabilities at given ids [..., k] and each row's log-sum-exp [...]."


def head_topk(
    head,
    hidden: torch.Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    form: str = "probs",
) -> TopK:
    """The exact top-k of ``hidden @ weight.T`` per row: ids ``[..., k]``
    by descending logit (equal logits: lower id first), and their softmax
    over the k at ``temperature`` (``form="probs"``) or their
    log-probabilities over the whole vocabulary (``form="logprobs"``).
    ``Head.topk`` is this function, ``head`` its ``self``."""
    if form not in ("probs", "logprobs"):
        raise ValueError(f"form={form!r}: expected probs or logprobs")
    k = _top_k(k, head.vocab_size)
    flat, lead = head._hidden(hidden)
    options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
    if _custom_op_for(head, options):
        ids, values = topk_op(head, flat, k, options, form == "logprobs")
    else:
        ids, values = _topk(head, flat, k, options, form == "logprobs")
    return TopK(ids.reshape(lead + (k,)), values.reshape(lead + (k,)))


def _topk(head, flat: torch.Tensor, k: int, options: dict, logprobs: bool):
    """The top-k of the checked rows ``flat`` ``[ntok][hs]`` on ``head``
    (re-read first where it changed): ids and values ``[ntok][k]`` on their
    device; the body of the ``headkl::topk`` custom op."""
    head._refresh()
    _say_f32(flat)
    ntok = flat.shape[0]
    zc = head._zero_copy(flat.device) if flat.device.type == "cuda" else None
    if isinstance(zc, _CudaDirect):
        return zc.topk(flat, k, options, logprobs)
    if zc is not None:
        zc.view("hidden", tuple(flat.shape), flat.dtype).copy_(flat)
        ids_view = zc.view("ids", (ntok, k), torch.int32)
        values_view = zc.view("values", (ntok, k), torch.float32)
        b = zc.buffers
        zc.call(lambda ready, done: head._engine.topk_shared(
            (ntok, k, _NAMES[flat.dtype]), (b["hidden"][0], b["ids"][0], b["values"][0]), logprobs,
            options, (ready, done),
        ))  # fmt: skip
        return ids_view.to(torch.int64), values_view.clone()
    host = _on_host("hidden", flat)
    ids = torch.empty((ntok, k), dtype=torch.int64)
    probs = torch.empty((ntok, k), dtype=torch.float32)
    logprob_out = torch.empty((ntok, k), dtype=torch.float32) if logprobs else None
    with explaining(hidden=flat):
        head._engine.topk(
            _spec(host), ntok, k, _spec(ids), _spec(probs), None if logprob_out is None else _spec(logprob_out), options
        )
    values = probs if logprob_out is None else logprob_out
    return _to_device(ids, flat.device), _to_device(values, flat.device)


def head_gather(
    head,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
) -> Gathered:
    """The log-probabilities over the whole vocabulary at ``ids``
    ``[..., k]`` (a negative id is none and reads ``-inf``), and each
    row's log-sum-exp: the teacher's side of a stored top-k.
    ``Head.gather`` is this function, ``head`` its ``self``."""
    flat, lead = head._hidden(hidden)
    ids = _ids("ids", ids)
    _same_device("ids", ids, hidden)
    if ids.dim() < 1 or tuple(ids.shape[:-1]) != lead:
        raise ValueError(f"ids: expected shape {lead} + (k,), got {tuple(ids.shape)}")
    k = ids.shape[-1]
    options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
    flat_ids = ids.reshape(flat.shape[0], k)
    if _custom_op_for(head, options):
        logprobs, lse = gather_op(head, flat, flat_ids, options)
    else:
        logprobs, lse = _gather(head, flat, flat_ids, options)
    return Gathered(logprobs.reshape(lead + (k,)), lse.reshape(lead))


def _gather(head, flat: torch.Tensor, ids: torch.Tensor, options: dict):
    """The gather of the checked rows ``flat`` ``[ntok][hs]`` at ``ids``
    ``[ntok][k]`` on ``head`` (re-read first where it changed):
    log-probabilities ``[ntok][k]`` and log-sum-exps ``[ntok]`` on their
    device; the body of the ``headkl::gather`` custom op."""
    head._refresh()
    _say_f32(flat)
    ntok, k = ids.shape
    zc = head._zero_copy(flat.device) if flat.device.type == "cuda" else None
    if isinstance(zc, _CudaDirect):
        return zc.gather(flat, ids, options)
    if zc is not None:
        zc.view("hidden", tuple(flat.shape), flat.dtype).copy_(flat)
        zc.view("ids", (ntok, k), torch.int32).copy_(torch.where(ids < 0, torch.full_like(ids, -1), ids))
        logprobs_view = zc.view("logprobs", (ntok, k), torch.float32)
        lse_view = zc.view("lse", (ntok,), torch.float32)
        b = zc.buffers
        zc.call(lambda ready, done: head._engine.gather_shared(
            (ntok, k, _NAMES[flat.dtype]), (b["hidden"][0], b["ids"][0], b["logprobs"][0], b["lse"][0]),
            options, (ready, done),
        ))  # fmt: skip
        return logprobs_view.clone(), lse_view.clone()
    host = _on_host("hidden", flat)
    ids_host = _on_host("ids", ids)
    logprobs = torch.empty((ntok, k), dtype=torch.float32)
    lse = torch.empty(ntok, dtype=torch.float32)
    with explaining(hidden=flat):
        head._engine.gather(_spec(host), ntok, _spec(ids_host), k, _spec(logprobs), _spec(lse), options)
    return _to_device(logprobs, flat.device), _to_device(lse, flat.device)
