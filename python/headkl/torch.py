"""headkl for PyTorch: the fused top-k distillation loss with its gradient,
the teacher's exact top-k and the gather, on a frozen head uploaded once.

The head ``weight`` is ``[V][hs]`` (``nn.Linear(hs, V).weight``, or an
embedding matrix), float32, float16 or bfloat16; the hidden rows are
``[..., hs]`` in any of those dtypes. Per token, with ``s = x·Wᵀ/τ``::

    L_t  = Σ_k q_k · (log q_k − log_softmax(s)[id_k])     q: the teacher's k, renormalized
    loss = Σ_t w_t L_t / Σ_t w_t                           (reduction="mean")

and ``loss.backward()`` gives ``hidden.grad``; no ``[ntok][V]`` tensor is
ever made. The other divergences, tail modes and terms are keywords of
``HeadKLLoss`` (the README's "Loss terms" has each one's PyTorch formula).

Tensors on the CPU are read and written in place. CUDA tensors go through
host copies for now (logged once on the ``headkl`` logger); the zero-copy
CUDA path is not built yet.
"""

from __future__ import annotations

import ctypes
import json
import logging
import struct
from collections import namedtuple
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import _native

__all__ = [
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
_warned_host_copies = False


def _spec(t: torch.Tensor) -> Tuple[int, int, str]:
    """A contiguous CPU tensor's memory, as the native module takes it."""
    return (t.data_ptr(), t.numel(), _NAMES[t.dtype])


def _on_host(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor: itself where it already is one."""
    global _warned_host_copies
    if t.device.type == "cpu":
        return t.detach().contiguous()
    if t.device.type == "cuda":
        if not _warned_host_copies:
            log.warning(
                "headkl: CUDA tensors go through host copies (the zero-copy CUDA path is not built yet)"
            )
            _warned_host_copies = True
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


def _ids(name: str, t) -> torch.Tensor:
    t = _tensor(name, t, (torch.int64, torch.int32))
    return t.to(torch.int64)


def _same_device(name: str, t: torch.Tensor, hidden: torch.Tensor) -> None:
    if t.device != hidden.device:
        raise ValueError(f"{name}: on {t.device}, but hidden is on {hidden.device}")


def _rows(name: str, t: torch.Tensor, lead: Tuple[int, ...]) -> None:
    if tuple(t.shape) != lead:
        raise ValueError(f"{name}: expected shape {lead} (hidden's leading dimensions), got {tuple(t.shape)}")


class Head:
    """A frozen head ``weight`` ``[V][hs]`` uploaded once to a backend.

    ``backend``: ``"auto"`` (the best GPU, else the f64 CPU reference),
    ``"vulkan"``, ``"wgpu"`` or ``"reference"``; ``device``: the index
    within it, as ``headkl.devices()`` lists them. For a vocabulary shard,
    ``shard=(v0, v1)`` with ``vocab_size=V``: ``weight`` then holds the rows
    ``[v0, v1)`` alone.
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
        host = _on_host("weight", weight)
        self._engine = _native.Engine(_spec(host), rows, hs, backend, device, shard_spec)
        self.shard = None if shard is None else (shard_spec[0], shard_spec[1])
        self.vocab_size = rows if shard_spec is None else shard_spec[2]
        self.hidden_size = hs

    @property
    def info(self) -> dict:
        """The device: backend, name, type, driver, matrix units, GEMM kernels."""
        return self._engine.info()

    def _hidden(self, hidden) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
        hidden = _tensor("hidden", hidden, _FLOATS)
        if hidden.dim() < 1 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden: last dimension must be the head's hidden size {self.hidden_size}, got shape {tuple(hidden.shape)}"
            )
        lead = tuple(hidden.shape[:-1])
        flat = hidden.reshape(-1, self.hidden_size)
        return flat, _on_host("hidden", flat), lead

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
        flat, host, lead = self._hidden(hidden)
        ntok = host.shape[0]
        ids = torch.empty((ntok, k), dtype=torch.int64)
        probs = torch.empty((ntok, k), dtype=torch.float32)
        logprobs = torch.empty((ntok, k), dtype=torch.float32) if form == "logprobs" else None
        options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
        self._engine.topk(
            _spec(host), ntok, k, _spec(ids), _spec(probs), None if logprobs is None else _spec(logprobs), options
        )
        values = probs if logprobs is None else logprobs
        shape = lead + (k,)
        return TopK(ids.reshape(shape).to(hidden.device), values.reshape(shape).to(hidden.device))

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
        flat, host, lead = self._hidden(hidden)
        ids = _ids("ids", ids)
        _same_device("ids", ids, hidden)
        if ids.dim() < 1 or tuple(ids.shape[:-1]) != lead:
            raise ValueError(f"ids: expected shape {lead} + (k,), got {tuple(ids.shape)}")
        k = ids.shape[-1]
        ntok = host.shape[0]
        ids_host = _on_host("ids", ids.reshape(ntok, k))
        logprobs = torch.empty((ntok, k), dtype=torch.float32)
        lse = torch.empty(ntok, dtype=torch.float32)
        options = {"temperature": temperature, "softcap": softcap, "logit_scale": logit_scale}
        self._engine.gather(_spec(host), ntok, _spec(ids_host), k, _spec(logprobs), _spec(lse), options)
        return Gathered(logprobs.reshape(lead + (k,)).to(hidden.device), lse.reshape(lead).to(hidden.device))


def topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, temperature: float = 1.0, **kwargs) -> TopK:
    """``Head(weight).topk(hidden, k, temperature=...)``: uploads the head for
    this call alone; keep a ``Head`` to call it again. ``backend`` and
    ``device`` go to ``Head``, the rest to ``Head.topk``."""
    head_kw = {key: kwargs.pop(key) for key in ("backend", "device") if key in kwargs}
    return Head(weight, **head_kw).topk(hidden, k, temperature=temperature, **kwargs)


