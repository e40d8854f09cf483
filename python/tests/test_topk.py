"""topk and gather against torch.topk and log_softmax in float64."""

import pytest
import torch

import headkl
import headkl.torch as ht
from test_loss import HS, V, problem


def logits(hidden, weight):
    return hidden.to(torch.float16).double() @ weight.to(torch.float16).double().T


@pytest.mark.parametrize("k", [1, 8, 33])
def test_topk_matches_torch_topk(backend, k):
    _, hidden, _, _, _, _ = problem(2)
    # Distinct logits (the small-integer head ties them): random values,
    # their f16 rounding taken by both sides.
    weight = torch.randn(V, HS, generator=torch.Generator().manual_seed(2)) / 8
    z = logits(hidden, weight) / 1.5
    want = torch.topk(z, k, dim=-1)
    head = ht.Head(weight, backend=backend)
    got = head.topk(hidden, k, temperature=1.5)
    assert got.ids.shape == hidden.shape[:-1] + (k,) and got.ids.dtype == torch.int64
    assert torch.equal(got.ids, want.indices)
    probs = torch.softmax(want.values, -1)
    assert (got.values.double() - probs).abs().max() < 1e-5
    lp = head.topk(hidden, k, temperature=1.5, form="logprobs")
    assert (lp.values.double() - torch.log_softmax(z, -1).gather(-1, want.indices)).abs().max() < 1e-4


def test_gather_matches_log_softmax(backend):
    weight, hidden, ids, _, _, _ = problem(4)
    ids[0, 0, 0] = -1  # none
    got = ht.gather(hidden, weight, ids, temperature=2.0, backend=backend)
    ls = torch.log_softmax(logits(hidden, weight) / 2.0, -1)
    want = ls.gather(-1, ids.clamp_min(0))
    assert got.logprobs[0, 0, 0] == -float("inf")
    mask = ids >= 0
    assert (got.logprobs[mask].double() - want[mask]).abs().max() < 1e-4
    assert (got.lse.double() - torch.logsumexp(logits(hidden, weight) / 2.0, -1)).abs().max() < 1e-4


def test_topk_then_loss_round_trip(backend):
    """The teacher's top-k from its own hidden rows, then the student's loss
    against it: the student equal to the teacher has the smallest loss."""
    weight, hidden, _, _, _, _ = problem(9)
    top = ht.topk(hidden, weight, 16, backend=backend)
    loss_fn = ht.HeadKLLoss(weight, backend=backend)
    same = loss_fn(hidden, top.ids, top.values).item()
    other = loss_fn(hidden * 0.5, top.ids, top.values).item()
    assert 0 <= same < other


def test_devices_lists_the_reference_and_what_auto_picks():
    rows = headkl.devices()
    assert any(r["backend"] == "reference" and "error" not in r for r in rows)
    assert sum(1 for r in rows if r.get("auto")) == 1


def test_check_runs_the_conformance_suite(backend):
    report = headkl.check(backend, cases=2)
    assert report["cases"] > 100, report["cases"]
    assert report["passed"] == report["cases"], report["failures"][:3]
