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
# Head's keywords (where the head runs, how it takes float32), which the
# functional API passes on to the Head it makes.
_HEAD_KEYWORDS = ("backend", "device", "f32_inputs")
# The loss modules' keywords that go to their Head or to the sharded loss's
# collectives, not into the loss's options.
_HEAD_AND_GROUP_KEYWORDS = _HEAD_KEYWORDS + ("shard", "vocab_size", "process_group")


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


def _module_options(init: Callable, arguments: Mapping[str, object]) -> dict:
    """A loss module's options from the ``arguments`` its ``init`` was
    called with (its ``locals()``): every keyword-only parameter but the
    head's, under its native name, checked as ``_loss_options`` checks
    them. The signature is the one list of a module's options, as it is
    for ``_options_repr``."""
    return _loss_options(
        **{
            _NATIVE_NAMES.get(name, name): arguments[name]
            for name, p in inspect.signature(init).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _HEAD_AND_GROUP_KEYWORDS
        }
    )


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
