"""The head is never silently wrong: a trainable head is read again after
each optimizer step, and a head changed after it
was uploaded (in place, through the parameter it was detached from, or its
storage replaced) is uploaded again at the next call, said once per re-read
on the ``headkl`` logger. Also the first-hour mends: ``k`` past the top-k's
limit, a second derivative, and a mask as ``weights``."""

import logging

import pytest
import torch

import headkl.torch as ht
from test_loss import HS, V, close, problem


def rereads(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "headkl" and "re-read" in r.getMessage()]


def full_vocab_problem(seed=13, teacher_hs=24):
    weight, hidden, _, _, _, weights = problem(seed)
    g = torch.Generator().manual_seed(seed + 1)
    teacher_weight = torch.randint(-8, 9, (V, teacher_hs), generator=g).float() / 32
    teacher_hidden = torch.randint(-8, 9, hidden.shape[:-1] + (teacher_hs,), generator=g).float() / 16
    return weight, teacher_weight, hidden, teacher_hidden, weights


def loss_and_grad(loss_fn, hidden, *args, **kw):
    x = hidden.clone().requires_grad_()
    loss = loss_fn(x, *args, **kw)
    loss.backward()
    return loss.detach(), x.grad


# --- A head that requires grad -----------------------------------------------
# (its gradient: test_head_grad.py)


def test_a_trainable_parameter_is_taken_and_read_again_after_each_step():
    """``HeadKLLoss(lm_head.weight)``: the parameter itself, trained by its
    optimizer through the loss's own gradient; each step's call runs on the
    head as the last step left it."""
    weight, hidden, ids, values, _, _ = problem(1)
    lm_head = torch.nn.Linear(HS, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
    loss_fn = ht.HeadKLLoss(lm_head.weight, backend="reference")
    opt = torch.optim.SGD(lm_head.parameters(), lr=1.0)
    for step in range(3):
        opt.zero_grad()
        got = loss_fn(hidden, ids, values)
        want = ht.HeadKLLoss(lm_head.weight.detach().clone(), backend="reference")(hidden, ids, values)
        assert got.item() == pytest.approx(want.item(), rel=1e-6), step
        got.backward()
        opt.step()
    assert loss_fn.head._uploads == 3


def test_head_takes_a_parameter_and_follows_its_optimizer():
    """``Head``'s results carry no gradient, so a trainable parameter is
    taken as it is and read again after each step."""
    _, hidden, _, _, _, _ = problem(2)
    lm_head = torch.nn.Linear(HS, V, bias=False)
    head = ht.Head(lm_head.weight, backend="reference")
    before = head.topk(hidden, 8)
    assert not before.values.requires_grad
    opt = torch.optim.SGD(lm_head.parameters(), lr=10.0)
    lm_head(hidden).logsumexp(-1).sum().backward()
    opt.step()
    got = head.topk(hidden, 8)
    want = ht.Head(lm_head.weight.detach().clone(), backend="reference").topk(hidden, 8)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.values, want.values)
    assert not torch.equal(got.values, before.values)
    assert head._uploads == 2


# --- A head changed after the upload is read again ---------------------------


