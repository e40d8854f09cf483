"""Safetensors files as ``headkl``'s commands read and write them (the
head as ``weight``, hidden rows as ``hidden``; ``headkl topk``'s ``ids``,
``probs`` and ``logprobs``), with no package beyond torch."""

from __future__ import annotations

import ctypes
import json
import struct
from typing import Optional

import torch

__all__ = ["read_safetensors", "write_safetensors"]

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
