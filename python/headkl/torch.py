"""headkl for PyTorch: the fused top-k distillation loss with its gradient,
the teacher's exact top-k and the gather, on a frozen head uploaded once
(and uploaded again where it changes: see ``Head``).

The head ``weight`` is ``[V][hs]`` (``nn.Linear(hs, V).weight``, or an
embedding matrix), float32, float16 or bfloat16; the hidden rows are
``[..., hs]`` in any of those dtypes. Per token, with ``s = x·Wᵀ/τ``::

    L_t  = Σ_k q_k · (log q_k − log_softmax(s)[id_k])     q: the teacher's k, renormalized
    loss = Σ_t w_t L_t / Σ_t w_t                           (reduction="mean")

and ``loss.backward()`` gives ``hidden.grad``; no ``[ntok][V]`` tensor is
ever made. The head gets no gradient: the losses refuse a head that
requires grad (pass ``weight.detach()``); a trainable head is not
supported yet. The other divergences, tail modes and terms are keywords of
``HeadKLLoss`` (the README's "Loss terms" has each one's PyTorch formula).

Tensors on the CPU are read and written in place. CUDA tensors go
zero-copy where the engine runs on the Vulkan backend of the same GPU: the
engine's input and output buffers are Vulkan memory CUDA maps, and one
timeline semaphore orders the two on the device (torch's current stream
signals it once the inputs are in, and waits on it before reading the
outputs), with no host wait inside a step. Anywhere else CUDA tensors go
through host copies, said once on the ``headkl`` logger;
``host_copy_bytes()`` counts the bytes they moved.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import operator
import struct
from collections import namedtuple
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._C import _functions as _autograd_functions

from . import _native

__all__ = [
    "FullVocabKLLoss",
    "Head",
    "HeadKLLoss",
    "TopK",
    "Gathered",
    "topk",
    "gather",
    "read_safetensors",
    "write_safetensors",
]

log = logging.getLogger("headkl")

TopK = namedtuple("TopK", ["ids", "values"])
TopK.__doc__ = "The top-k: ids [..., k] (int64, by descending logit) and their values (probs or logprobs)."
Gathered = namedtuple("Gathered", ["logprobs", "lse"])
Gathered.__doc__ = "Log-probabilities at given ids [..., k] and each row's log-sum-exp [...]."

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
}
# The most entries a top-k row holds: the engine's MAX_K (crates/core/src/problem.rs).
_MAX_K = 2048
_warned_host_copies = False
_host_copy_bytes = 0


def host_copy_bytes() -> int:
    """Bytes headkl has copied between CUDA tensors and the host since
    import (0 while every CUDA call went zero-copy)."""
    return _host_copy_bytes


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host result moved to the caller's device, counted where it leaves the host."""
    global _host_copy_bytes
    device = torch.device(device)
    if t.device.type == "cpu" and device.type != "cpu":
        _host_copy_bytes += t.numel() * t.element_size()
    return t.to(device)


def _spec(t: torch.Tensor) -> Tuple[int, int, str]:
    """A contiguous CPU tensor's memory, as the native module takes it."""
    return (t.data_ptr(), t.numel(), _NAMES[t.dtype])


def _on_host(name: str, t: torch.Tensor, why: str = "") -> torch.Tensor:
    """``t`` as a contiguous CPU tensor: itself where it already is one."""
    global _warned_host_copies, _host_copy_bytes
    if t.device.type == "cpu":
        return t.detach().contiguous()
    if t.device.type == "cuda":
        if not _warned_host_copies:
            log.warning("headkl: CUDA tensors go through host copies%s", f" ({why})" if why else "")
            _warned_host_copies = True
        _host_copy_bytes += t.numel() * t.element_size()
        return t.detach().to("cpu").contiguous()
    raise TypeError(f"{name}: tensors on {t.device.type} are not supported (use cpu or cuda)")


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
    """``t``, refused where it requires grad: a loss returns no gradient for
    a head, and a dropped gradient must not pass in silence."""
    if t.requires_grad:
        raise ValueError(
            f"{name}: requires grad, but headkl treats the head as frozen and returns no gradient for it "
            f"(a trainable head's gradient is not supported yet); pass {name}.detach() for a frozen head"
        )
    return t


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


def _row_arrays(labels, weights, lead: Tuple[int, ...], hidden: torch.Tensor):
    """The per-token ``labels`` (int64) and ``weights`` (float32), each
    optional, checked against hidden's leading dimensions and device and
    flattened to ``[ntok]``."""
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
    return labels, weights


