"""The zero-copy path for CUDA tensors: the engine's input and output
buffers are Vulkan memory CUDA maps (through ``_cuda``, libcuda by ctypes),
and one timeline semaphore orders the two on the device (torch's current
stream signals it once the inputs are in, and waits on it before reading
the outputs), with no host wait inside a step. ``Head`` holds one
``_ZeroCopy`` per engine; where it cannot be made, CUDA tensors go through
host copies (``_host``)."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ._host import _NAMES


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
        # name -> (the engine's handle, the imported memory, its device pointer, capacity)
        self.buffers: Dict[str, Tuple[Any, Any, int, int]] = {}

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

    def loss(self, options: dict, flat, ids, values, labels, weights, w, total):
        """The loss's unweighted per-token losses and ``dx`` on the device
        (copies: the next step writes the shared buffers again), for the
        checked ``[ntok]`` rows; ``w`` is the per-token weights after
        ``ignore_mask``, which the engine takes in place of the mask."""
        ntok, hs = flat.shape
        k = ids.shape[1]
        o = options
        self.view("hidden", (ntok, hs), flat.dtype).copy_(flat)
        self.view("ids", (ntok, k), torch.int32).copy_(ids)
        self.view("values", (ntok, k), torch.float32).copy_(values)
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
            (ntok, k, _NAMES[flat.dtype]),
            (b["hidden"][0], b["ids"][0], b["values"][0], weights_handle, labels_handle, b["loss"][0], b["dx"][0]),
            options, (ready, done),
        ))  # fmt: skip
        # Copies on the device: the next step writes the shared buffers again.
        return loss_view.clone(), dx_view.clone()
