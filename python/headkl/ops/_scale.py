"""The head's f32 gradient scaled by the upstream gradient into the
weight's dtype (``_head_gradient``'s last pass).

PyTorch computes ``torch.mul(f32, scale, out=bf16)`` into a temporary of
the common dtype and then copies: at shape A (a 5 GB f32 gradient) that
took 5.1–5.5 ms on an H100, where a plain f32 → bf16 copy took 2.5.
Where Triton is importable (it comes with PyTorch's CUDA wheels), one
kernel reads each f32 value once, multiplies it by the scale read from
the device and writes it rounded once: the product PyTorch gives, at the
copy's cost. Elsewhere (no Triton, CPU tensors) the scale goes a window
of rows at a time, so PyTorch's temporary stays a window's."""

from __future__ import annotations

import logging

import torch

_log = logging.getLogger("headkl")

# Rows of the head's gradient scaled into the weight's dtype at a time
# without Triton, in bytes of the f32 rows.
_SCALE_WINDOW_BYTES = 256 << 20

# Elements a Triton program scales.
_BLOCK = 4096

try:  # pragma: no cover - depends on the installed PyTorch
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_kernel(src, dst, scale, n, BLOCK: tl.constexpr):
        # 64-bit offsets: a large head's gradient is past 2**31 bytes.
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        factor = tl.load(scale)
        values = tl.load(src + offsets, mask=inside)
        tl.store(dst + offsets, (values * factor).to(dst.dtype.element_ty), mask=inside)

except Exception as e:  # ImportError, or a Triton that cannot compile here
    _scale_kernel = None
    _why_no_kernel = f"{type(e).__name__}: {e}"
else:
    _why_no_kernel = None


def fused_kernel_available() -> bool:
    """Whether the Triton kernel is there to scale CUDA tensors."""
    return _scale_kernel is not None


def scale_into(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = src · scale`` rounded once into ``out``'s dtype: ``src`` f32
    ``[rows][cols]``, ``scale`` a one-element tensor on ``src``'s device,
    ``out`` the same shape on that device. Returns ``out``."""
    global _scale_kernel
    if _kernel_takes(src, out):
        n = src.numel()
        factor = scale.reshape(1).to(torch.float32)
        try:
            _scale_kernel[(triton.cdiv(n, _BLOCK),)](src, out, factor, n, BLOCK=_BLOCK)
            return out
        except Exception as e:
            # Triton builds its launcher with the host's C compiler on first
            # use; where that fails nothing was queued, and PyTorch scales.
            _log.warning("headkl: the head gradient's Triton kernel failed (%s: %s); PyTorch scales it", type(e).__name__, e)
            _scale_kernel = None
    if out.dtype == src.dtype or src.dim() != 2:
        return torch.mul(src, scale, out=out)
    rows = max(1, _SCALE_WINDOW_BYTES // max(1, src.shape[1] * src.element_size()))
    for first in range(0, src.shape[0], rows):
        torch.mul(src[first : first + rows], scale, out=out[first : first + rows])
    return out


def _kernel_takes(src: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the Triton kernel scales ``src`` into ``out``: both
    contiguous CUDA tensors, ``src`` f32, ``out`` a float type."""
    if _scale_kernel is None or not src.is_cuda:
        return False
    # Traced (torch.compile's fake or functional tensors): PyTorch's ops,
    # which the compiler fuses itself.
    if type(src) is not torch.Tensor or type(out) is not torch.Tensor or _compiling():
        return False
    if src.dtype != torch.float32 or out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return src.is_contiguous() and out.is_contiguous() and src.numel() > 0


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


if _why_no_kernel is not None:
    _log.debug("headkl: the head gradient's scale goes through PyTorch (no Triton kernel: %s)", _why_no_kernel)