class Head:
    """A head ``weight`` ``[V][hs]`` uploaded once to a backend.

    ``backend``: ``"auto"`` (the best GPU, else the f64 CPU reference),
    ``"vulkan"``, ``"wgpu"`` or ``"reference"``; ``device``: the index
    within it, as ``headkl.devices()`` lists them. For a vocabulary shard,
    ``shard=(v0, v1)`` with ``vocab_size=V``: ``weight`` then holds the rows
    ``[v0, v1)`` alone.

    The head is never stale: the tensor given is kept (not copied) with its
    version counter, and a call that finds it changed since the upload (an
    in-place change such as an optimizer step or an EMA update, also made
    through the parameter ``weight`` was detached from, or its storage
    replaced with ``weight.set_()``) uploads it again first, said on the
    ``headkl`` logger. ``weight.data = ...`` on the parameter after
    ``.detach()`` is not seen: the detached tensor keeps the old storage.
    The results of ``topk`` and ``gather`` carry no gradient.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        backend: str = "auto",
        device: Optional[int] = None,
        shard: Optional[Tuple[int, int]] = None,
        vocab_size: Optional[int] = None,
    ):
        weight = _tensor("weight", weight, _FLOATS, ndim=2)
        rows, hs = weight.shape
        shard_spec = None
        if shard is not None:
            if vocab_size is None:
                raise ValueError("vocab_size: needed with shard (the whole head's rows)")
            v0, v1 = (int(v) for v in shard)
            if v1 - v0 != rows:
                raise ValueError(f"shard: ({v0}, {v1}) holds {v1 - v0} rows, but weight has {rows}")
            shard_spec = (v0, v1, int(vocab_size))
        elif vocab_size is not None and vocab_size != rows:
            raise ValueError(f"vocab_size: {vocab_size}, but weight has {rows} rows and no shard is given")
        self._open = (backend, device, shard_spec)
        self._weight = weight
        self._teacher = None  # FullVocabKLLoss's teacher head, kept as the head is
        self._engine = None
        self._zc = None
        self._no_zc = None if shard is None else "a vocabulary shard runs through host copies"
        self._uploads = self._teacher_uploads = 0
        self.shard = None if shard is None else (shard_spec[0], shard_spec[1])
        self.vocab_size = rows if shard_spec is None else shard_spec[2]
        self.hidden_size = hs
        self._upload()

    def _upload(self) -> None:
        """Makes the engine from the head as it is now (and the teacher's
        head, where one is set), in place of the last one: that one's
        zero-copy buffers and device memory go first."""
        self._release()
        weight = self._weight
        stamp = _stamp(weight)
        host = _on_host("weight", weight)
        engine = _native.Engine(_spec(host), weight.shape[0], weight.shape[1], *self._open)
        if self._teacher is not None:
            teacher_stamp = self._teacher_onto(engine)
        self._engine, self._stamp = engine, stamp
        self._uploads += 1
        if self._teacher is not None:
            self._teacher_stamp = teacher_stamp
            self._teacher_uploads += 1

    def _teacher_onto(self, engine):
        """Uploads the teacher's head to ``engine``; returns its stamp as read."""
        stamp = _stamp(self._teacher)
        host = _on_host("teacher_weight", self._teacher)
        engine.set_teacher_head(_spec(host), host.shape[0], host.shape[1])
        return stamp

    def _set_teacher(self, teacher_weight: torch.Tensor) -> None:
        """Sets the teacher's head (FullVocabKLLoss's), kept and re-read as the head is."""
        self._teacher = teacher_weight
        self._teacher_hidden_size = teacher_weight.shape[1]
        self._teacher_stamp = self._teacher_onto(self._engine)
        self._teacher_uploads += 1

    def _release(self) -> None:
        """Lets the engine go: once the device is done with the last
        zero-copy call (whose flagged errors are raised here, as the next
        call would), its shared buffers are freed."""
        if self._zc is not None:
            self._engine.synchronize()
            zc, self._zc = self._zc, None
            zc.close()
        self._engine = None

    def _refresh(self) -> None:
        """Uploads the head again where it changed since it was uploaded
        (the teacher's head alone where only that one changed), said on the
        ``headkl`` logger: a call never runs on a stale head."""
        why = "the last upload failed" if self._engine is None else _changed("weight", self._weight, self._stamp)
        if why is None and self._teacher is not None:
            teacher_why = _changed("teacher_weight", self._teacher, self._teacher_stamp)
            if teacher_why is not None:
                self._same_shape("teacher_weight", self._teacher, self._teacher_shape)
                log.info("headkl: re-read the teacher's head: %s since it was uploaded", teacher_why)
                self._teacher_stamp = self._teacher_onto(self._engine)
                self._teacher_uploads += 1
            return
        if why is None:
            return
        self._same_shape("weight", self._weight, (self._weight_rows, self.hidden_size))
        if self._teacher is not None:
            self._same_shape("teacher_weight", self._teacher, self._teacher_shape)
        log.info("headkl: re-read the head: %s since it was uploaded", why)
        self._upload()

    @property
    def _weight_rows(self) -> int:
        return self.vocab_size if self.shard is None else self.shard[1] - self.shard[0]

    @property
    def _teacher_shape(self) -> Tuple[int, int]:
        return (self.vocab_size, self._teacher_hidden_size)

    @staticmethod
    def _same_shape(name: str, t: torch.Tensor, shape: Tuple[int, int]) -> None:
        """A kept head changed must keep its shape (and a head's dtype)."""
        _tensor(name, t, _FLOATS)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"{name}: its shape changed from {tuple(shape)} to {tuple(t.shape)} since it was uploaded; "
                "make a new one for another head"
            )

    @property
    def info(self) -> dict:
        """The device: backend, name, type, driver, matrix units, GEMM kernels."""
        if self._engine is None:
            self._refresh()
        return self._engine.info()

    def synchronize(self) -> None:
        """Waits for the device and raises what the last zero-copy call
        flagged there (``ValueError``: an id ≥ V, a non-finite row)."""
        if self._engine is not None:
            self._engine.synchronize()

    def _zero_copy(self, device: torch.device, why_not: Optional[str] = None):
        """The engine's buffers shared with CUDA device ``device``, or None
        (then host copies, logged once with why): ``why_not`` names a
        caller's reason."""
        if why_not is None and self._zc is None and self._no_zc is None:
            try:
                self._zc = _ZeroCopy(self._engine, device)
            except Exception as e:  # noqa: BLE001 - any reason to fall back is said once
                self._no_zc = str(e)
        reason = why_not or self._no_zc
        if reason is not None:
            global _warned_host_copies
            if not _warned_host_copies:
                log.warning("headkl: CUDA tensors go through host copies (%s)", reason)
                _warned_host_copies = True
            return None
        return self._zc

    def _hidden(self, hidden) -> Tuple[torch.Tensor, Tuple[int, ...]]:
        hidden = _tensor("hidden", hidden, _FLOATS)
        if hidden.dim() < 1 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden: last dimension must be the head's hidden size {self.hidden_size}, got shape {tuple(hidden.shape)}"
            )
        if hidden.device.type not in ("cpu", "cuda"):
            raise TypeError(f"hidden: tensors on {hidden.device.type} are not supported (use cpu or cuda)")
        lead = tuple(hidden.shape[:-1])
        return hidden.reshape(-1, self.hidden_size), lead

    def topk(
        self,
        hidden: torch.Tensor,
        k: int,
        *,
        temperature: float = 1.0,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        form: str = "probs",
    ) -> TopK:
        """The exact top-k of ``hidden @ weight.T`` per row: ids ``[..., k]``
        by descending logit (equal logits: lower id first), and their
        softmax over the k at ``temperature`` (``form="probs"``) or their
        log-probabilities over the whole vocabulary (``form="logprobs"``)."""
        if form not in ("probs", "logprobs"):
            raise ValueError(f"form={form!r}: expected probs or logprobs")
        k = _top_k(k, self.vocab_size)
        flat, lead = self._hidden(hidden)
        options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
        shape = lead + (k,)
        self._refresh()
        zc = self._zero_copy(hidden.device) if hidden.device.type == "cuda" else None
        if zc is not None:
            ntok = flat.shape[0]
            zc.view("hidden", tuple(flat.shape), flat.dtype).copy_(flat)
            ids_view = zc.view("ids", (ntok, k), torch.int32)
            values_view = zc.view("values", (ntok, k), torch.float32)
            b = zc.buffers
            zc.call(lambda ready, done: self._engine.topk_shared(
                (ntok, k, _NAMES[flat.dtype]), (b["hidden"][0], b["ids"][0], b["values"][0]), form == "logprobs",
                options, (ready, done),
            ))  # fmt: skip
            return TopK(ids_view.to(torch.int64).reshape(shape), values_view.clone().reshape(shape))
        host = _on_host("hidden", flat)
        ntok = host.shape[0]
        ids = torch.empty((ntok, k), dtype=torch.int64)
        probs = torch.empty((ntok, k), dtype=torch.float32)
        logprobs = torch.empty((ntok, k), dtype=torch.float32) if form == "logprobs" else None
        self._engine.topk(
            _spec(host), ntok, k, _spec(ids), _spec(probs), None if logprobs is None else _spec(logprobs), options
        )
        values = probs if logprobs is None else logprobs
        return TopK(_to_device(ids.reshape(shape), hidden.device), _to_device(values.reshape(shape), hidden.device))

    def gather(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        *,
        temperature: float = 1.0,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
    ) -> Gathered:
        """The log-probabilities over the whole vocabulary at ``ids``
        ``[..., k]`` (a negative id is none and reads ``-inf``), and each
        row's log-sum-exp: the teacher's side of a stored top-k."""
        flat, lead = self._hidden(hidden)
        ids = _ids("ids", ids)
        _same_device("ids", ids, hidden)
        if ids.dim() < 1 or tuple(ids.shape[:-1]) != lead:
            raise ValueError(f"ids: expected shape {lead} + (k,), got {tuple(ids.shape)}")
        k = ids.shape[-1]
        options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
        self._refresh()
        zc = self._zero_copy(hidden.device) if hidden.device.type == "cuda" else None
        if zc is not None:
            ntok = flat.shape[0]
            zc.view("hidden", tuple(flat.shape), flat.dtype).copy_(flat)
            flat_ids = ids.reshape(ntok, k)
            zc.view("ids", (ntok, k), torch.int32).copy_(torch.where(flat_ids < 0, torch.full_like(flat_ids, -1), flat_ids))
            logprobs_view = zc.view("logprobs", (ntok, k), torch.float32)
            lse_view = zc.view("lse", (ntok,), torch.float32)
            b = zc.buffers
            zc.call(lambda ready, done: self._engine.gather_shared(
                (ntok, k, _NAMES[flat.dtype]), (b["hidden"][0], b["ids"][0], b["logprobs"][0], b["lse"][0]),
                options, (ready, done),
            ))  # fmt: skip
            return Gathered(logprobs_view.clone().reshape(lead + (k,)), lse_view.clone().reshape(lead))
        host = _on_host("hidden", flat)
        ntok = host.shape[0]
        ids_host = _on_host("ids", ids.reshape(ntok, k))
        logprobs = torch.empty((ntok, k), dtype=torch.float32)
        lse = torch.empty(ntok, dtype=torch.float32)
        self._engine.gather(_spec(host), ntok, _spec(ids_host), k, _spec(logprobs), _spec(lse), options)
        return Gathered(_to_device(logprobs.reshape(lead + (k,)), hidden.device), _to_device(lse.reshape(lead), hidden.device))


def topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float = 1.0, **kwargs) -> TopK:
    """``Head(weight).topk(hidden, k, temperature=...)``: uploads the head for
    this call alone; keep a ``Head`` to call it again. ``backend`` and
    ``device`` go to ``Head``, the rest to ``Head.topk``."""
    weight = _tensor("weight", weight, _FLOATS, ndim=2)
    _top_k(k, weight.shape[0])  # before the head is uploaded
    head_kw = {key: kwargs.pop(key) for key in ("backend", "device") if key in kwargs}
    return Head(weight, **head_kw).topk(hidden, k, temperature=temperature, **kwargs)


def gather(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, **kwargs) -> Gathered:
    """``Head(weight).gather(hidden, ids, temperature=...)``, the head
    uploaded for this call alone."""
    head_kw = {key: kwargs.pop(key) for key in ("backend", "device") if key in kwargs}
    return Head(weight, **head_kw).gather(hidden, ids, temperature=temperature, **kwargs)


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
    kept gradient by the incoming one (once: a second derivative raises)."""

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


def _loss_options(**o) -> dict:
    """The loss's keywords as the native module takes them (headkl's own
    names), the names of the enumerations checked here."""
    for name, allowed in (
        ("reduction", _REDUCTIONS),
        ("tail", _TAILS),
        ("teacher_form", _FORMS),
        ("divergence", _DIVERGENCES),
    ):
        if o.get(name, allowed[0]) not in allowed:
            raise ValueError(f"{name}={o[name]!r}: expected one of {', '.join(allowed)}")
    floats = ("temperature", "teacher_temperature", "beta", "soft_weight", "hard_weight", "label_smoothing",
              "z_loss", "softcap", "logit_scale", "gscale")  # fmt: skip
    out = {}
    for key, value in o.items():
        if key in floats and value is not None:
            value = float(value)
        elif key == "filter_eps" and value is not None and value != "auto":
            value = float(value)
        out[key] = value
    return out


def _effective_weights(options: dict, labels, weights, ntok: int, device):
    """The per-token weights after ``ignore_mask``."""
    w = torch.ones(ntok, device=device) if weights is None else weights
    if options.get("ignore_mask") and labels is not None:
        w = w * ((labels >= 0) & (labels != options.get("ignore_index", -100)))
    return w


def _reduced(reduction: str, per_token, w, total):
    """The loss from the unweighted per-token losses, as the engine reduces it."""
    if reduction == "none":
        return per_token * w
    weighted = (per_token.double() * w.double()).sum()
    if reduction == "mean":
        return (weighted / (w.double().sum() if total is None else total)).float()
    if reduction == "batchmean":
        return (weighted / per_token.shape[0]).float()
    return weighted.float()


_REDUCTIONS = ("mean", "sum", "batchmean", "none")
_TAILS = ("renormalize", "bucket", "none")
_FORMS = ("probs", "logprobs")
_DIVERGENCES = ("forward", "reverse", "jsd")


class _HeadLoss(nn.Module):
    """What HeadKLLoss and FullVocabKLLoss share: ``self.head``, the loss's
    ``options`` and its ``reduction``."""

    @property
    def info(self) -> dict:
        """The device the loss runs on."""
        return self.head.info

    def _weights(self, labels, weights, ntok, device):
        return _effective_weights(self.options, labels, weights, ntok, device)

    def _host_result(self, mean, per_token, dx, labels, weights, device):
        """A host call's outputs on ``device``: the loss (the weighted
        per-token losses with reduction="none", else the engine's reduced
        ``mean``) and ``dx``."""
        if self.reduction == "none":
            loss = per_token * self._weights(labels, weights, per_token.shape[0], "cpu")
        else:
            loss = torch.tensor(mean, dtype=torch.float32)
        return _to_device(loss, device), _to_device(dx, device)


class HeadKLLoss(_HeadLoss):
    """The distillation loss of hidden rows against a teacher's top-k,
    through the frozen head ``weight`` ``[V][hs]`` (uploaded once).

    ``forward(hidden, teacher_ids, teacher_values, *, labels=None,
    weights=None, total=None)``: ``hidden`` ``[..., hs]``, the teacher's
    ``[..., k]`` ids (int64) and values (probabilities, or
    log-probabilities with ``teacher_form="logprobs"``), ``labels``
    ``[...]`` for the hard term and ``ignore_mask``, per-token ``weights``
    ``[...]`` (0 masks a token) and the ``total`` the mean divides by
    (default ``Σ weights``; a bool or integer mask is taken as 0/1).
    Returns the loss: a scalar, or ``[...]`` with ``reduction="none"`` (the
    weighted per-token losses); its backward gives ``hidden.grad``.

    The head gets no gradient: a ``weight`` that requires grad is refused
    (pass ``weight.detach()``; a trainable head is not supported yet). A
    head changed after the loss was made (in place, as an optimizer or an
    EMA update does, also through the parameter it was detached from) is
    uploaded again at the next call, said on the ``headkl`` logger.

    Keywords (the ``headkl loss`` options, under PyTorch's or Liger's name):

    - ``temperature`` τ (default 1): ``s = z/τ``; a ``τ²`` factor is the caller's.
    - ``reduction``: ``"mean"`` (``Σ w L / Σ w``), ``"sum"``, ``"batchmean"``
      (``/ ntok``, ``F.kl_div``'s) or ``"none"``.
    - ``tail``: ``"renormalize"`` (the teacher's k renormalized), ``"bucket"``
      (the mass outside the k as one bin, matched by the student's own) or
      ``"none"`` (the k as given).
    - ``teacher_form``: ``"probs"`` or ``"logprobs"``; ``teacher_temperature``:
      the temperature the teacher's values were made at (rescaled to τ).
    - ``divergence``: ``"forward"`` (KL(p_T‖p_S)), ``"reverse"`` or ``"jsd"``
      with ``beta`` (TRL's generalized JSD; 0 forward, 1 reverse).
    - ``weight_soft_loss`` (α_soft, 1), ``weight_hard_loss`` (α_hard, 0: the
      cross-entropy against ``labels``), ``label_smoothing``,
      ``lse_square_scale`` (the z-loss λ), ``softcap``, ``logit_scale``.
    - ``ignore_index`` (−100; any negative label is none too) and
      ``ignore_mask`` (drop tokens without a label from every term).
    - ``filter_eps``: skip the gradient GEMM's blocks whose ``|∂L/∂s|`` are
      all ≤ ε (``"auto"``: 2⁻¹⁵, Cut Cross-Entropy's; the loss stays exact);
      ``gscale``: the f16 gradient's scale (default from the weights);
      ``budget_bytes``: device scratch.
    - ``backend``, ``device``: as ``Head``'s.
    - ``shard=(v0, v1)``, ``vocab_size``, ``process_group``: vocabulary
      parallel. ``weight`` is the rows ``[v0, v1)``; every rank of
      ``process_group`` (default: the world) calls forward with the same
      rows and teacher, and the two phases meet through
      ``torch.distributed.all_reduce``. The sharded loss takes the forward
      KL with the default tail and no hard term, z-loss, softcap or filter.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        temperature: float = 1.0,
        reduction: str = "mean",
        tail: str = "renormalize",
        teacher_form: str = "probs",
        teacher_temperature: Optional[float] = None,
        divergence: str = "forward",
        beta: float = 0.5,
        weight_soft_loss: float = 1.0,
        weight_hard_loss: float = 0.0,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        ignore_index: int = -100,
        ignore_mask: bool = False,
        filter_eps=None,
        gscale: Optional[float] = None,
        budget_bytes: Optional[int] = None,
        backend: str = "auto",
        device: Optional[int] = None,
        shard: Optional[Tuple[int, int]] = None,
        vocab_size: Optional[int] = None,
        process_group=None,
    ):
        super().__init__()
        self.options = _loss_options(
            temperature=temperature,
            reduction=reduction,
            tail=tail,
            teacher_form=teacher_form,
            teacher_temperature=teacher_temperature,
            divergence=divergence,
            beta=beta,
            soft_weight=weight_soft_loss,
            hard_weight=weight_hard_loss,
            label_smoothing=label_smoothing,
            z_loss=lse_square_scale,
            softcap=softcap,
            logit_scale=logit_scale,
            ignore_index=ignore_index,
            ignore_mask=ignore_mask,
            filter_eps=filter_eps,
            gscale=gscale,
            budget_bytes=budget_bytes,
        )
        # Every value is checked here, before the head goes to a device.
        _native.check_loss_options(self.options, shard is not None)
        weight = _frozen("weight", _tensor("weight", weight, _FLOATS, ndim=2))
        self.reduction = reduction
        self.head = Head(weight, backend=backend, device=device, shard=shard, vocab_size=vocab_size)
        self.process_group = process_group

    @property
    def zero_copy(self) -> bool:
        """Whether the last CUDA call went zero-copy."""
        return getattr(self, "_used_zero_copy", False)

    def synchronize(self) -> None:
        """Waits for the device and raises what the last zero-copy call
        flagged there (an id ≥ V, a non-finite row: ``ValueError``). The
        zero-copy path checks each call's flags when the next call starts,
        so a bad step raises one call late unless this is called."""
        self.head.synchronize()

    def forward(
        self,
        hidden: torch.Tensor,
        teacher_ids: torch.Tensor,
        teacher_values: torch.Tensor,
        *,
        labels: Optional[torch.Tensor] = None,
        weights: Optional[torch.Tensor] = None,
        total: Optional[float] = None,
    ) -> torch.Tensor:
        flat, lead = self.head._hidden(hidden)
        ntok = flat.shape[0]
        teacher_ids = _ids("teacher_ids", teacher_ids)
        teacher_values = _tensor("teacher_values", teacher_values, _FLOATS + (torch.float64,))
        if teacher_ids.dim() < 1 or tuple(teacher_ids.shape[:-1]) != lead:
            raise ValueError(f"teacher_ids: expected shape {lead} + (k,), got {tuple(teacher_ids.shape)}")
        if teacher_values.shape != teacher_ids.shape:
            raise ValueError(
                f"teacher_values: shape {tuple(teacher_values.shape)} differs from teacher_ids' {tuple(teacher_ids.shape)}"
            )
        k = teacher_ids.shape[-1]
        for name, t in (("teacher_ids", teacher_ids), ("teacher_values", teacher_values)):
            _same_device(name, t, hidden)
        labels, weights = _row_arrays(labels, weights, lead, hidden)
        if self.options["hard_weight"] > 0 and labels is None:
            raise ValueError(f"labels: needed with weight_hard_loss={self.options['hard_weight']}")
        inputs = (flat, teacher_ids.reshape(ntok, k), teacher_values.reshape(ntok, k), labels, weights)
        total = None if total is None else float(total)
        self.head._refresh()
        zero_copy = self._zero_copy(hidden.device) if hidden.device.type == "cuda" else None
        if zero_copy is not None:
            run = lambda: zero_copy.loss(self, *inputs, total)  # noqa: E731
        else:
            run = lambda: self._host_loss(*inputs, total, hidden.device)  # noqa: E731
        return _HeadKLFunction.apply(flat, run).reshape(lead if self.reduction == "none" else ())

    def _zero_copy(self, device: torch.device):
        """The zero-copy path for CUDA tensors on ``device``, or None (then
        host copies, logged once with why)."""
        why = None
        if self.options["teacher_temperature"] is not None:
            why = "teacher_temperature runs through host copies"
        # A flag, not the buffers: a head read again lets the last engine go.
        zero_copy = self.head._zero_copy(device, why)
        self._used_zero_copy = zero_copy is not None
        return zero_copy

    def _reduce(self, per_token, w, total):
        return _reduced(self.reduction, per_token, w, total)

    def _host_loss(self, flat, ids, values, labels, weights, total, device):
        host = _on_host("hidden", flat)
        ntok, hs = host.shape
        k = ids.shape[1]
        ids = _on_host("teacher_ids", ids)
        values = _on_host("teacher_values", values.to(torch.float32))
        labels_host = None if labels is None else _on_host("labels", labels)
        weights_host = None if weights is None else _on_host("weights", weights)
        options = dict(self.options, total=total)
        engine = self.head._engine
        dx = torch.empty((ntok, hs), dtype=torch.float32)
        per_token = torch.empty(ntok, dtype=torch.float32)
        spec = lambda t: None if t is None else _spec(t)  # noqa: E731
        if self.head.shard is None:
            mean = engine.head_kl(
                _spec(host), ntok, (_spec(ids), _spec(values), k),
                spec(labels_host), spec(weights_host), (_spec(dx), _spec(per_token)), options,
            )  # fmt: skip
        else:
            if labels_host is not None:
                raise ValueError("labels: the sharded loss takes no hard term or ignore mask")
            stats = [torch.empty(ntok, dtype=torch.float32) for _ in range(3)]
            engine.loss_partials(
                _spec(host), ntok, (_spec(ids), _spec(values), k), spec(weights_host),
                *(_spec(s) for s in stats), options,
            )  # fmt: skip
            # The collective runs on the caller's device: NCCL takes CUDA
            # tensors only, gloo takes both.
            merged = _merge_partials([_to_device(t, device) for t in stats], self.process_group)
            merged = [_on_host("partials", t) for t in merged]
            mean = engine.loss_finish(_spec(host), ntok, *(_spec(s) for s in merged), (_spec(dx), _spec(per_token)))
            dx = _to_device(dx, device)
            dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=self.process_group)
        return self._host_result(mean, per_token, dx, labels_host, weights_host, device)


class FullVocabKLLoss(_HeadLoss):
    """The exact full-vocabulary divergence of the student from a teacher
    given by its own hidden rows and head, as Liger's
    ``LigerFusedLinearJSD`` computes it: ``p_T = softmax(x_T·W_Tᵀ/τ)`` over
    the whole vocabulary, never stored whole (a chunk of rows at a time).

    ``FullVocabKLLoss(weight, teacher_weight, *, divergence="jsd",
    beta=0.5, ...)`` uploads both heads once (they share V, not hs);
    ``forward(hidden, teacher_hidden, *, labels=None, weights=None,
    total=None)`` returns the loss, whose backward gives ``hidden.grad``.
    Keywords as ``HeadKLLoss``'s that apply: ``temperature``, ``reduction``,
    ``divergence``, ``beta``, ``weight_soft_loss``, ``logit_scale`` (the
    student's), ``ignore_index``, ``ignore_mask``, ``gscale``,
    ``budget_bytes``, ``backend``, ``device``. It runs on host memory (CUDA
    tensors through host copies). Neither head gets a gradient: a
    ``weight`` or ``teacher_weight`` that requires grad is refused (pass
    ``.detach()``); either head changed after the loss was made is
    uploaded again at the next call, as ``HeadKLLoss``'s is.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        teacher_weight: torch.Tensor,
        *,
        temperature: float = 1.0,
        reduction: str = "mean",
        divergence: str = "jsd",
        beta: float = 0.5,
        weight_soft_loss: float = 1.0,
        logit_scale: float = 1.0,
        ignore_index: int = -100,
        ignore_mask: bool = False,
        gscale: Optional[float] = None,
        budget_bytes: Optional[int] = None,
        backend: str = "auto",
        device: Optional[int] = None,
    ):
        super().__init__()
        self.options = _loss_options(
            temperature=temperature,
            reduction=reduction,
            divergence=divergence,
            beta=beta,
            soft_weight=weight_soft_loss,
            logit_scale=logit_scale,
            ignore_index=ignore_index,
            ignore_mask=ignore_mask,
            gscale=gscale,
            budget_bytes=budget_bytes,
        )
        _native.check_loss_options(self.options, False)
        weight = _frozen("weight", _tensor("weight", weight, _FLOATS, ndim=2))
        teacher_weight = _frozen("teacher_weight", _tensor("teacher_weight", teacher_weight, _FLOATS, ndim=2))
        if teacher_weight.shape[0] != weight.shape[0]:
            raise ValueError(
                f"teacher_weight: {teacher_weight.shape[0]} rows, but weight has {weight.shape[0]} (the heads share V)"
            )
        self.reduction = reduction
        self.head = Head(weight, backend=backend, device=device)
        self.teacher_hidden_size = teacher_weight.shape[1]
        self.head._set_teacher(teacher_weight)

    def forward(
        self,
        hidden: torch.Tensor,
        teacher_hidden: torch.Tensor,
        *,
        labels: Optional[torch.Tensor] = None,
        weights: Optional[torch.Tensor] = None,
        total: Optional[float] = None,
    ) -> torch.Tensor:
        flat, lead = self.head._hidden(hidden)
        ntok, hs = flat.shape
        teacher_hidden = _tensor("teacher_hidden", teacher_hidden, _FLOATS)
        _same_device("teacher_hidden", teacher_hidden, hidden)
        if tuple(teacher_hidden.shape) != lead + (self.teacher_hidden_size,):
            raise ValueError(
                f"teacher_hidden: expected shape {lead + (self.teacher_hidden_size,)}, got {tuple(teacher_hidden.shape)}"
            )
        labels, weights = _row_arrays(labels, weights, lead, hidden)
        labels = None if labels is None else _on_host("labels", labels)
        weights = None if weights is None else _on_host("weights", weights)
        options = dict(self.options, total=None if total is None else float(total))
        self.head._refresh()

        def run():
            host = _on_host("hidden", flat)
            teacher = _on_host("teacher_hidden", teacher_hidden.reshape(ntok, -1))
            dx = torch.empty((ntok, hs), dtype=torch.float32)
            per_token = torch.empty(ntok, dtype=torch.float32)
            spec = lambda t: None if t is None else _spec(t)  # noqa: E731
            mean = self.head._engine.head_kl_full_vocab(
                _spec(host), ntok, _spec(teacher), teacher.shape[1], spec(labels), spec(weights),
                (_spec(dx), _spec(per_token)), options,
            )  # fmt: skip
            return self._host_result(mean, per_token, dx, labels, weights, hidden.device)

        return _HeadKLFunction.apply(flat, run).reshape(lead if self.reduction == "none" else ())


class _ZeroCopy:
    """The engine's buffers shared with CUDA, and its timeline semaphore
    imported into CUDA: the loss on CUDA tensors with no host copy and no
    host wait inside a step."""

    def __init__(self, engine, device: torch.device):
        from . import _cuda

        why = engine.interop()
        if why is not None:
            raise RuntimeError(why)
        self._cuda = _cuda
        self.engine = engine
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        self.driver = _cuda.Driver()
        self.driver.ensure_context(self.ordinal)
        if bytes(self.driver.device_uuid(self.ordinal)) != bytes(engine.device_uuid()):
            raise RuntimeError(f"the engine's Vulkan device is not CUDA device {self.ordinal}")
        self.timeline = self.driver.import_timeline(engine.export_timeline())
        self.value = 0
        self.buffers = {}

    def close(self) -> None:
        """Frees the shared buffers and the imported semaphore, once the
        device is done with them (before the engine goes: the head was
        uploaded again)."""
        torch.cuda.synchronize(self.ordinal)
        buffers, self.buffers = self.buffers, {}
        for handle, memory, _, _ in buffers.values():
            self.engine.free_buffer(handle)
            memory.close()
        self.timeline.close()

    def view(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A CUDA tensor over the shared buffer ``name`` (grown as needed)."""
        count = 1
        for d in shape:
            count *= d
        nbytes = max(count * torch.empty((), dtype=dtype).element_size(), 4)
        have = self.buffers.get(name)
        if have is None or have[3] < nbytes:
            if have is not None:
                # CUDA's last use of the old buffer must be done before it goes.
                torch.cuda.current_stream(self.ordinal).synchronize()
                self.engine.free_buffer(have[0])
                have[1].close()
            capacity = -(-nbytes * 5 // 4 // 65536) * 65536
            handle, fd, allocation = self.engine.export_buffer(capacity)
            memory = self.driver.import_memory(fd, allocation, dedicated=True)
            pointer = memory.map(0, capacity)
            have = self.buffers[name] = (handle, memory, pointer, capacity)
        return self._cuda.tensor_at(have[2], tuple(shape), dtype, self.ordinal, owner=have[1])

    def call(self, run) -> None:
        """``run(ready, done)`` between torch's stream and headkl's queue:
        the stream signals ``ready`` once its earlier work (the inputs'
        copies) is done, headkl's submission waits for it and signals
        ``done``, and the stream's later work waits for ``done``."""
        stream = torch.cuda.current_stream(self.ordinal).cuda_stream
        ready, done = self.value + 1, self.value + 2
        self.value = done
        self.timeline.signal(ready, stream)
        run(ready, done)
        self.timeline.wait(done, stream)

    def loss(self, module, flat, ids, values, labels, weights, total):
        ntok, hs = flat.shape
        k = ids.shape[1]
        o = module.options
        self.view("hidden", (ntok, hs), flat.dtype).copy_(flat)
        self.view("ids", (ntok, k), torch.int32).copy_(ids)
        self.view("values", (ntok, k), torch.float32).copy_(values)
        w = module._weights(labels, weights, ntok, flat.device)
        weights_handle = labels_handle = None
        if weights is not None or (o["ignore_mask"] and labels is not None):
            self.view("weights", (ntok,), torch.float32).copy_(w)
            weights_handle = self.buffers["weights"][0]
        if o["hard_weight"] > 0:
            none = (labels < 0) | (labels == o["ignore_index"])
            self.view("labels", (ntok,), torch.int32).copy_(torch.where(none, torch.full_like(labels, -1), labels))
            labels_handle = self.buffers["labels"][0]
        loss_view = self.view("loss", (ntok,), torch.float32)
        dx_view = self.view("dx", (ntok, hs), torch.float32)
        options = dict(o, ignore_mask=False, total=total)
        b = self.buffers
        self.call(lambda ready, done: self.engine.head_kl_shared(
            (ntok, k, _NAMES[flat.dtype]), b["hidden"][0], b["ids"][0], b["values"][0], weights_handle,
            labels_handle, b["loss"][0], b["dx"][0], options, (ready, done),
        ))  # fmt: skip
        # Copies on the device: the next step writes the shared buffers again.
        per_token, dx = loss_view.clone(), dx_view.clone()
        return module._reduce(per_token, w, total), dx


def _merge_partials(stats, group):
    """The shards' phase-one statistics merged by all-reduce: the
    log-sum-exps by MAX then SUM of ``exp(lse − max)``, the teacher terms by
    SUM (in float64)."""
    lse, lse1, soft = stats
    merged = []
    for part in (lse, lse1):
        top = part.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        mass = torch.exp(part.double() - top.double())
        dist.all_reduce(mass, op=dist.ReduceOp.SUM, group=group)
        merged.append((top.double() + mass.log()).to(torch.float32))
    soft = soft.double()
    dist.all_reduce(soft, op=dist.ReduceOp.SUM, group=group)
    merged.append(soft.to(torch.float32))
    return merged


_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "F64": torch.float64,
}


def read_safetensors(path) -> dict:
    """The tensors of a safetensors file (as ``headkl topk`` writes them:
    ``ids`` and ``probs``, with ``logprobs`` where asked), and its metadata
    under the key ``"__metadata__"``."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise ValueError(f"{path}: header of {size} bytes runs past the file's end")
    header = json.loads(data[8 : 8 + size])
    body = memoryview(data)[8 + size :]
    out = {"__metadata__": header.pop("__metadata__", {})}
    for name, entry in header.items():
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r}: dtype {entry['dtype']} is not supported here")
        start, end = entry["data_offsets"]
        raw = bytearray(body[start:end])
        t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(entry["shape"])
    return out


def write_safetensors(path, tensors: dict, metadata: Optional[dict] = None) -> None:
    """Writes CPU tensors as a safetensors file (what ``headkl topk`` and
    ``headkl loss`` read: the head as ``weight``, hidden rows as ``hidden``)."""
    names = {v: k for k, v in _ST_DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        blob = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
