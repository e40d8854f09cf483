"""headkl's operations as ``torch.library`` custom ops, where the running
torch has ``torch.library.custom_op`` (torch >= 2.4): ``torch.compile``
(also ``fullgraph=True``) then traces a model that uses ``HeadKLLoss``,
``FullVocabKLLoss``, ``Head.topk`` or ``Head.gather`` with no graph break,
each call one opaque operator in the graph, as flash-attn's kernels are.

- ``headkl::head_kl_loss`` and ``headkl::full_vocab_kl_loss``: the loss,
  ``dx`` ``[ntok][hs]`` and the head's gradient ``[V][hs]`` (f32; empty
  where not asked) in one call; their autograd (``register_autograd``)
  scales the kept gradients by the incoming one, once;
- ``headkl::head_kl_head_grad`` and ``headkl::full_vocab_kl_head_grad``:
  the head's gradient for an uneven per-token upstream gradient
  (``reduction="none"``), the backward's one more call;
- ``headkl::topk`` and ``headkl::gather``: no gradient.

An operator takes tensors and primitives only: the head is its integer
handle (``headkl._registry``), the loss's options one argument each
(``given``: a bit per option in ``_OPTIONS`` that the options hold). Each
op takes the head's tensor too, so a compiled graph orders it after any
change to the head; the op re-reads the head where it changed (the
engine's state, no tensor of torch's), so it is a function of its inputs
and mutates none. Each is tagged ``cudagraph_unsafe`` where torch has the
tag: it waits for the host. A sharded head, or options an op cannot carry,
go through the ``torch.autograd.Function`` as on an older torch.

``CUSTOM_OPS`` says whether the ops are on; ``CUSTOM_OPS_REASON`` why not
(said once at DEBUG on the ``headkl`` logger at the first call that falls
back). ``HEADKL_CUSTOM_OPS=0`` in the environment turns them off.
"""

import logging
import os
from typing import Optional

import torch

log = logging.getLogger("headkl")

# The loss's native options as the ops take them, in schema order.
_OPTIONS = (
    ("temperature", "float"), ("reduction", "str"), ("tail", "str"), ("teacher_form", "str"),
    ("teacher_temperature", "float?"), ("divergence", "str"), ("beta", "float"), ("soft_weight", "float"),
    ("hard_weight", "float"), ("label_smoothing", "float"), ("z_loss", "float"), ("softcap", "float?"),
    ("logit_scale", "float"), ("ignore_index", "int"), ("ignore_mask", "bool"), ("filter_eps", "float?"),
    ("gscale", "float?"), ("budget_bytes", "int?"),
)  # fmt: skip
_TYPES = dict(_OPTIONS)
# filter_eps="auto" is filter_eps=None with filter_auto; an absent option takes its type's placeholder.
_OPTIONS_SCHEMA = "int given, " + ", ".join(f"{t} {n}" for n, t in _OPTIONS) + ", bool filter_auto"
_PLACEHOLDER = {"float": 0.0, "int": 0, "bool": False, "str": ""}
_ROWS = "Tensor hidden, Tensor {}, Tensor {}, Tensor? labels, Tensor? weights, Tensor weight, int head"
_TEACHERS = {"head_kl": ("teacher_ids", "teacher_values"), "full_vocab_kl": ("teacher_hidden", "teacher_weight")}
_REDUCTION = [n for n, _ in _OPTIONS].index("reduction")


def _carried(name: str, value, kind: str):
    """``value`` as an op's argument of schema type ``kind``; ``TypeError``
    where it is none (then the plain path, whose engine names it)."""
    if value is None and kind.endswith("?"):
        return None
    kind = kind.rstrip("?")
    if kind in ("float", "int") and isinstance(value, (int, float)) and not isinstance(value, bool):
        if kind == "float":
            return float(value)
        if isinstance(value, int):
            return int(value)
    elif kind == "bool" and isinstance(value, bool) or kind == "str" and isinstance(value, str):
        return value
    raise TypeError(name)


def _option_args(options: dict) -> list:
    """The loss's ``options`` as the ops' trailing arguments; ``TypeError``
    for an option they cannot carry."""
    given, args = 0, []
    for i, (name, kind) in enumerate(_OPTIONS):
        if name in options:
            given |= 1 << i
            value = options[name]
            auto = name == "filter_eps" and isinstance(value, str) and value == "auto"
            args.append(None if auto else _carried(name, value, kind))
        else:
            args.append(_PLACEHOLDER.get(kind))
    for name in options:
        if name not in _TYPES:
            raise TypeError(name)
    auto = options.get("filter_eps")
    return [given, *args, isinstance(auto, str) and auto == "auto"]


