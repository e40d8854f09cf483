"""headkl's operations over tensors, under the modules and functions
(``headkl.nn``, ``headkl.functional``, ``Head``):

- ``head_kl_loss``: the top-k distillation loss with its gradient
  (``HeadKLLoss``'s forward);
- ``full_vocab_kl_loss``: the full-vocabulary divergence with its gradient
  (``FullVocabKLLoss``'s forward);
- ``head_topk``, ``head_gather``: the teacher's exact top-k and the gather
  on an uploaded ``Head`` (``Head.topk``, ``Head.gather``);
- ``autograd``: the autograd Function both losses return through where
  the custom ops are off;
- ``custom``: the same operations as ``torch.library`` custom ops
  (``headkl::head_kl_loss`` and the rest, torch >= 2.4), which
  ``torch.compile`` traces with no graph break; ``CUSTOM_OPS`` says whether
  they are on, ``CUSTOM_OPS_REASON`` why not.

Each takes a ``Head`` and the module's native options as they are made by
the modules; call those for checked keywords.
"""

from .custom import CUSTOM_OPS, CUSTOM_OPS_REASON
from .full_vocab import full_vocab_kl_loss
from .loss import head_kl_loss
from .topk import Gathered, TopK, head_gather, head_topk

__all__ = [
    "CUSTOM_OPS",
    "CUSTOM_OPS_REASON",
    "Gathered",
    "TopK",
    "full_vocab_kl_loss",
    "head_gather",
    "head_kl_loss",
    "head_topk",
]
