"""The vocabulary-parallel loss on 2 and 3 gloo processes against the
unsharded loss and gradient: each rank holds rows [v0, v1) of the head and
the phases meet through torch.distributed.all_reduce."""

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import headkl.torch as ht
from test_loss import HS, V, problem


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, backend, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        weight, hidden, ids, values, _, weights = problem(21)
        cuts = [round(V * i / world) for i in range(world + 1)]
        v0, v1 = cuts[rank], cuts[rank + 1]
        loss_fn = ht.HeadKLLoss(weight[v0:v1], shard=(v0, v1), vocab_size=V, temperature=1.5, backend=backend)
        x = hidden.clone().requires_grad_()
        loss = loss_fn(x, ids, values, weights=weights)
        loss.backward()
        torch.save({"loss": loss.detach(), "grad": x.grad}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_loss_matches_the_whole_head(backend, world):
    weight, hidden, ids, values, _, weights = problem(21)
    x = hidden.clone().requires_grad_()
    whole = ht.HeadKLLoss(weight, temperature=1.5, backend=backend)(x, ids, values, weights=weights)
    whole.backward()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, _free_port(), backend, out), nprocs=world, start_method="spawn")
        for rank in range(world):
            got = torch.load(os.path.join(out, f"rank{rank}.pt"))
            assert abs(got["loss"].item() - whole.item()) <= 1e-5 * abs(whole.item()), rank
            err = (got["grad"] - x.grad).abs().max().item()
            assert err <= 2e-3 * x.grad.abs().max().item(), (rank, err)
