"""The loss's weighting and reduction where Python does them: the
zero-copy path's per-token losses reduced as the engine reduces them, and
a host call's outputs on the caller's device."""

from __future__ import annotations

import torch

from .._host import _to_device


def _effective_weights(options: dict, labels, weights, ntok: int, device):
    """The per-token weights after ``ignore_mask``."""
    w = torch.ones(ntok, device=device) if weights is None else weights
    if options.get("ignore_mask") and labels is not None:
        w = w * ((labels >= 0) & (labels != options.get("ignore_index", -100)))
    return w


def _reduced(reduction: str, per_token, w, total):
    """The loss from the unweighted per-token losses, as the engine reduces it."""
    if reduction == "none":
        return per_token * w
    weighted = (per_token.double() * w.double()).sum()
    if reduction == "mean":
        return (weighted / (w.double().sum() if total is None else total)).float()
    if reduction == "batchmean":
        return (weighted / per_token.shape[0]).float()
    return weighted.float()


def _host_result(options: dict, mean, per_token, dx, labels, weights, device):
    """A host call's outputs on ``device``: the loss (the weighted
    per-token losses with reduction="none", else the engine's reduced
    ``mean``) and ``dx``."""
    if options["reduction"] == "none":
        loss = per_token * _effective_weights(options, labels, weights, per_token.shape[0], "cpu")
    else:
        loss = torch.tensor(mean, dtype=torch.float32)
    return _to_device(loss, device), _to_device(dx, device)