def test_an_in_place_change_through_the_parameter_is_re_read(backend, caplog):
    caplog.set_level(logging.INFO, logger="headkl")
    weight, hidden, ids, values, _, _ = problem(7)
    lm_head = torch.nn.Linear(HS, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
    loss_fn = ht.HeadKLLoss(lm_head.weight.detach(), backend=backend)
    stale, _ = loss_and_grad(loss_fn, hidden, ids, values)
    with torch.no_grad():
        lm_head.weight.mul_(2)  # the detached tensor shares the parameter's version counter
    got, got_dx = loss_and_grad(loss_fn, hidden, ids, values)
    want, want_dx = loss_and_grad(ht.HeadKLLoss(weight * 2, backend=backend), hidden, ids, values)
    close(got.reshape(1), want.double().reshape(1), "loss", rel=1e-6)
    close(got_dx, want_dx.double(), "dx", rel=1e-6)
    assert abs(got.item() - stale.item()) > 1e-3, "the loss stayed at the stale head's value"
    messages = rereads(caplog)
    assert len(messages) == 1 and "re-read the head" in messages[0] and "changed in place" in messages[0], messages
    assert loss_fn.head._uploads == 2


def test_an_ema_update_is_re_read_each_step():
    """An EMA-style update (``mul_``/``add_`` under no_grad) of the tensor
    the loss holds, step after step: each step runs on the head as it is."""
    weight, hidden, ids, values, _, _ = problem(8)
    ema = weight.clone()
    loss_fn = ht.HeadKLLoss(ema, backend="reference")
    for step in range(3):
        with torch.no_grad():
            ema.mul_(0.5).add_(weight, alpha=0.5 + step)
        got = loss_fn(hidden, ids, values)
        want = ht.HeadKLLoss(ema.clone(), backend="reference")(hidden, ids, values)
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert loss_fn.head._uploads == 4


@pytest.mark.parametrize("how", ["set_", "data"])
def test_replaced_storage_is_re_read(how, caplog):
    caplog.set_level(logging.INFO, logger="headkl")
    weight, hidden, ids, values, _, _ = problem(9)
    held = weight.clone()
    loss_fn = ht.HeadKLLoss(held, backend="reference")
    stale = loss_fn(hidden, ids, values).item()
    new = weight.flip(0).contiguous()
    if how == "set_":
        held.set_(new)
    else:
        held.data = new
    got = loss_fn(hidden, ids, values).item()
    want = ht.HeadKLLoss(new.clone(), backend="reference")(hidden, ids, values).item()
    assert got == pytest.approx(want, rel=1e-6) and got != pytest.approx(stale, rel=1e-4)
    messages = rereads(caplog)
    assert len(messages) == 1 and "storage was replaced" in messages[0], messages


def test_a_head_whose_shape_changed_is_refused():
    weight, hidden, ids, values, _, _ = problem(9)
    held = weight.clone()
    loss_fn = ht.HeadKLLoss(held, backend="reference")
    held.data = torch.zeros(V, HS + 1)
    with pytest.raises(ValueError, match=r"^weight: its shape changed from \(300, 40\) to \(300, 41\)"):
        loss_fn(hidden, ids, values)


def test_the_full_vocabulary_loss_re_reads_either_head(caplog):
    caplog.set_level(logging.INFO, logger="headkl")
    weight, teacher_weight, hidden, teacher_hidden, weights = full_vocab_problem()
    student, teacher = weight.clone(), teacher_weight.clone()
    loss_fn = ht.FullVocabKLLoss(student, teacher, temperature=1.5, backend="reference")

    def fresh():
        return ht.FullVocabKLLoss(student.clone(), teacher.clone(), temperature=1.5, backend="reference")

    stale, _ = loss_and_grad(loss_fn, hidden, teacher_hidden, weights=weights)
    # The teacher's head alone: set again on the same engine.
    teacher.mul_(2)
    got, got_dx = loss_and_grad(loss_fn, hidden, teacher_hidden, weights=weights)
    want, want_dx = loss_and_grad(fresh(), hidden, teacher_hidden, weights=weights)
    assert got.item() == pytest.approx(want.item(), rel=1e-6) and got.item() != pytest.approx(stale.item(), rel=1e-4)
    close(got_dx, want_dx.double(), "dx", rel=1e-6)
    assert (loss_fn.head._uploads, loss_fn.head._teacher_uploads) == (1, 2)
    # The student's head: a new engine, with the teacher's head set on it again.
    stale = got
    student.mul_(-1)
    got, got_dx = loss_and_grad(loss_fn, hidden, teacher_hidden, weights=weights)
    want, want_dx = loss_and_grad(fresh(), hidden, teacher_hidden, weights=weights)
    assert got.item() == pytest.approx(want.item(), rel=1e-6) and got.item() != pytest.approx(stale.item(), rel=1e-4)
    close(got_dx, want_dx.double(), "dx", rel=1e-6)
    assert (loss_fn.head._uploads, loss_fn.head._teacher_uploads) == (2, 3)
    messages = rereads(caplog)
    assert len(messages) == 2, messages
    assert "teacher's head" in messages[0] and "teacher_weight changed in place" in messages[0]
    assert "re-read the head: weight changed in place" in messages[1]


def test_head_topk_and_gather_follow_the_head():
    _, hidden, ids, _, _, _ = problem(4)
    weight = torch.randn(V, HS, generator=torch.Generator().manual_seed(4)) / 8
    head = ht.Head(weight, backend="reference")
    stale = head.topk(hidden, 8)
    weight.mul_(-1)
    got = head.topk(hidden, 8)
    fresh = ht.Head(weight.clone(), backend="reference")
    want = fresh.topk(hidden, 8)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.values, want.values)
    assert not torch.equal(got.ids, stale.ids)
    weight.add_(0.25)
    got, want = head.gather(hidden, ids), fresh.gather(hidden, ids)
    assert not torch.equal(got.logprobs, want.logprobs)  # fresh was made before the add_
    want = ht.Head(weight.clone(), backend="reference").gather(hidden, ids)
    assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.lse, want.lse)
    assert head._uploads == 3


