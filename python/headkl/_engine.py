"""Opening the native engine for a ``Head``: with Mesa's ``XDG_RUNTIME_DIR``
lines kept off stderr (``_stderr``), a refused head value named as the
caller's argument (``weight[17][3]``, not the engine's ``head[17][3]``),
and ``backend="auto"``'s pick said on the ``headkl`` logger (INFO) with
why, once per device picked."""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import torch

from . import _native
from ._hints import _head_error
from ._host import _on_host, _spec
from ._stderr import quiet_mesa

log = logging.getLogger("headkl")

_said_auto: set = set()


def _open_engine(weight: torch.Tensor, host: torch.Tensor, open_args: Tuple[Any, Any, Any]):
    """The native Engine of the head ``host`` (``weight`` as the caller
    gave it) on ``open_args`` ``(backend, device, shard)``."""
    try:
        engine = quiet_mesa(_native.Engine, _spec(host), host.shape[0], host.shape[1], *open_args)
    except ValueError as e:
        _head_error(e, "weight", weight)
        raise
    if open_args[0] == "auto":
        _say_auto(engine.info(), open_args[1])
    return engine


def _teacher_onto(engine, teacher: torch.Tensor) -> None:
    """Uploads the teacher's head ``teacher`` (FullVocabKLLoss's) to ``engine``."""
    host = _on_host("teacher_weight", teacher)
    try:
        engine.set_teacher_head(_spec(host), host.shape[0], host.shape[1])
    except ValueError as e:
        _head_error(e, "teacher_weight", teacher)
        raise


def _say_auto(info: dict, device: Optional[int]) -> None:
    """Says at INFO which device ``backend="auto"`` picked and why, once per
    device (a Head made per call says it the first time alone)."""
    key = (info.get("backend"), info.get("name"), device)
    if key in _said_auto or not log.isEnabledFor(logging.INFO):
        return
    _said_auto.add(key)
    # The runtime's own words, as `headkl devices` gives them.
    reason = info.get("auto_reason") or "auto's first usable device"
    log.info(
        "headkl: backend='auto' picked %s (%s): %s (`headkl devices` explains the policy)",
        info.get("backend"),
        info.get("name"),
        reason,
    )
