"""The loss modules' keywords as the native module takes them (headkl's own
names: ``soft_weight`` for ``weight_soft_loss`` and so on), and back: the
options a module was made with, as its ``repr`` shows them."""

from __future__ import annotations

import inspect
from typing import Callable, Mapping, Sequence

_REDUCTIONS = ("mean", "sum", "batchmean", "none")
_TAILS = ("renormalize", "bucket", "none")
_FORMS = ("probs", "logprobs")
_DIVERGENCES = ("forward", "reverse", "jsd")
# Whether float32 hidden rows and heads may be computed as float16 (``_precision``); a Head's, not the engine's.
_F32_INPUTS = ("f16", "error")

# The modules' keywords (PyTorch's or Liger's names) whose native name differs.
_NATIVE_NAMES = {"weight_soft_loss": "soft_weight", "weight_hard_loss": "hard_weight", "lse_square_scale": "z_loss"}


def _loss_options(**o) -> dict:
    """The loss's keywords as the native module takes them (headkl's own
    names), the names of the enumerations checked here."""
    for name, allowed in (
        ("reduction", _REDUCTIONS),
        ("tail", _TAILS),
        ("teacher_form", _FORMS),
        ("divergence", _DIVERGENCES),
    ):
        if o.get(name, allowed[0]) not in allowed:
            raise ValueError(f"{name}={o[name]!r}: expected one of {', '.join(allowed)}")
    floats = ("temperature", "teacher_temperature", "beta", "soft_weight", "hard_weight", "label_smoothing",
              "z_loss", "softcap", "logit_scale", "gscale")  # fmt: skip
    out = {}
    for key, value in o.items():
        if key in floats and value is not None:
            value = float(value)
        elif key == "filter_eps" and value is not None and value != "auto":
            value = float(value)
        out[key] = value
    return out


def _options_repr(
    init: Callable, options: dict, fields: Mapping[str, object], keywords: Mapping[str, object], always: Sequence[str]
) -> str:
    """A loss module's ``extra_repr``: ``fields`` (its head's sizes) first,
    then its keywords in ``init``'s order under their own names, their
    values from ``keywords`` or else the native ``options``: those named in
    ``always``, and every other one whose value differs from its default."""
    parts = [f"{name}={value!r}" for name, value in fields.items()]
    for name, p in inspect.signature(init).parameters.items():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or name in fields:
            continue
        if name in keywords:
            value = keywords[name]
        elif _NATIVE_NAMES.get(name, name) in options:
            value = options[_NATIVE_NAMES.get(name, name)]
        else:
            continue
        if name in always or value != p.default:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)
