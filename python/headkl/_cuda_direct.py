"""CUDA tensors on headkl's CUDA backend: the engine runs on the tensors'
own memory (their device addresses) and queues on ``torch.cuda``'s current
stream, so there is no copy into separate buffers, no semaphore and no host
wait inside a step; the outputs come from PyTorch's allocator. A trainable
head gets its gradient the same way (``loss(..., head_grad=True)``), and a
head changed in place is read again on the device (``refill``). ``Head``
holds one ``_CudaDirect`` per engine where its backend is ``cuda``, in
place of the Vulkan zero-copy path (``_zero_copy``), with the same calls.

Rows the device flags (a bad teacher id, weight or label) get a NaN loss
and a zero ``dx`` row; ``Head.synchronize()`` raises the typed error naming
the row."""

from __future__ import annotations

from typing import Tuple

import torch

from ._host import _NAMES

_F16_MAX = 65504.0


def _memory(t: torch.Tensor) -> Tuple[int, int]:
    """A contiguous tensor's ``(address, bytes)``."""
    return (t.data_ptr(), t.numel() * t.element_size())


class _CudaDirect:
    """The CUDA engine on CUDA tensors of one device."""

    def __init__(self, engine, device: torch.device, vocab: int):
        backend = engine.info()["backend"]
        if backend != "cuda":
            raise RuntimeError(f"the {backend} backend does not run on CUDA tensors directly")
        self.engine = engine
        self.vocab = vocab
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        # The engine's device is the tensors' (both count CUDA's devices in
        # CUDA's order; HEADKL_DEVICE or device= picked it).
        name = engine.info()["name"]
        if torch.cuda.get_device_name(self.ordinal) != name:
            raise RuntimeError(f"the engine's CUDA device ({name}) is not the tensors' (cuda:{self.ordinal})")

    def close(self) -> None:
        """Nothing to free: every buffer was the caller's."""

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.ordinal).cuda_stream

    def refill(self, weight: torch.Tensor) -> None:
        """Reads ``weight`` (the head, changed since it was read) again into
        the engine on the device: its values checked and its f16 rows'
        norms read (one small read to the host), the planes rewritten by
        device copies on torch's stream."""
        w = weight.detach()
        w16 = w.to(torch.float16).contiguous()
        w32 = w.float()
        bad_rows = (~torch.isfinite(w32) | (w32.abs() > _F16_MAX)).any(1)
        norms = w16.float().pow(2).sum(1).sqrt()
        read = torch.stack([norms, bad_rows.float()], 1).cpu()
        bad = torch.nonzero(read[:, 1]).flatten()
        if bad.numel():
            row = int(bad[0])
            values = w32[row].cpu()
            col = int(torch.nonzero(~torch.isfinite(values) | (values.abs() > _F16_MAX)).flatten()[0])
            what = "is not finite" if not bool(torch.isfinite(values[col])) else "is past f16's range"
            raise ValueError(f"weight: row {row}, column {col}: {float(values[col])} {what}")
        stream = torch.cuda.current_stream(self.ordinal).cuda_stream
        self.engine.refill_head_cuda(_memory(w16), read[:, 0].tolist(), stream)

    def loss(self, options: dict, flat, ids, values, labels, weights, w, total, head_grad: bool = False):
        """The unweighted per-token losses and ``dx`` for the checked
        ``[ntok]`` rows, as new CUDA tensors, and with ``head_grad`` the
        head's gradient f32 ``[V][hs]`` (else None); ``w`` is the per-token
        weights after ``ignore_mask``, which the engine takes in place of
        the mask."""
        ntok, hs = flat.shape
        k = ids.shape[1]
        o = options
        flat = flat.contiguous()
        ids32 = ids.to(torch.int32).contiguous()
        values32 = values.to(torch.float32).contiguous()
        weights32 = labels32 = None
        if weights is not None or (o["ignore_mask"] and labels is not None):
            weights32 = w.to(torch.float32).contiguous()
        if o["hard_weight"] > 0:
            none = (labels < 0) | (labels == o["ignore_index"])
            labels32 = torch.where(none, torch.full_like(labels, -1), labels).to(torch.int32).contiguous()
        per_token = torch.empty(ntok, dtype=torch.float32, device=flat.device)
        dx = torch.empty((ntok, hs), dtype=torch.float32, device=flat.device)
        dw = None
        if head_grad:
            dw = torch.empty((self.vocab, hs), dtype=torch.float32, device=flat.device)
        maybe = lambda t: None if t is None else _memory(t)  # noqa: E731
        tensors = (flat, ids32, values32, weights32, labels32, per_token, dx)
        self.engine.head_kl_cuda(
            (ntok, k, _NAMES[flat.dtype]), tuple(maybe(t) for t in tensors), dict(o, ignore_mask=False, total=total),
            self._stream(), maybe(dw),
        )  # fmt: skip
        return per_token, dx, dw

    def topk(self, flat: torch.Tensor, k: int, options: dict, logprobs: bool):
        """Ids (int64) and values (f32) ``[ntok][k]`` of the checked rows."""
        ntok = flat.shape[0]
        flat = flat.contiguous()
        ids = torch.empty((ntok, k), dtype=torch.int32, device=flat.device)
        values = torch.empty((ntok, k), dtype=torch.float32, device=flat.device)
        self.engine.topk_cuda(
            (ntok, k, _NAMES[flat.dtype]), (_memory(flat), _memory(ids), _memory(values)), logprobs, options,
            self._stream(),
        )  # fmt: skip
        return ids.to(torch.int64), values

    def gather(self, flat: torch.Tensor, ids: torch.Tensor, options: dict):
        """Log-probabilities ``[ntok][k]`` at ``ids`` (negative: none) and
        each row's log-sum-exp ``[ntok]``."""
        ntok, k = ids.shape
        flat = flat.contiguous()
        ids32 = torch.where(ids < 0, torch.full_like(ids, -1), ids).to(torch.int32).contiguous()
        logprobs = torch.empty((ntok, k), dtype=torch.float32, device=flat.device)
        lse = torch.empty(ntok, dtype=torch.float32, device=flat.device)
        self.engine.gather_cuda(
            (ntok, k, _NAMES[flat.dtype]), (_memory(flat), _memory(ids32), _memory(logprobs), _memory(lse)), options,
            self._stream(),
        )  # fmt: skip
        return logprobs, lse
