"""The teacher's exact top-k and the gather over tensors, on a ``Head``
(``Head.topk`` and ``Head.gather``): through the zero-copy path where the
head has one for the hidden rows' GPU, else on host memory. Their results
carry no gradient."""

from __future__ import annotations

from collections import namedtuple
from typing import Optional

import torch

from .._checks import _ids, _same_device, _top_k
from .._host import _NAMES, _on_host, _spec, _to_device

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
    """The exact top-k of ``hidden @ weight.T`` per row on ``head``, as
    ``Head.topk`` gives it."""
    if form not in ("probs", "logprobs"):
        raise ValueError(f"form={form!r}: expected probs or logprobs")
    k = _top_k(k, head.vocab_size)
    flat, lead = head._hidden(hidden)
    options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
    shape = lead + (k,)
    head._refresh()
    zc = head._zero_copy(hidden.device) if hidden.device.type == "cuda" else None
    if zc is not None:
        ntok = flat.shape[0]
        zc.view("hidden", tuple(flat.shape), flat.dtype).copy_(flat)
        ids_view = zc.view("ids", (ntok, k), torch.int32)
        values_view = zc.view("values", (ntok, k), torch.float32)
        b = zc.buffers
        zc.call(lambda ready, done: head._engine.topk_shared(
            (ntok, k, _NAMES[flat.dtype]), (b["hidden"][0], b["ids"][0], b["values"][0]), form == "logprobs",
            options, (ready, done),
        ))  # fmt: skip
        return TopK(ids_view.to(torch.int64).reshape(shape), values_view.clone().reshape(shape))
    host = _on_host("hidden", flat)
    ntok = host.shape[0]
    ids = torch.empty((ntok, k), dtype=torch.int64)
    probs = torch.empty((ntok, k), dtype=torch.float32)
    logprobs = torch.empty((ntok, k), dtype=torch.float32) if form == "logprobs" else None
    head._engine.topk(
        _spec(host), ntok, k, _spec(ids), _spec(probs), None if logprobs is None else _spec(logprobs), options
    )
    values = probs if logprobs is None else logprobs
    return TopK(_to_device(ids.reshape(shape), hidden.device), _to_device(values.reshape(shape), hidden.device))


def head_gather(
    head,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
) -> Gathered:
    """The log-probabilities at ``ids`` and each row's log-sum-exp on
    ``head``, as ``Head.gather`` gives them."""
    flat, lead = head._hidden(hidden)
    ids = _ids("ids", ids)
    _same_device("ids", ids, hidden)
    if ids.dim() < 1 or tuple(ids.shape[:-1]) != lead:
        raise ValueError(f"ids: expected shape {lead} + (k,), got {tuple(ids.shape)}")
    k = ids.shape[-1]
    options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
    head._refresh()
    zc = head._zero_copy(hidden.device) if hidden.device.type == "cuda" else None
    if zc is not None:
        ntok = flat.shape[0]
        zc.view("hidden", tuple(flat.shape), flat.dtype).copy_(flat)
        flat_ids = ids.reshape(ntok, k)
        zc.view("ids", (ntok, k), torch.int32).copy_(torch.where(flat_ids < 0, torch.full_like(flat_ids, -1), flat_ids))
        logprobs_view = zc.view("logprobs", (ntok, k), torch.float32)
        lse_view = zc.view("lse", (ntok,), torch.float32)
        b = zc.buffers
        zc.call(lambda ready, done: head._engine.gather_shared(
            (ntok, k, _NAMES[flat.dtype]), (b["hidden"][0], b["ids"][0], b["logprobs"][0], b["lse"][0]),
            options, (ready, done),
        ))  # fmt: skip
        return Gathered(logprobs_view.clone().reshape(lead + (k,)), lse_view.clone().reshape(lead))
    host = _on_host("hidden", flat)
    ntok = host.shape[0]
    ids_host = _on_host("ids", ids.reshape(ntok, k))
    logprobs = torch.empty((ntok, k), dtype=torch.float32)
    lse = torch.empty(ntok, dtype=torch.float32)
    head._engine.gather(_spec(host), ntok, _spec(ids_host), k, _spec(logprobs), _spec(lse), options)
    return Gathered(
        _to_device(logprobs.reshape(lead + (k,)), hidden.device), _to_device(lse.reshape(lead), hidden.device)
    )
