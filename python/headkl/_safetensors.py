"""Safetensors files as ``headkl``'s commands read and write them (the
head as ``weight``, hidden rows as ``hidden``; ``headkl topk``'s ``ids``,
``probs`` and ``logprobs``, with its ``headkl.*`` metadata), through the
``safetensors`` package (imported on first use: ``import headkl.torch``
does not need it)."""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["read_safetensors", "write_safetensors"]


def _safetensors():
    """The ``safetensors`` package, with ``safetensors.torch`` loaded, or an
    ImportError that says how to install it."""
    try:
        import safetensors
        import safetensors.torch  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "headkl's read_safetensors and write_safetensors use the safetensors package: "
            "pip install safetensors"
        ) from e
    return safetensors


def read_safetensors(path) -> dict:
    """The tensors of a safetensors file (as ``headkl topk`` writes them:
    ``ids`` and ``probs``, with ``logprobs`` where asked), and its metadata
    (string keys and values; ``{}`` where it has none) under the key
    ``"__metadata__"``. The tensors are CPU tensors that own their memory
    (copied out of the file's mapping), so the file may be overwritten
    while they live."""
    st = _safetensors()
    try:
        handle = st.safe_open(os.fspath(path), framework="pt")
    except st.SafetensorError as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from e
    except OSError as e:
        if e.filename is not None or os.fspath(path) in str(e):
            raise
        raise type(e)(f"{path}: {e}") from e
    with handle as f:
        out = {"__metadata__": dict(f.metadata() or {})}
        for name in f.keys():
            try:
                t = f.get_tensor(name)
            except (st.SafetensorError, AttributeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: tensor {name!r}: cannot be read here ({e!r})") from e
            # safetensors maps the file: a copy keeps the tensor valid when
            # the file is truncated or rewritten in place (a SIGBUS otherwise).
            out[name] = t.clone()
    return out


def _owned(tensors: dict, path) -> dict:
    """``tensors`` as contiguous CPU tensors, none overlapping another in
    memory (safetensors refuses those; a view of another entry is copied)."""
    out, spans = {}, []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"{path}: tensor name {name!r} is a {type(name).__name__}, not a str")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{path}: tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise ValueError(f"{path}: tensor {name!r} is {t.layout}, not dense: .to_dense() it first")
        t = t.detach().to("cpu").contiguous()
        if t.numel() == 0:
            t = torch.empty(t.shape, dtype=t.dtype)
        else:
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
            if any(start < e and s < end for s, e in spans):
                t = t.clone()
                start = t.data_ptr()
                end = start + t.numel() * t.element_size()
            spans.append((start, end))
        out[name] = t
    return out


def write_safetensors(path, tensors: dict, metadata: Optional[dict] = None) -> None:
    """Writes tensors as a safetensors file (what ``headkl topk`` and
    ``headkl loss`` read: the head as ``weight``, hidden rows as
    ``hidden``), with ``metadata`` (keys and values as strings) as its
    ``__metadata__``. Tensors on another device, non-contiguous ones and
    views of one another are copied to the CPU first."""
    st = _safetensors()
    flat = _owned(tensors, path)
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    try:
        st.torch.save_file(flat, os.fspath(path), metadata=meta)
    except ModuleNotFoundError as e:
        if e.name != "numpy":
            raise
        raise ImportError("safetensors' PyTorch writer imports numpy: pip install numpy") from e
    except KeyError as e:
        raise ValueError(f"{path}: dtype {e} is not one safetensors stores") from e
    except st.SafetensorError as e:
        raise OSError(f"{path}: cannot be written ({e})") from e
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: cannot be written as safetensors ({e})") from e
