"""The vocabulary-parallel loss's collectives (``HeadKLLoss(weight[v0:v1],
shard=(v0, v1), vocab_size=V, process_group=...)``).

Each rank holds the head's rows ``[v0, v1)``. Phase one gives each shard's
statistics per token (two log-sum-exps and the teacher's term), merged
across ``process_group`` by ``torch.distributed.all_reduce``
(``merge_partials``); phase two gives each shard's part of ``dx``, summed
the same way. The collectives run on the caller's device: NCCL takes CUDA
tensors only, gloo takes both.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ._host import _on_host, _spec, _to_device

__all__ = ["merge_partials", "sharded_loss"]


def merge_partials(stats: List[torch.Tensor], group) -> List[torch.Tensor]:
    """The shards' phase-one statistics merged by all-reduce: the
    log-sum-exps by MAX then SUM of ``exp(lse − max)``, the teacher terms by
    SUM (in float64)."""
    lse, lse1, soft = stats
    merged = []
    for part in (lse, lse1):
        top = part.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        mass = torch.exp(part.double() - top.double())
        dist.all_reduce(mass, op=dist.ReduceOp.SUM, group=group)
        merged.append((top.double() + mass.log()).to(torch.float32))
    soft = soft.double()
    dist.all_reduce(soft, op=dist.ReduceOp.SUM, group=group)
    merged.append(soft.to(torch.float32))
    return merged


def sharded_loss(engine, host: torch.Tensor, teacher, weights, options: dict, outputs, device, group):
    """The sharded loss on host memory: this rank's phase one on ``engine``
    (``host`` the ``[ntok][hs]`` rows, ``teacher`` and ``weights`` as the
    native module takes them), the statistics merged across ``group`` on
    ``device``, phase two into ``outputs`` (``dx``, ``per_token``), and
    ``dx`` summed across ``group``. Returns the reduced loss and ``dx`` on
    ``device``."""
    ntok = host.shape[0]
    dx, per_token = outputs
    stats = [torch.empty(ntok, dtype=torch.float32) for _ in range(3)]
    engine.loss_partials(_spec(host), ntok, teacher, weights, *(_spec(s) for s in stats), options)
    merged = merge_partials([_to_device(t, device) for t in stats], group)
    merged = [_on_host("partials", t) for t in merged]
    mean = engine.loss_finish(_spec(host), ntok, *(_spec(s) for s in merged), (_spec(dx), _spec(per_token)))
    dx = _to_device(dx, device)
    dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=group)
    return mean, dx