def gather(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, **kwargs) -> Gathered:
    """``Head(weight).gather(hidden, ids, temperature=...)``, the head
    uploaded for this call alone."""
    head_kw = {key: kwargs.pop(key) for key in ("backend", "device") if key in kwargs}
    return Head(weight, **head_kw).gather(hidden, ids, temperature=temperature, **kwargs)


class _HeadKLFunction(torch.autograd.Function):
    """The loss, computed with its gradient in one call; backward scales the
    kept gradient by the incoming one."""

    @staticmethod
    def forward(ctx, hidden, run):
        loss, dx = run()
        ctx.save_for_backward(dx)
        ctx.per_token = loss.dim() > 0
        ctx.dtype = hidden.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        (dx,) = ctx.saved_tensors
        scale = grad.reshape(-1, 1) if ctx.per_token else grad
        return (dx * scale).to(ctx.dtype), None


_REDUCTIONS = ("mean", "sum", "batchmean", "none")
_TAILS = ("renormalize", "bucket", "none")
_FORMS = ("probs", "logprobs")
_DIVERGENCES = ("forward", "reverse", "jsd")


class HeadKLLoss(nn.Module):
    """The distillation loss of hidden rows against a teacher's top-k,
    through the frozen head ``weight`` ``[V][hs]`` (uploaded once).

    ``forward(hidden, teacher_ids, teacher_values, *, labels=None,
    weights=None, total=None)``: ``hidden`` ``[..., hs]``, the teacher's
    ``[..., k]`` ids (int64) and values (probabilities, or
    log-probabilities with ``teacher_form="logprobs"``), ``labels``
    ``[...]`` for the hard term and ``ignore_mask``, per-token ``weights``
    ``[...]`` (0 masks a token) and the ``total`` the mean divides by
    (default ``Σ weights``). Returns the loss: a scalar, or ``[...]`` with
    ``reduction="none"`` (the weighted per-token losses); its backward
    gives ``hidden.grad``. The head gets no gradient.

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
      all ≤ ε (the loss stays exact); ``budget_bytes``: device scratch.
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
        filter_eps: Optional[float] = None,
        budget_bytes: Optional[int] = None,
        backend: str = "auto",
        device: Optional[int] = None,
        shard: Optional[Tuple[int, int]] = None,
        vocab_size: Optional[int] = None,
        process_group=None,
    ):
        super().__init__()
        for name, value, allowed in (
            ("reduction", reduction, _REDUCTIONS),
            ("tail", tail, _TAILS),
            ("teacher_form", teacher_form, _FORMS),
            ("divergence", divergence, _DIVERGENCES),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
        self.options = {
            "temperature": float(temperature),
            "reduction": reduction,
            "tail": tail,
            "teacher_form": teacher_form,
            "teacher_temperature": None if teacher_temperature is None else float(teacher_temperature),
            "divergence": divergence,
            "beta": float(beta),
            "soft_weight": float(weight_soft_loss),
            "hard_weight": float(weight_hard_loss),
            "label_smoothing": float(label_smoothing),
            "z_loss": float(lse_square_scale),
            "softcap": None if softcap is None else float(softcap),
            "logit_scale": float(logit_scale),
            "ignore_index": int(ignore_index),
            "ignore_mask": bool(ignore_mask),
            "filter_eps": None if filter_eps is None else float(filter_eps),
            "budget_bytes": budget_bytes,
        }
        # Every value is checked here, before the head goes to a device.
        _native.check_loss_options(self.options, shard is not None)
        self.reduction = reduction
        self.head = Head(weight, backend=backend, device=device, shard=shard, vocab_size=vocab_size)
        self.process_group = process_group

    @property
    def info(self) -> dict:
        """The device the loss runs on."""
        return self.head.info

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
        flat, host, lead = self.head._hidden(hidden)
        ntok, hs = host.shape
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
        ids = _on_host("teacher_ids", teacher_ids.reshape(ntok, k))
        values = _on_host("teacher_values", teacher_values.reshape(ntok, k).to(torch.float32))
        labels_host = weights_host = None
        if labels is not None:
            labels = _ids("labels", labels)
            _rows("labels", labels, lead)
            _same_device("labels", labels, hidden)
            labels_host = _on_host("labels", labels.reshape(ntok))
        if weights is not None:
            weights = _tensor("weights", weights, _FLOATS + (torch.float64,))
            _rows("weights", weights, lead)
            _same_device("weights", weights, hidden)
            weights_host = _on_host("weights", weights.reshape(ntok).to(torch.float32))
        options = dict(self.options, total=None if total is None else float(total))
        engine = self.head._engine
        group = self.process_group

        def run():
            dx = torch.empty((ntok, hs), dtype=torch.float32)
            per_token = torch.empty(ntok, dtype=torch.float32)
            spec = lambda t: None if t is None else _spec(t)  # noqa: E731
            if self.head.shard is None:
                mean = engine.head_kl(
                    _spec(host), ntok, _spec(ids), _spec(values), k,
                    spec(labels_host), spec(weights_host), _spec(dx), _spec(per_token), options,
                )  # fmt: skip
            else:
                if labels_host is not None:
                    raise ValueError("labels: the sharded loss takes no hard term or ignore mask")
                stats = [torch.empty(ntok, dtype=torch.float32) for _ in range(3)]
                engine.loss_partials(
                    _spec(host), ntok, _spec(ids), _spec(values), k, spec(weights_host),
                    *(_spec(s) for s in stats), options,
                )  # fmt: skip
                merged = _merge_partials(stats, group)
                mean = engine.loss_finish(_spec(host), ntok, *(_spec(s) for s in merged), _spec(dx), _spec(per_token))
                dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=group)
            if self.reduction == "none":
                w = torch.ones(ntok) if weights_host is None else weights_host
                if self.options["ignore_mask"] and labels_host is not None:
                    valid = (labels_host >= 0) & (labels_host != self.options["ignore_index"])
                    w = w * valid
                loss = (per_token * w).reshape(lead)
            else:
                loss = torch.tensor(mean, dtype=torch.float32)
            return loss.to(hidden.device), dx.to(hidden.device)

        return _HeadKLFunction.apply(flat, run).reshape(lead if self.reduction == "none" else ())


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
