"""A model that holds headkl's losses copies as any ``nn.Module`` does:
``copy.deepcopy``, ``pickle`` and ``torch.save``/``torch.load`` keep the
head, its backend's name and the options, leave the native engine behind
(it is not picklable), open a new one at the copy's first call, and give
the original's loss and gradients; a head tied to a parameter stays tied
to the copied parameter."""

import copy
import io
import pickle

import pytest
import torch

import headkl.torch as ht
from test_head_refresh import full_vocab_problem
from test_loss import problem


def torch_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        return torch.load(buf, weights_only=False)  # a module, not weights alone (torch >= 2.6's default)
    except TypeError:  # a torch without weights_only
        buf.seek(0)
        return torch.load(buf)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": torch_round_trip,
}


class Student(torch.nn.Module):
    """A model that holds the losses and a Head, as a trainer's does."""

    def __init__(self, weight, teacher_weight):
        super().__init__()
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)
        self.kl = ht.HeadKLLoss(self.lm_head.weight, temperature=2.0, tail="bucket", backend="reference")
        self.frozen = ht.HeadKLLoss(self.lm_head.weight.detach(), reduction="sum", backend="reference")
        self.full = ht.FullVocabKLLoss(self.lm_head.weight.detach(), teacher_weight, beta=0.3, backend="reference")
        self.head = ht.Head(self.lm_head.weight.detach(), backend="reference")


def outputs(model, hidden, ids, values, teacher_hidden):
    """Every loss's value and gradients, and the Head's top-k."""
    model.zero_grad()
    x = hidden.clone().requires_grad_()
    loss = model.kl(x, ids, values) + model.frozen(x, ids, values) + model.full(x, teacher_hidden)
    loss.backward()
    return loss.detach(), x.grad, model.lm_head.weight.grad.clone(), model.head.topk(hidden, 5).ids


@pytest.fixture
def setup():
    weight, teacher_weight, hidden, teacher_hidden, _ = full_vocab_problem()
    _, _, ids, values, _, _ = problem(13)
    return Student(weight, teacher_weight), (hidden, ids, values, teacher_hidden)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_model_gives_the_same_losses(setup, how):
    model, inputs = setup
    want = outputs(model, *inputs)
    copied = COPIES[how](model)
    heads = [copied.kl.head, copied.frozen.head, copied.full.head, copied.head]
    # The engine is left behind and opens at the first call, on the same backend name.
    assert all(h._engine is None for h in heads)
    got = outputs(copied, *inputs)
    for g, w, what in zip(got, want, ("loss", "hidden.grad", "weight.grad", "topk")):
        assert torch.equal(g, w), what
    for h, original in zip(heads, [model.kl.head, model.frozen.head, model.full.head, model.head]):
        assert h._engine is not None and h._engine is not original._engine
        assert h._open == original._open and h._handle != original._handle
        assert h.info["backend"] == "reference"
    assert copied.full.head._teacher_uploads == 1
    assert repr(copied) == repr(model)
    # The original goes on as before.
    assert torch.equal(outputs(model, *inputs)[0], want[0])


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_trainable_head_stays_tied_to_the_copied_parameter(setup, how):
    model, inputs = setup
    copied = COPIES[how](model)
    assert copied.kl.head._weight is copied.lm_head.weight
    assert copied.lm_head.weight is not model.lm_head.weight
    outputs(copied, *inputs)
    assert copied.lm_head.weight.grad is not None and model.lm_head.weight.grad is None
    # A step on the copy is read again by the copy's loss, and the original's is untouched.
    before = model.kl(inputs[0], *inputs[1:3]).item()
    with torch.no_grad():
        copied.lm_head.weight.mul_(0.5)
    assert copied.kl(inputs[0], *inputs[1:3]).item() != before
    assert model.kl(inputs[0], *inputs[1:3]).item() == before


def test_a_copy_takes_the_options_and_its_own_engine():
    weight, hidden, ids, values, labels, weights = problem(4)
    loss_fn = ht.HeadKLLoss(
        weight, temperature=1.5, divergence="jsd", beta=0.2, weight_hard_loss=0.3, reduction="none",
        f32_inputs="f16", backend="reference",
    )  # fmt: skip
    want = loss_fn(hidden, ids, values, labels=labels, weights=weights)
    copied = copy.deepcopy(loss_fn)
    assert copied.options == loss_fn.options and copied.head.f32_inputs == "f16"
    assert torch.equal(copied(hidden, ids, values, labels=labels, weights=weights), want)
    assert copied.head._uploads == 1 and loss_fn.head._uploads == 1
    # A copy of a copy, and a copy made before the first call.
    again = pickle.loads(pickle.dumps(copy.deepcopy(copied)))
    assert torch.equal(again(hidden, ids, values, labels=labels, weights=weights), want)
    head = ht.Head(weight, backend="reference")
    assert torch.equal(copy.copy(head).topk(hidden, 3).ids, head.topk(hidden, 3).ids)
