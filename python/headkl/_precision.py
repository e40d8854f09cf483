"""float32 inputs, and what they cost: headkl's GEMMs take float16 (the
matrix units' input), so float32 hidden rows and heads are computed as
float16 (bfloat16 ones are rounded to float16 too, which keeps their 8
bits). ``f32_inputs`` says whether that may happen:

- ``"f16"`` (the default): float32 is taken and computed as float16, said
  once at INFO on the ``headkl`` logger: about 3e-4 relative error on the
  gradients (f16 keeps 11 bits; 2e-4 to 5e-4 measured against float64),
  and a value past float16's range (±65504) refused, naming it;
- ``"error"``: a float32 hidden row or head is a ``TypeError`` that says
  so, for a caller who wants nothing rounded behind its back.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ._options import _F32_INPUTS

log = logging.getLogger("headkl")

F16_MAX = 65504.0
# What f16 costs, as the messages say it.
_COST = "about 3e-4 relative error on the gradients, and values past ±65504 refused"
_said_f32 = False


def _f32_inputs(value) -> str:
    """``f32_inputs`` checked: one of ``_F32_INPUTS``."""
    if not isinstance(value, str) or value not in _F32_INPUTS:
        raise ValueError(f"f32_inputs={value!r}: expected one of {', '.join(_F32_INPUTS)}")
    return value


def _f32_input(name: str, t: torch.Tensor, mode: str) -> None:
    """Refuses a float32 ``t`` where ``mode`` is ``"error"``, saying why and
    what to pass instead."""
    if t.dtype == torch.float32 and mode == "error":
        raise TypeError(
            f"{name}: float32, and f32_inputs='error' refuses it: headkl computes float32 hidden rows and heads "
            f"as float16 ({_COST}); pass {name}.half() or {name}.bfloat16(), or f32_inputs='f16' to have "
            "float32 computed as float16"
        )


def _say_f32(*tensors: Optional[torch.Tensor]) -> None:
    """Says once, on the ``headkl`` logger (INFO), that float32 inputs are
    computed as float16 and what that costs, where any of ``tensors`` is
    float32 (f32_inputs="f16")."""
    global _said_f32
    if _said_f32 or not any(t is not None and t.dtype == torch.float32 for t in tensors):
        return
    _said_f32 = True
    log.info(
        "headkl: float32 hidden rows and heads are computed as float16 (the GEMMs' input): %s; pass float16 or "
        "bfloat16 tensors to choose the rounding yourself, or f32_inputs='error' to refuse float32",
        _COST,
    )


# How to bring each argument into float16's range with the same loss.
_SCALE_HINTS = {
    "hidden": "pass hidden / 2**s with logit_scale=2**s (the same logits)",
    "weight": "make the loss with weight / 2**s and logit_scale=2**s (the same logits)",
    "teacher_hidden": "move a factor 2**s from teacher_hidden into teacher_weight (the same teacher logits)",
    "teacher_weight": "move a factor 2**s from teacher_weight into teacher_hidden (the same teacher logits)",
}


def _range_hint(name: str, dtype: torch.dtype) -> str:
    """Why a value of ``name`` past ±65504 is refused, and how to scale."""
    kind = str(dtype).replace("torch.", "")
    how = "f32_inputs='f16'" if dtype == torch.float32 else "as bfloat16 is"
    return (
        f"{name} is {kind}, which headkl computes as float16 ({how}), whose range ends at ±65504; "
        f"scale it into range: {_SCALE_HINTS.get(name, 'divide it by a power of two')}"
    )


def _past_f16(row: torch.Tensor) -> bool:
    """Whether ``row`` holds a finite value past float16's range."""
    row = row.detach()
    return bool((torch.isfinite(row) & (row.abs() > F16_MAX)).any())
