"""The engine's input errors in the caller's words: its messages name the
engine's fields (``head[17][3]``, ``hidden[9]``), and a refusal is best
read with what to do about it. Each function here takes a ``ValueError``
the engine raised and changes its message in place (the exception keeps
its type and traceback), on the error path alone: a call that succeeds
pays nothing."""

from __future__ import annotations

import contextlib
import re
from typing import Optional

import torch

from ._precision import _past_f16, _range_hint

_HEAD = re.compile(r"^head(\[\d+\]\[\d+\]) = (.*)$", re.S)
_ROW = re.compile(r"^hidden\[(\d+)\]: the row's logits are not finite")


def _said(e: BaseException, message: str) -> None:
    e.args = (message,) + tuple(e.args[1:])


def _head_error(e: ValueError, name: str, t: torch.Tensor) -> None:
    """A head value the engine refused (``head[r][c] = v ...``), named as
    the caller's argument ``name`` (``weight``, ``teacher_weight``), with
    how to scale where it is past float16's range."""
    if not e.args or not isinstance(e.args[0], str):
        return
    m = _HEAD.match(e.args[0])
    if m is None:
        return
    message = f"{name}{m.group(1)} = {m.group(2)}"
    if "outside f16's range" in message:
        message += f": {_range_hint(name, t.dtype)}"
    _said(e, message)


@contextlib.contextmanager
def explaining(
    options: Optional[dict] = None,
    hidden: Optional[torch.Tensor] = None,
    teacher_values: Optional[torch.Tensor] = None,
    teacher_hidden: Optional[torch.Tensor] = None,
):
    """Runs an engine call, adding to a ``ValueError`` it raises what to do:
    teacher values refused as probabilities or log-probabilities that read
    as the other form (``teacher_form``), and a row that is not finite
    because of a value past float16's range (``hidden``, or
    ``teacher_hidden`` ``[ntok][hs_T]`` where the teacher's row is the bad
    one)."""
    try:
        yield
    except ValueError as e:
        if e.args and isinstance(e.args[0], str):
            hint = _hint(e.args[0], options or {}, hidden, teacher_values, teacher_hidden)
            if hint is not None:
                _said(e, hint)
        raise


def _hint(message: str, options: dict, hidden, teacher_values, teacher_hidden) -> Optional[str]:
    """``message`` with a hint added (or renamed), or None where there is none to give."""
    form = options.get("teacher_form", "probs")
    if teacher_values is not None and message.startswith("teacher_values["):
        if form == "probs" and message.endswith("is negative"):
            looks = bool((teacher_values <= 0).all())
            return message + (
                ": teacher_values look like log-probabilities (none is positive); pass teacher_form='logprobs'"
                if looks
                else "; if teacher_values are log-probabilities, pass teacher_form='logprobs'"
            )
        if form == "logprobs" and "a log-probability must be ≤ 0" in message and bool((teacher_values >= 0).all()):
            return message + "; teacher_values look like probabilities: pass teacher_form='probs' (the default)"
    m = _ROW.match(message)
    if m is not None and hidden is not None:
        row = int(m.group(1))
        if row < hidden.shape[0]:
            return _row_hint(message, row, hidden, teacher_hidden)
    return None


def _row_hint(message: str, row: int, hidden: torch.Tensor, teacher_hidden) -> Optional[str]:
    """A row whose logits are not finite: the teacher's where its row is the
    bad one and the student's is not; why, where a value is past float16's
    range."""
    name, t = "hidden", hidden
    if teacher_hidden is not None and not _bad(hidden[row]) and _bad(teacher_hidden[row]):
        name, t = "teacher_hidden", teacher_hidden
        message = "teacher_" + message
    if _past_f16(t[row]):
        message += f": {_range_hint(name, t.dtype)}"
    return message


def _bad(row: torch.Tensor) -> bool:
    """Whether ``row`` holds a value the engine refuses: not finite, or past float16's range."""
    return not bool(torch.isfinite(row.detach()).all()) or _past_f16(row)
