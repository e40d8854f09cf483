"""headkl's loss modules, thin ``nn.Module``s over ``headkl.ops``: each
checks its keywords and uploads its head once (a ``Head``) when it is made,
and its ``forward`` is one call; ``repr`` shows the options it was made
with.

- ``HeadKLLoss``: the distillation loss of hidden rows against a teacher's
  top-k, through the head (frozen, or trainable: tied or not);
- ``FullVocabKLLoss``: the exact full-vocabulary divergence from a teacher
  given by its own hidden rows and head.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from . import _native
from ._checks import _FLOATS, _frozen, _tensor, _unsharded
from ._options import _module_options, _options_repr
from .head import Head
from .ops import full_vocab_kl_loss, head_kl_loss

__all__ = ["FullVocabKLLoss", "HeadKLLoss"]


class _HeadLoss(nn.Module):
    """What HeadKLLoss and FullVocabKLLoss share: ``self.head``, the loss's
    ``options`` and its ``reduction``."""

    head: Head
    options: dict
    reduction: str
    # The keywords extra_repr shows at any value (the rest where not the default).
    _SHOWN: Tuple[str, ...] = ()

    @property
    def info(self) -> dict:
        """The device the loss runs on."""
        return self.head.info

    def _fields(self) -> dict:
        return {"vocab_size": self.head.vocab_size, "hidden_size": self.head.hidden_size}

    def extra_repr(self) -> str:
        """The head's sizes and the options the loss was made with: the
        main ones always, the rest where not the default."""
        if getattr(self, "head", None) is None:  # not made (yet)
            return ""
        backend, device, _ = self.head._open
        head = self.head
        keywords = {"backend": backend, "device": device, "shard": head.shard, "f32_inputs": head.f32_inputs}
        return _options_repr(type(self).__init__, self.options, self._fields(), keywords, self._SHOWN)


class HeadKLLoss(_HeadLoss):
    """The distillation loss of hidden rows against a teacher's top-k,
    through the head ``weight`` ``[V][hs]`` (uploaded once, and again
    whenever it changes).

    ``forward(hidden, teacher_ids, teacher_values, *, labels=None,
    weights=None, total=None)``: ``hidden`` ``[..., hs]``, the teacher's
    ``[..., k]`` ids (int64) and values (probabilities, or
    log-probabilities with ``teacher_form="logprobs"``), ``labels``
    ``[...]`` for the hard term and ``ignore_mask``, per-token ``weights``
    ``[...]`` (0 masks a token) and the ``total`` the mean divides by
    (default ``Σ weights``; a bool or integer mask is taken as 0/1).
    Returns the loss: a scalar, or ``[...]`` with ``reduction="none"`` (the
    weighted per-token losses); its backward gives ``hidden.grad``.

    **Frozen or trainable head.** Pass ``lm_head.weight.detach()`` (or a
    parameter with ``requires_grad=False``) for a frozen head: the loss
    costs what it always did and the head gets no gradient. Pass the
    parameter itself (``lm_head.weight``, or a tied ``embed.weight``) for a
    trainable one: while it requires grad and grad is on, each call also
    computes ``∂loss/∂W`` (on host memory, f32, the same f16 GEMM inputs as
    ``dx``) and backward returns it scaled by the incoming gradient, in the
    weight's dtype on its device, so autograd adds it to ``weight.grad``
    (a tied embedding gets both its uses' shares). Under
    ``torch.no_grad()`` a trainable head costs nothing more. CUDA tensors
    with a head that requires grad go through host copies, not zero-copy
    (the device-resident loss does not compute the head's gradient; said
    once on the ``headkl`` logger). With ``reduction="none"`` and an
    upstream gradient that differs between tokens, the head's gradient
    takes a second call in backward. The sharded loss refuses a head that
    requires grad.

    The head is never stale: a head changed after the loss was made (in
    place, as an optimizer step or an EMA update does, also through the
    parameter it was detached from) is uploaded again at the next call,
    said on the ``headkl`` logger (INFO). A trainable head is so uploaded
    again after every optimizer step (correct, if slow for a large head:
    the upload is the step's extra cost beside the gradient's download).

    **torch.compile.** With torch >= 2.4 each call is one ``torch.library``
    custom op (``headkl::head_kl_loss``, with its fake and autograd), so
    ``torch.compile(model, fullgraph=True)`` traces a model that uses the
    loss with no graph break (``headkl.torch.CUSTOM_OPS`` says whether it
    does; the sharded loss runs through a ``torch.autograd.Function``, as
    every loss does on an older torch).

    **Copies.** ``copy.deepcopy``, ``pickle`` and ``torch.save`` of a model
    that holds the loss keep its head (a parameter as itself: a tied head
    stays tied to the copied parameter) and options, not the native engine:
    the copy opens its own on the same backend name at its first call
    (``Head`` says more).

    Keywords (the ``headkl loss`` options, under PyTorch's or Liger's name):

    - ``temperature`` τ (default 1): ``s = z/τ``; a ``τ²`` factor is the caller's.
    - ``reduction``: ``"mean"`` (``Σ w L / Σ w``), ``"sum"``, ``"batchmean"``
      (``/ ntok``, ``F.kl_div``'s) or ``"none"``.
    - ``tail``: ``"renormalize"`` (the teacher's k renormalized), ``"bucket"``
      (the mass outside the k as one bin, matched by the student's own) or
      ``"none"`` (the k as given).
    - ``teacher_form``: ``"probs"`` or ``"logprobs"``; ``teacher_temperature``:
      the temperature the teacher's values were made at (rescaled to τ).
    - ``divergence``: ``"forward"`` (KL(p_T‖p_S)), ``"reverse"`` or ``"jsd"``
      with ``beta`` (TRL's generalized JSD; 0 forward, 1 reverse).
    - ``weight_soft_loss`` (α_soft, 1), ``weight_hard_loss`` (α_hard, 0: the
      cross-entropy against ``labels``), ``label_smoothing``,
      ``lse_square_scale`` (the z-loss λ), ``softcap``, ``logit_scale``.
    - ``ignore_index`` (−100; any negative label is none too) and
      ``ignore_mask`` (drop tokens without a label from every term).
    - ``filter_eps``: skip the gradient GEMM's blocks whose ``|∂L/∂s|`` are
      all ≤ ε (``"auto"``: 2⁻¹⁵, Cut Cross-Entropy's; the loss stays exact);
      ``gscale``: the f16 gradient's scale (default from the weights);
      ``budget_bytes``: device scratch.
    - ``backend``, ``device``: as ``Head``'s.
    - ``f32_inputs``: float32 ``hidden`` and ``weight`` are computed as
      float16 (the GEMMs' input). ``"f16"`` (the default) takes them so,
      said once at INFO on the ``headkl`` logger: about 3e-4 relative error
      on the gradients, and a value past ±65504 refused (a ``ValueError``
      naming it and how to scale: ``hidden / 2**s`` with
      ``logit_scale=2**s`` gives the same loss). ``"error"`` refuses float32
      with a ``TypeError``: pass float16 or bfloat16 tensors.
    - ``shard=(v0, v1)``, ``vocab_size``, ``process_group``: vocabulary
      parallel. ``weight`` is the rows ``[v0, v1)``; every rank of
      ``process_group`` (default: the world) calls forward with the same
      rows and teacher, and the two phases meet through
      ``torch.distributed.all_reduce``. The sharded loss takes the forward
      KL with the default tail and no hard term, z-loss, softcap or filter.
    """

    _SHOWN = ("temperature", "reduction", "tail", "divergence", "backend")

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        temperature: float = 1.0,
        reduction: str = "mean",
        tail: str = "renormalize",
        teacher_form: str = "probs",
        teacher_temperature: Optional[float] = None,
        divergence: str = "forward",
        beta: float = 0.5,
        weight_soft_loss: float = 1.0,
        weight_hard_loss: float = 0.0,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        ignore_index: int = -100,
        ignore_mask: bool = False,
        filter_eps=None,
        gscale: Optional[float] = None,
        budget_bytes: Optional[int] = None,
        backend: str = "auto",
        device: Optional[int] = None,
        shard: Optional[Tuple[int, int]] = None,
        vocab_size: Optional[int] = None,
        process_group=None,
        f32_inputs: str = "f16",
    ):
        super().__init__()
        # The options are this signature's keywords, all but the head's (_module_options).
        self.options = _module_options(HeadKLLoss.__init__, locals())
        # Every value is checked here, before the head goes to a device.
        _native.check_loss_options(self.options, shard is not None)
        weight = _tensor("weight", weight, _FLOATS, ndim=2)
        _unsharded(weight, shard)  # before the head goes to a device
        self.reduction = reduction
        self.head = Head(
            weight, backend=backend, device=device, shard=shard, vocab_size=vocab_size, f32_inputs=f32_inputs
        )
        self.process_group = process_group

    @property
    def zero_copy(self) -> bool:
        """Whether the last CUDA call went zero-copy."""
        return self.head._loss_zero_copy

    def synchronize(self) -> None:
        """Waits for the device and raises what the last zero-copy call
        flagged there (an id ≥ V, a non-finite row: ``ValueError``). The
        zero-copy path checks each call's flags when the next call starts,
        so a bad step raises one call late unless this is called."""
        self.head.synchronize()

    def forward(
        self,
        hidden: torch.Tensor,
        teacher_ids: torch.Tensor,
        teacher_values: torch.Tensor,
        *,
        labels: Optional[torch.Tensor] = None,
        weights: Optional[torch.Tensor] = None,
        total: Optional[float] = None,
    ) -> torch.Tensor:
        """The loss of ``hidden`` ``[..., hs]`` against the teacher's top-k:
        ``teacher_ids`` ``[..., k]`` (int64 or int32) and ``teacher_values``
        (probabilities, or log-probabilities with ``teacher_form="logprobs"``).

        ``labels`` ``[...]``: the hard term's targets (needed with
        ``weight_hard_loss``) and what ``ignore_mask`` drops; ``weights``
        ``[...]``: per-token weights (0 masks a token; a bool or integer
        mask is taken as 0/1); ``total``: what the mean divides by (default
        ``Σ weights``). Returns a scalar, or ``[...]`` with
        ``reduction="none"`` (the weighted per-token losses); its backward
        gives ``hidden.grad`` and, where the head requires grad, the head's
        (once: a second derivative raises).
        """
        return head_kl_loss(
            self.head, self.options, hidden, teacher_ids, teacher_values,
            labels=labels, weights=weights, total=total, process_group=self.process_group,
        )  # fmt: skip


class FullVocabKLLoss(_HeadLoss):
    """The exact full-vocabulary divergence of the student from a teacher
    given by its own hidden rows and head, as Liger's
    ``LigerFusedLinearJSD`` computes it: ``p_T = softmax(x_T·W_Tᵀ/τ)`` over
    the whole vocabulary, never stored whole (a chunk of rows at a time).

    ``FullVocabKLLoss(weight, teacher_weight, *, divergence="jsd",
    beta=0.5, ...)`` uploads both heads once (they share V, not hs);
    ``forward(hidden, teacher_hidden, *, labels=None, weights=None,
    total=None)`` returns the loss, whose backward gives ``hidden.grad``.
    Keywords as ``HeadKLLoss``'s that apply: ``temperature``, ``reduction``,
    ``divergence``, ``beta``, ``weight_soft_loss``, ``logit_scale`` (the
    student's), ``ignore_index``, ``ignore_mask``, ``gscale``,
    ``budget_bytes``, ``backend``, ``device``, ``f32_inputs`` (which covers
    the teacher's ``teacher_hidden`` and ``teacher_weight`` too). It runs on
    host memory (CUDA tensors through host copies). The student's head
    ``weight`` may be frozen or trainable (tied or not), as
    ``HeadKLLoss``'s: where it requires grad, backward gives its gradient
    too. The teacher gets no gradient: a ``teacher_weight`` that requires
    grad is refused when the loss is made, and a ``teacher_hidden`` that
    requires grad (with grad on) at the call, rather than its gradient
    dropped in silence (pass ``.detach()``, or run the teacher under
    ``torch.no_grad()``). Either head changed after the loss was made is
    uploaded again at the next call, as ``HeadKLLoss``'s is.
    """

    _SHOWN = ("temperature", "reduction", "divergence", "beta", "backend")

    def __init__(
        self,
        weight: torch.Tensor,
        teacher_weight: torch.Tensor,
        *,
        temperature: float = 1.0,
        reduction: str = "mean",
        divergence: str = "jsd",
        beta: float = 0.5,
        weight_soft_loss: float = 1.0,
        logit_scale: float = 1.0,
        ignore_index: int = -100,
        ignore_mask: bool = False,
        gscale: Optional[float] = None,
        budget_bytes: Optional[int] = None,
        backend: str = "auto",
        device: Optional[int] = None,
        f32_inputs: str = "f16",
    ):
        super().__init__()
        # The options are this signature's keywords, all but the head's (_module_options).
        self.options = _module_options(FullVocabKLLoss.__init__, locals())
        _native.check_loss_options(self.options, False)
        weight = _tensor("weight", weight, _FLOATS, ndim=2)
        teacher_weight = _frozen("teacher_weight", _tensor("teacher_weight", teacher_weight, _FLOATS, ndim=2))
        if teacher_weight.shape[0] != weight.shape[0]:
            raise ValueError(
                f"teacher_weight: {teacher_weight.shape[0]} rows, but weight has {weight.shape[0]} (the heads share V)"
            )
        self.reduction = reduction
        self.head = Head(weight, backend=backend, device=device, f32_inputs=f32_inputs)
        self.teacher_hidden_size = teacher_weight.shape[1]
        self.head._set_teacher(teacher_weight)

    def _fields(self) -> dict:
        return dict(super()._fields(), teacher_hidden_size=self.teacher_hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        teacher_hidden: torch.Tensor,
        *,
        labels: Optional[torch.Tensor] = None,
        weights: Optional[torch.Tensor] = None,
        total: Optional[float] = None,
    ) -> torch.Tensor:
        """The divergence of the student's ``hidden`` ``[..., hs]`` from the
        teacher's ``teacher_hidden`` ``[..., teacher_hidden_size]`` (the
        same tokens), each through its own head over the whole vocabulary.

        ``labels`` ``[...]``: what ``ignore_mask`` drops; ``weights``
        ``[...]``: per-token weights (0 masks a token; a bool or integer
        mask is taken as 0/1); ``total``: what the mean divides by (default
        ``Σ weights``). Returns a scalar, or ``[...]`` with
        ``reduction="none"``; its backward gives ``hidden.grad`` and, where
        the student's head requires grad, its gradient. ``teacher_hidden``
        must not require grad (with grad on): the teacher gets none.
        """
        return full_vocab_kl_loss(
            self.head, self.options, hidden, teacher_hidden, labels=labels, weights=weights, total=total
        )
