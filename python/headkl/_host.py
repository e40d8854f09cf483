"""Tensors in host memory, as the native module reads and writes them: CPU
tensors in place, CUDA tensors through host copies (said once on the
``headkl`` logger, and counted by ``host_copy_bytes()``)."""

from __future__ import annotations

import logging
from typing import Tuple

import torch

log = logging.getLogger("headkl")

_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
}
_warned_host_copies = False
_said_head_grad_on_host = False
_host_copy_bytes = 0


def host_copy_bytes() -> int:
    """Bytes headkl has copied between CUDA tensors and the host since
    import (0 while every CUDA call went zero-copy)."""
    return _host_copy_bytes


def _warn_host_copies(why: str = "") -> None:
    """Says once, on the ``headkl`` logger, that CUDA tensors go through
    host copies (and ``why``, where given)."""
    global _warned_host_copies
    if not _warned_host_copies:
        log.warning("headkl: CUDA tensors go through host copies%s", f" ({why})" if why else "")
        _warned_host_copies = True


def _say_head_grad_on_host(why: str = "the zero-copy path does not compute the head's gradient") -> None:
    """Says once, on the ``headkl`` logger (WARNING), why a loss whose head
    requires grad takes host copies for CUDA tensors."""
    global _said_head_grad_on_host
    if not _said_head_grad_on_host:
        log.warning(
            "headkl: the head requires grad, and %s: the loss runs on host memory while it does "
            "(detach the head, or set requires_grad_(False), to go zero-copy)",
            why,
        )
        _said_head_grad_on_host = True


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
    global _host_copy_bytes
    if t.device.type == "cpu":
        return t.detach().contiguous()
    if t.device.type == "cuda":
        _warn_host_copies(why)
        _host_copy_bytes += t.numel() * t.element_size()
        return t.detach().to("cpu").contiguous()
    raise TypeError(f"{name}: tensors on {t.device.type} are not supported (use cpu or cuda)")
