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
# Rows of the head converted and checked at a time when it is read again
# (``refill``), in bytes of f16.
_REFILL_WINDOW_BYTES = 256 << 20


class _PlaneRows:
    """``rows × ld`` f16 values of an engine plane at a device address, for
    ``torch.as_tensor`` (the CUDA array interface; no stream named, as the
    writes are queued on the stream the engine runs on)."""

    def __init__(self, address: int, rows: int, ld: int):
        self.__cuda_array_interface__ = {
            "shape": (rows, ld),
            "typestr": "<f2",
            "data": (address, False),
            "version": 2,
        }


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
        the engine on the device: converted to f16 straight into the
        engine's planes by PyTorch's kernels on torch's stream, a window of
        ``_REFILL_WINDOW_BYTES`` at a time, each row's largest magnitude
        checked on the way (one flag a row, read back once). So a refresh
        costs about a device copy of the head and a read of it, and no
        memory beside it.
        A value that is not finite, or past f16's range (that rounds to
        infinity), is an error naming its row and column; the head is then
        read again at the next call."""
        w = weight.detach()
        vocab, hs = w.shape
        bad_rows = torch.zeros(vocab, dtype=torch.bool, device=w.device)
        step = max(1, _REFILL_WINDOW_BYTES // (2 * max(hs, 1)))

        def write(address: int, first_row: int, rows: int, ld: int) -> None:
            plane = torch.as_tensor(_PlaneRows(address, rows, ld), device=w.device)[:, :hs]
            for r in range(0, rows, step):
                dst = plane[r : r + step]
                ids = slice(first_row + r, first_row + r + dst.shape[0])
                dst.copy_(w[ids])
                largest = torch.linalg.vector_norm(dst, float("inf"), dim=1)
                torch.logical_not(torch.isfinite(largest), out=bad_rows[ids])

        self.engine.refill_head_cuda(write, torch.cuda.current_stream(self.ordinal).cuda_stream)
        bad = torch.nonzero(bad_rows).flatten()
        if bad.numel():
            row = int(bad[0])
            values = w[row].float().cpu()
            wrong = ~torch.isfinite(values) | (values.abs() > _F16_MAX)
            col = int(torch.nonzero(wrong).flatten()[0])
            what = "is not finite" if not bool(torch.isfinite(values[col])) else "is past f16's range"
            raise ValueError(f"weight: row {row}, column {col}: {float(values[col])} {what}")

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
