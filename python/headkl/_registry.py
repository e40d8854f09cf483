"""Every ``Head`` by an integer handle: what headkl's ``torch.library``
custom ops take in place of the head (an operator's arguments are tensors
and primitives only). The registry holds no head alive: a head that is
gone is an error at the call that names it."""

from __future__ import annotations

import itertools
import weakref

_HEADS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def _register(head) -> int:
    """A new handle for ``head`` (each ``Head`` takes one when it is made)."""
    handle = next(_NEXT)
    _HEADS[handle] = head
    return handle


def _head_of(handle: int):
    """The ``Head`` of ``handle``; ``RuntimeError`` where it was freed."""
    head = _HEADS.get(handle)
    if head is None:
        raise RuntimeError(f"headkl: no Head has handle {handle} (it was freed: keep the loss module or Head alive)")
    return head