def _options_of(given: int, *args) -> dict:
    """The options dict back from the ops' trailing arguments."""
    *values, filter_auto = args
    options = {name: values[i] for i, (name, _) in enumerate(_OPTIONS) if given >> i & 1}
    if filter_auto:
        options["filter_eps"] = "auto"
    return options


def _why_not() -> Optional[str]:
    if os.environ.get("HEADKL_CUSTOM_OPS", "").strip() == "0":
        return "HEADKL_CUSTOM_OPS=0 is set"
    if not hasattr(torch.library, "custom_op"):
        return f"torch {torch.__version__} has no torch.library.custom_op (torch >= 2.4 has it)"
    return None


CUSTOM_OPS_REASON: Optional[str] = _why_not()
_said_why_not = False


def _custom_op_for(head, options: Optional[dict] = None) -> bool:
    """Whether a call on ``head`` with ``options`` goes through a custom op:
    where they are on, for an unsharded head and options the op carries
    (else the Function; the first call that falls back for want of the ops
    says why, once, at DEBUG)."""
    global _said_why_not
    if CUSTOM_OPS_REASON is not None:
        if not _said_why_not:
            log.debug("headkl: no torch.library custom ops (%s): torch.autograd.Function instead", CUSTOM_OPS_REASON)
            _said_why_not = True
        return False
    if head.shard is not None:
        return False
    try:
        if options is not None:
            _option_args(options)
    except TypeError:
        return False
    return True


def head_kl_op(head, options: dict, flat, ids, values, labels, weights, weight, total):
    """``headkl::head_kl_loss`` on the checked ``[ntok]``-first rows: the
    loss (a scalar, or ``[ntok]``); ``weight`` the head's tensor where its
    gradient is asked, else None."""
    return _loss_op("head_kl", head, options, flat, ids, values, labels, weights, weight, total)


def full_vocab_kl_op(head, options: dict, flat, teacher, labels, weights, weight, total):
    """``headkl::full_vocab_kl_loss`` on the checked ``[ntok]``-first rows
    and the teacher's ``[ntok][hs_T]``: the loss (a scalar, or ``[ntok]``)."""
    return _loss_op("full_vocab_kl", head, options, flat, teacher, head._teacher, labels, weights, weight, total)


def _loss_op(kind, head, options, flat, a, b, labels, weights, weight, total):
    head_grad = weight is not None
    weight = head._weight if head_grad else head._weight.detach()
    detach = lambda t: None if t is None else t.detach()  # noqa: E731 - no gradient flows to these
    op = torch.ops.headkl.head_kl_loss if kind == "head_kl" else torch.ops.headkl.full_vocab_kl_loss
    args = (flat, a.detach(), b.detach(), detach(labels), detach(weights), weight, head._handle, total, head_grad)
    return op(*args, *_option_args(options))[0]


def topk_op(head, flat, k: int, options: dict, logprobs: bool):
    """``headkl::topk``: ids and values ``[ntok][k]`` (no gradient)."""
    args = [_carried(n, options[n], _TYPES[n]) for n in ("temperature", "softcap", "logit_scale")]
    return torch.ops.headkl.topk(flat.detach(), head._weight.detach(), head._handle, k, *args, logprobs)


def gather_op(head, flat, ids, options: dict):
    """``headkl::gather``: log-probabilities ``[ntok][k]`` and log-sum-exps
    ``[ntok]`` (no gradient)."""
    args = [_carried(n, options[n], _TYPES[n]) for n in ("temperature", "softcap", "logit_scale")]
    return torch.ops.headkl.gather(flat.detach(), ids, head._weight.detach(), head._handle, *args)


if CUSTOM_OPS_REASON is None:
    try:
        from . import _custom_ops  # noqa: F401 - registers the ops
    except Exception as e:  # noqa: BLE001 - any failure falls back, with why
        CUSTOM_OPS_REASON = f"registering headkl's custom ops failed: {type(e).__name__}: {e}"
CUSTOM_OPS: bool = CUSTOM_OPS_REASON is None