def test_nothing_changed_is_not_re_read(caplog):
    caplog.set_level(logging.INFO, logger="headkl")
    weight, hidden, ids, values, _, _ = problem(5)
    lm_head = torch.nn.Linear(HS, V, bias=False)
    lm_head.weight.requires_grad_(False)
    loss_fn = ht.HeadKLLoss(lm_head.weight, backend="reference")
    head = ht.Head(weight, backend="reference")
    full = ht.FullVocabKLLoss(weight, weight[:, :24].contiguous(), backend="reference")
    first = loss_fn(hidden, ids, values).item()
    for _ in range(3):
        # Reads and out-of-place uses of the head change nothing.
        _ = lm_head.weight * 2, lm_head.weight.detach().clone(), weight.sum(), lm_head(hidden)
        assert loss_fn(hidden, ids, values).item() == first
        head.topk(hidden, 4)
        head.gather(hidden, ids)
        full(hidden, hidden[..., :24])
    assert loss_fn.head._uploads == head._uploads == full.head._uploads == 1
    assert full.head._teacher_uploads == 1
    assert rereads(caplog) == []


# --- First-hour mends --------------------------------------------------------


def test_k_past_the_limit_is_refused_before_anything_is_allocated():
    """k = 10⁹ over 21 rows would be a 168 GB output: refused by name first."""
    weight, hidden, _, _, _, _ = problem(2)
    head = ht.Head(weight, backend="reference")
    message = r"^k: 1000000000 is more than 300, the most the top-k takes \(k <= min\(V = 300, 2048\)\).*FullVocabKLLoss"
    with pytest.raises(ValueError, match=message):
        head.topk(hidden, 10**9)
    with pytest.raises(ValueError, match=message):
        ht.topk(hidden, weight, 10**9, backend="reference")
    big = torch.zeros(4096, 8)  # V past 2048: the limit is 2048
    with pytest.raises(ValueError, match=r"^k: 2049 is more than 2048"):
        ht.topk(torch.zeros(2, 8), big, 2049, backend="reference")
    with pytest.raises(ValueError, match=r"^k: 0"):
        head.topk(hidden, 0)
    for bad in (2.0, True, None):
        with pytest.raises(TypeError, match="^k: expected an int"):
            head.topk(hidden, bad)
    assert head.topk(hidden, torch.tensor(3)).ids.shape == hidden.shape[:-1] + (3,)


def test_a_second_derivative_raises_pytorchs_error():
    weight, hidden, ids, values, _, _ = problem(3)
    loss_fn = ht.HeadKLLoss(weight, backend="reference")
    twice = "trying to differentiate twice"
    # A gradient penalty: the gradient's own gradient must not read as zero.
    x = hidden.clone().requires_grad_()
    loss = loss_fn(x, ids, values)
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match=twice):
        (loss + g.pow(2).sum()).backward()
    # A loss scaled by something that needs a gradient itself.
    scale = torch.tensor(2.0, requires_grad=True)
    x = hidden.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss_fn(x, ids, values) * scale, x, create_graph=True)
    with pytest.raises(RuntimeError, match=twice):
        g.sum().backward()
    # One backward is as before.
    x = hidden.clone().requires_grad_()
    loss_fn(x, ids, values).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.uint8])
def test_a_mask_as_weights_is_taken_as_float(dtype):
    weight, hidden, ids, values, labels, _ = problem(6)
    mask = torch.ones(hidden.shape[:-1], dtype=torch.bool)
    mask[0, :3] = False
    mask[2, -1] = False
    loss_fn = ht.HeadKLLoss(weight, backend="reference")
    got, got_dx = loss_and_grad(loss_fn, hidden, ids, values, weights=mask.to(dtype))
    want, want_dx = loss_and_grad(loss_fn, hidden, ids, values, weights=mask.float())
    assert torch.equal(got, want) and torch.equal(got_dx, want_dx)
    assert got_dx[0, :3].abs().sum() == 0
    per_token = ht.HeadKLLoss(weight, reduction="none", backend="reference")(hidden, ids, values, weights=mask.to(dtype))
    assert per_token.dtype == torch.float32 and (per_token[~mask] == 0).all()
    w, tw, h, th, _ = full_vocab_problem()
    full = ht.FullVocabKLLoss(w, tw, backend="reference")
    assert torch.equal(full(h, th, weights=mask.to(dtype)), full(h, th, weights=mask.float()))
