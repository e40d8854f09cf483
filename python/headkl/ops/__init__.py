"""headkl's operations over tensors, under the modules and functions
(``headkl.nn``, ``headkl.functional``, ``Head``):

- ``head_kl_loss``: the top-k distillation loss with its gradient
  (``HeadKLLoss``'s forward);
- ``full_vocab_kl_loss``: the full-vocabulary divergence with its gradient
  (``FullVocabKLLoss``'s forward);
- ``head_topk``, ``head_gather``: the teacher's exact top-k and the gather
  on an uploaded ``Head`` (``Head.topk``, ``Head.gather``);
- ``autograd``: the autograd Function both losses return through.

Each takes a ``Head`` and the module's native options as they are made by
the modules; call those for checked keywords.
"""

from .full_vocab import full_vocab_kl_loss
from .loss import head_kl_loss
from .topk import Gathered, TopK, head_gather, head_topk

__all__ = ["Gathered", "TopK", "full_vocab_kl_loss", "head_gather", "head_kl_loss", "head_topk"]
